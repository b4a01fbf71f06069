"""Fault hooks: the named points where the test suite makes dfo die, wait, lose an answer or start slowly.

The run lifecycle's promises ("a dfo killed between recording a fallback and stopping the run leaves an intent
the next `dfo watch` finishes", "a start whose answer never came is adopted only if it really started") can
only be tested by failing at exactly those points in a real dfo process. Each hook below is a no-op unless
its environment variable names its point; nothing but the tests sets these variables, and no hook changes
what dfo does when they are unset. They live here, one module, so that the list of them is in one place and
runs.py, chains.py and multinode.py carry one call per point and nothing else.

| variable | its points (where) | what happens there |
|---|---|---|
| DFO_TEST_LAUNCH_EXIT_AT | reserved, started, recorded (runs.py) | dfo exits 137 at once (`os._exit`: no cleanup, as a SIGKILL) |
| DFO_TEST_FALLBACK_EXIT_AT | recorded, stopped (chains.py); launching, launch_started (runs.py, a successor's launch); nodeK_started (multinode.py) | the same |
| DFO_TEST_PAUSE_AT, DFO_TEST_PAUSE_FILE | identified (`dfo stop` between its identity check and its signal, runs.py); nodes_recorded (a multi-node launch between recording its nodes and starting them, multinode.py) | dfo creates the file and goes on once the test removes it, at most PAUSE_MAX_S later |
| DFO_TEST_START_TIMEOUT_AT | before_start (the word to start never went out), after_start (the run started, its PID never came back), runs.py, a successor's start only | the start raises CommandTimeout, as over a link that drops |
| DFO_TEST_SLOW_START | NAME:SECONDS (runs.py) | run NAME's start script sleeps SECONDS before it starts the run, and dfo waits only SLOW_START_ANSWER_S for its answer, as when a loaded container starts a run after dfo gave up waiting |
"""

from __future__ import annotations

import os
import time

from .errors import CommandTimeout

LAUNCH_EXIT_AT = "DFO_TEST_LAUNCH_EXIT_AT"
FALLBACK_EXIT_AT = "DFO_TEST_FALLBACK_EXIT_AT"
PAUSE_AT = "DFO_TEST_PAUSE_AT"
PAUSE_FILE = "DFO_TEST_PAUSE_FILE"
START_TIMEOUT_AT = "DFO_TEST_START_TIMEOUT_AT"
SLOW_START = "DFO_TEST_SLOW_START"

KILLED_EXIT = 137
"""The status a hook's exit leaves: what a shell reports for a SIGKILL."""
PAUSE_MAX_S = 120.0
"""The longest pause_at holds dfo (agent/stopper.py's wait for dfo's word is longer)."""
SLOW_START_ANSWER_S = 1.0
"""How long dfo waits for the answer of a start that DFO_TEST_SLOW_START slows."""


def exit_at(point: str, variable: str = LAUNCH_EXIT_AT) -> None:
    """Exit at once, with no cleanup, when `variable` names `point`."""
    if os.environ.get(variable) == point:
        os._exit(KILLED_EXIT)


def pause_at(point: str) -> None:
    """Hold dfo at `point` while the test's DFO_TEST_PAUSE_FILE exists (created here), at most PAUSE_MAX_S."""
    if os.environ.get(PAUSE_AT) != point:
        return
    flag = os.environ[PAUSE_FILE]
    open(flag, "w").close()
    deadline = time.monotonic() + PAUSE_MAX_S
    while os.path.exists(flag) and time.monotonic() < deadline:
        time.sleep(0.05)


def lose_start_answer(point: str, *, successor: bool, timeout_s: float) -> None:
    """Raise the CommandTimeout of a start whose answer did not come, at `point` of a successor's start."""
    if successor and os.environ.get(START_TIMEOUT_AT) == point:
        raise CommandTimeout(f"the launch script gave no answer to the start within {timeout_s:g}s (test: {point})")


def slow_start_s(name: str) -> float:
    """How long run `name`'s start script waits before it starts the run (0: not slowed)."""
    run, _, seconds = os.environ.get(SLOW_START, "").partition(":")
    return float(seconds) if run == name and seconds else 0.0
