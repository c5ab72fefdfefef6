"""`stoker bench finetune`: does fine-tuning from `--init` pay?

The built-in texture classes are split in two tasks with no class in common: the first 6 classes to pretrain
on, the other 4 as "one's own classes" (few images each). For each seed, a model is pretrained on the first task;
then the second task is trained twice with the same settings and seed: from the pretrained weights (`--init`, a
new head) and from scratch. Reported: each epoch's validation accuracy, and the epochs each needs to reach
`--target` (median over seeds; a run that never reaches it counts as epochs + 1).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
from pathlib import Path
from typing import Any

from stoker.bench.runs import completed_run

PRETRAIN_CLASSES = 6  # of the built-in 10; the rest are the fine-tuning task
FINETUNE_BATCH = 8  # a small set: several steps per epoch


def add_parser(kinds: argparse._SubParsersAction) -> None:
    parser = kinds.add_parser("finetune", help="epochs to an accuracy: fine-tuned with --init against scratch")
    parser.add_argument("--pretrain-per-class", type=int, default=300, help="training images per pretrain class")
    parser.add_argument("--finetune-per-class", type=int, default=30, help="training images per new class")
    parser.add_argument("--val-per-class", type=int, default=50)
    parser.add_argument("--pretrain-epochs", type=int, default=8)
    parser.add_argument("--epochs", type=int, default=8, help="epochs of each fine-tuning and scratch run")
    parser.add_argument("--target", type=float, default=0.8, help="validation accuracy to reach")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--devices", default="cpu:1")
    parser.add_argument("--json", type=Path, help="write the figures to this file")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    with tempfile.TemporaryDirectory(prefix="stoker-bench-finetune-") as scratch:
        figures = measure(Path(scratch), args.pretrain_per_class, args.finetune_per_class, args.val_per_class,
                          args.pretrain_epochs, args.epochs, args.target, args.seeds, args.devices)
    print(table(figures))
    if args.json is not None:
        args.json.write_text(json.dumps(figures, indent=2))
    return 0


def split_tasks(root: Path, pretrain_per_class: int, finetune_per_class: int,
                val_per_class: int) -> tuple[Path, Path]:
    """Two ImageFolders under `root` (`pretrain/`, `finetune/`, each with train and val), disjoint classes."""
    from stoker.data.formats.builtin_data import generate

    generated = root / "generated"
    generate(generated, max(pretrain_per_class, finetune_per_class), val_per_class)
    classes = sorted(p.name for p in (generated / "train").iterdir())
    for task, names, per_class in (("pretrain", classes[:PRETRAIN_CLASSES], pretrain_per_class),
                                   ("finetune", classes[PRETRAIN_CLASSES:], finetune_per_class)):
        for split, count in (("train", per_class), ("val", val_per_class)):
            for name in names:
                target = root / task / split / name
                target.mkdir(parents=True)
                for source in sorted((generated / split / name).iterdir())[:count]:
                    os.link(source, target / source.name)
    return root / "pretrain", root / "finetune"


def measure(root: Path, pretrain_per_class: int, finetune_per_class: int, val_per_class: int,
            pretrain_epochs: int, epochs: int, target: float, seeds: int, devices: str) -> dict[str, Any]:
    pretrain, finetune = split_tasks(root, pretrain_per_class, finetune_per_class, val_per_class)
    common: dict[str, Any] = {"devices": devices, "image_size": 32, "report": False, "lr": 0.05}
    runs: list[dict[str, Any]] = []
    for seed in range(seeds):
        base = root / f"pretrained-{seed}"
        _train(data=pretrain / "train", val=pretrain / "val", epochs=pretrain_epochs, seed=seed, out=base,
                     batch_size=32, show_progress=False, **common)
        curves: dict[str, list[float]] = {}
        choices: tuple[tuple[str, dict[str, Any]], ...] = (("finetuned", {"init": base / "model.pt"}), ("scratch", {}))
        for name, extra in choices:
            out = root / f"{name}-{seed}"
            _train(data=finetune / "train", val=finetune / "val", epochs=epochs, seed=seed, out=out,
                         batch_size=FINETUNE_BATCH, show_progress=False, **common, **extra)
            curves[name] = val_curve(out)
        runs.append({"seed": seed, **curves})
    return {"target": target, "epochs": epochs, "pretrain_epochs": pretrain_epochs, "runs": runs,
            "median_epochs_to_target": {name: statistics.median(epochs_to(run[name], target, epochs)
                                                                for run in runs)
                                        for name in ("finetuned", "scratch")},
            "median_accuracy_per_epoch": {name: median_curve([run[name] for run in runs])
                                          for name in ("finetuned", "scratch")},
            "settings": {**common, "pretrain_batch_size": 32, "finetune_batch_size": FINETUNE_BATCH,
                         "pretrain_per_class": pretrain_per_class,
                         "finetune_per_class": finetune_per_class, "val_per_class": val_per_class}}


def _train(**settings: Any) -> None:
    """One run; an interrupted or failed one stops the benchmark (Ctrl-C reaches the run's controller first)."""
    import stoker

    completed_run(stoker.train(**settings), "bench finetune")


def val_curve(run_dir: Path) -> list[float]:
    """Validation accuracy after each epoch, from metrics.jsonl."""
    events = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [e["accuracy"] for e in sorted((e for e in events if e["event"] == "val"), key=lambda e: e["epoch"])]


def epochs_to(curve: list[float], target: float, epochs: int) -> int:
    """The first epoch (1-based) at or over `target`; epochs + 1 when never."""
    return next((index + 1 for index, accuracy in enumerate(curve) if accuracy >= target), epochs + 1)


def median_curve(curves: list[list[float]]) -> list[float]:
    """Each epoch's median validation accuracy over the seeds: the figure that still compares when neither run
    reaches the target."""
    return [statistics.median(curve[epoch] for curve in curves) for epoch in range(min(map(len, curves)))]


def table(figures: dict[str, Any]) -> str:
    lines = [f"epochs to {100 * figures['target']:.0f}% validation accuracy (median of {len(figures['runs'])} seeds;"
             f" {figures['epochs'] + 1} = not reached in {figures['epochs']})"]
    for name in ("finetuned", "scratch"):
        curves = "  ".join(" ".join(f"{100 * a:3.0f}" for a in run[name]) for run in figures["runs"])
        lines.append(f"{name:10s} {figures['median_epochs_to_target'][name]:4}   per epoch, each seed: {curves}")
    for name in ("finetuned", "scratch"):
        median = " ".join(f"{100 * a:3.0f}" for a in figures["median_accuracy_per_epoch"][name])
        lines.append(f"{name:10s} median validation accuracy per epoch (%): {median}")
    return "\n".join(lines)
