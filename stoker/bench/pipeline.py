"""`stoker bench pipeline`: stoker's producers against torch's DataLoader on the same files, cores and transform.

Four measurements per image set, interleaved and repeated (medians reported):
  stoker            producers build batches into shared-memory slots; this process receives them the way a GPU
                    consumer does (a copy of the uint8 batch out of the slot, then the slot is handed back)
  dataloader_uint8  DataLoader, the torchvision recipe (Pillow decode, RandomResizedCrop, flip), uint8 tensors
  dataloader_float  the same plus ToTensor and Normalize on the CPU: what most training scripts run
  ceiling           full-size libjpeg-turbo decode only, one process, times the number of workers
Each measurement is one pass in steady state: its start-up batches (process start-up and the prefetch each
worker fills, `workers x PREFETCH` batches) are skipped and the next `--images-per-run` are timed. DataLoader runs
in its best configuration: persistent workers, prefetch factor PREFETCH, and one epoch long enough for the whole
measurement (a sampler that walks the file list as many times as needed), so no worker is restarted, no epoch
boundary drains the prefetch, and with few files (96 large ones) every worker still serves many batches.

`--transport` times slots and queues alone: producers write batches from a ready-made image instead of decoding,
and the consumer's receive rate is compared with single-core memcpy bandwidth measured in the same run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from collections import deque
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, cast

import numpy as np
import simplejpeg
from PIL import Image

from stoker.bench import photos
from stoker.common.procs import CONTEXT, Mailbox
from stoker.common.waiting import waiting
from stoker.data.formats.folders import scan_image_folder
from stoker.data.pixels.imaging import random_resized_crop_box
from stoker.pipeline.plan import BatchPlan
from stoker.pipeline.pool import MAX_IN_FLIGHT, ProducerPool
from stoker.pipeline.producer import Part, PartDone, ProducerSetup, SampleSource, Source
from stoker.pipeline.ring import SlotRing

SETS = {"500x375": (500, 375), "2000x1500": (2000, 1500)}
IMAGE_SETS = (*SETS, "imagenet-like")
QUALITY = 90
TRANSPORT_BATCHES = 500  # a batch moves in about half a millisecond: time enough of them
PREFETCH = MAX_IN_FLIGHT  # batches queued per worker, for DataLoader as for stoker's producers
MEAN = np.array([0.485, 0.456, 0.406], np.float32)
STD = np.array([0.229, 0.224, 0.225], np.float32)


def add_parser(kinds: argparse._SubParsersAction) -> None:
    parser = kinds.add_parser("pipeline", help="stoker's producers against torch DataLoader, same files and cores")
    parser.add_argument("--generate", type=Path, metavar="DIR", help="write the image sets into DIR and exit")
    parser.add_argument("--images", type=_image_sets, default="photos",
                        help="comma-separated sets: 500x375 and 2000x1500, mosaics of photographs (--small-images, "
                        "--large-images; 'photos' is both), imagenet-like, --small-images crops of photographs at "
                        "ImageNet's shapes and bytes per pixel (stoker/bench/photos.py)")
    parser.add_argument("--data", type=Path, metavar="DIR", help="a folder written by --generate "
                        "(default: generate into a temporary folder first)")
    parser.add_argument("--small-images", type=int, default=512, help="--generate: images in the 500x375 set")
    parser.add_argument("--large-images", type=int, default=96, help="--generate: images in the 2000x1500 set")
    parser.add_argument("--workers", type=int, default=os.cpu_count(), help="producers = DataLoader workers")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--image-size", type=int, default=224)
    parser.add_argument("--images-per-run", type=int, default=2048,
                        help="images timed per measurement, after the start-up batches")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--transport", action="store_true",
                        help="time slots and queues only (no decoding); a full run ends with this too")
    parser.add_argument("--json", type=Path, help="write the figures (medians) to this file")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    if args.generate:
        generate_kind(args.generate, args)
        print(f"wrote {', '.join(args.images)} JPEGs under {args.generate}")
        return 0
    result: dict[str, Any]
    names = args.images
    if args.transport:
        result = {"transport": measure_transport(args)}
    elif args.data:
        result = {"sets": [measure_set(args.data / name, name, args) for name in names]}
    else:
        with tempfile.TemporaryDirectory(prefix="stoker-pipeline-") as scratch:
            generate_kind(Path(scratch), args)
            result = {"sets": [measure_set(Path(scratch) / name, name, args) for name in names]}
    if "transport" not in result:
        result["transport"] = measure_transport(args)
    result["setup"] = {"workers": args.workers, "batch_size": args.batch_size, "image_size": args.image_size,
                       "repeats": args.repeats, "cores": os.cpu_count()}
    print_tables(result)
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0


# ---- benchmark images ------------------------------------------------------------------------------------------

def _image_sets(text: str) -> list[str]:
    names = [name for part in text.split(",") for name in (SETS if part == "photos" else [part])]
    unknown = [name for name in names if name not in IMAGE_SETS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"{text!r}: expected names of {', '.join(IMAGE_SETS)} or 'photos'")
    return names


def generate_kind(folder: Path, args: argparse.Namespace) -> None:
    """The sets --images names: the mosaic sets, and folder/imagenet-like with --small-images JPEGs."""
    mosaics = [name in args.images for name in SETS]
    if any(mosaics):
        generate(folder, args.small_images if mosaics[0] else 0, args.large_images if mosaics[1] else 0)
    if photos.NAME in args.images:
        photos.make_imagenet_like(folder / photos.NAME, args.small_images)


def generate(folder: Path, small: int, large: int, seed: int = 0, processes: int = 1) -> None:
    """Two ImageFolder sets of JPEGs, quality 90, tiled from native-resolution pieces of real photographs (no
    upscaling: upscaled or flat images compress and decode unrealistically fast). `processes` > 1: written in
    that many processes, in chunks of CHUNK images, each drawn from its own seed (other pixels than one process
    writes, alike in kind)."""
    from concurrent.futures import ProcessPoolExecutor

    if processes <= 1:
        _generate_serially(folder, small, large, seed)
        return
    chunks = [(folder / name / "photos", size, start, min(count, start + CHUNK), seed)
              for (name, size), count in zip(SETS.items(), (small, large)) for start in range(0, count, CHUNK)]
    for target, *_ in chunks:
        target.mkdir(parents=True, exist_ok=True)
    with waiting(f"generating {folder}", total=small + large, unit="images") as progress, \
            ProcessPoolExecutor(max(1, min(processes, len(chunks))), mp_context=CONTEXT) as pool:
        for written in pool.map(_write_chunk, *zip(*chunks)):
            progress.advance(written)


def _generate_serially(folder: Path, small: int, large: int, seed: int) -> None:
    pieces = photos.photographs()
    rng = np.random.default_rng(seed)
    with waiting(f"generating {folder}", total=small + large, unit="images") as progress:
        for (name, (width, height)), count in zip(SETS.items(), (small, large)):
            target = folder / name / "photos"
            target.mkdir(parents=True, exist_ok=True)
            for index in range(count):
                pixels = _mosaic(pieces, height, width, rng)
                Image.fromarray(pixels).save(target / f"{index:05d}.jpg", quality=QUALITY)
                progress.advance()


CHUNK = 256


def _write_chunk(target: Path, size: tuple[int, int], start: int, stop: int, seed: int) -> int:
    """Images start..stop-1 of one set; their draws from (seed, start): the same whichever process writes them."""
    pieces = photos.photographs()
    rng = np.random.default_rng([seed, start])
    width, height = size
    for index in range(start, stop):
        Image.fromarray(_mosaic(pieces, height, width, rng)).save(target / f"{index:05d}.jpg", quality=QUALITY)
    return stop - start


def _mosaic(photos: list[np.ndarray], height: int, width: int, rng: np.random.Generator) -> np.ndarray:
    canvas = np.empty((height, width, 3), np.uint8)
    tile_h, tile_w = min(height, 375), min(width, 500)
    for top in range(0, height, tile_h):
        for left in range(0, width, tile_w):
            photo = photos[rng.integers(len(photos))]
            h, w = min(tile_h, height - top), min(tile_w, width - left)
            y, x = rng.integers(0, photo.shape[0] - h + 1), rng.integers(0, photo.shape[1] - w + 1)
            piece = photo[y:y + h, x:x + w]
            if rng.integers(2):
                piece = piece[:, ::-1]
            gain = rng.uniform(0.8, 1.2)  # exposure varies from picture to picture
            canvas[top:top + h, left:left + w] = np.clip(piece * gain, 0, 255).astype(np.uint8)
    return canvas


# ---- one image set ---------------------------------------------------------------------------------------------

def measure_set(folder: Path, name: str, args: argparse.Namespace) -> dict[str, Any]:
    index = scan_image_folder(folder)
    paths, labels = index.paths, index.labels
    runs: dict[str, list[float]] = {"stoker": [], "dataloader_uint8": [], "dataloader_float": [], "ceiling": []}
    with waiting(f"bench pipeline {name}", total=args.repeats * len(runs), unit="runs") as progress:
        for _ in range(args.repeats):  # interleaved, so drift in the machine's speed hits every variant alike
            runs["stoker"].append(time_stoker(paths, labels, args))
            progress.advance()
            runs["dataloader_uint8"].append(time_dataloader(paths, labels, args, to_float=False))
            progress.advance()
            runs["dataloader_float"].append(time_dataloader(paths, labels, args, to_float=True))
            progress.advance()
            runs["ceiling"].append(time_decode_only(paths, args))
            progress.advance()
    medians = {key: round(statistics.median(values), 1) for key, values in runs.items()}
    return {"name": name, "images": len(paths), "stoker_img_s": medians["stoker"],
            "dataloader_uint8_img_s": medians["dataloader_uint8"],
            "dataloader_float_img_s": medians["dataloader_float"], "ceiling_img_s": medians["ceiling"],
            "stoker_over_dataloader_uint8": round(medians["stoker"] / medians["dataloader_uint8"], 2),
            "stoker_over_dataloader_float": round(medians["stoker"] / medians["dataloader_float"], 2),
            "stoker_over_ceiling": round(medians["stoker"] / medians["ceiling"], 2), "all_runs": runs}


def _batches_to_time(args: argparse.Namespace) -> tuple[int, int]:
    """(start-up batches skipped, batches timed)."""
    return args.workers * PREFETCH, max(2, -(-args.images_per_run // args.batch_size))


def _rate(batches: Iterator[int], args: argparse.Namespace) -> float:
    """Images per second over the timed batches of an iterator that yields batch sizes."""
    skip, timed = _batches_to_time(args)
    for _ in range(skip):
        next(batches)
    started, images = time.perf_counter(), 0
    for _ in range(timed):
        images += next(batches)
    rate = images / (time.perf_counter() - started)
    close = getattr(batches, "close", None)
    if close is not None:  # a generator's finally runs now (a DataLoader's workers stop), not at collection
        close()
    return rate


def time_stoker(paths: Sequence[str] | None, labels: np.ndarray | None, args: argparse.Namespace,
                transport_only: bool = False, source: SampleSource | None = None) -> float:
    """Images per second of stoker's producers over `paths` (or over `source`, a packed index)."""
    feed_source: SampleSource = source or Source(tuple(paths or ()), np.asarray(labels))
    with _StokerFeed(feed_source, args, transport_only) as feed:
        return _rate(feed.batches(), args)


class _StokerFeed:
    """stoker's producer pool and slot ring, with this process as the consumer."""

    def __init__(self, source: SampleSource, args: argparse.Namespace, transport_only: bool) -> None:
        self.args = args
        self.num_slots = args.workers * MAX_IN_FLIGHT + 2
        self.ring = SlotRing.create(self.num_slots, args.batch_size, args.image_size, args.workers,
                                    samples=(len(source.labels), 0))
        self.mailbox, self.stop = Mailbox(), CONTEXT.Event()
        self.arrived: deque = deque()
        setup = ProducerSetup(self.ring.spec, source, None, "standard", 0, transport_only)
        self.pool = ProducerPool(setup, self.ring, self.mailbox, self.stop, args.workers, producer_timeout_s=60)
        self.num_samples = len(source.labels)
        self.part_ids = iter(range(1 << 62))
        # Where a GPU consumer copies into pinned memory before the host-to-device copy.
        self.staging = np.empty(self.ring.images.shape[1:], np.uint8)

    def __enter__(self) -> _StokerFeed:
        for _ in range(self.args.workers):
            self.pool.grow()
        return self

    def __exit__(self, *_exc) -> None:
        self.stop.set()
        self.pool.close()
        self.mailbox.close()
        self.ring.close()

    def batches(self) -> Iterator[int]:
        free = list(range(self.num_slots))
        works = self._works()
        while True:
            while free and self.pool.can_take():
                self.pool.assign(Part(next(self.part_ids), next(works), free.pop(), {}))
            done = self._next_done()
            part = self.pool.finished(done)
            assert part is not None, "every part is assigned once and done once"
            count = int(self.ring.counts[part.slot])
            np.copyto(self.staging[:count], self.ring.images[part.slot, :count])
            free.append(part.slot)
            yield count

    def _works(self) -> Iterator[BatchPlan]:
        batch = self.args.batch_size
        for epoch in range(1 << 30):
            order = np.random.default_rng(epoch).permutation(self.num_samples)
            for step in range(len(order) // batch):
                yield BatchPlan("train", epoch, step, 0, order[step * batch:(step + 1) * batch], batch)

    def _next_done(self) -> PartDone:
        while not self.arrived:
            messages = self.mailbox.receive(timeout_s=30)
            if not messages:
                raise RuntimeError("no batch from the producers in 30 s")
            self.arrived.extend(messages)
        message = self.arrived.popleft()
        if not isinstance(message, PartDone):
            raise RuntimeError(f"producer failed: {message.error}")
        return message


def time_dataloader(paths, labels, args: argparse.Namespace, to_float: bool) -> float:
    dataset = TorchvisionStyleDataset(paths, labels, args.image_size, to_float)
    return _rate(dataloader_batches(dataset, args), args)


def dataloader_batches(dataset: Any, args: argparse.Namespace, warmup_images: int = 0) -> Iterator[int]:
    """Batch sizes from torch's DataLoader over `dataset` in its best configuration (persistent workers, prefetch
    PREFETCH, one epoch as long as the measurement and `warmup_images` before it); its workers are shut down when
    the iterator is closed."""
    import torch
    from torch.utils.data import DataLoader, Dataset, RandomSampler
    from torch.utils.data.dataloader import _MultiProcessingDataLoaderIter

    skip, timed = _batches_to_time(args)
    # One epoch covers the whole measurement plus what the workers prefetch beyond it: random order without
    # replacement, the file list walked again whenever it runs out, as shuffle=True does epoch after epoch.
    sampler = RandomSampler(dataset, num_samples=(skip + timed + 2 * skip) * args.batch_size + warmup_images,
                            generator=torch.Generator().manual_seed(0))
    # DataLoader reads any object with __getitem__ and __len__; the stub asks for a Dataset
    loader: DataLoader[Any] = DataLoader(cast("Dataset[Any]", dataset), batch_size=args.batch_size, sampler=sampler,
                                         num_workers=args.workers, drop_last=True, persistent_workers=True,
                                         prefetch_factor=PREFETCH)
    iterator = cast(_MultiProcessingDataLoaderIter, iter(loader))  # workers > 0: the multi-process iterator
    try:
        yield from (len(labels) for _, labels in iterator)
    finally:
        iterator._shutdown_workers()  # now, not whenever the garbage collector gets to it: the next run is timed
        del iterator


class TorchvisionStyleDataset:
    """torchvision's ImageFolder + RandomResizedCrop + RandomHorizontalFlip (+ ToTensor + Normalize), written
    out with Pillow because torchvision is not a dependency: the same decode, crop, resize and conversion calls."""

    def __init__(self, paths, labels, size: int, to_float: bool) -> None:
        self.paths, self.labels, self.size, self.to_float = list(paths), np.asarray(labels), size, to_float
        self.rng = np.random.default_rng()

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, index: int):
        import torch

        with open(self.paths[index], "rb") as handle:
            image = Image.open(handle).convert("RGB")  # what torchvision's default pil_loader does
        box = random_resized_crop_box(image.height, image.width, self.rng)
        image = image.crop((box.left, box.top, box.left + box.width, box.top + box.height))
        image = image.resize((self.size, self.size), Image.Resampling.BILINEAR)
        if self.rng.random() < 0.5:
            image = image.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
        pixels = torch.from_numpy(np.array(image, np.uint8, copy=True)).permute(2, 0, 1)  # pil_to_tensor
        if self.to_float:
            pixels = pixels.contiguous().to(torch.float32).div(255)  # to_tensor
            pixels = (pixels - torch.from_numpy(MEAN).view(3, 1, 1)) / torch.from_numpy(STD).view(3, 1, 1)
        return pixels, int(self.labels[index])


def time_decode_only(paths, args: argparse.Namespace) -> float:
    """Full-size libjpeg-turbo decode in this one process, scaled by the number of workers."""
    skip, timed = _batches_to_time(args)
    count = min(len(paths), timed * args.batch_size)
    for path in paths[:skip]:
        simplejpeg.decode_jpeg(Path(path).read_bytes())
    started = time.perf_counter()
    for position in range(count):
        simplejpeg.decode_jpeg(Path(paths[position % len(paths)]).read_bytes())
    return args.workers * count / (time.perf_counter() - started)


# ---- transport ---------------------------------------------------------------------------------------------------

def measure_transport(args: argparse.Namespace) -> dict[str, Any]:
    batch_bytes = args.batch_size * args.image_size * args.image_size * 3
    samples = max(4 * args.batch_size, 256)
    batches = argparse.Namespace(**{**vars(args), "images_per_run": TRANSPORT_BATCHES * args.batch_size})
    received, memcpy = [], []
    with waiting("bench pipeline transport", total=args.repeats, unit="runs") as progress:
        for _ in range(args.repeats):
            rate = time_stoker([""] * samples, np.zeros(samples, np.int64), batches, transport_only=True)
            received.append(rate / args.batch_size * batch_bytes / 1e9)
            memcpy.append(memcpy_gb_s(batch_bytes))
            progress.advance()
    consumer, baseline = statistics.median(received), statistics.median(memcpy)
    return {"batch_shape": [args.batch_size, 3, args.image_size, args.image_size], "consumer_gb_s":
            round(consumer, 3), "memcpy_gb_s": round(baseline, 3), "consumer_over_memcpy":
            round(consumer / baseline, 3), "all_runs": {"consumer_gb_s": received, "memcpy_gb_s": memcpy}}


def memcpy_gb_s(nbytes: int, working_set_bytes: int = 512 * 2**20) -> float:
    """Single-core copy bandwidth for batches that come from memory, not cache: the sources rotate through a
    working set larger than any last-level cache, as batches written by other cores do."""
    sources = [np.full(nbytes, index, np.uint8) for index in range(max(2, working_set_bytes // nbytes))]
    target = np.zeros(nbytes, np.uint8)
    np.copyto(target, sources[0])
    started = time.perf_counter()
    for source in sources:
        np.copyto(target, source)
    return len(sources) * nbytes / (time.perf_counter() - started) / 1e9


# ---- output ------------------------------------------------------------------------------------------------------

def print_tables(result: dict[str, Any]) -> None:
    setup = result["setup"]
    print(f"{setup['workers']} workers, batch {setup['batch_size']}, {setup['image_size']}px, "
          f"median of {setup['repeats']}, {setup['cores']} cores")
    for row in result.get("sets", []):
        print(f"\n{row['name']} JPEGs ({row['images']} files)            img/s   stoker / this")
        for key, label in (("stoker_img_s", "stoker producers"), ("dataloader_uint8_img_s", "DataLoader uint8"),
                           ("dataloader_float_img_s", "DataLoader float+normalize"),
                           ("ceiling_img_s", "ceiling (full decode x workers)")):
            ratio = row["stoker_img_s"] / row[key]
            print(f"  {label:<34} {row[key]:>8.1f}   {ratio:>6.2f}")
    if "transport" in result:
        row = result["transport"]
        print(f"\ntransport, batches of {'x'.join(map(str, row['batch_shape']))} uint8: consumer receives "
              f"{row['consumer_gb_s']:.2f} GB/s, single-core memcpy {row['memcpy_gb_s']:.2f} GB/s "
              f"({row['consumer_over_memcpy']:.0%})")

