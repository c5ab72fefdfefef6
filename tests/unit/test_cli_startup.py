"""Help and argument errors come back without importing torch (2 s of a 2.2 s `stoker --help` before): every
command's `--help`, every benchmark's, and the usual mistakes, each checked in a fresh interpreter."""

from __future__ import annotations

import json
import subprocess
import sys

# Runs each command line through the real entry point in one fresh interpreter and reports, per command line,
# the exit code and which heavy modules were loaded by then (a module once loaded stays: the first offender shows).
PROBE = """
import argparse, contextlib, io, json, sys
from stoker.cli import build_parser, main

bench = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)).choices["bench"]
kinds = next(a for a in bench._actions if isinstance(a, argparse._SubParsersAction)).choices
cases = [argv for argv in json.loads(sys.argv[1])] + [["bench", kind, "--help"] for kind in kinds]
results = []
for argv in cases:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(argv)
        except SystemExit as exit:
            code = exit.code
    heavy = sorted(name for name in ("torch", "matplotlib") if name in sys.modules)
    results.append({"argv": argv, "code": code, "heavy": heavy, "stderr": err.getvalue()[-300:]})
print(json.dumps(results))
"""

CASES = [
    ["--help"],
    ["train", "--help"],
    ["report", "--help"],
    ["bench", "--help"],
    ["train", "--epochs", "0"],
    ["train", "--no-such-flag"],
    ["train", "--data", "/no/such/folder"],
    ["train", "--devices", "tpu"],
    ["report"],
    ["eval", "--help"],
    ["predict", "--help"],
    ["eval", "model.pt"],  # no --data
    ["predict", "model.pt", "images", "--top-k", "0"],
]


def test_help_and_argument_errors_do_not_import_torch(tmp_path):
    result = subprocess.run([sys.executable, "-c", PROBE, json.dumps(CASES)], capture_output=True, text=True,
                            timeout=60, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    outcomes = json.loads(result.stdout)
    assert len(outcomes) > len(CASES), "no benchmark was listed"
    for outcome in outcomes:
        assert outcome["heavy"] == [], f"stoker {' '.join(outcome['argv'])} imported {outcome['heavy']}"
        expected = 0 if "--help" in outcome["argv"] else 2
        assert outcome["code"] == expected, outcome
    errors = {" ".join(o["argv"]): o["stderr"] for o in outcomes if o["code"]}
    assert "epochs" in errors["train --epochs 0"]
    assert "/no/such/folder" in errors["train --data /no/such/folder"]
