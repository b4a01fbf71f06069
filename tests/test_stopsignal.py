"""The trainer's SIGTERM handler never deadlocks on the Event it sets (trainer/stopsignal.py).

A handler that called a multiprocessing Event's set() hung the process whenever the signal came while the main
thread was inside the same Event's is_set(): a procsplit run on an H200 ignored its SIGTERM for good. These run
in fresh interpreters without torch (a hung child is killed by the timeout and the test fails, never hangs).
"""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# the main thread inside is_set() (its lock held) when the handler runs: exactly what a signal there does
INSIDE_IS_SET = textwrap.dedent("""
    import multiprocessing as mp, signal
    from trainer.stopsignal import set_on_signal
    event = mp.get_context("spawn").Event()
    handler = set_on_signal(event)
    with event._cond:
        handler(signal.SIGTERM, None)
    print("set" if event.wait(10) else "not set", flush=True)
""")

# a loop that polls the Event as fast as it can, as a drafter's wait does, stopped by real SIGTERMs
POLLING = textwrap.dedent("""
    import multiprocessing as mp, signal
    from trainer.stopsignal import set_on_signal
    event = mp.get_context("spawn").Event()
    signal.signal(signal.SIGTERM, set_on_signal(event))
    print("ready", flush=True)
    while not event.is_set():
        pass
    print("stopped", flush=True)
""")


def python(code: str, **kwargs) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, stdout=subprocess.PIPE, text=True, **kwargs)


def test_a_sigterm_inside_the_events_own_is_set_still_sets_it():
    child = python(INSIDE_IS_SET)
    try:
        out, _ = child.communicate(timeout=30)
    finally:
        child.kill()
    assert out.strip() == "set"


def test_a_loop_polling_the_event_ends_on_every_sigterm():
    # the old handler (event.set() in the handler) hung on about one SIGTERM in three of these
    for attempt in range(15):
        child = python(POLLING)
        try:
            assert child.stdout.readline().strip() == "ready"
            child.send_signal(signal.SIGTERM)
            out, _ = child.communicate(timeout=30)
        finally:
            child.kill()
            child.wait()
        assert out.strip() == "stopped", f"attempt {attempt}: the process did not end on its SIGTERM"
