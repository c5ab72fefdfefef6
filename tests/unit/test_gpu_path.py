"""The parts of the CUDA path that break or slow several GPUs, checked where a CPU can reach them: aligned flat
buckets, averaging groups that overlap backward, a torch that cannot see the machine's GPUs, aborting the group on
every path but a clean finish, compile done before the first collective, and a missing optional part named."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from stoker.training.averager import flatten_float_state, group_bytes
from stoker.training.backward_average import _groups
from stoker.training.models import build_model


def test_every_view_of_a_flat_bucket_starts_at_64_bytes():
    """A 10-class head leaves BatchNorm's buffers 8 bytes off 16-byte alignment when views are packed tight."""
    model = build_model("resnet8", 10)
    before = {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}
    buckets, parameters = flatten_float_state(model)
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        if tensor.is_floating_point():
            assert tensor.data_ptr() % 64 == 0, name
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, before[name]), name  # the values moved with the views
    counted = sum(p.numel() for p in model.parameters())
    assert parameters[0].numel() >= counted and buckets[0].numel() >= parameters[0].numel()


@pytest.mark.parametrize("name", ["resnet8", "resnet18", "resnet50"])
def test_a_model_has_several_averaging_groups_on_a_gpu(name):
    """With DDP's fixed 25 MB every built-in model up to resnet18 is one or two groups, and the first group fires
    only at the end of backward: nothing overlaps. Cut from the parameter count, each model has several."""
    model = build_model(name, 1000)
    buckets, _ = flatten_float_state(model)
    size = group_bytes(sum(b.numel() * b.element_size() for b in buckets), on_gpu=True)
    groups = _groups([p for p in model.parameters()], buckets, size)
    assert len(groups) >= (3 if name == "resnet8" else 6)
    assert size <= 25 << 20


@pytest.fixture
def nvidia_smi_lists_a_gpu(tmp_path, monkeypatch):
    """A machine whose driver lists a GPU that this (CPU-only) torch cannot use: a real `nvidia-smi` on PATH."""
    script = tmp_path / "nvidia-smi"
    script.write_text("#!/bin/sh\nif [ \"$1\" = -L ]; then echo 'GPU 0: NVIDIA H200 (UUID: GPU-0)'; "
                      "else echo '| NVIDIA-SMI 535.1   Driver Version: 535.1   CUDA Version: 12.2 |'; fi\n")
    script.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)


def test_devices_auto_stops_when_torch_cannot_see_the_gpus_nvidia_smi_lists(nvidia_smi_lists_a_gpu, monkeypatch):
    from stoker.common.devices import TorchCannotSeeGpus, resolve_devices

    with pytest.raises(TorchCannotSeeGpus, match=r"nvidia-smi lists 1 GPU .*install a torch wheel.*whl/cu122"):
        resolve_devices("auto")
    assert resolve_devices("cpu:2") == ["cpu", "cpu"]  # asked for the CPU: no question
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # hidden on purpose (as the test suite does)
    assert resolve_devices("auto")[0] == "cpu"


def test_bench_gpu_stops_when_torch_cannot_see_the_gpus(nvidia_smi_lists_a_gpu, capsys):
    from stoker.cli import main

    assert main(["bench", "gpu", "--images", "4"]) == 2
    assert "nvidia-smi lists 1 GPU" in capsys.readouterr().err


def test_bench_gpu_without_the_bench_extra_says_which_extra_to_install(monkeypatch, capsys):
    import sys

    from stoker.cli import main

    monkeypatch.setitem(sys.modules, "sklearn", None)  # not installed
    monkeypatch.setitem(sys.modules, "sklearn.datasets", None)
    assert main(["bench", "gpu", "--device", "cpu", "--images", "4"]) == 2
    assert "pip install 'stoker[bench]'" in capsys.readouterr().err


def _count_compiles() -> tuple[list[int], object]:
    compiles = [0]

    def backend(graph, example_inputs):
        compiles[0] += 1
        return graph.forward

    return compiles, backend


def test_compile_warm_up_covers_every_shape_a_run_meets_and_leaves_the_model_as_it_was():
    """After the warm-up, the full batch, a short last batch and validation (eval mode, either size, at the
    training side and at --val-image-size's) compile nothing more, a 1-sample share or last validation batch
    included (dynamo specializes size 1): no rank compiles after the group's first collective."""
    import torch._dynamo

    from stoker.training import accel, warmup

    torch._dynamo.reset()
    torch.manual_seed(0)
    model = build_model("resnet8", 10)
    flatten_float_state(model)
    before = [t.detach().clone() for t in (*model.parameters(), *model.buffers())]
    compiles, backend = _count_compiles()
    forward = accel.compiled(model, threads=1, backend=backend)
    precision = accel.MixedPrecision("fp32", torch.device("cpu"))
    rng = torch.get_rng_state()
    warmup.warm_up(model, forward, precision, torch.device("cpu"), 8, 32, 10, channels_last=True, val_image_size=40)
    assert compiles[0] > 0
    assert all(torch.equal(a, b) for a, b in zip(before, (*model.parameters(), *model.buffers())))
    assert torch.equal(torch.get_rng_state(), rng) and all(p.grad is None for p in model.parameters())
    after_warm_up = compiles[0]
    for size in (8, 5, 3, 1):
        images = torch.randn(size, 3, 32, 32).contiguous(memory_format=torch.channels_last)
        model.train()
        F.cross_entropy(forward(images), torch.zeros(size, dtype=torch.int64)).backward()
        model.eval()
        with torch.no_grad():
            forward(images)
            forward(torch.randn(size, 3, 40, 40).contiguous(memory_format=torch.channels_last))
    assert compiles[0] == after_warm_up
    torch._dynamo.reset()


def test_compile_warm_up_covers_every_side_of_an_image_size_ramp():
    """Training steps at the other sides an --image-size-ramp reaches (here 16 and 24 px, the ring's side 32; the
    consumer passes `SizeRamp.sizes`) compile nothing after the warm-up either."""
    import torch._dynamo

    from stoker.training import accel, warmup

    torch._dynamo.reset()
    model = build_model("resnet8", 10)
    flatten_float_state(model)
    compiles, backend = _count_compiles()
    forward = accel.compiled(model, threads=1, backend=backend)
    precision = accel.MixedPrecision("fp32", torch.device("cpu"))
    warmup.warm_up(model, forward, precision, torch.device("cpu"), 8, 32, 10, channels_last=True,
                   ramp_sizes=(16, 24, 32))
    after_warm_up = compiles[0]
    model.train()
    for side in (16, 24):
        for size in (8, 5, 1):
            images = torch.randn(size, 3, side, side).contiguous(memory_format=torch.channels_last)
            F.cross_entropy(forward(images), torch.zeros(size, dtype=torch.int64)).backward()
    assert compiles[0] == after_warm_up
    torch._dynamo.reset()



def _counting_aot_backend() -> tuple[list[int], object]:
    """aot_eager that counts its forward graphs: AOTAutograd runs over the real model (functionalization, the
    mutated BatchNorm buffers, inputs that are views of one flat storage), the graphs then run eagerly."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    compiles = [0]

    def forward_compiler(graph, example_inputs):
        compiles[0] += 1
        return make_boxed_func(graph.forward)

    return compiles, aot_autograd(fw_compiler=forward_compiler,
                                  bw_compiler=lambda graph, example_inputs: make_boxed_func(graph.forward))


def test_aot_autograd_trains_the_flat_bucket_model_as_eager_does_at_every_warm_up_size():
    """Every parameter and BatchNorm buffer is a view of one flat storage and the running stats are mutated inside
    the graph: compiled through AOTAutograd (aot_eager, no C compiler) after the warm-up, a flattened resnet8's
    gradients, running stats and outputs in train and eval match eager's at each size the warm-up compiled (half
    the batch, the batch, 1), and nothing compiles again."""
    import copy

    import torch._dynamo

    from stoker.training import accel, warmup

    torch._dynamo.reset()
    torch.manual_seed(0)
    eager = build_model("resnet8", 10)
    flatten_float_state(eager)
    model = copy.deepcopy(eager)
    flatten_float_state(model)
    assert len({t.untyped_storage().data_ptr() for t in (*model.parameters(), *model.buffers())
                if t.is_floating_point()}) == 1
    compiles, backend = _counting_aot_backend()
    forward = accel.compiled(model, threads=1, backend=backend)
    warmup.warm_up(model, forward, accel.MixedPrecision("fp32", torch.device("cpu")), torch.device("cpu"), 8, 32,
                   10, channels_last=True)
    warmed = compiles[0]
    assert warmed > 0
    for size in warmup.warm_up_sizes(8):
        images = torch.randn(size, 3, 32, 32).contiguous(memory_format=torch.channels_last)
        labels = torch.arange(size) % 10
        for module, run in ((eager, eager), (model, forward)):
            module.train()
            module.zero_grad(set_to_none=True)
            F.cross_entropy(run(images), labels).backward()
        for (name, a), b in zip(eager.named_parameters(), model.parameters()):
            assert torch.allclose(a.grad, b.grad, atol=1e-5), (size, name)
        for (name, a), b in zip(eager.named_buffers(), model.buffers()):  # running stats, updated in the graph
            assert torch.allclose(a.float(), b.float(), atol=1e-6), (size, name)
        eager.eval()
        model.eval()
        with torch.no_grad():
            assert torch.allclose(eager(images), forward(images), atol=1e-5), size
    assert compiles[0] == warmed
    torch._dynamo.reset()


class _BatchNormHead(torch.nn.Module):
    """A user model whose head is a BatchNorm1d: it cannot train on a batch of one sample."""

    def __init__(self) -> None:
        super().__init__()
        self.features = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.AdaptiveAvgPool2d(1),
                                            torch.nn.Flatten(), torch.nn.Linear(8, 10))
        self.head = torch.nn.BatchNorm1d(10)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(images))


def test_a_plan_says_where_it_can_give_a_batch_of_one_sample():
    from stoker.pipeline.plan import EpochPlan

    def plan(train, val, consumers, **options):
        return EpochPlan(train, val, 8, consumers, 0, **options).one_sample_batches()

    assert plan(64, 16, 2) == (False, False)  # whole steps, validation shards of 8
    assert plan(65, 16, 2) == (True, False)  # the last step's one sample: a share of 1 beside one of 0
    assert plan(66, 16, 2) == (True, False)  # two: one each
    assert plan(68, 16, 2) == (False, False)  # four: two each
    assert plan(65, 16, 2, drop_last=True) == (False, False)  # no short last step
    assert plan(64, 17, 1) == (False, True) and plan(64, 18, 2) == (False, True)  # a shard of 9: 8 then 1
    assert plan(64, 16, 2, start_offset=15, start_step=1) == (True, False)  # resumed: 49 left, its last step 1


@pytest.mark.parametrize("one_sample", [(False, False), (False, True)])
def test_the_warm_up_trains_at_one_sample_only_where_the_plan_gives_one(one_sample):
    """A model with a BatchNorm1d head cannot train on one sample: a run whose plan never gives one must not fail
    at its warm-up (it used to train at size 1 always); where the plan gives one, the warm-up meets it at start."""
    from stoker.training import accel, warmup

    model = _BatchNormHead()
    before = [t.detach().clone() for t in model.state_dict().values()]
    precision = accel.MixedPrecision("fp32", torch.device("cpu"))
    warmup.warm_up(model, model, precision, torch.device("cpu"), 8, 16, 10, channels_last=False,
                   one_sample=one_sample)
    assert all(torch.equal(a, b) for a, b in zip(before, model.state_dict().values()))
    with pytest.raises(ValueError, match="Expected more than 1 value per channel"):
        warmup.warm_up(model, model, precision, torch.device("cpu"), 8, 16, 10, channels_last=False,
                       one_sample=(True, one_sample[1]))


def test_a_consumer_still_compiling_does_not_time_out_the_others(tmp_path):
    """The consumers meet through the store after compiling: a late one holds the others there, not in a
    collective with a 60 s timeout."""
    from stoker.training.warmup import wait_for_peers

    store = dist.FileStore(str(tmp_path / "store"), 2)
    waited: list[float] = []

    def early() -> None:
        started = time.monotonic()
        wait_for_peers(store, "compiled", 2, alive=lambda: None)
        waited.append(time.monotonic() - started)

    thread = threading.Thread(target=early)
    thread.start()
    time.sleep(1.0)  # the other consumer is still compiling
    assert thread.is_alive()
    wait_for_peers(dist.FileStore(str(tmp_path / "store"), 2), "compiled", 2, alive=lambda: None)
    thread.join(timeout=10)
    assert waited and waited[0] >= 1.0


def test_a_consumer_told_to_stop_leaves_the_meeting(tmp_path):
    from stoker.training.warmup import wait_for_peers

    class Stop(Exception):
        pass

    def stopped() -> None:
        raise Stop

    with pytest.raises(Stop):
        wait_for_peers(dist.FileStore(str(Path(tmp_path) / "store"), 2), "compiled", 2, alive=stopped)


@pytest.mark.parametrize(("devices", "clip", "expected"), [
    ({}, 0.0, True),
    ({"compile": True}, 0.0, False),  # one compiled backward node: every group's hook fires at its end
    ({"precision": "fp16"}, 0.0, False),  # the scaler unscales and steps the whole model after backward
    ({}, 1.0, False),  # clipping needs every gradient's norm first
])
def test_averaging_in_backward_only_where_a_group_can_step_as_its_gradients_complete(devices, clip, expected):
    from stoker.common.config import AveragingSettings, DeviceSettings, RecipeSettings
    from stoker.training.consumer import averages_in_backward

    assert averages_in_backward(AveragingSettings(), DeviceSettings(**devices),
                                RecipeSettings(clip_grad_norm=clip)) is expected


def test_compile_threads_share_the_cores_among_this_machine_s_consumers_not_its_gpus(monkeypatch):
    """`--devices cuda:0` on an 8-GPU machine: one consumer, which may compile on every core."""
    from stoker.training import consumer

    monkeypatch.setattr(consumer, "available_cores", lambda: 16)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    assert consumer.compile_threads("cuda:0", num_threads=2, local_consumers=1) == 16
    assert consumer.compile_threads("cuda:3", num_threads=2, local_consumers=4) == 4
    assert consumer.compile_threads("cpu", num_threads=2, local_consumers=1) == 2  # its torch threads


@pytest.mark.parametrize("ending, expected", [
    ("a peer died", ["sent ConsumerFailed", "abort"]), ("stopped", ["abort"]), ("finished", ["destroy"])])
def test_a_consumer_aborts_its_group_after_a_failure_or_a_stop_and_destroys_it_only_after_a_finish(
        monkeypatch, ending, expected):
    """The consumer's own ending, as on a GPU: a collective that fails because a peer died (NCCL raises
    DistBackendError) sends the failure to the controller first, then aborts the group; nothing destroys it, which
    would flush the pending work and block until the controller kills the consumer."""
    from torch.distributed import distributed_c10d

    from stoker.training import consumer

    calls: list[str] = []

    class Outbox:
        def send(self, message) -> None:
            if type(message).__name__ != "StartupPhase":  # its start-up's phases (stoker.training.startup)
                calls.append(f"sent {type(message).__name__}")

    class Replica:
        def __init__(self, *args) -> None:
            pass

        def serve(self, ready) -> None:
            if ending == "a peer died":
                raise dist.DistBackendError("NCCL error: remote process exited or there was a network error")
            if ending == "stopped":
                raise consumer.Stopped()

    class Ring:
        def close(self) -> None:
            pass

    monkeypatch.setattr(consumer, "Replica", Replica)
    monkeypatch.setattr(consumer.SlotRing, "attach", lambda spec: Ring())
    monkeypatch.setattr(consumer, "name_process", lambda name: None)
    monkeypatch.setattr(consumer, "exit_with_parent", lambda: None)
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "destroy_process_group", lambda *a: calls.append("destroy"))
    monkeypatch.setattr(distributed_c10d, "_abort_process_group", lambda *a: calls.append("abort"))
    setup = type("Setup", (), {"rank": 1, "local_rank": 1, "ring": None})()
    consumer.consumer_main(setup, ready=None, outbox=Outbox(), stop=threading.Event())
    assert calls == expected


def test_an_abort_that_raises_is_logged_not_raised_over_the_consumer_s_own_error(monkeypatch, caplog):
    """With TORCH_NCCL_ASYNC_ERROR_HANDLING=2 the watchdog may have aborted the communicators already."""
    from torch.distributed import distributed_c10d

    from stoker.training import consumer

    def already_aborted(*args):
        raise RuntimeError("NCCL communicator was aborted")

    monkeypatch.setattr(distributed_c10d, "_abort_process_group", already_aborted)
    with caplog.at_level("WARNING"):
        consumer.abort_group()
    assert "NCCL communicator was aborted" in caplog.text


def test_an_abort_that_does_not_return_ends_the_process(monkeypatch):
    from torch.distributed import distributed_c10d

    from stoker.training import consumer

    released = threading.Event()
    exits: list[int] = []
    monkeypatch.setattr(distributed_c10d, "_abort_process_group", lambda *a: released.wait(10))
    monkeypatch.setattr(consumer, "ABORT_S", 0.05)
    monkeypatch.setattr(os, "_exit", exits.append)
    consumer.abort_group()
    released.set()
    assert exits and exits[0] != 0


def _cuda_of(monkeypatch, visible: int, initialized: bool, current: int = 0, local_rank: str | None = None):
    """torch.cuda as a rank would see it (there is no GPU here)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: visible)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: initialized)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: current)
    if local_rank is None:
        monkeypatch.delenv("LOCAL_RANK", raising=False)
    else:
        monkeypatch.setenv("LOCAL_RANK", local_rank)


def test_the_loader_s_cuda_is_the_rank_s_own_gpu(monkeypatch):
    from stoker.use.loader import resolve_device

    _cuda_of(monkeypatch, visible=8, initialized=False, local_rank="3")
    assert resolve_device("cuda") == torch.device("cuda", 3)  # torchrun on one machine, every GPU visible
    _cuda_of(monkeypatch, visible=1, initialized=False, local_rank="3")
    assert resolve_device("cuda") == torch.device("cuda", 0)  # SLURM --gpus-per-task=1: its one GPU
    _cuda_of(monkeypatch, visible=8, initialized=True, current=5, local_rank="3")
    assert resolve_device("cuda") == torch.device("cuda", 5)  # the user's own torch.cuda.set_device
    assert resolve_device("cuda:2") == torch.device("cuda", 2)  # asked for by number
    _cuda_of(monkeypatch, visible=4, initialized=False, local_rank="6")
    with pytest.raises(ValueError, match="LOCAL_RANK"):
        resolve_device("cuda")


def test_the_loader_s_cuda_is_the_rank_s_own_gpu_when_the_script_never_called_set_device(monkeypatch):
    """A torchrun script that moves its model with `.to(f"cuda:{local_rank}")` and never calls set_device: CUDA is
    initialized with device 0 current on every rank. Rank 3's Loader must not feed GPU 0."""
    from stoker.use.loader import resolve_device

    _cuda_of(monkeypatch, visible=8, initialized=True, current=0, local_rank="3")
    assert resolve_device("cuda") == torch.device("cuda", 3)
    _cuda_of(monkeypatch, visible=1, initialized=True, current=0, local_rank="3")
    assert resolve_device("cuda") == torch.device("cuda", 0)  # its one visible GPU


def test_the_loader_s_cuda_is_the_device_the_process_group_is_bound_to(monkeypatch, tmp_path):
    """`init_process_group(device_id=...)` names the rank's GPU whatever else says: a real (gloo) default group,
    whose bound device is set as NCCL's init would set it (there is no GPU here)."""
    from stoker.use.loader import resolve_device

    _cuda_of(monkeypatch, visible=8, initialized=True, current=5, local_rank="3")
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        dist.group.WORLD.bound_device_id = torch.device("cuda", 6)
        assert resolve_device("cuda") == torch.device("cuda", 6)
        dist.group.WORLD.bound_device_id = None  # not bound: the user's set_device
        assert resolve_device("cuda") == torch.device("cuda", 5)
    finally:
        dist.destroy_process_group()


def test_eval_and_predict_copy_each_batch_to_the_gpu_without_waiting_for_it(monkeypatch):
    """A recording fake CUDA device at torch's API boundary (its tensors stay on the CPU): every copy to it is
    recorded with whether it was pinned and non-blocking. A blocking copy, or one from pageable memory, makes the
    host wait for the device's stream: per batch, that is a synchronization per batch. Only the replica's set-up
    (the model, the normalization constants) may copy blocking; each batch's pixels and labels go from pinned
    memory, non-blocking, and nothing is read back (.item, .cpu, .tolist) until the pass ends."""
    from stoker.training.model_file import ModelCard
    from stoker.use import evaluate
    from stoker.use.inference import LoadedModel

    copies: list[tuple[str, bool, bool]] = []
    reads: list[str] = []
    to = torch.Tensor.to

    def fake_to(self, *args, **kwargs):
        target = next((a for a in (*args, kwargs.get("device")) if isinstance(a, (torch.device, str))), None)
        if target is not None and torch.device(target).type == "cuda":
            copies.append(("batch" if running else "set-up", bool(kwargs.get("non_blocking")),
                           getattr(self, "_pinned", False)))
            return to(self, "cpu", *(a for a in args if not isinstance(a, (torch.device, str))),
                      **{k: v for k, v in kwargs.items() if k != "device"})
        return to(self, *args, **kwargs)

    def fake_pin(self):
        pinned = self.clone()
        pinned._pinned = True
        return pinned

    for name in ("item", "cpu", "tolist"):
        original = getattr(torch.Tensor, name)
        monkeypatch.setattr(torch.Tensor, name, lambda self, *a, _o=original, _n=name, **k: (
            reads.append(_n) if running else None, _o(self, *a, **k))[1])
    monkeypatch.setattr(torch.Tensor, "to", fake_to)
    monkeypatch.setattr(torch.Tensor, "pin_memory", fake_pin)
    running = False
    card = ModelCard("resnet8", tuple(str(k) for k in range(10)), 32)
    replicas = evaluate.Replicas(LoadedModel(build_model("resnet8", 10).eval(), card, Path("m.pt"),
                                             torch.device("cpu")), ["cuda:0"])
    running = True
    for _ in range(4):
        pixels = torch.randint(0, 256, (2, 32, 32, 3), dtype=torch.uint8).permute(0, 3, 1, 2)  # as the Loader's
        logits = replicas.run(pixels)
        evaluate.to_device(torch.tensor([1, 2]), torch.device("cuda:0"))
    assert logits.shape == (2, 10)
    per_batch = [(non_blocking, pinned) for when, non_blocking, pinned in copies if when == "batch"]
    assert per_batch == [(True, True)] * 8, copies  # pixels and labels, 4 batches
    assert reads == []
