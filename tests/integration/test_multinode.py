"""Two "machines" on one host: two torchrun agents with different node ranks on loopback, one stoker controller
each, their consumers in one process group."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from tests.conftest import HELPERS, assert_same_weights, free_port, read_summary, run_cli, wait_for_no_trace

pytestmark = pytest.mark.timeout(240)


def _one_core(node: int):
    """Each "machine" gets a core of its own, as separate machines would: same threads per consumer as one
    machine with two consumers on this host's two cores, so the weights can be compared bit for bit."""
    cores = sorted(os.sched_getaffinity(0))
    return lambda: os.sched_setaffinity(0, {cores[node % len(cores)]})


def launch_machines(textures, out, *extra, env=None, nodes=2, per_node=None):
    """`torchrun --nnodes 2 --nproc-per-node 1 --node-rank K ...` for each K, as the README shows."""
    train, val = textures
    port = free_port()
    environment = {**os.environ, **(env or {})}
    agents = [subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(nodes), "--nproc-per-node", "1",
         "--node-rank", str(node), "--master-addr", "127.0.0.1", "--master-port", str(port),
         "-m", "stoker", "train", "--data", str(train), "--val", str(val), "--devices", "cpu:1",
         "--batch-size", "8", "--image-size", "32", "--epochs", "2", "--seed", "4", "--out", str(out), "--quiet",
         "--report", "false",
         *extra, *(per_node or {}).get(node, ())], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        env=environment, preexec_fn=_one_core(node)) for node in range(nodes)]
    results = []
    for agent in agents:
        _, stderr = agent.communicate(timeout=180)
        results.append((agent.returncode, stderr))
    return results


@pytest.fixture(scope="module")
def two_machines(textures, tmp_path_factory):
    """One uninterrupted run on two machines, the reference for the tests that stop and resume."""
    out = tmp_path_factory.mktemp("two")
    results = launch_machines(textures, out)
    assert [code for code, _ in results] == [0, 0], results[1][1][-3000:] + results[0][1][-3000:]
    return out


def test_two_machines_train_like_one_with_as_many_consumers_and_every_sample_once(textures, two_machines,
                                                                                   tmp_path):
    summary = read_summary(two_machines)
    assert summary["status"] == "completed" and summary["machines"] == 2 and summary["num_consumers"] == 2
    assert summary["samples_consumed"] == [120, 120]  # the union over machines: each sample once per epoch
    assert summary["duplicate_samples"] == 0 and summary["missing_samples"] == 0
    assert summary["replicas_identical"] is True
    assert (two_machines / "metrics-node1.jsonl").exists()  # every machine logs; only the first summarizes
    train, val = textures
    run_cli("train", "--data", str(train), "--val", str(val), "--devices", "cpu:2", "--batch-size", "8",
            "--image-size", "32",
            "--epochs", "2", "--seed", "4", "--out", str(tmp_path / "one"), "--quiet")
    assert_same_weights(two_machines, tmp_path / "one")


def test_interrupting_one_machine_stops_all_at_one_checkpoint_and_resume_is_exact(textures, two_machines,
                                                                                 tmp_path):
    results = launch_machines(textures, tmp_path, env={"STOKER_FAULT": "consumer:interrupt-parent:rank=1,step=5;"})
    (_, first_log), (_, second_log) = results
    assert "another machine was interrupted" in first_log, first_log[-3000:]
    said = "Ctrl-C: stopping after the steps already prepared, with a checkpoint (Ctrl-C again to stop now)"
    assert said in second_log, second_log[-3000:]
    summary = read_summary(tmp_path)
    assert summary["status"] == "interrupted", summary.get("error")
    assert summary["replicas_identical"] is True  # every machine's replicas ended on the same average
    stopped_at = int(summary["checkpoint"].rsplit("_", 1)[1])
    assert 5 < stopped_at < 16  # a step both machines reached; the resume crosses the epoch boundary
    assert wait_for_no_trace(timeout_s=15) == ([], [])
    resumed = launch_machines(textures, tmp_path, "--resume", str(tmp_path))
    assert [code for code, _ in resumed] == [0, 0], resumed[0][1][-3000:]
    assert read_summary(tmp_path)["start_step"] == stopped_at
    assert_same_weights(two_machines, tmp_path)


def test_a_killed_machine_stops_the_other_cleanly_and_the_run_resumes(textures, tmp_path):
    started = time.monotonic()
    results = launch_machines(textures, tmp_path, "--collective-timeout-s", "30",
                              env={"STOKER_FAULT": "consumer:kill-parent:rank=1,step=9;"})
    assert time.monotonic() - started < 120
    assert all(code != 0 for code, _ in results)
    summary = read_summary(tmp_path)
    assert summary["status"] == "failed" and "another machine" in summary["error"]
    assert summary["checkpoint"].endswith("step_00000008")  # epoch 1's end, written by the first machine
    assert wait_for_no_trace(timeout_s=15) == ([], [])
    # An accounting file its meta.json does not list: neither machine may read it. Machine 1 opened the path of
    # the accounting the first machine sent (README: "paths in what peers send are never opened"): it opens
    # nothing under checkpoints/ now, which the audit hook of tests/helpers/audit_opens records.
    (tmp_path / "checkpoints" / "step_00000008" / "accounting.npz").write_bytes(b"not an npz")
    opened = tmp_path / "opened-by-machine-1.txt"
    hook = f"{HELPERS / 'audit_opens'}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"
    resumed = launch_machines(textures, tmp_path, "--resume", str(tmp_path),
                              env={"PYTHONPATH": hook, "STOKER_TEST_OPEN_LOG": str(opened)})
    assert [code for code, _ in resumed] == [0, 0], resumed[0][1][-3000:]
    assert not opened.exists(), opened.read_text()
    summary = read_summary(tmp_path)
    assert summary["status"] == "completed" and summary["start_step"] == 8
    assert summary["samples_consumed"] == [120] and summary["missing_samples"] == 0


def test_machines_with_different_settings_refuse_to_start(textures, tmp_path):
    results = launch_machines(textures, tmp_path, per_node={1: ("--lr", "0.1")})
    assert all(code != 0 for code, _ in results)
    assert "machine 1 differs from machine 0 in lr" in results[1][1]
    assert "another machine's settings differ" in results[0][1]


def test_a_machine_lost_under_elastic_torchrun_costs_the_steps_since_the_checkpoint_and_the_run_goes_on(tmp_path):
    """`torchrun --nnodes 1:2 --max-restarts 1` on two "machines". Machine 1's consumer stops at step 9 (a hang: the
    marker it leaves is the test's cue, no race) and the whole machine is killed, agent and all; the survivor's
    run fails within a second, torchrun starts it again alone, and stoker resumes from the step-8 checkpoint by
    itself on one machine. The witness model counts by content: every image trained exactly once per epoch."""
    from stoker.bench.elastic import agent_command, kill_tree
    from tests.faults.test_elastic import seen_by_content, write_numbered_images

    count = write_numbered_images(tmp_path / "data" / "train", 4, 30)
    write_numbered_images(tmp_path / "data" / "val", 4, 3)
    port, out, cue = free_port(), tmp_path / "run", tmp_path / "fired"
    # last_call_timeout: how long a rendezvous with fewer than 2 machines waits for more. At start both join well
    # within it (else machine 0 trains alone and the cue never comes: the test fails saying so); after the loss
    # the survivor waits that long, and keep_alive_interval x 3 for the lost machine's heartbeat.
    environment = {**os.environ, "PYTHONPATH": f"{HELPERS}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
                   "STOKER_FAULT": "consumer:hang:rank=1,step=9;", "STOKER_FAULT_ONCE": str(cue)}
    agents = [subprocess.Popen(
        agent_command(node, port, "last_call_timeout=10,keep_alive_interval=1", [
            "--data", str(tmp_path / "data" / "train"), "--val", str(tmp_path / "data" / "val"), "--model",
            "witness:counting_cnn", "--augment", "none", "--devices", "cpu:1", "--batch-size", "8", "--image-size",
            "32", "--epochs", "3", "--out", str(out), "--quiet", "--report", "false"]),
        stdout=subprocess.DEVNULL, stderr=(tmp_path / f"machine{node}.log").open("w"), env=environment,
        preexec_fn=_one_core(node)) for node in range(2)]
    try:
        while not cue.exists() and agents[1].poll() is None and agents[0].poll() is None:
            time.sleep(0.05)
        assert cue.exists(), (tmp_path / "machine1.log").read_text()[-3000:]
        kill_tree(agents[1].pid)  # the machine goes: its agent, controller, consumer, producers
        agents[0].wait(timeout=180)
    finally:
        for agent in agents:
            kill_tree(agent.pid)
    stderr = (tmp_path / "machine0.log").read_text()
    assert agents[0].returncode == 0, stderr[-3000:]
    assert "started again by torchrun: resuming" in stderr
    summary = read_summary(out)
    assert summary["status"] == "completed" and summary["start_step"] == 8
    assert summary["machines"] == 1 and summary["num_consumers"] == 1
    assert seen_by_content(out, count) == [3] * count
    assert wait_for_no_trace(timeout_s=15) == ([], [])
