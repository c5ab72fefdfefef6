"""What a real SIGINT or SIGTERM, sent to this process, does in each phase of a run."""

from __future__ import annotations

import logging
import os
import signal
import time

import pytest

from stoker.common.procs import CONTEXT, start
from stoker.run.lifecycle import Interrupted, Lifecycle


def send(signum: int) -> None:
    os.kill(os.getpid(), signum)
    time.sleep(0.01)  # the handler runs in the main thread at the next bytecode; give it one


def test_training_first_signal_asks_for_a_clean_stop_and_a_second_stops_now():
    lifecycle = Lifecycle()
    with lifecycle.handling_signals():
        send(signal.SIGTERM)
        assert lifecycle.interrupted
        with pytest.raises(Interrupted):
            send(signal.SIGINT)


def _sleep_forever() -> None:
    while True:
        time.sleep(1)


def test_closing_a_signal_kills_every_child_and_raises_nothing():
    lifecycle = Lifecycle()
    child = start(_sleep_forever, (), "test child")
    try:
        with lifecycle.handling_signals():
            lifecycle.closing()
            send(signal.SIGINT)
            send(signal.SIGTERM)
        child.join(timeout=10)
        assert child.exitcode == -signal.SIGKILL and lifecycle.forced
    finally:
        child.kill()
        child.join()


def test_a_child_ignores_the_signals_its_process_group_gets():
    child = start(_sleep_forever, (), "test child")
    try:
        time.sleep(0.5)  # still starting up, or already in its loop: either way blocked from before the fork
        os.kill(child.pid, signal.SIGTERM)
        os.kill(child.pid, signal.SIGINT)
        child.join(timeout=1.0)
        assert child.is_alive()
    finally:
        child.kill()
        child.join()
    assert not CONTEXT.active_children()


def test_reporting_a_signal_skips_the_report_only(caplog):
    lifecycle = Lifecycle()
    drawn = False
    with caplog.at_level(logging.WARNING), lifecycle.handling_signals():
        with lifecycle.reporting():
            send(signal.SIGINT)
            drawn = True
        assert lifecycle.phase == "closing"
    assert not drawn and "report skipped" in caplog.text and not lifecycle.interrupted
