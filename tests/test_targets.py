"""tracer/recorder/targets.py: which file names are CUDA libraries, and the process tree below a pid (real /proc)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from tracer.recorder import targets


@pytest.mark.parametrize(
    "path, kind",
    [
        ("/usr/local/cuda/lib64/libcudart.so.12", "cudart"),
        ("/usr/local/cuda/lib64/libcudart.so.12.4.127", "cudart"),
        ("site-packages/torch/lib/libcudart-9335f6a2.so.12", "cudart"),  # auditwheel-mangled
        ("/usr/local/cuda-13.0/lib/libcudart.so.13", "cudart"),
        ("libcudart.so", "cudart"),
        ("/usr/lib/x86_64-linux-gnu/libcuda.so.1", "cuda"),
        ("/usr/lib/x86_64-linux-gnu/libcuda.so.550.54.15", "cuda"),
        ("libcudnn.so.9", None),
        ("libcudart_static.a", None),
        ("libcuda.so.1.bak", None),
        ("/usr/lib/libcublas.so.12", None),
    ],
)
def test_library_kind_on_real_world_names(path: str, kind: str | None) -> None:
    assert targets.library_kind(path) == kind


def test_descendants_lists_a_child_after_its_parent() -> None:
    # GIVEN a process that has started a child
    parent = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import subprocess, sys, time\n"
            "c = subprocess.Popen(['sleep', '30']); print(c.pid, flush=True); time.sleep(30)",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    child = 0
    try:
        assert parent.stdout is not None
        child = int(parent.stdout.readline())
        # WHEN its descendants are listed; THEN parent first, then the child, nothing else
        assert targets.descendants(parent.pid) == [parent.pid, child]
        assert targets.is_alive(child)
        assert targets.proc_stat(child) == ("sleep", parent.pid)
    finally:
        if child:
            os.kill(child, signal.SIGKILL)
        parent.kill()
        parent.wait()
    # THEN a reaped process is no longer alive and check_pid refuses it
    assert not targets.is_alive(parent.pid)
    with pytest.raises(targets.TargetError):
        targets.check_pid(parent.pid)
