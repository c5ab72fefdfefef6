"""What a machine that trains on local files needs installed: not obstore or pycurl (only remote sources read with
them), and not pyte to collect the tests (`pytest -m gpu` on a GPU image). Each is hidden from a child Python by a
module of its name that fails to import, as a missing package does, on PYTHONPATH: the children it starts (the
producers, the consumers) miss it too."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.conftest import HELPERS, ROOT, read_summary, run_cli


def _hiding(folder: Path, *names: str) -> dict[str, str]:
    folder.mkdir(exist_ok=True)
    for name in names:
        (folder / f"{name}.py").write_text(f"raise ImportError('No module named {name}')\n")
    return {"PYTHONPATH": os.pathsep.join([str(folder), str(HELPERS), str(ROOT), os.environ.get("PYTHONPATH", "")])}


def test_a_run_on_local_files_needs_neither_obstore_nor_pycurl(tmp_path, textures):
    env = _hiding(tmp_path / "hidden", "obstore", "pycurl")
    train, val = textures
    run_cli("train", "--data", str(train), "--val", str(val), "--devices", "cpu:1", "--producers", "1",
            "--batch-size", "16", "--image-size", "32", "--epochs", "1", "--out", str(tmp_path / "run"), "--quiet",
            env=env)
    assert read_summary(tmp_path / "run")["status"] == "completed"


def test_a_remote_source_without_obstore_says_which_package_it_needs(tmp_path):
    env = {**os.environ, **_hiding(tmp_path / "hidden", "obstore", "pycurl")}
    code = ("from stoker.data.sources import load_source\n"
            "load_source('http://127.0.0.1:9/shards/train-{0000..0001}.tar')\n")
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode != 0
    assert "a remote source (http(s)://, s3://, gs://) needs the Python package 'obstore'" in result.stderr, \
        result.stderr[-2000:]


def test_collecting_the_gpu_tests_needs_no_pyte(tmp_path):
    env = {**os.environ, **_hiding(tmp_path / "hidden", "pyte")}
    result = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-m", "gpu", "-p",
                             "no:cacheprovider", "tests"], cwd=ROOT, env=env, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stdout[-3000:]
    assert "error" not in result.stdout.lower().splitlines()[-1], result.stdout[-3000:]
