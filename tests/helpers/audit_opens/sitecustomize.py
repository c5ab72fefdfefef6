"""Loaded by every Python process started with this folder on PYTHONPATH: on machine 1 of a torchrun launch
(RANK=1, inherited by its controller's children), every file opened under a `checkpoints/` folder is appended to
$STOKER_TEST_OPEN_LOG, so a test can check that no machine but the first opens a path the first one sent."""

import os
import sys

_LOG = os.environ.get("STOKER_TEST_OPEN_LOG")


def _record(event, args):
    if event == "open" and args and isinstance(args[0], (str, bytes)):
        path = os.fsdecode(args[0])
        if f"{os.sep}checkpoints{os.sep}" in path and path != _LOG:
            with open(_LOG, "a") as log:
                log.write(path + "\n")


if _LOG and os.environ.get("RANK") == "1":
    sys.addaudithook(_record)
