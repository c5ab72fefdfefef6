"""How a consumer tells a broken group in its log line, and how its lines look (issue 53, item 4)."""

from __future__ import annotations

import subprocess
import sys

from stoker.training.recovery import in_brief

GLOO = ("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:34197: "
        "Connection reset by peer. This is typically caused by a remote worker hanging or bugs in the application "
        "code that calls collectives in a different order on different ranks; check the logs of the remote worker")


def test_gloos_error_is_told_by_its_first_sentence_without_its_source_location():
    """Before: the line's first 200 characters, "... or bugs in the applic", and gloo's source path."""
    assert in_brief(RuntimeError(GLOO)) == "Read error [127.0.0.1]:34197: Connection reset by peer"


def test_a_long_error_is_cut_between_words():
    brief = in_brief(RuntimeError("word " * 100 + "end"))
    assert brief.endswith("word ...") and len(brief) <= 204


def test_a_consumers_warning_carries_the_time_as_the_controllers_lines_do():
    """A consumer forked from a zygote had no logging set up: its warnings came bare, without the time."""
    probe = ("import logging; from stoker.common.procs import log_as_the_controller; log_as_the_controller(); "
             "logging.getLogger('stoker.training.consumer').warning('the group broke')")
    line = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stderr.strip()
    time, level, message = line.split(" ", 2)
    assert len(time) == 8 and time.count(":") == 2 and (level, message) == ("WARNING", "the group broke")
