"""Pausing Python's cyclic garbage collector over an analysis's bulk reads.

Reading a recording makes hundreds of thousands of small objects that hold no reference cycles: a tuple per
process (200 K in an hour of a monitoring loop's commands), per thread, per histogram. The collector runs a
young-generation pass every 700 allocations and an older one every 10 of those, and each pass walks what is still
alive: comparing two hour-long recordings spent 18% of its time there (2.25 -> 1.85 s, issue 21), making nothing
collectable. So an analysis runs with the collector paused, and it runs again once the last analysis in the
process is done: anything cyclic made meanwhile is collected then. Threads share the collector (the MCP server
answers tools from worker threads, and compare_traces loads its two sides in two), so the pause is counted.
"""

from __future__ import annotations

import gc
import threading
from collections.abc import Iterator
from contextlib import contextmanager

_lock = threading.Lock()
_depth = 0  # analyses running with the collector paused
_was_enabled = False  # whether the first of them found it enabled (a caller that disabled it keeps it so)


@contextmanager
def gc_paused() -> Iterator[None]:
    """Run the body with the cyclic collector paused; re-enable it (if it was) when the last such body ends."""
    global _depth, _was_enabled
    with _lock:
        if _depth == 0:
            _was_enabled = gc.isenabled()
            gc.disable()
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0 and _was_enabled:
                gc.enable()
