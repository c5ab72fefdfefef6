"""`stoker bench sync`: stoker's every-step parameter averaging against DistributedDataParallel, same run.

Two gloo processes train the same small CNN from the same initialization on the same batches with the same
optimizer, once with stoker's `Averager` (average the parameters after each step) and once with DDP (average the
gradients during backward). Reported: the median step time of each, their ratio, whether the weights agree after
CHECK_STEPS steps (they must for SGD with momentum and weight decay, which are linear in the gradient; they need
not for AdamW), and what averaging a model of many tensors costs against one all_reduce of a flat tensor of the
same size.

With `--train`, real training instead: scikit-learn's digits as PNG files, `stoker train` on 2 CPU consumers with
default settings (averaging during backward, and after the step for reference) against DDP with the same model,
optimizer, learning-rate schedule, batch and 2 ranks, the images decoded once into memory (no loader cost: a
baseline stoker's producers must beat on its own cores). Samples per second over the second half of the steps,
interleaved repeats, medians.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from stoker.bench.group import run_group
from stoker.common.waiting import waiting

if TYPE_CHECKING:  # torch is imported where it runs: `stoker bench sync --help` need not wait for it
    import torch
    from torch import nn

WORLD = 2
# Weights are compared after this many steps: float32 rounding differs between the two methods (they add the
# same numbers in a different order) and training amplifies it step after step, so compare early.
CHECK_STEPS = 8


def add_parser(kinds: argparse._SubParsersAction) -> None:
    parser = kinds.add_parser("sync", help="every-step averaging against DistributedDataParallel, 2 processes")
    parser.add_argument("--model", default=f"{__name__}:small_cnn",
                        help="module:function or a built-in name (BatchNorm models: see small_cnn)")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--image-size", type=int, default=32)
    parser.add_argument("--steps", type=int, default=20, help="timed steps per repeat")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--optimizer", choices=("sgd", "adamw"), default="sgd")
    parser.add_argument("--train", action="store_true", help="real training: stoker train against DDP")
    parser.add_argument("--epochs", type=int, default=20, help="--train: epochs of each run")
    parser.add_argument("--json", type=Path, help="write the figures to this file")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    if args.train:
        from stoker.bench.sync_train import run_training

        return run_training(args)
    settings = {k: getattr(args, k) for k in ("model", "batch_size", "image_size", "steps", "repeats", "optimizer")}
    with waiting("bench sync: stoker against DDP, 2 processes", total=1, unit="runs") as progress:
        result = run_group(_compare, WORLD, (settings,), timeout_s=600)
        progress.advance()
    print_table(result)
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0


def _compare(rank: int, _world: int, settings: dict[str, Any]) -> dict[str, Any]:
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel

    from stoker.training.averager import Averager

    steps, repeats = settings["steps"], settings["repeats"]
    batches = _batches(rank, settings, max(steps, CHECK_STEPS))
    stoker_model, ddp_model = _model(settings), _model(settings)
    averager = Averager(stoker_model, 1, WORLD, in_backward=True)
    ddp = DistributedDataParallel(ddp_model)
    stoker_opt, ddp_opt = _optimizer(stoker_model, settings), _optimizer(ddp, settings)
    samples = settings["batch_size"] * WORLD

    def stoker_step(images, labels):  # as the consumer does it: averaging starts during backward
        averager.begin_step(0, len(labels), samples, stoker_opt)
        stoker_opt.zero_grad(set_to_none=True)
        F.cross_entropy(stoker_model(images), labels).backward()
        stoker_opt.step()
        averager.end_step(0)

    def ddp_step(images, labels):
        ddp_opt.zero_grad(set_to_none=True)
        F.cross_entropy(ddp(images), labels).backward()
        ddp_opt.step()

    for images, labels in batches[:CHECK_STEPS]:
        stoker_step(images, labels)
        ddp_step(images, labels)
    weights_match, max_difference = _same_parameters(stoker_model, ddp_model)
    times = _time_steps({"stoker": stoker_step, "ddp": ddp_step}, batches[:steps], repeats)
    stoker_s, ddp_s = statistics.median(times["stoker"]), statistics.median(times["ddp"])
    bucketed, flat, per_tensor, bucketed_over_flat = _averaging_costs(stoker_model)
    return {"model": settings["model"], "optimizer": settings["optimizer"], "processes": WORLD,
            "batch_size": settings["batch_size"], "steps": steps, "repeats": repeats,
            "parameters": sum(p.numel() for p in stoker_model.parameters()),
            "tensors": len(list(stoker_model.parameters())) + len(list(stoker_model.buffers())),
            "stoker_step_s": round(stoker_s, 5), "ddp_step_s": round(ddp_s, 5), "ratio": round(stoker_s / ddp_s, 3),
            "weights_match": weights_match, "max_weight_difference": max_difference, "check_steps": CHECK_STEPS,
            "bucketed_average_ms": round(1000 * bucketed, 3), "flat_allreduce_ms": round(1000 * flat, 3),
            "per_tensor_allreduce_ms": round(1000 * per_tensor, 3), "bucketed_over_flat": round(bucketed_over_flat, 3),
            "all_runs": times}


def _time_steps(steps: dict[str, Callable[[Any, Any], None]], batches: list[Any], repeats: int
                ) -> dict[str, list[float]]:
    """Seconds per step of each way of stepping, `repeats` times each, interleaved, so drift in the machine's
    speed hits all alike."""
    import torch.distributed as dist

    times: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(repeats):
        for name, step in steps.items():
            dist.barrier()
            started = time.perf_counter()
            for images, labels in batches:
                step(images, labels)
            dist.barrier()
            times[name].append((time.perf_counter() - started) / len(batches))
    return times


def small_cnn(num_classes: int) -> nn.Module:
    """A small CNN without BatchNorm. With BatchNorm the two methods still agree in exact arithmetic, but batch
    statistics amplify float32 rounding step after step (resnet8: 1e-7 after one step, 4e-4 after eight), so a
    weight comparison would measure that amplification instead of the averaging."""
    from torch import nn

    def block(inputs: int, outputs: int) -> list[nn.Module]:
        return [nn.Conv2d(inputs, outputs, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2)]

    return nn.Sequential(*block(3, 32), *block(32, 64), *block(64, 128), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                         nn.Linear(128, num_classes))


def _model(settings: dict[str, Any]) -> torch.nn.Module:
    import torch

    from stoker.training.models import build_model

    torch.manual_seed(0)  # both replicas and both methods start from the same weights
    return build_model(settings["model"], 10)


def _optimizer(model: torch.nn.Module, settings: dict[str, Any]) -> torch.optim.Optimizer:
    import torch

    if settings["optimizer"] == "adamw":
        return torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=5e-4)
    return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=5e-4)


def _batches(rank: int, settings: dict[str, Any], steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each rank its own batches, the same for both methods: class-dependent patterns plus noise."""
    import torch

    generator = torch.Generator().manual_seed(1000 + rank)
    size, batch = settings["image_size"], settings["batch_size"]
    prototypes = torch.randn(10, 3, size, size, generator=torch.Generator().manual_seed(7))
    batches = []
    for _ in range(steps):
        labels = torch.randint(0, 10, (batch,), generator=generator)
        images = prototypes[labels] + 0.5 * torch.randn(batch, 3, size, size, generator=generator)
        batches.append((images, labels))
    return batches


def _same_parameters(a: torch.nn.Module, b: torch.nn.Module) -> tuple[bool, float]:
    """Parameters agree to float32 rounding (the two methods add the same numbers in a different order).
    Buffers are not compared: DDP copies rank 0's BatchNorm statistics, stoker averages them."""
    import torch

    difference = max((x - y).abs().max().item() for x, y in zip(a.parameters(), b.parameters()))
    agree = all(torch.allclose(x, y, rtol=1e-4, atol=1e-5) for x, y in zip(a.parameters(), b.parameters()))
    return agree, difference


def _averaging_costs(model: torch.nn.Module, repeats: int = 200) -> tuple[float, float, float, float]:
    """Median seconds of averaging: the whole model with stoker's Averager, one flat tensor of the same size, and
    the model tensor by tensor (what averaging without buckets would cost). Each is all_reduce then divide."""
    import torch
    import torch.distributed as dist

    from stoker.training.averager import Averager

    averager = Averager(model, 1, WORLD)
    flat = torch.zeros(sum(b.numel() for b in averager.float_buckets))
    tensors = [t.detach().clone() for t in [*model.parameters(), *model.buffers()] if t.is_floating_point()]

    def one_flat():
        dist.all_reduce(flat)
        flat.div_(WORLD)

    def per_tensor():
        for tensor in tensors:
            dist.all_reduce(tensor)
            tensor.div_(WORLD)

    actions = (averager.average, one_flat, per_tensor)
    samples: list[list[float]] = [[] for _ in actions]
    for _ in range(repeats):  # interleaved: each round times all three back to back
        for action, times in zip(actions, samples):
            dist.barrier()
            started = time.perf_counter()
            action()
            times.append(time.perf_counter() - started)
    bucketed, flat_s, per_tensor_s = (statistics.median(times) for times in samples)
    # The ratio is taken round by round: the two timings of a round are microseconds apart, so a slow spell of
    # the machine hits both instead of one median.
    ratio = statistics.median(b / f for b, f in zip(samples[0], samples[1]))
    return bucketed, flat_s, per_tensor_s, ratio


def print_table(result: dict[str, Any]) -> None:
    print(f"{result['model']} ({result['parameters']:,} parameters in {result['tensors']} tensors), "
          f"{result['processes']} processes, batch {result['batch_size']}, {result['optimizer']}, "
          f"median of {result['repeats']} x {result['steps']} steps")
    print(f"  stoker (average parameters, from backward)  {1000 * result['stoker_step_s']:8.2f} ms/step")
    print(f"  DistributedDataParallel (average gradients) {1000 * result['ddp_step_s']:8.2f} ms/step")
    print(f"  ratio stoker / DDP                          {result['ratio']:8.3f}")
    print(f"  weights agree after {result['check_steps']} steps: {result['weights_match']} "
          f"(largest difference {result['max_weight_difference']:.2e})")
    print(f"  averaging the model {result['bucketed_average_ms']:.3f} ms, one flat tensor of the same size "
          f"{result['flat_allreduce_ms']:.3f} ms (x{result['bucketed_over_flat']:.2f}), tensor by tensor "
          f"{result['per_tensor_allreduce_ms']:.3f} ms")
