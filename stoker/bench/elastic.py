"""`stoker bench elastic`: what a consumer's death costs, going on without it against the checkpoint-restart way,
side by side in one run.

Each repeat trains the built-in set twice with the same kill (consumer `--kill-rank` is SIGKILLed as it ends step
`--kill-step`, before the averaging):
- **elastic** (`--on-consumer-failure continue`): the survivors leave the broken group and go on;
- **restart** (`--on-consumer-failure stop`, then `--resume RUN_DIR`): the run fails and is started again from its
  last checkpoint, as torchrun's agents restart every worker.

With `--lose machine`, a whole machine is lost instead, under elastic torchrun on loopback (`--nnodes 1:2
--max-restarts 1`, two agents with `--devices` each): machine 1's consumer stops at `--kill-step` (a hang, whose
marker is the cue) and its agent and every process below it are SIGKILLed; torchrun starts the survivor again and
stoker resumes from the last checkpoint by itself. `--rdzv-conf` is torchrun's (its defaults when not given).

Both are timed by the wall clock at which metrics.jsonl's lines appear (polled every 10 ms), from the last step
reported before the kill to the first step reported after the recovery: the step the kill interrupted is in both.
The restart way also trains again the steps between its checkpoint and the kill: they are added at the run's own
step time (the median gap between steps before the kill).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from stoker.bench.runs import stop_child
from stoker.common.procs import descendants

POLL_S = 0.01


def add_parser(kinds: argparse._SubParsersAction) -> None:
    parser = kinds.add_parser("elastic", help="a consumer's death: going on without it against a checkpoint restart")
    parser.add_argument("--devices", default="cpu:2", help="the run's devices (2 or more consumers)")
    parser.add_argument("--epochs", type=int, default=2, help="epochs of the built-in set per run")
    parser.add_argument("--kill-step", type=int, default=None,
                        help="global step the consumer is killed at (default: the middle of the last epoch)")
    parser.add_argument("--kill-rank", type=int, default=1, help="the consumer killed")
    parser.add_argument("--repeats", type=int, default=5, help="repeats (medians)")
    parser.add_argument("--lose", choices=("consumer", "machine"), default="consumer",
                        help="what dies: one consumer (going on against a checkpoint restart) or a whole machine "
                             "under elastic torchrun (two agents on loopback)")
    parser.add_argument("--rdzv-conf", default="", help="with --lose machine: torchrun's --rdzv-conf")
    parser.add_argument("--json", type=Path, help="write the figures to this file")
    parser.set_defaults(run=run)


@dataclass
class Timed:
    """A run's metrics.jsonl lines, each with the wall-clock time it appeared."""

    lines: list[tuple[float, dict[str, Any]]]

    def events(self, name: str) -> list[tuple[float, dict[str, Any]]]:
        return [(at, line) for at, line in self.lines if line["event"] == name]


def run(args: argparse.Namespace) -> int:
    if args.lose == "machine":
        return run_machine_loss(args)
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="stoker-bench-elastic-") as scratch:
        kill_step = args.kill_step if args.kill_step is not None else _middle_of_last_epoch(args, Path(scratch))
        for repeat in range(args.repeats):
            root = Path(scratch) / f"r{repeat}"
            rows.append({"elastic": elastic_recovery(args, root / "elastic", kill_step),
                         "restart": restart_recovery(args, root / "restart", kill_step)})
            print(f"repeat {repeat + 1}: going on {rows[-1]['elastic']['recovery_s']:.2f} s, restart "
                  f"{rows[-1]['restart']['recovery_s']:.2f} s", file=sys.stderr)
    result = summarize(rows, args, kill_step)
    print_table(result)
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0


def _middle_of_last_epoch(args: argparse.Namespace, scratch: Path) -> int:
    """The global step halfway through the last epoch, from a run's own count of steps (one short run)."""
    timed = train(args, scratch / "probe", "stop", fault=None, epochs=1)
    steps = timed.events("summary")[-1][1]["steps"]
    return steps * (args.epochs - 1) + steps // 2


def elastic_recovery(args: argparse.Namespace, run_dir: Path, kill_step: int) -> dict[str, float]:
    timed = train(args, run_dir, "continue", fault=_fault(args, kill_step, run_dir))
    regrouped_at = timed.events("regrouped")[0][0]
    before = [at for at, _ in timed.events("step") if at < regrouped_at]
    after = [at for at, _ in timed.events("step") if at > regrouped_at]
    lost = timed.events("regrouped")[0][1]
    return {"recovery_s": after[0] - before[-1], "steps_trained_again": lost["steps_taken_back"],
            "controller_regroup_s": lost["recovered_s"]}


def restart_recovery(args: argparse.Namespace, run_dir: Path, kill_step: int) -> dict[str, float]:
    failed = train(args, run_dir, "stop", fault=_fault(args, kill_step, run_dir))
    steps = [at for at, _ in failed.events("step")]
    watched = [at for at, line in failed.events("step") if line["rank"] == _survivor(args)]
    step_s = statistics.median(b - a for a, b in zip(watched, watched[1:], strict=False))
    resumed = train(args, run_dir, "stop", fault=None, resume=True)
    resumed_steps = [at for at, line in resumed.events("step")]
    summary = json.loads((run_dir / "summary.json").read_text())
    steps_again = kill_step - summary["start_step"]
    return {"recovery_s": resumed_steps[0] - steps[-1] + steps_again * step_s, "steps_trained_again": steps_again,
            "restart_to_first_step_s": resumed_steps[0] - steps[-1], "step_s": step_s}


def _survivor(args: argparse.Namespace) -> int:
    """A consumer that is not killed: the gaps between its steps are the run's step time."""
    return 0 if args.kill_rank != 0 else 1


def _fault(args: argparse.Namespace, kill_step: int, run_dir: Path) -> dict[str, str]:
    return {"STOKER_FAULT": f"consumer:sigkill:rank={args.kill_rank},step={kill_step};",
            "STOKER_FAULT_ONCE": str(run_dir.parent / f"{run_dir.name}.fired")}


def train(args: argparse.Namespace, run_dir: Path, on_failure: str, fault: dict[str, str] | None,
          epochs: int | None = None, resume: bool = False) -> Timed:
    """Run `stoker train` on the built-in set, reading metrics.jsonl as it grows; returns its new lines, timed."""
    command = [sys.executable, "-m", "stoker", "train", "--devices", args.devices, "--epochs",
               str(epochs or args.epochs), "--on-consumer-failure", on_failure, "--quiet", "--report", "false"]
    command += ["--resume", str(run_dir)] if resume else ["--out", str(run_dir)]
    watch = _Watch(run_dir / "metrics.jsonl")  # a resume appends: only the new lines
    env = {**os.environ, **(fault or {})}
    if fault is None:
        env.pop("STOKER_FAULT", None)
    lines: list[tuple[float, dict[str, Any]]] = []
    with subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE) as process:
        try:
            while True:
                finished = process.poll() is not None
                lines += watch.read()
                if finished:
                    break
                time.sleep(POLL_S)
        except BaseException:  # interrupted: the run stops too, before its scratch folder goes
            stop_child(process)
            raise
        stderr = process.stderr.read().decode(errors="replace") if process.stderr else ""
    if process.returncode not in (0, 1) or not lines:
        raise RuntimeError(f"{' '.join(command)} ended with {process.returncode}:\n{stderr[-2000:]}")
    return Timed(lines)


def summarize(rows: list[dict[str, Any]], args: argparse.Namespace, kill_step: int) -> dict[str, Any]:
    elastic = statistics.median(row["elastic"]["recovery_s"] for row in rows)
    restart = statistics.median(row["restart"]["recovery_s"] for row in rows)
    return {"devices": args.devices, "epochs": args.epochs, "kill_step": kill_step, "kill_rank": args.kill_rank,
            "repeats": len(rows), "elastic_recovery_s": round(elastic, 3), "restart_recovery_s": round(restart, 3),
            "speedup": round(restart / elastic, 2) if elastic > 0 else None, "runs": rows}


def print_table(result: dict[str, Any]) -> None:
    print(f"consumer {result['kill_rank']} of {result['devices']} killed at step {result['kill_step']}, "
          f"medians of {result['repeats']}:")
    print(f"  going on without it (stoker): {result['elastic_recovery_s']:.2f} s from the last step before the kill "
          "to the survivors' first after it")
    print(f"  checkpoint restart (torchrun's way): {result['restart_recovery_s']:.2f} s (the run fails, --resume "
          "from its last checkpoint, the steps since it trained again)")
    print(f"  going on is {result['speedup']}x faster")


# ---- a machine lost under elastic torchrun ----------------------------------------------------------------------

def run_machine_loss(args: argparse.Namespace) -> int:
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="stoker-bench-elastic-") as scratch:
        # The probe trains the two machines' consumers on one: the same global steps.
        both = argparse.Namespace(**{**vars(args), "devices": f"cpu:{2 * _cpu_count(args.devices)}"})
        kill_step = args.kill_step if args.kill_step is not None else _middle_of_last_epoch(both, Path(scratch))
        for repeat in range(args.repeats):
            rows.append(machine_recovery(args, Path(scratch) / f"r{repeat}", kill_step))
            print(f"repeat {repeat + 1}: {rows[-1]['recovery_s']:.2f} s", file=sys.stderr)
    result = {"lose": "machine", "devices_per_machine": args.devices, "epochs": args.epochs, "kill_step": kill_step,
              "rdzv_conf": args.rdzv_conf or "torchrun's defaults", "repeats": len(rows),
              "recovery_s": round(statistics.median(r["recovery_s"] for r in rows), 3),
              "restart_to_first_step_s": round(statistics.median(r["restart_to_first_step_s"] for r in rows), 3),
              "runs": rows}
    print(f"machine 1 of 2 ({args.devices} each) lost at step {kill_step}, torchrun --nnodes 1:2, --rdzv-conf "
          f"{result['rdzv_conf']}, medians of {len(rows)}: {result['recovery_s']:.2f} s from the last step before "
          f"the loss to the same point again ({result['restart_to_first_step_s']:.2f} s to the survivor's first "
          "step, and the steps since the checkpoint trained again)")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0


def _cpu_count(devices: str) -> int:
    kind, _, count = devices.partition(":")
    if kind != "cpu" or not count.isdigit():
        raise SystemExit(f"bench elastic --lose machine: --devices is each loopback machine's, cpu:N (got {devices})")
    return int(count)


def machine_recovery(args: argparse.Namespace, root: Path, kill_step: int) -> dict[str, float]:
    """One loss: two agents, machine 1 killed whole at `kill_step`, the survivor's metrics.jsonl timed."""
    from stoker.bench.servers import free_port

    root.mkdir(parents=True)
    run_dir, cue, port = root / "run", root / "fired", free_port()
    env = {**os.environ, "STOKER_FAULT": f"consumer:hang:rank=1,step={kill_step};", "STOKER_FAULT_ONCE": str(cue)}
    agents = [subprocess.Popen(agent_command(node, port, args.rdzv_conf, [
        "--devices", args.devices, "--epochs", str(args.epochs), "--out", str(run_dir), "--quiet", "--report",
        "false"]), env=env, stdout=subprocess.DEVNULL, stderr=(root / f"machine{node}.log").open("w"))
        for node in range(2)]
    lines: list[tuple[float, dict[str, Any]]] = []
    watch = _Watch(run_dir / "metrics.jsonl")
    killed_at = None
    try:
        while agents[0].poll() is None:
            lines += watch.read()
            if cue.exists() and killed_at is None:
                kill_tree(agents[1].pid)
                killed_at = time.monotonic()
            time.sleep(POLL_S)
        lines += watch.read()
    finally:
        for agent in agents:
            kill_tree(agent.pid)
    log = (root / "machine0.log").read_text(errors="replace")[-3000:]
    if agents[0].returncode != 0:
        raise RuntimeError(f"the surviving machine's torchrun ended with {agents[0].returncode}:\n{log}")
    if killed_at is None:
        raise RuntimeError(f"the run ended before step {kill_step}, where machine 1 was to be lost:\n{log}")
    timed = Timed(lines)
    before = [at for at, _ in timed.events("step") if at < killed_at]
    # The resumed part's lines follow its own "start" (a step finished before the loss may be written after it).
    started_again = timed.events("start")[-1][0]
    resumed_at, resumed = next((at, line) for at, line in timed.events("step") if at >= started_again)
    step_s = statistics.median(b - a for a, b in zip(before, before[1:], strict=False))
    again = kill_step - resumed["global_step"]
    restart_s = resumed_at - before[-1]
    return {"recovery_s": restart_s + again * step_s, "restart_to_first_step_s": restart_s,
            "steps_trained_again": again, "step_s": step_s}


def agent_command(node: int, port: int, rdzv_conf: str, train_args: list[str]) -> list[str]:
    """torchrun for "machine" `node` of two on loopback: machine 0 hosts the rendezvous and, by its address, is rank
    0 (the c10d rendezvous lives on one machine, which must not be the one lost)."""
    conf = ",".join(part for part in (f"is_host={str(node == 0).lower()}", rdzv_conf) if part)
    return [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1:2", "--nproc-per-node", "1",
            "--max-restarts", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id",
            "stoker-elastic", "--rdzv-conf", conf, "--local-addr", f"127.0.0.{node + 1}", "-m", "stoker", "train",
            *train_args]


def kill_tree(pid: int) -> None:
    """A machine lost: the process and everything below it, SIGKILLed."""
    for member in [pid, *descendants(pid)]:
        try:
            os.kill(member, signal.SIGKILL)
        except ProcessLookupError:
            pass


class _Watch:
    """A metrics.jsonl read as it grows, each new line with the wall-clock time it was seen."""

    def __init__(self, path: Path) -> None:
        self.path, self.pending = path, b""
        self.offset = path.stat().st_size if path.exists() else 0

    def read(self) -> list[tuple[float, dict[str, Any]]]:
        if not self.path.exists():
            return []
        with self.path.open("rb") as file:
            file.seek(self.offset)
            chunk = file.read()
        self.offset += len(chunk)
        self.pending += chunk
        *whole, self.pending = self.pending.split(b"\n")
        now = time.monotonic()
        return [(now, json.loads(line)) for line in whole if line.strip()]
