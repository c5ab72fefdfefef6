"""What a controller does when torchrun starts its job again: its own folder is recognized by the job's rendezvous
id, and the first machine decides from its folder whether all resume, start afresh or stop."""

from __future__ import annotations

import json

import pytest

from stoker.run import rundir


def _folder(tmp_path, job: str | None, status: str | None, checkpoint: bool):
    folder = tmp_path / "run"
    (folder / "checkpoints").mkdir(parents=True)
    if job is not None:
        (folder / rundir.JOB_FILE).write_text(json.dumps({"job": job}))
    if status is not None:
        (folder / "summary.json").write_text(json.dumps({"status": status}))
    if checkpoint:
        (folder / "checkpoints" / "step_00000008").mkdir()
    (folder / "checkpoints" / ".tmp-step_00000016").mkdir()  # half written: not a checkpoint
    return folder


@pytest.mark.parametrize("environment, recorded, same", [
    ("job-7", "job-7", True), ("job-7", "job-8", False), ("none", "none", False), (None, "job-7", False)],
    ids=["its-job", "another-job", "static-rendezvous", "not-under-torchrun"])
def test_a_folder_is_this_job_s_only_by_the_job_s_own_rendezvous_id(tmp_path, monkeypatch, environment, recorded,
                                                                     same):
    """A static rendezvous (`--node-rank`) names its job "none": two such launches must not share a folder."""
    if environment is None:
        monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    else:
        monkeypatch.setenv("TORCHELASTIC_RUN_ID", environment)
    assert rundir.started_again(_folder(tmp_path, recorded, "failed", True)) is same


@pytest.mark.parametrize("status, checkpoint, expected", [
    ("failed", True, "resume"), (None, True, "resume"), ("failed", False, None)],
    ids=["failed", "killed-before-its-summary", "failed-before-a-checkpoint"])
def test_a_failed_part_of_the_job_is_resumed_from_its_checkpoint(tmp_path, status, checkpoint, expected):
    assert rundir.after_a_restart(_folder(tmp_path, "j", status, checkpoint), here=True, elsewhere=True) == expected


@pytest.mark.parametrize("status", ["completed", "interrupted"])
def test_a_part_that_completed_or_was_interrupted_is_not_resumed(tmp_path, status):
    """A new launch with the same id after a finished run, or torchrun restarting after Ctrl-C (exit 130)."""
    with pytest.raises(rundir.RunDirError, match=f"ended {status}"):
        rundir.after_a_restart(_folder(tmp_path, "j", status, True), here=True, elsewhere=False)


def test_a_first_machine_without_the_job_s_folder_stops_every_machine_rather_than_start_from_step_0(tmp_path):
    """The machine that held the folder was lost, and a survivor whose folder is not the job's is first now."""
    with pytest.raises(rundir.RunDirError, match="not this job's"):
        rundir.after_a_restart(tmp_path, here=False, elsewhere=True)
    assert rundir.after_a_restart(tmp_path, here=False, elsewhere=False) is None  # no machine's: a new run


def test_without_out_a_job_s_folder_is_the_same_at_every_start(monkeypatch):
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-7")
    assert rundir.default_run_dir() == rundir.default_run_dir().parent / "torchrun-job-7"
