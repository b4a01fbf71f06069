"""A SIGTERM handler that sets an Event without deadlocking on the Event's own lock.

A Python signal handler runs in the main thread between two bytecodes, which may be inside the very Event's
`is_set()`: a multiprocessing Event holds its (non-reentrant) lock there, so a handler that calls `set()`
waits on its own thread forever. On an H200 that hung a procsplit run for good: its drafter ignored the
SIGTERM, and the supervisor, which polls the same Event, blocked on the lock too, so not even its stop grace
ran out (bench/record_shapes.sh gpu4, 2026-12-03). A tight `while not event.is_set()` loop hangs on roughly
one SIGTERM in three. Here the handler only starts a thread, which sets the Event once the main thread has
let go of the lock, a few microseconds later.
"""

from __future__ import annotations

import threading


def set_on_signal(event):
    """A `signal.signal` handler that sets `event` (a threading or multiprocessing Event) from a thread."""

    def handler(signum, frame) -> None:
        threading.Thread(target=event.set, name="sigterm", daemon=True).start()

    return handler
