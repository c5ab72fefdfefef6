"""The suite run as people run it: `make test &` or `nohup make test &` from a script, where the shell starts the
job with SIGINT ignored and every process inherits that. The tests that send Ctrl-C must still get what a user at a
terminal gets (issue 53: five of them failed and left a helper, a zygote and two producers behind)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.conftest import ROOT


@pytest.mark.timeout(180)
def test_a_ctrl_c_test_passes_in_a_suite_started_as_a_background_job():
    """`trap "" INT` is what bash does for `&` in a script; the Ctrl-C test of `stoker pack` (the quickest one)
    then runs in a pytest of its own, as `make test` would run it there."""
    command = (f'trap "" INT; exec {sys.executable} -m pytest -q -p no:cacheprovider '
               "'tests/integration/test_pack.py::test_ctrl_c_or_sigterm_during_a_pack_says_interrupted_and_writes_nothing"
               "[ctrl-c]'")
    result = subprocess.run(["bash", "-c", command], cwd=ROOT, capture_output=True, text=True, timeout=150,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert result.returncode == 0 and "1 passed" in result.stdout, result.stdout[-3000:] + result.stderr[-2000:]


@pytest.mark.timeout(120)
def test_what_a_failed_test_left_is_removed_with_the_helper_above_it(textures):
    """A test that failed before it stopped what it started (the Ctrl-C that never arrived): the fixture that
    fails it kills the stoker processes, the helper script above them, and removes their segments."""
    from tests.conftest import HELPERS, clear_traces, live_segments, stoker_processes, wait_for_no_trace

    helper = subprocess.Popen([sys.executable, str(HELPERS / "loader_idle.py"), str(textures[0])],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert helper.stdout.readline().strip() == "training", helper.stderr.read()[-3000:]
        left = stoker_processes()
        assert left and live_segments()
        clear_traces([pid for pid, _ in left], live_segments())
        assert helper.wait(timeout=10) == -9
        assert wait_for_no_trace(timeout_s=0.5) == ([], [])
    finally:
        helper.kill()
        helper.communicate()
