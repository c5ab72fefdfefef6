"""`stoker bench soak`: a long run with producers SIGKILLed at random moments, watched from outside.

Every half second it samples the resident memory of every process of the run, the number of its segments in
/dev/shm and the bytes its entries there hold. Samples are judged from the end of the first epoch (every process
has trained or decoded and validated once; on a loaded machine start-up takes seconds) or `--warmup-fraction`, the
later.
Producer 0 is never killed: it is the witness whose memory is judged over its own life (a replaced producer is
young; comparing a title across replacements compares different processes). At the end it interrupts the run and
checks: the memory of every process that lived through the judged window stays flat (growth under
`--max-rss-growth`), /dev/shm keeps the same segments and the same bytes in use (the ring is allocated up front, so
a leak shows as new segments or new bytes, not as a ring that grows), every killed producer was replaced, every
epoch had every sample exactly once, and nothing is left behind. Exit status 1 when a check fails.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

from stoker.bench.runs import stop_child
from stoker.common.procs import descendants, parent_of, stoker_processes
from stoker.common.waiting import waiting
from stoker.data.formats import builtin_data
from stoker.observe.metrics import read_events
from stoker.pipeline.ring import SHM_DIR, live_segments

SAMPLE_EVERY_S = 0.5
WITNESS = "stoker producer 0"  # never killed: its memory over its own life is what the producer check judges
PAGE_BYTES = os.sysconf("SC_PAGE_SIZE")


def add_parser(kinds: argparse._SubParsersAction) -> None:
    parser = kinds.add_parser("soak", help="long run with producers killed at random; memory and /dev/shm flat")
    parser.add_argument("--minutes", type=float, default=10.0, help="how long to run")
    parser.add_argument("--kill-every-s", type=float, default=5.0,
                        help="mean time between producer kills (uniform between half and 1.5x)")
    parser.add_argument("--producers", type=int, default=2)
    parser.add_argument("--devices", default="cpu:1")
    parser.add_argument("--warmup-fraction", type=float, default=0.25, help="share of the run not judged")
    parser.add_argument("--max-rss-growth", type=float, default=0.10)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, help="write the figures to this file")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    if args.producers < 2:
        print(f"stoker bench soak: --producers {args.producers}: need at least 2 (producer 0 is never killed)",
              file=sys.stderr)
        return 2
    rng = random.Random(args.seed)
    with tempfile.TemporaryDirectory(prefix="stoker-soak-") as scratch:
        root = Path(scratch)
        builtin_data.generate(root / "data", train_per_class=12, val_per_class=2)
        command = [sys.executable, "-m", "stoker", "train", "--data", str(root / "data" / "train"),
                   "--val", str(root / "data" / "val"), "--image-size", "32", "--batch-size", "8",
                   "--epochs", "100000", "--producers", str(args.producers), "--devices", args.devices,
                   "--out", str(root / "run"), "--quiet", "--report", "false"]
        log = root / "run.log"  # a file, not a pipe: a full pipe would block the run's logging
        with open(log, "w") as log_handle:
            run_process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=log_handle)
        try:
            first_epoch = _FirstEpoch(root / "run" / "metrics.jsonl")
            samples, kills = _watch(run_process, args.minutes * 60, args.kill_every_s, rng, first_epoch)
            if run_process.poll() is None:
                run_process.send_signal(signal.SIGINT)
                run_process.wait(timeout=120)
        except BaseException as error:  # through the run's own cleanup, so its shared memory goes with it
            stop_child(run_process, group_signalled=isinstance(error, KeyboardInterrupt))
            raise
        left = _left_behind(run_process.pid)
        summary = json.loads((root / "run" / "summary.json").read_text())
        replaced = len(read_events(root / "run" / "metrics.jsonl")["producer_lost"])
        log_tail = log.read_text()[-4000:]
    result = _judge(samples, kills, replaced, summary, left, args)
    _print(result)
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    if not result["passed"]:
        print(log_tail, file=sys.stderr)
    return 0 if result["passed"] else 1


class _FirstEpoch:
    """Whether the run has finished its first epoch (trained and validated once: every process has allocated what
    it will hold), read from the new lines of metrics.jsonl until it has."""

    def __init__(self, path: Path) -> None:
        self.path, self.offset, self.seen = path, 0, False

    def done(self) -> bool:
        if not self.seen:
            try:
                with open(self.path, "rb") as handle:
                    handle.seek(self.offset)
                    new = handle.read()
            except OSError:
                return False
            lines = new[:new.rfind(b"\n") + 1]
            self.offset += len(lines)
            self.seen = b'{"event": "val"' in lines
        return self.seen


def _watch(run_process: subprocess.Popen, seconds: float, kill_every_s: float, rng: random.Random,
           first_epoch: _FirstEpoch) -> tuple[list[dict[str, Any]], int]:
    """Sample memory and /dev/shm until the deadline (or the run's early end, which the checks then report),
    SIGKILLing a random producer now and then."""
    started = time.monotonic()
    next_kill = started + rng.uniform(0.5, 1.5) * kill_every_s
    samples, kills = [], 0
    with waiting("bench soak", total=round(seconds), unit="s", rate=False) as progress:
        while (now := time.monotonic()) - started < seconds and run_process.poll() is None:
            progress.update(round(now - started))
            family = _family(run_process.pid)
            rss = {pid: (title, _rss_bytes(pid)) for pid, title in family.items()}
            samples.append({"t": now - started, "rss": rss, "shm_segments": len(live_segments(run_process.pid)),
                            "shm_used_bytes": _shm_used_bytes(run_process.pid), "warm": first_epoch.done()})
            producers = [pid for pid, title in family.items()
                         if title.startswith("stoker producer") and title != WITNESS]
            if now >= next_kill and producers:
                os.kill(rng.choice(producers), signal.SIGKILL)
                kills += 1
                next_kill = now + rng.uniform(0.5, 1.5) * kill_every_s
            time.sleep(SAMPLE_EVERY_S)
    return samples, kills


def _family(controller_pid: int) -> dict[int, str]:
    """The run's processes: the controller and every stoker process below it (the zygotes, the consumers, the
    producers)."""
    family = {controller_pid, *descendants(controller_pid)}
    return {pid: title for pid, title in stoker_processes() if pid in family}


def _rss_bytes(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/statm") as handle:
            return int(handle.read().split()[1]) * PAGE_BYTES
    except (OSError, IndexError, ValueError):
        return 0


def _shm_used_bytes(controller_pid: int) -> int:
    """Bytes the run holds in /dev/shm: the blocks of every entry named after its controller (its ring, its
    semaphores and their lock). Not /dev/shm's whole use, which any other program on the machine changes meanwhile;
    a leak under no name of the run's (an unlinked segment still mapped) shows in the processes' RSS instead."""
    used = 0
    for name in os.listdir(SHM_DIR):
        if re.match(rf"^(?:sem\.)?stoker(?:-sem)?_{controller_pid}_", name):
            try:
                used += os.stat(os.path.join(SHM_DIR, name)).st_blocks * 512
            except FileNotFoundError:  # removed meanwhile
                pass
    return used


def _left_behind(controller_pid: int) -> dict[str, list]:
    deadline = time.monotonic() + 15
    while True:
        processes = [p for p in stoker_processes() if p[0] == controller_pid or parent_of(p[0]) in (controller_pid, 1)]
        segments = live_segments(controller_pid)
        if (not processes and not segments) or time.monotonic() > deadline:
            return {"processes": processes, "segments": segments}
        time.sleep(0.2)


def _judge(samples: list[dict[str, Any]], kills: int, replaced: int, summary: dict[str, Any],
           left: dict[str, list], args: argparse.Namespace) -> dict[str, Any]:
    warm = next((index for index, sample in enumerate(samples) if sample["warm"]), len(samples))
    judged = samples[max(warm, int(args.warmup_fraction * len(samples))):]
    memory, replacements = _rss_growth(judged)
    segments, shm = [s["shm_segments"] for s in judged], [s["shm_used_bytes"] for s in judged]
    epochs = summary["epoch_accounting"]
    exact = [row["epoch"] for row in epochs if row["duplicates"] == 0 and row["missing"] == 0]
    checks = {
        "rss_flat": WITNESS in memory and all(row["growth"] < args.max_rss_growth for row in memory.values()),
        "shm_flat": bool(shm) and max(shm) == min(shm) and max(segments) == min(segments),
        "killed_producers_replaced": kills > 0 and replaced == kills,
        "exactly_once_every_epoch": bool(epochs) and len(exact) == len(epochs),
        "interrupted_cleanly": summary["status"] == "interrupted",
        "nothing_left_behind": not left["processes"] and not left["segments"],
    }
    return {"minutes": args.minutes, "status": summary["status"], "error": summary.get("error"), "kills": kills,
            "producers_replaced": replaced, "epochs": len(epochs), "epochs_exactly_once": len(exact),
            "samples_per_s": summary["throughput_samples_per_s"], "rss": memory,
            "replacement_producers_rss_mb": replacements,
            "shm_segments": {"min": min(segments, default=0), "max": max(segments, default=0)},
            "shm_used_bytes": {"min": min(shm, default=0), "max": max(shm, default=0)}, "left_behind": left,
            "checks": checks, "passed": all(checks.values())}


def _rss_growth(samples: list[dict[str, Any]]) -> tuple[dict[str, dict[str, float]], dict[str, float]]:
    """Per process (keyed by its title), one pid over its own life in the judged samples: median RSS over the first
    and last tenth of its samples. Producers not alive through the whole window are replacements of killed ones,
    young processes: their RSS is summarized (median and max MB), not judged as growth."""
    series: dict[int, list[int]] = defaultdict(list)
    titles: dict[int, str] = {}
    for sample in samples:
        for pid, (title, rss) in sample["rss"].items():
            if rss:
                series[pid].append(rss)
                titles[pid] = title
    rows, young = {}, []
    for pid, values in series.items():
        if titles[pid].startswith("stoker producer") and not (pid in samples[0]["rss"] and pid in samples[-1]["rss"]):
            young.extend(values)
            continue
        tenth = max(1, len(values) // 10)
        first, last = statistics.median(values[:tenth]), statistics.median(values[-tenth:])
        rows[titles[pid]] = {"pid": pid, "first_mb": round(first / 2**20, 1), "last_mb": round(last / 2**20, 1),
                             "growth": round(last / first - 1, 4)}
    summary = {"median": round(statistics.median(young) / 2**20, 1), "max": round(max(young) / 2**20, 1)} \
        if young else {}
    return dict(sorted(rows.items())), summary


def _print(result: dict[str, Any]) -> None:
    print(f"{'process':<22} {'RSS first MB':>12} {'RSS last MB':>12} {'growth':>8}")
    for title, row in result["rss"].items():
        print(f"{title:<22} {row['first_mb']:>12.1f} {row['last_mb']:>12.1f} {row['growth']:>8.1%}")
    young, shm, segments = result["replacement_producers_rss_mb"], result["shm_used_bytes"], result["shm_segments"]
    if young:
        print(f"replaced producers (young, not judged): median {young['median']:.1f} MB, max {young['max']:.1f} MB")
    print(f"/dev/shm: {segments['min']}-{segments['max']} stoker segments, {shm['min'] / 2**20:.2f}-"
          f"{shm['max'] / 2**20:.2f} MiB in use; producers killed {result['kills']}, "
          f"replaced {result['producers_replaced']}; epochs {result['epochs']}, exactly once "
          f"{result['epochs_exactly_once']}; {result['samples_per_s']} samples/s")
    for name, ok in result["checks"].items():
        print(f"  {'ok  ' if ok else 'FAIL'} {name}")
