"""The feeds `stoker bench anchors` runs, each an endless iterator of batch sizes that the benchmark times.

DALI and FFCV are imported only inside their feed's process: they are not stoker's dependencies, and nothing of
theirs is copied here, only the calls a user of each writes.
"""

from __future__ import annotations

import argparse
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from stoker.data.formats.folders import scan_image_folder


def make(args: argparse.Namespace) -> Iterator[int]:
    """The feed args.feed names over args.data (or args.beton for FFCV)."""
    return {"stoker": _stoker, "stoker_packed": _stoker, "dataloader_pillow": _dataloader,
            "dataloader_stoker": _dataloader, "dali": _dali, "ffcv": _ffcv, "ffcv_raw50": _ffcv}[args.feed](args)


def _stoker(args: argparse.Namespace) -> Iterator[int]:
    """stoker's producers over the folder's files, or (stoker_packed) over the pack `stoker pack` made of them."""
    from stoker.bench.pipeline import _StokerFeed
    from stoker.data.sources import load_source
    from stoker.pipeline.producer import SampleSource, Source

    source: SampleSource
    if args.feed == "stoker_packed":  # its index cached beside the pack, in the benchmark's scratch folder
        source = load_source(args.pack, cache=args.pack.parent / "index-cache")
    else:
        index = scan_image_folder(args.data)
        source = Source(tuple(index.paths), np.asarray(index.labels))
    with _StokerFeed(source, args, transport_only=False) as feed:
        yield from feed.batches()


def write_pack(folder: Path, out: Path) -> None:
    """`stoker pack FOLDER OUT` as its defaults make it: every JPEG kept, with a restart marker after each MCU."""
    from stoker.data.formats.pack import pack

    pack(folder, out, 1 << 30)


def _dataloader(args: argparse.Namespace) -> Iterator[int]:
    from stoker.bench.loader import StokerDecodeDataset
    from stoker.bench.pipeline import TorchvisionStyleDataset, dataloader_batches

    index = scan_image_folder(args.data)
    dataset: Any
    if args.feed == "dataloader_pillow":
        dataset = TorchvisionStyleDataset(index.paths, index.labels, args.image_size, to_float=False)
    else:
        dataset = StokerDecodeDataset(list(index.paths), index.labels, args.image_size)
    return dataloader_batches(dataset, args, warmup_images(args))


def warmup_images(args: argparse.Namespace) -> int:
    """What a feed runs before it is timed: process or thread start-up, JIT compilation, prefetch filled; and the
    epochs asked (--warmup-epochs)."""
    return max(8 * args.batch_size, args.warmup_epochs * len(scan_image_folder(args.data).paths))


def _dali(args: argparse.Namespace) -> Iterator[int]:
    from nvidia.dali import fn, pipeline_def, types

    @pipeline_def(batch_size=args.batch_size, num_threads=args.workers, device_id=None, seed=0)
    def crops() -> Any:
        jpegs, labels = fn.readers.file(file_root=str(args.data), random_shuffle=True, name="reader")
        images = fn.decoders.image_random_crop(jpegs, device="cpu", output_type=types.RGB,
                                               random_area=[0.08, 1.0], random_aspect_ratio=[3 / 4, 4 / 3])
        images = fn.resize(images, resize_x=args.image_size, resize_y=args.image_size)
        images = fn.flip(images, horizontal=fn.random.coin_flip())
        return images, labels

    pipe = crops()
    pipe.build()
    while True:
        images, _ = pipe.run()
        batch = images.as_array()  # into this process's memory, as a consumer takes a batch
        yield len(batch)


def _ffcv(args: argparse.Namespace) -> Iterator[int]:
    from ffcv.fields.basics import IntDecoder
    from ffcv.fields.rgb_image import RandomResizedCropRGBImageDecoder
    from ffcv.loader import Loader, OrderOption
    from ffcv.transforms import RandomHorizontalFlip, ToTensor

    loader = Loader(str(args.beton), batch_size=args.batch_size, num_workers=args.workers, order=OrderOption.RANDOM,
                    drop_last=True, os_cache=True, seed=0,
                    pipelines={"image": [RandomResizedCropRGBImageDecoder((args.image_size, args.image_size)),
                                         RandomHorizontalFlip(), ToTensor()],
                               "label": [IntDecoder(), ToTensor()]})
    while True:
        for images, _ in loader:
            yield len(images)


class _Jpeg(np.ndarray):
    """Decoded pixels that carry their file's bytes: FFCV's writer stores those bytes instead of encoding again."""

    original: bytes


class _Files:
    """The folder as FFCV's DatasetWriter reads a dataset: (image, label) by index."""

    def __init__(self, folder: Path) -> None:
        index = scan_image_folder(folder)
        self.paths, self.labels = index.paths, index.labels

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, position: int) -> tuple[np.ndarray, int]:
        import simplejpeg

        data = Path(self.paths[position]).read_bytes()
        image = simplejpeg.decode_jpeg(data).view(_Jpeg)
        image.original = data
        return image, int(self.labels[position])


def write_beton(folder: Path, beton: Path, raw_half: bool) -> None:
    """FFCV's .beton of the folder's JPEGs, their bytes as they are (not encoded again at FFCV's quality 90), or with
    half of them as raw pixels."""
    import ffcv.fields.rgb_image as rgb_image
    from ffcv.fields import IntField, RGBImageField
    from ffcv.writer import DatasetWriter

    encode = rgb_image.encode_jpeg
    rgb_image.encode_jpeg = lambda pixels, quality: (np.frombuffer(pixels.original, np.uint8)
                                                     if isinstance(pixels, _Jpeg) else encode(pixels, quality))
    field = RGBImageField(write_mode="proportion", compress_probability=0.5) if raw_half else RGBImageField(
        write_mode="jpg")
    DatasetWriter(str(beton), {"image": field, "label": IntField()}, num_workers=1).from_indexed_dataset(
        _Files(folder))
