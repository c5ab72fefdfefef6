"""One rank of a DDP training loop fed by stoker.Loader, as a user's torchrun script would be (tests/integration/
test_loader.py starts two of them with RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT set, as torchrun does).

It records what each batch held (a hash of its bytes and its sample ids) and the final weights' hash, can write a
checkpoint (model, optimizer, loader.state_dict()) after given steps while it trains on, and can resume from one.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

import stoker


class NoisyDataset:
    """A user's own dataset: 16x16 images made from the index, with their own random augmentation drawn from
    Python's random, NumPy's global generator and torch (the producers seed all three per sample)."""

    def __init__(self, size: int = 60) -> None:
        self.size = size

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int):
        import random

        base = np.full((16, 16, 3), index * 4 % 256, dtype=np.uint8)
        shift = random.randint(0, 15)
        noise = np.random.randint(0, 20, size=(16, 16, 3)).astype(np.uint8)
        flip = bool(torch.rand(()) < 0.5)
        image = np.roll(base + noise, shift, axis=1)
        return (image[:, ::-1].copy() if flip else image), index % 3


def model_for(num_classes: int) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3, stride=2), torch.nn.AdaptiveAvgPool2d(1),
                               torch.nn.Flatten(), torch.nn.Linear(4, num_classes))


def weights_digest(model: torch.nn.Module) -> str:
    digest = hashlib.sha256()
    for tensor in model.state_dict().values():
        digest.update(tensor.detach().contiguous().numpy().tobytes())
    return digest.hexdigest()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--data", required=True)  # a folder, or "noisy" for NoisyDataset
    parser.add_argument("--producers", default="1")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--save-at", default="")  # steps over the run (5,8): a checkpoint CHECKPOINT-5.RANK after each
    parser.add_argument("--checkpoint")
    parser.add_argument("--resume")  # a checkpoint written by --save-at, without its .RANK: CHECKPOINT-5
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    producers = args.producers if args.producers == "auto" else int(args.producers)
    data = NoisyDataset() if args.data == "noisy" else args.data  # a folder, shards or their URL
    loader = stoker.Loader(data, batch_size=args.batch_size, image_size=16, seed=3, producers=producers,
                           device="cpu", max_producers=3)
    model = torch.nn.parallel.DistributedDataParallel(model_for(10))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    start_epoch, steps = 0, 0
    save_at = {int(step) for step in args.save_at.split(",") if step}
    if args.resume:
        mine = Path(f"{args.resume}.{rank}")  # saved by fewer ranks: rank 0's (DDP's replicas and states agree)
        state = torch.load(mine if mine.exists() else f"{args.resume}.0", weights_only=False)
        model.module.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        loader.load_state_dict(state["loader"])
        start_epoch, steps = state["loader"]["epoch"], state["steps"]
    record = {"len": [], "batches": [], "hashes": [], "ids": []}
    with loader:
        for epoch in range(start_epoch, args.epochs):
            loader.set_epoch(epoch)
            record["len"].append(len(loader))
            count = 0
            for images, labels in loader:
                record["hashes"].append(hashlib.sha256(images.numpy().tobytes()).hexdigest())
                record["ids"].append([epoch, loader.batch_ids.tolist()])
                optimizer.zero_grad()
                F.cross_entropy(model(images), labels).backward()
                optimizer.step()
                count, steps = count + 1, steps + 1
                if steps in save_at:  # mid-iteration, batches still in flight: what a periodic checkpoint sees
                    torch.save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                                "loader": loader.state_dict(), "steps": steps}, f"{args.checkpoint}-{steps}.{rank}")
            record["batches"].append(count)
        record["summary"] = loader.summary()
    record["weights"] = weights_digest(model.module)
    Path(f"{args.out}.{rank}").write_text(json.dumps(record))
    dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
