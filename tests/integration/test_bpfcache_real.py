"""The BPF program from the cache is the program bcc compiled: the same functions loaded, each with the kernel's
tag (a hash of its instructions, map references aside) equal to the compiled one's, and the same maps; a changed
kernel misses and compiles. Real bcc and a real kernel (root)."""

from __future__ import annotations

import ctypes as ct
import struct
from pathlib import Path
from typing import Any

import pytest

from tests.support.need import need_module, need_root
from tracer.recorder import bpfcache
from tracer.recorder.program import ProgramOptions, _compile, load_programs

_BPF_OBJ_GET_INFO_BY_FD = 15


def _info(fd: int, size: int) -> bytes:
    info = ct.create_string_buffer(size)
    attr = ct.create_string_buffer(struct.pack("=IIQ", fd, size, ct.addressof(info)), 16)
    assert bpfcache._bpf(_BPF_OBJ_GET_INFO_BY_FD, attr) == 0, "BPF_OBJ_GET_INFO_BY_FD"
    return info.raw


def _loaded(bpf: Any) -> tuple[dict[str, tuple[int, bytes]], dict[str, tuple[int, ...]]]:
    """(function -> (program type, kernel tag)), (map -> (type, key size, value size, max entries, flags))."""
    progs = {}
    for name, fn in bpf.funcs.items():
        raw = _info(fn.fd, 256)
        progs[name.decode()] = (struct.unpack_from("=I", raw)[0], raw[8:16])
    maps = {}
    for m in ("op_cfg", "sched_rb", "native_stacks", "stage_prog", "seen_code", "held", "tstate"):
        t = bpf[m]
        mtype, _id, ks, vs, me, fl = struct.unpack_from("=6I", _info(t.map_fd, 88))
        maps[m] = (mtype, ks, vs, me, fl, ct.sizeof(t.Key), ct.sizeof(t.Leaf), type(t).__name__)
    return progs, maps


@pytest.fixture(scope="module")
def compiled_then_cached(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any, Any]:
    need_root()
    need_module("bcc")
    d = tmp_path_factory.mktemp("bpfcache") / "bpf"
    opts = ProgramOptions(with_pyframes=True)
    cold = _compile(opts, d)
    load_programs(cold, True)
    cold_seen = _loaded(cold)
    cold.cleanup()
    warm = _compile(opts, d)
    load_programs(warm, True)
    warm_seen = _loaded(warm)
    warm_type = type(warm).__name__
    warm.cleanup()
    return d, (cold_seen, type(cold).__name__), (warm_seen, warm_type)


def test_cache_hit_loads_the_compiled_programs(compiled_then_cached: tuple[Path, Any, Any]) -> None:
    d, (cold, cold_type), (warm, warm_type) = compiled_then_cached
    assert cold_type == "BPF" and warm_type == "CachedBPF"  # compiled, then taken from the cache
    assert len(list(d.glob("*.json"))) == 1
    cold_progs, cold_maps = cold
    warm_progs, warm_maps = warm
    assert len(cold_progs) > 20  # every tracepoint and the uprobe programs
    assert warm_progs == cold_progs  # same names, program types and kernel tags
    assert warm_maps == cold_maps


def test_another_kernel_misses(compiled_then_cached: tuple[Path, Any, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    d = compiled_then_cached[0]
    monkeypatch.setattr(bpfcache, "_kernel_id", lambda: "another kernel")
    bpf = _compile(ProgramOptions(with_pyframes=True), d)
    try:
        assert type(bpf).__name__ == "BPF"  # compiled
    finally:
        bpf.cleanup()
    assert len(list(d.glob("*.json"))) == 2  # and cached under its own key
