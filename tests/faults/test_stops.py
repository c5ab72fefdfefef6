"""Every way a run stops is clean: a reused run folder, a resume with nothing to resume from, signals at every
moment (start-up, training, shutdown, the report) and from every sender (the controller alone or the whole
process group). Each ends with the status it names, a summary.json, and no process or segment left (the autouse
fixture checks the last two after every test)."""

from __future__ import annotations

import os
import shutil

import pytest

from tests.conftest import read_summary, run_cli
from tests.faults.test_faults import fault, train_args

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def own_data(textures, tmp_path_factory):
    """A copy of the textures that a test may rename a class folder of (and must rename it back)."""
    folder = tmp_path_factory.mktemp("own-data")
    return shutil.copytree(textures[0], folder / "train"), shutil.copytree(textures[1], folder / "val")


@pytest.fixture(scope="module")
def finished_run(own_data, tmp_path_factory):
    """One completed 1-epoch run with a checkpoint at the end of its epoch."""
    run_dir = tmp_path_factory.mktemp("finished") / "run"
    run_cli(*train_args(own_data, run_dir, "--epochs", "1", "--devices", "cpu:1"))  # as its resumes
    return run_dir


def run_files(run_dir):
    return {path: path.read_bytes() for path in sorted(run_dir.rglob("*")) if path.is_file()}


def test_resuming_a_completed_run_is_refused_and_rewrites_nothing(finished_run):
    """Before: every process started, nothing trained, and summary.json said val_accuracy null, verdict
    "starting"."""
    before = run_files(finished_run)
    result = run_cli("train", "--resume", str(finished_run), "--quiet", check=False)
    assert result.returncode == 2, result.stderr[-3000:]
    assert "run already completed (1/1 epochs); give --epochs 2 or more to train on" in result.stderr
    assert "Traceback" not in result.stderr
    assert run_files(finished_run) == before


@pytest.mark.parametrize("change,named", [
    ({"seed": 7}, "seed: checkpoint 0, now 7"),
    ({"batch_size": 4}, "batch_size: checkpoint 8, now 4"),
    ({"image_size": 48}, "image_size: checkpoint 32, now 48"),
    ({"augment": "none"}, "augment: checkpoint 'standard', now 'none'"),
    ({"lr": 0.1}, "lr: checkpoint 0.05, now 0.1"),
    ({"model": "resnet14"}, "model: checkpoint 'resnet8', now 'resnet14'"),
])
def test_resume_with_a_setting_that_changes_the_plan_is_refused_naming_it(finished_run, tmp_path, change, named):
    """In the API, as on the command line (exit code 2): an error before any process starts, nothing written."""
    import stoker

    run_dir = shutil.copytree(finished_run, tmp_path / "run")
    before = run_files(run_dir)
    with pytest.raises(ValueError, match="a resume continues the same run") as refused:
        stoker.train(resume=run_dir, epochs=2, show_progress=False, **change)
    assert named in str(refused.value)
    assert run_files(run_dir) == before


def test_resume_on_other_data_or_a_renamed_class_folder_is_refused(own_data, finished_run, tmp_path):
    """Renaming a class folder between interrupt and resume shifted labels 3-9 silently; other data with the same
    classes and sizes is another run too."""
    import stoker

    train, _ = own_data
    elsewhere = shutil.copytree(train, tmp_path / "elsewhere")
    with pytest.raises(ValueError, match=f"data: checkpoint {str(train)!r}, now {str(elsewhere)!r}"):
        stoker.train(resume=finished_run, data=elsewhere, epochs=2, show_progress=False)
    classes = sorted(p.name for p in train.iterdir())
    renamed = train / ("zz_" + classes[3])
    (train / classes[3]).rename(renamed)
    try:
        with pytest.raises(ValueError, match=f"classes: label 3 was {classes[3]!r} at the checkpoint, now "
                                             f"{classes[4]!r}"):
            stoker.train(resume=finished_run, epochs=2, show_progress=False)
    finally:
        renamed.rename(train / classes[3])


def test_a_new_run_refuses_a_folder_that_holds_a_run(textures, finished_run, tmp_path):
    run_dir = tmp_path / "run"
    shutil.copytree(finished_run, run_dir)
    metrics_before = (run_dir / "metrics.jsonl").read_bytes()
    result = run_cli(*train_args(textures, run_dir, "--epochs", "1"), check=False)
    assert result.returncode == 2
    assert "already holds a run" in result.stderr and f"--resume {run_dir}" in result.stderr
    assert "Traceback" not in result.stderr
    assert (run_dir / "metrics.jsonl").read_bytes() == metrics_before  # untouched


@pytest.mark.parametrize("damage", ["truncated", "removed"])
def test_resume_with_no_valid_checkpoint_is_a_clear_error(finished_run, tmp_path, damage):
    run_dir = tmp_path / "run"
    shutil.copytree(finished_run, run_dir)
    for folder in (run_dir / "checkpoints").iterdir():
        if damage == "truncated":
            (folder / "rank_0.pt").write_bytes((folder / "rank_0.pt").read_bytes()[:100])
        else:
            shutil.rmtree(folder)
    result = run_cli("train", "--resume", str(run_dir), "--quiet", check=False)
    assert result.returncode == 2
    assert "no valid checkpoint" in result.stderr and "nothing to resume from" in result.stderr
    assert "Traceback" not in result.stderr


def test_a_second_resume_of_a_folder_in_use_is_refused_and_the_first_run_is_unharmed(finished_run, tmp_path):
    """Two real resumes of one folder at once: before the lock, both trained and the first to close deleted the
    other's checkpoint in progress. The first holds the folder's lock (its pid is in the lock file once it does),
    its steps slowed so that it still trains when the second starts; then it is interrupted to end the test."""
    import signal
    import subprocess
    import sys
    import time

    from stoker.common import checkpoint
    from tests.conftest import HELPERS

    run_dir = shutil.copytree(finished_run, tmp_path / "run")
    lock = run_dir / ".lock"
    lock.unlink(missing_ok=True)
    env = {**os.environ, "PYTHONPATH": f"{HELPERS}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
           "STOKER_STEP_TIME_MS": "600"}
    first = subprocess.Popen([sys.executable, "-m", "stoker", "train", "--resume", str(run_dir), "--epochs", "2",
                              "--devices", "cpu:1", "--slots-per-consumer", "2", "--quiet", "--report", "false"],
                             env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while not (lock.exists() and lock.read_text().strip()) and first.poll() is None:
            assert time.monotonic() < deadline, "the first resume never locked its folder"
            time.sleep(0.05)
        second = run_cli("train", "--resume", str(run_dir), "--epochs", "2", "--devices", "cpu:1", "--quiet",
                         check=False)
        assert second.returncode == 2, second.stderr[-3000:]
        assert f"{run_dir} is in use by another stoker run (pid {first.pid} holds {lock})" in second.stderr
        first.send_signal(signal.SIGINT)
        _, stderr = first.communicate(timeout=60)
    finally:
        if first.poll() is None:
            first.kill()
            first.wait()
    assert first.returncode == 130, stderr[-3000:]
    summary = read_summary(run_dir)
    assert summary["status"] == "interrupted" and summary["start_step"] == 15
    newest, _ = checkpoint.newest_valid(run_dir)
    assert str(newest) == summary["checkpoint"]


def test_growing_while_a_producer_retires_at_the_budget_waits_for_its_row(tmp_path):
    """At the budget, the autoscaler retires one producer (it counts only active ones) and then asks for one
    more: the retiring producer still holds its status row until it exits, so there is none free yet."""
    import numpy as np

    from stoker.common.procs import CONTEXT, Mailbox
    from stoker.pipeline.pool import ProducerPool
    from stoker.pipeline.producer import ProducerSetup, Source
    from stoker.pipeline.ring import SlotRing

    ring = SlotRing.create(num_slots=2, batch_size=2, image_size=8, num_status=2, samples=(1, 0))
    mailbox, stop = Mailbox(), CONTEXT.Event()
    setup = ProducerSetup(ring.spec, Source(("none.jpg",), np.zeros(1, np.int64)), None, "none", 0)
    pool = ProducerPool(setup, ring, mailbox, stop, capacity=2, producer_timeout_s=60)
    try:
        assert [pool.grow(), pool.grow()] == [0, 1]
        assert pool.shrink()
        retiring = next(h for h in pool.handles.values() if h.retiring)
        assert pool.grow() is None  # not a ValueError out of the controller
        assert len(pool.active) == 1
        retiring.process.join(timeout=30)
        assert pool.grow() == retiring.producer  # its row, once it has exited
        assert len(pool.active) == 2
    finally:
        stop.set()
        pool.close()
        mailbox.close()
        ring.close()


def run_in_own_group(*args, env):
    """The CLI as a session leader, so a fault can signal its whole process group (as scancel or docker stop
    do) without reaching pytest."""
    return run_cli(*args, env=env, check=False, new_session=True)


def assert_interrupted_with_a_checkpoint(result, run_dir):
    summary = read_summary(run_dir)
    assert result.returncode == 130, result.stderr[-3000:]
    assert summary["status"] == "interrupted", summary.get("error")
    assert summary["checkpoint"] is not None and (run_dir / "checkpoints").is_dir()
    assert "Traceback" not in result.stderr
    return summary


def test_sigterm_to_the_whole_process_group_ends_interrupted_with_a_checkpoint(textures, tmp_path):
    """Every child gets the SIGTERM too, at the same moment as the controller: none may die of it."""
    run_dir = tmp_path / "run"
    result = run_in_own_group(*train_args(textures, run_dir, "--devices", "cpu:2", "--producers", "2",
                                          "--epochs", "1"), env=fault("consumer:term-group:rank=1,step=3;"))
    summary = assert_interrupted_with_a_checkpoint(result, run_dir)
    assert ("SIGTERM: stopping after the steps already prepared, with a checkpoint (SIGTERM again to stop now)"
            in result.stderr)
    assert int(summary["checkpoint"].rsplit("_", 1)[1]) >= 3  # where the stop fell: the furthest step started


def test_ctrl_c_while_consumers_are_still_starting_ends_interrupted(textures, tmp_path):
    """SIGINT to the whole group right after the consumers were started, while they still import torch."""
    run_dir = tmp_path / "run"
    result = run_in_own_group(*train_args(textures, run_dir, "--devices", "cpu:2", "--epochs", "2"),
                              env=fault("controller:interrupt-group:consumers started"))
    summary = assert_interrupted_with_a_checkpoint(result, run_dir)
    assert summary["steps"] == 0


def test_a_signal_during_validation_does_not_wait_for_the_whole_pass(textures, tmp_path):
    """Before, the cut row was the validation pass and every batch of it was built and evaluated (9.3 s in the
    review). The signal comes as the first validation batch is handed over, with one consumer and two slots: the
    pass's end is not handed out yet, so the batches not yet prepared are dropped with it; the epoch's checkpoint
    is still written, and no accuracy is reported for a pass that did not happen."""
    from tests.faults.test_faults import events

    run_dir = tmp_path / "run"
    result = run_cli(*train_args(textures, run_dir, "--devices", "cpu:1", "--epochs", "2", "--slots-per-consumer",
                                 "2"), env=fault("controller:term-self:val batch 0 of epoch 0 handed over"),
                     check=False)
    summary = assert_interrupted_with_a_checkpoint(result, run_dir)
    assert summary["checkpoint"].endswith("step_00000015") and summary["steps"] == 15  # epoch 1 complete
    assert events(run_dir, "val") == [] and summary["val_accuracy"] is None


def test_sigterm_while_starting_up_says_so_and_starts_nothing(textures, tmp_path):
    """Before, SIGTERM while the settings were read and the data indexed ended the command with 143, silently."""
    run_dir = tmp_path / "run"
    result = run_cli(*train_args(textures, run_dir), env=fault("controller:term-self:starting up"), check=False)
    assert result.returncode == 130
    assert "stoker: SIGTERM before training started: stopped, nothing was started" in result.stderr
    assert "Traceback" not in result.stderr and not run_dir.exists()


def test_a_second_signal_during_shutdown_still_writes_the_summary_and_leaves_nothing(textures, tmp_path):
    """The first signal stops training; the second arrives while the controller stops its processes."""
    run_dir = tmp_path / "run"
    result = run_cli(*train_args(textures, run_dir, "--devices", "cpu:2", "--epochs", "2"),
                     env=fault("consumer:interrupt-parent:rank=0,step=3;|controller:term-self:closing"),
                     check=False)
    assert_interrupted_with_a_checkpoint(result, run_dir)
    assert "stopping every process now" in result.stderr


def test_a_signal_while_the_report_is_drawn_keeps_the_run_completed(textures, tmp_path):
    run_dir = tmp_path / "run"
    result = run_cli(*train_args(textures, run_dir, "--epochs", "1", "--report", "true"),
                     env=fault("controller:term-self:drawing the report"), check=False)
    summary = read_summary(run_dir)
    assert result.returncode == 0 and summary["status"] == "completed"
    assert (run_dir / "model.pt").exists()
    assert "report skipped" in result.stderr and "Traceback" not in result.stderr
    assert not (run_dir / "report.png").exists()


def test_a_hung_producer_with_two_consumers_at_default_timeouts_is_recovered(textures, tmp_path):
    """The rank whose batch hangs keeps its peer waiting in the averaging collective. At the default timeouts,
    both scaled by one factor to keep the test short, the file is skipped before the peer gives up. The file is in
    rank 1's step 4, so rank 0 is already in that step's collective (at step 0 both would still wait for input),
    and two slots per consumer keep rank 0 from being far behind the hang."""
    from stoker.common.config import TrainConfig
    from stoker.data.formats.folders import scan_image_folder
    from stoker.pipeline.plan import EpochPlan

    train, val = textures
    paths = scan_image_folder(train).paths
    victim = paths[EpochPlan(len(paths), 40, 8, 2, seed=0).train_work(0, 4, 1).sample_ids[0]]
    defaults, scale = TrainConfig(), 0.2
    run_dir = tmp_path / "run"
    run_cli(*train_args(textures, run_dir, "--devices", "cpu:2", "--producers", "2", "--epochs", "1",
                        "--slots-per-consumer", "2", "--seed", "0",
                        "--producer-timeout-s", str(defaults.producer_timeout_s * scale),
                        "--collective-timeout-s", str(defaults.collective_timeout_s * scale)),
            env=fault(f"producer:hang:{victim}"))
    summary = read_summary(run_dir)
    assert summary["status"] == "completed"
    [skipped] = summary["skipped_files"]
    assert skipped["path"] == victim and "hung" in skipped["reason"]
    assert summary["samples_consumed"] == [119]


def test_a_batch_delivered_twice_is_counted_and_reported(textures, tmp_path):
    """The producer of part 5 writes the batch it built before (part 4) again: one batch of 8 samples is trained
    on twice and the 8 samples of part 5 never."""
    run_dir = tmp_path / "run"
    result = run_cli(*train_args(textures, run_dir, "--devices", "cpu:1", "--producers", "1", "--epochs", "1"),
                     env=fault("producer-batch:repeat-batch:part=5;"))
    summary = read_summary(run_dir)
    assert summary["status"] == "completed"
    assert summary["duplicate_samples"] == 8 and summary["missing_samples"] == 8
    assert summary["missing_samples_skipped_as_unusable"] == 0
    assert summary["epoch_accounting"] == [{"epoch": 0, "consumed": 120, "duplicates": 8, "missing": 8,
                                            "missing_unusable": 0}]
    assert "exactly-once delivery broken: 8 sample(s) trained on more than once and 8 never" in result.stderr


HOLDER = """
import fcntl, os, sys
descriptor = os.open(sys.argv[1], os.O_CREAT | os.O_RDWR, 0o600)
os.ftruncate(descriptor, 4096)
fcntl.flock(descriptor, fcntl.LOCK_EX)
print("locked", flush=True)
sys.stdin.read()
"""


@pytest.mark.serial  # sweeps all of /dev/shm
def test_the_stale_segment_sweep_keeps_a_segment_a_live_controller_holds_whatever_its_pid():
    """A controller in another container (another PID namespace, /dev/shm shared with --ipc=host) names its
    segment with a pid that means nothing here, 999999: only the lock it holds says it is alive."""
    import os
    import subprocess
    import sys

    from stoker.pipeline.ring import NAME_PREFIX, SHM_DIR, sweep_dead_segments

    name = f"{NAME_PREFIX}999999_cafe0001"
    path = os.path.join(SHM_DIR, name)
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, path], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        assert name not in sweep_dead_segments()
        assert os.path.exists(path)
    finally:
        holder.stdin.close()
        holder.wait(timeout=10)
    assert sweep_dead_segments() == [name]  # its holder is gone: the lock went with it
    assert not os.path.exists(path)
