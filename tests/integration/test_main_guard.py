"""`stoker.train` in a script without `if __name__ == "__main__":` (spawn re-imports the script in every child):
one line that shows the guard and exit code 2, no run started; a child that re-runs the call anyway starts none."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.conftest import ROOT

pytestmark = pytest.mark.timeout(120)


def _script(tmp_path: Path, body: str) -> subprocess.CompletedProcess:
    script = tmp_path / "train_it.py"
    script.write_text(textwrap.dedent(body))
    environment = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    return subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=100,
                          cwd=tmp_path, env=environment)


def _settings(textures, out: Path) -> str:
    train_dir, val_dir = textures
    return (f"data={str(train_dir)!r}, val={str(val_dir)!r}, epochs=1, batch_size=16, image_size=16, "
            f"devices='cpu:1', producers=1, report=False, out={str(out)!r}")


@pytest.mark.parametrize("shape", ["top level", "in a function called at the top level"])
def test_an_unguarded_call_stops_with_one_line_showing_the_guard(textures, tmp_path, shape):
    call = f"stoker.train({_settings(textures, tmp_path / 'run')})"
    body = (f"import stoker\n{call}\n" if shape == "top level" else
            f"import stoker\n\ndef main():\n    {call}\n\nmain()\n")
    result = _script(tmp_path, body)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and 'if __name__ == "__main__":' in lines[0] and "train_it.py" in lines[0], lines
    assert not (tmp_path / "run").exists()


def test_a_guarded_call_goes_on_to_check_its_settings(tmp_path):
    result = _script(tmp_path, 'import stoker\nif __name__ == "__main__":\n    stoker.train(epochs=0)\n')
    assert result.returncode == 1 and "epochs" in result.stderr and "__main__" not in result.stderr


def test_a_child_that_re_imports_an_unguarded_call_starts_no_run_of_its_own(textures, tmp_path):
    # The test names __name__, so the parent lets it through; every child still re-runs the call.
    body = f"import stoker\nif __name__ or True:\n    summary = stoker.train({_settings(textures, tmp_path / 'run')})\n"
    result = _script(tmp_path, body)
    assert 'if __name__ == "__main__":' in result.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run", "train_it.py"]  # one run folder, the parent's
    assert "internal error" not in (tmp_path / "run" / "summary.json").read_text()


def _from_stdin(tmp_path: Path, body: str) -> subprocess.CompletedProcess:
    """`python - <<EOF`: the main module's file is '<stdin>', which a spawned child cannot run again."""
    environment = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    return subprocess.run([sys.executable, "-"], input=textwrap.dedent(body), capture_output=True, text=True,
                          timeout=100, cwd=tmp_path, env=environment)


def test_a_loader_in_a_script_read_from_standard_input_feeds_its_loop(textures, tmp_path):
    """9 producers in a row died of FileNotFoundError: '<stdin>' before this worked as with `python -c`."""
    result = _from_stdin(tmp_path, f"""
        import stoker
        with stoker.Loader({str(textures[0])!r}, batch_size=8, image_size=16, producers=2, device="cpu") as loader:
            print("batches", sum(1 for _ in loader))
        """)
    assert result.returncode == 0, result.stderr
    assert "batches" in result.stdout and "FileNotFoundError" not in result.stderr


def test_a_dataset_class_defined_on_standard_input_is_one_error_before_any_producer(tmp_path):
    result = _from_stdin(tmp_path, """
        import numpy as np, stoker
        class Squares:
            def __len__(self): return 8
            def __getitem__(self, i): return np.zeros((8, 8, 3), np.uint8), i % 2
        try:
            stoker.Loader(Squares(), batch_size=4, device="cpu")
        except ValueError as error:
            print(error)
        """)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("data: the Squares class is defined in a script with no file (read from "
                                    "standard input"), result.stdout
