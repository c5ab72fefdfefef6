"""Run in a throwaway venv that has kornia and albumentations (never a dependency of stoker); figures:
docs/consumers.md, "The training recipe".
Hand-written recipe ops against kornia's (and albumentations' draws), CPU, one thread: medians of interleaved
repeats, per batch (device-side ops) or per image (producer-side policy)."""
import inspect
import random
import statistics
import sys
import time

import numpy as np
import torch

sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[1]))  # this checkout's stoker
import albumentations as A
import kornia
import kornia.augmentation as K
from kornia.augmentation.auto import TrivialAugment as KTrivial

from stoker.data.pixels.policies import apply_policy
from stoker.training.recipe import Mix, apply_mix, cutmix_box, erase, erasing_boxes

torch.set_num_threads(1)
B, PX, REPEATS = 64, 224, 7
images = torch.randn(B, 3, PX, PX)
targets = torch.nn.functional.one_hot(torch.arange(B) % 10, 10).float()
labels = torch.arange(B) % 10
rng = np.random.default_rng(0)
uint8 = np.random.default_rng(1).integers(0, 256, (B, PX, PX, 3), dtype=np.uint8)

k_mixup = K.RandomMixUpV2(p=1.0, data_keys=["input", "class"])
k_cutmix = K.RandomCutMixV2(p=1.0, data_keys=["input", "class"])
k_erase = K.RandomErasing(p=0.5)
k_trivial = KTrivial()
def ours_mixup(): apply_mix(images, targets, Mix(float(rng.beta(0.2, 0.2))))
def ours_cutmix(): apply_mix(images, targets, cutmix_box(PX, PX, float(rng.beta(1.0, 1.0)), rng))
def ours_erase():
    x = images.clone()
    erase(x, erasing_boxes(x.shape, 0.5, rng))
def kornia_mixup(): k_mixup(images, labels)
def kornia_cutmix(): k_cutmix(images, labels)
def kornia_erase(): k_erase(images)   # kornia returns a new tensor: the clone above is ours' equivalent
def ours_trivial():
    batch = uint8.copy()
    for i in range(B):
        apply_policy(batch[i], "trivial", rng)
def kornia_trivial(): k_trivial(torch.from_numpy(uint8).permute(0, 3, 1, 2).float() / 255)

pairs = {"mixup": (ours_mixup, kornia_mixup), "cutmix": (ours_cutmix, kornia_cutmix),
         "random erasing p=0.5": (ours_erase, kornia_erase),
         "TrivialAugment (64 images)": (ours_trivial, kornia_trivial)}
for fn in [f for p in pairs.values() for f in p]:
    fn()  # warm up
results = {}
for name, (ours, theirs) in pairs.items():
    times = {"ours": [], "kornia": []}
    for _ in range(REPEATS):
        for label, fn in (("ours", ours), ("kornia", theirs)):
            start = time.perf_counter()
            fn()
            times[label].append(time.perf_counter() - start)
    o, k = statistics.median(times["ours"]) * 1e3, statistics.median(times["kornia"]) * 1e3
    results[name] = (o, k)
    print(f"{name:28s} hand-written {o:8.2f} ms   kornia {k:8.2f} ms   kornia/ours {k / o:5.2f}")

# albumentations: can a transform take its draws from the plan's generator (not a global RNG)?
op = A.Affine(rotate=(-30, 30), translate_percent=(-0.2, 0.2), p=1.0)
def albu_with(seed):
    op.set_random_state(np.random.default_rng([seed, 0, 0, 5]), random.Random(seed))
    return op(image=uint8[0])["image"]
np.random.seed(123)
random.seed(123)
a = albu_with(7)
np.random.seed(999)
random.seed(999)
before = (np.random.get_state()[1].copy(), np.random.get_state()[2], random.getstate(), torch.get_rng_state().clone())
b = albu_with(7)
after = (np.random.get_state()[1].copy(), np.random.get_state()[2], random.getstate(), torch.get_rng_state().clone())
untouched = (np.array_equal(before[0], after[0]) and before[1] == after[1] and before[2] == after[2]
             and torch.equal(before[3], after[3]))
c = albu_with(8)
print("albumentations Affine, draws from a given Generator: same seed same bytes:", np.array_equal(a, b),
      "| other seed differs:", not np.array_equal(a, c), "| global RNGs (numpy, random, torch) untouched:", untouched)
# kornia draws from torch's global generator; its forward takes `params=` to replay given draws instead.
print("kornia forward takes params=:", "params" in inspect.signature(k_erase.forward).parameters)
print("albumentations has TrivialAugment/RandAugment:",
      any("trivial" in n.lower() or "randaug" in n.lower() for n in dir(A)))
print("torch", torch.__version__, "kornia", kornia.__version__, "albumentations", A.__version__)
