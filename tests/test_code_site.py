"""tracer/analysis/code_site.py: the one rule for the user's line in a stack (issue 31). A call's stored stack
and the same frames read by the stack tools name the same line; the binding that made a CUDA call is stepped
over, a stack that does not enter CUDA keeps its innermost user line."""

from __future__ import annotations

from tests.support.builder import TraceBuilder
from tracer.analysis.code_site import code_site, short_site, site_of, user_frame
from tracer.analysis.db import open_trace
from tracer.analysis.stack_time import load_frames

TRAIN = ("python", "train.py", "main", "/job/train.py", 40)
STEP = ("python", "train.py", "step", "/job/train.py", 88)
BINDING = ("python", "fakecuda.py", "FakeCuda.call", "/job/fakecuda.py", 332)
LIB = ("python", "torch", "forward", "/usr/lib/python3/dist-packages/torch/nn/module.py", 1500)
CUDA = ("cuda", "libcudart.so.12", "cudaStreamSynchronize", None, None)
NATIVE = ("native", "libc.so.6", "read", None, None)


def test_a_cuda_call_made_through_a_binding_is_named_by_its_caller():
    assert site_of([TRAIN, STEP, BINDING, CUDA]) == "/job/train.py:88 step"
    assert short_site([TRAIN, STEP, BINDING, CUDA]) == "step (train.py:88)"


def test_a_stack_outside_cuda_keeps_its_innermost_user_line():
    # blocked in read under the binding's file: that line waits, whoever called it
    assert site_of([TRAIN, STEP, BINDING, NATIVE]) == "/job/fakecuda.py:332 FakeCuda.call"


def test_library_frames_are_skipped_and_a_library_only_stack_keeps_its_innermost_frame():
    assert user_frame([TRAIN, STEP, LIB, CUDA]) == STEP
    assert user_frame([LIB, NATIVE]) == LIB
    assert user_frame([NATIVE, CUDA]) is None and site_of([NATIVE]) is None


def test_a_stored_stack_is_named_the_same_by_the_chains_and_the_stack_tools(tmp_path):
    b = TraceBuilder()
    sid = b.stack([(k, m, f, p, ln) for k, m, f, p, ln in (TRAIN, STEP, BINDING, CUDA)])
    b.call(1_000_000_000, 10_000, "cudaStreamSynchronize", stack_id=sid)
    b.write(tmp_path / "t.duckdb")
    with open_trace(tmp_path / "t.duckdb") as c:
        frames = load_frames(c, [sid])[sid]
        assert code_site(c, sid) == site_of(frames) == "/job/train.py:88 step"
