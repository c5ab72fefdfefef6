"""Fault injection: nothing lost, nothing hung, a clear message, no process or segment left (the autouse
fixture checks the last two after every test). Faults are driven by STOKER_FAULT, not by timing luck."""

from __future__ import annotations

import hashlib
import io
import json
import os
import pickle
import time

import pytest
import torch

from stoker.common import checkpoint
from stoker.common.config import make_config
from stoker.pipeline.ring import NAME_PREFIX, SHM_DIR
from stoker.run.checkpoint_fit import model_fit_check
from tests.conftest import (
    assert_same_weights,
    read_summary,
    run_cli,
    stoker_processes,
    wait_for_no_trace,
)

pytestmark = pytest.mark.timeout(240)


def train_args(textures, out, *extra):
    train, val = textures
    return ["train", "--data", str(train), "--val", str(val), "--batch-size", "8", "--image-size", "32", "--out",
            str(out), "--quiet", *extra]


def fault(spec, once_dir=None):
    env = {"STOKER_FAULT": spec}
    if once_dir is not None:
        env["STOKER_FAULT_ONCE"] = str(once_dir / "fired")
    return env


def events(run_dir, name):
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [record for record in map(json.loads, lines) if record["event"] == name]


def test_producer_killed_mid_epoch_is_replaced_and_nothing_is_lost(textures, tmp_path):
    victim = "train/3_checker/00005.jpg"
    run_cli(*train_args(textures, tmp_path / "run", "--devices", "cpu:2", "--producers", "2", "--epochs", "2"),
            env=fault(f"producer:sigkill:{victim}", once_dir=tmp_path))
    summary = read_summary(tmp_path / "run")
    assert summary["status"] == "completed"
    assert summary["samples_consumed"] == [120, 120]
    assert summary["duplicate_samples"] == 0 and summary["missing_samples"] == 0
    lost = events(tmp_path / "run", "producer_lost")
    assert len(lost) == 1 and "SIGKILL" in lost[0]["message"] and victim in lost[0]["message"]
    assert summary["skipped_files"] == []


def test_a_producer_killed_on_a_part_costs_that_part_not_its_batch(textures, tmp_path):
    """4 producers, 1 consumer, batches of 16: each batch is built in 2 parts of 8 (stoker/pipeline/parts.py)."""
    victim = "train/3_checker/00005.jpg"
    run_cli(*train_args(textures, tmp_path / "run", "--devices", "cpu:1", "--producers", "4", "--epochs", "1",
                        "--batch-size", "16"),
            env=fault(f"producer:sigkill:{victim}", once_dir=tmp_path))
    summary = read_summary(tmp_path / "run")
    assert summary["status"] == "completed"
    assert summary["samples_consumed"] == [120]
    assert summary["duplicate_samples"] == 0 and summary["missing_samples"] == 0
    [lost] = events(tmp_path / "run", "producer_lost")
    assert victim in lost["message"] and lost["reissued_samples"]
    assert all(0 < n <= 8 for n in lost["reissued_samples"])  # parts of a batch of 16, never a whole one


def test_producer_killed_halfway_through_sending_its_result_breaks_only_its_own_pipe(textures, tmp_path):
    """Half a message on the pipe, then SIGKILL: with one queue shared by every producer this garbles the stream
    (or leaves its lock held); with a pipe per producer the controller sees that pipe close and re-issues."""
    run_cli(*train_args(textures, tmp_path / "run", "--devices", "cpu:2", "--producers", "2", "--epochs", "2"),
            env=fault("producer-result:sigkill-mid-message:part=5;", once_dir=tmp_path))
    summary = read_summary(tmp_path / "run")
    assert summary["status"] == "completed"
    assert summary["samples_consumed"] == [120, 120]
    assert summary["duplicate_samples"] == 0 and summary["missing_samples"] == 0
    [lost] = events(tmp_path / "run", "producer_lost")
    assert "SIGKILL" in lost["message"] and lost["reissued"] >= 1
    assert summary["skipped_files"] == []


def test_producer_segfault_names_pid_and_file_and_the_file_is_skipped(textures, tmp_path):
    victim = "train/5_rings/00002.jpg"
    run_cli(*train_args(textures, tmp_path, "--producers", "2", "--epochs", "1"),
            env=fault(f"producer:segfault:{victim}"))
    summary = read_summary(tmp_path)
    assert summary["status"] == "completed"
    [skipped] = summary["skipped_files"]
    assert skipped["path"].endswith(victim)
    assert "SIGSEGV" in skipped["reason"] and "pid" in skipped["reason"]
    assert summary["missing_samples"] == summary["missing_samples_skipped_as_unusable"] == 1
    assert summary["samples_consumed"] == [119]


def test_hung_producer_is_killed_and_the_file_skipped(textures, tmp_path):
    victim = "train/7_blobs/00001.jpg"
    run_cli(*train_args(textures, tmp_path, "--producers", "1", "--epochs", "1", "--producer-timeout-s", "3"),
            env=fault(f"producer:hang:{victim}"))
    summary = read_summary(tmp_path)
    assert summary["status"] == "completed"
    [skipped] = summary["skipped_files"]
    assert skipped["path"].endswith(victim) and "hung" in skipped["reason"]


def test_consumer_killed_before_averaging_fails_cleanly_and_resume_continues(textures, tmp_path):
    run_dir = tmp_path / "run"
    args = train_args(textures, run_dir, "--devices", "cpu:2", "--epochs", "2", "--collective-timeout-s", "20",
                      "--on-consumer-failure", "stop")
    started = time.monotonic()
    result = run_cli(*args, env=fault("consumer:sigkill:rank=1,step=11;"), check=False)
    assert time.monotonic() - started < 60
    summary = read_summary(run_dir)
    assert result.returncode == 1 and summary["status"] == "failed"
    assert "consumer 1" in summary["error"] and "SIGKILL" in summary["error"]
    assert summary["checkpoint"].endswith("step_00000008")  # the end of epoch 1 (8 steps of 2 x 8 samples)
    run_cli("train", "--resume", str(run_dir), "--devices", "cpu:2", "--quiet")
    resumed = read_summary(run_dir)
    assert resumed["status"] == "completed" and resumed["start_step"] == 8
    assert resumed["samples_consumed"] == [120, 120]  # the whole run: epoch 1 before the kill, epoch 2 resumed


@pytest.mark.serial  # plants a dead run's segment: any other check would see it
def test_controller_killed_children_exit_and_next_start_sweeps_its_segment(textures, tmp_path):
    result = run_cli(*train_args(textures, tmp_path, "--devices", "cpu:2", "--epochs", "3"),
                     env=fault("consumer:kill-parent:rank=0,step=4;"), check=False)
    assert result.returncode == -9
    processes, _ = wait_for_no_trace(timeout_s=15)
    assert not processes  # producers and consumers noticed on their own
    stale = os.path.join(SHM_DIR, f"{NAME_PREFIX}999999_deadbeef")
    with open(stale, "wb") as handle:
        handle.write(b"\0" * 4096)
    run_cli(*train_args(textures, tmp_path / "again", "--epochs", "1"))
    assert not os.path.exists(stale)


def _of_dead_runs(names: set[str]) -> set[str]:
    """The stoker entries (a ring, a semaphore lock and its semaphores, a store folder) whose creator, named in
    them, is gone: what this test's killed run left. Another program's entries, and a live run's, are not it."""
    import re

    dead = set()
    for name in names:
        match = re.match(r"^(?:sem\.)?stoker(?:-sem_|-store-|_)(\d+)[-_]", name)
        if match and not os.path.exists(f"/proc/{match.group(1)}"):
            dead.add(name)
    return dead


@pytest.mark.serial  # leaves a dead run's entries, which every other test's no-trace check would count as a leak
def test_kill_9_of_the_whole_group_leaves_semaphores_and_a_store_that_the_next_start_removes(textures, tmp_path):
    """SIGKILL to every process of the run at once, the resource tracker included (which otherwise unlinks what a
    killed controller leaves): before, 11 `sem.mp-*` per run stayed in /dev/shm and the store folder in /tmp
    forever. Only entries of dead stoker processes count: other programs on the machine may use /dev/shm and /tmp
    meanwhile."""
    import re
    import tempfile

    def stores():  # named with their controller's pid: older stokers' (never swept, maybe in use) are not
        return {name for name in os.listdir(tempfile.gettempdir()) if re.match(r"stoker-store-\d+-", name)}

    shm_before, stores_before = _of_dead_runs(set(os.listdir(SHM_DIR))), stores()
    result = run_cli(*train_args(textures, tmp_path / "killed", "--devices", "cpu:1", "--epochs", "2"),
                     env=fault("consumer:kill-group:rank=0,step=1;"), check=False, new_session=True)
    assert result.returncode == -9
    assert wait_for_no_trace(timeout_s=15)[0] == []
    left = _of_dead_runs(set(os.listdir(SHM_DIR))) - shm_before
    assert any(name.startswith("sem.") for name in left), left  # what the kill left: the case is real
    killed_store = _of_dead_runs(stores() - stores_before)
    assert killed_store
    run_cli(*train_args(textures, tmp_path / "next", "--devices", "cpu:1", "--epochs", "1"))
    assert not left & set(os.listdir(SHM_DIR))
    assert not killed_store & stores()


@pytest.mark.parametrize("averaging", [(), ("--overlap-averaging", "true", "--sync-every", "2")],
                         ids=["every-step", "overlapped"])
def test_interrupt_checkpoints_and_resume_is_bitwise_exact_across_an_epoch_boundary(textures, tmp_path, averaging):
    """Overlapped, the checkpoint also holds the average still in flight, applied after resuming where the
    uninterrupted run applies it."""
    straight, split = tmp_path / "straight", tmp_path / "split"
    common = ("--devices", "cpu:2", "--epochs", "2", "--seed", "5", *averaging)
    run_cli(*train_args(textures, straight, *common))
    result = run_cli(*train_args(textures, split, *common), env=fault("consumer:interrupt-parent:rank=0,step=5;"),
                     check=False)
    interrupted = read_summary(split)
    assert result.returncode == 130 and interrupted["status"] == "interrupted"
    assert interrupted["checkpoint"] is not None
    stopped_at = int(interrupted["checkpoint"].rsplit("_", 1)[1])
    assert 5 < stopped_at < 16  # in epoch 1, before its end: the resume crosses the boundary
    run_cli("train", "--resume", str(split), "--devices", "cpu:2", "--quiet")
    whole, resumed = read_summary(straight), read_summary(split)
    assert resumed["start_step"] == stopped_at
    # the summary describes the whole run: the epoch split by the interrupt still counts every sample once
    for key in ("status", "epochs", "steps", "samples_consumed", "epoch_accounting", "duplicate_samples",
                "missing_samples"):
        assert resumed[key] == whole[key], key
    assert [(s["start_step"], s["end_step"], s["status"]) for s in resumed["segments"]] == [
        (0, stopped_at, "interrupted"), (stopped_at, 16, "completed")]
    assert_same_weights(straight, split)


class _Exploit:
    def __reduce__(self):
        return (os.system, (f"touch {os.environ['EXPLOIT_MARKER']}",))


def test_malicious_or_truncated_checkpoints_are_refused_and_the_newest_loadable_one_used(textures, tmp_path,
                                                                                         monkeypatch):
    """The newest checkpoint holds a code-running pickle under a checksum its forger fixed, the one before is
    truncated: resume must refuse both, run no code, and continue from the third."""
    run_dir = tmp_path / "run"
    run_cli(*train_args(textures, run_dir, "--devices", "cpu:1", "--epochs", "1", "--checkpoint-every", "4"))
    newest, truncated, good = sorted((run_dir / "checkpoints").glob("step_*"), reverse=True)[:3]
    marker = tmp_path / "exploited"
    monkeypatch.setenv("EXPLOIT_MARKER", str(marker))
    forge(newest / "rank_0.pt", pickle.dumps(_Exploit()))
    (truncated / "model.pt").write_bytes((truncated / "model.pt").read_bytes()[:100])
    result = run_cli("train", "--resume", str(run_dir), "--epochs", "2", "--devices", "cpu:1", "--quiet")
    assert not marker.exists()
    resumed = read_summary(run_dir)
    assert resumed["status"] == "completed"
    assert resumed["start_step"] == int(good.name.split("_")[1])
    assert f"{newest.name}/rank_0.pt: refused" in result.stderr
    assert f"{truncated.name}/model.pt: checksum mismatch" in result.stderr


def forge(path, payload: bytes) -> None:
    """Replace a checkpoint's file as a forger who also fixes the checksums in meta.json."""
    path.write_bytes(payload)
    meta = json.loads((path.parent / "meta.json").read_text())
    meta["files"][path.name] = hashlib.sha256(payload).hexdigest()
    meta[checkpoint.META_CHECKSUM] = checkpoint.meta_checksum(meta)
    (path.parent / "meta.json").write_text(json.dumps(meta))


def _edited(path, edit) -> bytes:
    state = torch.load(path, weights_only=True)
    edit(state)
    buffer = io.BytesIO()
    torch.save(state, buffer)
    return buffer.getvalue()


def test_checkpoints_that_load_but_do_not_fit_the_model_are_refused_and_the_newest_fitting_one_used(textures,
                                                                                                    tmp_path):
    """Under checksums their forger fixed: the newest checkpoint's averaged model has a tensor of another shape,
    the one before a momentum buffer of another shape (torch's load_state_dict takes it; the first step failed).
    Resume continues from the third (before, a consumer failed while starting: "size mismatch for stem.0.weight").
    A replica's EMA without one of its tensors is refused too."""
    run_dir = tmp_path / "run"
    run_cli(*train_args(textures, run_dir, "--devices", "cpu:2", "--epochs", "1", "--checkpoint-every", "2",
                        "--ema", "0.9"))
    newest, second, good = sorted((run_dir / "checkpoints").glob("step_*"), reverse=True)[:3]
    ema_lost = _edited(good / "rank_1.pt", lambda s: s["ema"].pop("model.head.bias"))
    fits = model_fit_check(make_config(json.loads((run_dir / "config.json").read_text())), 10)
    with pytest.raises(checkpoint.CheckpointError, match=r"rank_1.pt\['ema'\] does not fit the model \(1 missing: "
                                                          r"head.bias\)"):
        fits(good / "rank_1.pt", torch.load(io.BytesIO(ema_lost), weights_only=True),
             json.loads((good / "meta.json").read_text()))
    forge(newest / "model.pt", _edited(newest / "model.pt", lambda s: s.update({"stem.0.weight": torch.zeros(3)})))
    forge(second / "rank_0.pt", _edited(second / "rank_0.pt", _momentum_of_another_shape))
    result = run_cli("train", "--resume", str(run_dir), "--epochs", "2", "--devices", "cpu:2", "--quiet")
    assert read_summary(run_dir)["status"] == "completed"
    assert read_summary(run_dir)["start_step"] == int(good.name.split("_")[1])
    assert (f"{newest.name}/model.pt does not fit the model (1 of another shape or dtype: stem.0.weight (3,) "
            "float32)") in result.stderr
    assert f"{second.name}/rank_0.pt: the optimizer's 'momentum_buffer' of parameter 0 has shape (7,)" in result.stderr


def _momentum_of_another_shape(state: dict) -> None:
    state["optimizer"]["state"][0]["momentum_buffer"] = torch.zeros(7)


def test_a_model_with_frozen_parameters_resumes(textures, tmp_path):
    """Its optimizer holds only the trainable parameters: the fit check must count those, not all of the model's."""
    run_dir = tmp_path / "run"
    run_cli(*train_args(textures, run_dir, "--devices", "cpu:1", "--epochs", "1", "--model", "frozen:frozen_stem_cnn"))
    last = sorted((run_dir / "checkpoints").glob("step_*"))[-1]
    result = run_cli("train", "--resume", str(run_dir), "--epochs", "2", "--devices", "cpu:1", "--quiet")
    assert read_summary(run_dir)["status"] == "completed", result.stderr[-2000:]
    assert read_summary(run_dir)["start_step"] == int(last.name.split("_")[1])
    assert "skipping checkpoint" not in result.stderr
    assert "pixels version" not in result.stderr  # the same decoder wrote it


def test_a_checkpoint_written_by_a_decoder_that_gave_other_pixels_resumes_with_a_warning(textures, tmp_path):
    """Written before checkpoints recorded their pixels version (1: any DCT scale, where 2 keeps to the SIMD
    ones): the run continues where it stood, and the log says its images are not bitwise the uninterrupted run's."""
    run_dir = tmp_path / "run"
    run_cli(*train_args(textures, run_dir, "--devices", "cpu:1", "--epochs", "1"))
    last = sorted((run_dir / "checkpoints").glob("step_*"))[-1]
    meta = json.loads((last / "meta.json").read_text())
    assert meta.pop("pixels") == 2
    meta[checkpoint.META_CHECKSUM] = checkpoint.meta_checksum(meta)
    (last / "meta.json").write_text(json.dumps(meta))
    result = run_cli("train", "--resume", str(run_dir), "--epochs", "2", "--devices", "cpu:1", "--quiet")
    assert read_summary(run_dir)["status"] == "completed"
    assert f"{last}: saved by a stoker whose decoder gave other pixels (pixels version 1, now 2)" in result.stderr


def test_shared_memory_too_small_is_a_clear_error_before_any_process(textures, tmp_path):
    result = run_cli(*train_args(textures, tmp_path, "--image-size", "2048", "--batch-size", "100",
                                    "--slots-per-consumer", "64"), check=False)
    assert result.returncode == 2
    assert "MiB of shared memory" in result.stderr and "--shm-size" in result.stderr
    assert not stoker_processes()  # this worker's, read at once: none was started
    # Segments waited for: one whose creator is gone counts whoever made it, and another worker's test that SIGKILLs
    # its controller leaves one for the moment its run takes to remove it.
    assert wait_for_no_trace() == ([], [])


def test_disk_full_while_checkpointing_is_a_clear_error_and_the_previous_checkpoint_stands(textures, tmp_path):
    run_dir = tmp_path / "run"
    result = run_cli(*train_args(textures, run_dir, "--epochs", "2", "--checkpoint-every", "4"),
                     env=fault("checkpoint:enospc:step_00000008"), check=False)
    summary = read_summary(run_dir)
    assert result.returncode == 1 and summary["status"] == "failed"
    assert "No space left on device" in summary["error"] and "step_00000008" in summary["error"]
    assert summary["checkpoint"].endswith("step_00000004")
    assert [p.name for p in (run_dir / "checkpoints").iterdir()] == ["step_00000004"]  # no half-written folder
    run_cli("train", "--resume", str(run_dir), "--quiet")
    assert read_summary(run_dir)["start_step"] == 4


@pytest.mark.parametrize("signal_action", ["interrupt-parent", "kill-parent"])
def test_signal_while_a_checkpoint_is_written_leaves_a_checkpoint_that_loads(textures, tmp_path, signal_action):
    """The controller gets SIGINT (or SIGKILL) while a consumer is writing the step-8 checkpoint."""
    run_dir = tmp_path / "run"
    result = run_cli(*train_args(textures, run_dir, "--epochs", "2", "--checkpoint-every", "4"),
                     env=fault(f"checkpoint:{signal_action}:step_00000008/rank_0.pt"), check=False)
    if signal_action == "interrupt-parent":
        interrupted = read_summary(run_dir)
        assert result.returncode == 130 and interrupted["status"] == "interrupted"
        checkpoint.verify(run_dir / "checkpoints" / "step_00000008")  # the write under way completed
        expected_start = int(interrupted["checkpoint"].rsplit("_", 1)[1])  # then where the stop fell
        assert expected_start >= 8
    else:
        assert result.returncode == -9
        assert wait_for_no_trace(timeout_s=15) == ([], [])
        expected_start = 4  # the half-written one is ignored; the previous one loads
    run_cli("train", "--resume", str(run_dir), "--quiet")
    resumed = read_summary(run_dir)
    assert resumed["status"] == "completed" and resumed["start_step"] == expected_start
    assert not list((run_dir / "checkpoints").glob(".tmp-*"))
