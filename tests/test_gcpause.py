"""analysis.gcpause: the cyclic collector paused while any analysis runs, in any thread, and back as it was after
the last one."""

from __future__ import annotations

import gc
import threading

from tracer.analysis.gcpause import gc_paused


def test_nested_and_overlapping_pauses_end_with_the_last():
    assert gc.isenabled()
    inside, go_on = threading.Event(), threading.Event()

    def other() -> None:
        with gc_paused():
            inside.set()
            go_on.wait(5)

    t = threading.Thread(target=other)
    with gc_paused():
        assert not gc.isenabled()
        with gc_paused():
            t.start()
            inside.wait(5)
        # GIVEN another thread's analysis still running: this one's end does not restart the collector
    assert not gc.isenabled()
    go_on.set()
    t.join(5)
    assert gc.isenabled()


def test_a_caller_that_disabled_the_collector_keeps_it_disabled():
    gc.disable()
    try:
        with gc_paused():
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_an_error_inside_still_restarts_the_collector():
    try:
        with gc_paused():
            raise KeyError("x")
    except KeyError:
        pass
    assert gc.isenabled()
