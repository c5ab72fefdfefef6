"""`stoker.train`, or a `stoker.Loader`'s first `iter()`, in a script without `if __name__ == "__main__":`.

stoker's processes are started with spawn: each child imports the parent's main module again (as `__mp_main__`)
before it runs its own work, so a script that calls `stoker.train` at its top level would start a whole new run in
every producer and consumer (seen: 4 run folders and 3 "internal error" summaries), and one that iterates a Loader
there lost 9 producers in a row to multiprocessing's bootstrapping error, each with a page of traceback. The parent
refuses such a call before anything starts; a child that gets there anyway (the call made some other way) stops
with the same line instead of starting anything.
"""

from __future__ import annotations

import ast
import multiprocessing
import sys
from types import FrameType

GUARD = 'if __name__ == "__main__":'


def unguarded_call_message(where: str, call: str = "stoker.train()") -> str:
    return (f"{call} runs at the top level of {where}, which every stoker process re-imports when it "
            f"starts (spawn); put the call under {GUARD}")


def check_main_guard(caller: FrameType | None, call: str = "stoker.train()") -> None:
    """Stop with one line on stderr and exit code 2, before anything starts, when `stoker.train` is called from
    the main script's top level outside the guard (in the parent), or while a child re-imports the script.
    `caller` is the frame that called `stoker.train`."""
    if getattr(multiprocessing.current_process(), "_inheriting", False):  # multiprocessing's own flag for this
        _stop(unguarded_call_message("the main script", call))
    where = _unguarded_top_level_line(caller)
    if where is not None:
        _stop(unguarded_call_message(where, call))


def may_start_children(caller: FrameType | None) -> bool:
    """Whether `check_main_guard` lets a call from `caller` start processes; it stops nothing itself."""
    return not getattr(multiprocessing.current_process(), "_inheriting", False) and \
        _unguarded_top_level_line(caller) is None


def _stop(message: str) -> None:
    # Not an exception for the script to catch: the script itself is what must change, and a traceback through
    # stoker would hide the one line that says how.
    print(f"stoker: error: {message}", file=sys.stderr)
    raise SystemExit(2)


def _unguarded_top_level_line(caller: FrameType | None) -> str | None:
    """'script.py line N' when some frame of the call chain is the main script's own top-level code at a statement
    that is not under an `if __name__ ...` test."""
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    frame = caller
    while frame is not None and path is not None:
        if frame.f_code.co_name == "<module>" and frame.f_globals is vars(main):
            return None if _guarded(path, frame.f_lineno) else f"{path} line {frame.f_lineno}"
        frame = frame.f_back
    return None


def _guarded(path: str, line: int) -> bool:
    """Whether the top-level statement holding `line` is an `if` whose test names `__name__` (unreadable source:
    given the benefit of the doubt)."""
    try:
        with open(path, encoding="utf-8") as handle:
            tree = ast.parse(handle.read(), filename=path)
    except (OSError, SyntaxError, ValueError):
        return True
    for statement in tree.body:
        if statement.lineno <= line <= (statement.end_lineno or statement.lineno):
            return isinstance(statement, ast.If) and any(
                isinstance(node, ast.Name) and node.id == "__name__" for node in ast.walk(statement.test))
    return True
