"""The CPython side of the frame walker (tracer/recorder/cpython/, tracer/recorder/pyruntime.py): line-table
decoders against real code objects of every available interpreter, binary analysis (DWARF == _Py_DebugOffsets ==
built-in table == disassembly), the on-disk cache, and resolve() reading live code objects from another process.
No BPF here (see tests/integration/test_pyframes_bpf.py)."""

from __future__ import annotations

import ctypes as ct
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.support.interpreters import DEBIAN_PYTHON, PYENV_VERSIONS, pyenv_libpython, pyenv_python
from tests.support.need import need
from tracer.recorder import pyruntime
from tracer.recorder.cpython import elf, pycfg
from tracer.recorder.cpython.layouts import TABLE, BinaryInfo, PyTarget
from tracer.recorder.cpython.linetable import decode_line
from tracer.recorder.cpython.pycfg import build_cfg

# name -> the interpreter (None: not installed here); pyenv builds have DWARF, Debian's has none
INTERPRETERS: dict[str, Path | None] = {
    **{v: pyenv_python(v) for v in PYENV_VERSIONS},
    "debian-3.11": DEBIAN_PYTHON if DEBIAN_PYTHON.exists() else None,
    "running": Path(sys.executable),
}
# name -> the ELF file that embeds CPython (Debian's python is linked statically)
LIBPYTHON: dict[str, Path | None] = {
    **{v: pyenv_libpython(v) for v in PYENV_VERSIONS},
    "debian-3.11": INTERPRETERS["debian-3.11"],
}

# Source with the constructs that exercise the line tables: multi-line expressions, loops, comprehensions,
# try/except, nested functions and classes, a long jump in lines, non-ASCII names.
SAMPLE = """
import os

def outer(x):
    y = [i * 2
         for i in range(x)
         if i % 3]
    try:
        z = os.getpid(
            ) + 1
    except Exception:
        z = 0
    while x > 0:
        x -= 1
        if x == 5:
            break
    def inner(q):
        return q + \\
            1
    return inner(z) + sum(y)






class Kl\u00e4sse:
    def m\u00e9thode(self, a, b=2):
        lam = lambda t: (t,
                         a)
        return {k: v for k, v in zip(range(a), range(b))}, lam(1)
"""

# Run in each interpreter: compile SAMPLE, dump every code object's table, the expected line per code unit,
# and id(code) of live code objects; then wait on stdin so the test can read its memory.
DUMP = r"""
import json, sys, types
src = sys.stdin.readline()
src = json.loads(src)
mod = compile(src, "/tmp/sample_mod.py", "exec")
ns = {}
exec(mod, ns)
out = []
def walk(co):
    d = {"name": co.co_name, "qualname": getattr(co, "co_qualname", co.co_name), "first": co.co_firstlineno,
         "id": id(co)}
    n = len(co.co_code) // 2
    if sys.version_info >= (3, 11):
        d["table"] = co.co_linetable.hex()
        d["lines"] = [p[0] for p in co.co_positions()]
    else:
        d["table"] = co.co_linetable.hex()
        lines = [None] * n
        for start, end, line in co.co_lines():
            for b in range(start, end, 2):
                lines[b // 2] = line
        d["lines"] = lines
    out.append(d)
    for c in co.co_consts:
        if isinstance(c, types.CodeType):
            walk(c)
walk(mod)
print(json.dumps({"version": list(sys.version_info[:2]), "codes": out}), flush=True)
sys.stdin.readline()
"""


def _dump(interp: Path) -> tuple[subprocess.Popen, dict]:
    p = subprocess.Popen([str(interp), "-c", DUMP], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    p.stdin.write(json.dumps(SAMPLE) + "\n")
    p.stdin.flush()
    return p, json.loads(p.stdout.readline())


def _need(name: str, path: Path | None) -> Path:
    need(path is not None and path.exists(), f"CPython {name} is not installed (pyenv install {name})")
    assert path is not None
    return path


@pytest.mark.parametrize("name", list(INTERPRETERS))
def test_line_decoder_matches_interpreter(name: str) -> None:
    interp = _need(name, INTERPRETERS[name])
    p, d = _dump(interp)
    p.communicate("\n", timeout=10)
    version = tuple(d["version"])
    checked = 0
    for co in d["codes"]:
        table = bytes.fromhex(co["table"])
        for lasti, want in enumerate(co["lines"]):
            got = decode_line(version, table, co["first"], lasti)
            assert got == want, (name, co["qualname"], lasti, got, want)
            checked += 1
        # lasti -1 (3.11/3.12 prev_instr of a frame just entered, also as u32 from BPF) -> first line
        assert decode_line(version, table, co["first"], -1) == co["first"]
        assert decode_line(version, table, co["first"], 0xFFFFFFFF) == co["first"]
    assert checked > 100


@pytest.mark.parametrize("name", [n for n in INTERPRETERS if n != "running"])
def test_resolve_live_code_objects(name: str) -> None:
    """configure() + resolve() on a live process, with no BPF: names, qualnames and executing lines."""
    interp = _need(name, INTERPRETERS[name])
    p, d = _dump(interp)
    try:
        mgr = pyruntime.PyRuntimeManager(None)
        t = mgr.configure(p.pid)
        assert t is not None and t.version == tuple(d["version"])
        for co in d["codes"]:
            lasti = next(i for i, line in enumerate(co["lines"]) if line is not None)
            (fr,) = mgr.resolve(p.pid, [(co["id"], lasti), (0, 0)])
            assert fr.resolved
            assert (fr.filename, fr.qualname, fr.firstlineno) == (
                "/tmp/sample_mod.py",
                co["qualname"],
                co["first"],
            )
            assert fr.line == co["lines"][lasti]
        # not a code object (the type check rejects it) -> unresolved, not garbage
        (bad,) = mgr.resolve(p.pid, [(t.runtime_addr, 0)])
        assert not bad.resolved
        # a torn pointer past the user half (pread's offset is signed) -> unresolved, not an OverflowError
        assert [f.resolved for f in mgr.resolve(p.pid, [(2**64 - 16, 0), (2**63, 0), (2**63 - 8, 0)])] == [False] * 3
    finally:
        p.communicate("\n", timeout=10)


def test_resolve_gone_process_is_unresolved() -> None:
    mgr = pyruntime.PyRuntimeManager(None)
    assert mgr.configure(2**22 + 7) is None
    assert [f.resolved for f in mgr.resolve(2**22 + 7, [(0x1000, 0)])] == [False]


@pytest.mark.parametrize("name", list(LIBPYTHON))
def test_offsets_agree(name: str, tmp_path, monkeypatch) -> None:
    """DWARF (pyenv) and the built-in table agree; 3.13's _Py_DebugOffsets agrees; disassembly finds the TSS
    key."""
    path = _need(name, LIBPYTHON[name])
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    info = elf.analyze_binary(str(path))
    assert info is not None
    assert info.source == ("table" if name.startswith("debian") else "dwarf")
    assert info.offsets == TABLE[info.version]
    from elftools.elf.elffile import ELFFile

    with open(path, "rb") as f:
        image = ELFFile(f)
        segs = [(s["p_offset"], s["p_vaddr"], s["p_filesz"]) for s in image.iter_segments() if s["p_type"] == "PT_LOAD"]
        fn = image.get_section_by_name(".dynsym").get_symbol_by_name("PyGILState_GetThisThreadState")[0]["st_value"]
        f.seek(elf.vaddr_to_offset(segs, fn))
        assert elf.disasm_tss(f.read(64), fn, info.runtime_vaddr) == TABLE[info.version]["tss"]
        if info.version == (3, 13):
            f.seek(elf.vaddr_to_offset(segs, info.runtime_vaddr))
            dbg = elf.debug_offsets_313(f.read(71 * 8))
            assert dbg == {**TABLE[(3, 13)], "tss": None}


def test_disk_cache(tmp_path, monkeypatch) -> None:
    path = _need("3.12", LIBPYTHON["3.12"])
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    cold = elf.analyze_binary(str(path))
    files = list((tmp_path / "cuda-host-tracer").glob("pyrt-*.json"))
    assert len(files) == 1
    t0 = time.perf_counter()
    warm = elf.analyze_binary(str(path))
    assert time.perf_counter() - t0 < 0.1
    assert warm == cold
    # an unwritable cache is not an error
    monkeypatch.setenv("XDG_CACHE_HOME", "/proc/nonexistent")
    assert elf.analyze_binary(str(path)) == cold


def test_not_python() -> None:
    assert elf.analyze_binary("/bin/ls", use_cache=False) is None


def test_314_table_matches_research_note() -> None:
    """3.14 is not installed here; its layout comes from py-spy/OTel/CPython headers (research note §1.1)."""
    t = TABLE[(3, 14)]
    assert (t["ts_frame"], t["f_previous"], t["f_code"], t["f_instr"], t["f_owner"]) == (72, 8, 0, 56, 74)
    assert (t["co_filename"], t["co_name"], t["co_qualname"], t["co_firstlineno"]) == (112, 120, 128, 68)
    assert (t["co_linetable"], t["co_adaptive"]) == (136, 208)
    info = BinaryInfo("x", "b", (3, 14), "ET_DYN", 0x1000, 0, {**t, "tss": 2000}, "table")
    cfg = build_cfg(PyTarget(1, info, 0x10000))
    assert cfg.flags == pycfg.PYCFG_F_TAGGED  # _PyStackRef: mask tag bits
    assert cfg.owner_skip == 3  # skip INTERPRETER (3) and CSTACK (4) shims
    assert cfg.frame_read == 80 and cfg.f_owner == 74
    assert cfg.tss_key_addr == 0x11000 + 2000


def test_cfg_per_version() -> None:
    def cfg(ver):
        info = BinaryInfo("x", "b", ver, "ET_DYN", 0, 0, dict(TABLE[ver]), "table")
        return build_cfg(PyTarget(1, info, 0))

    assert ct.sizeof(pycfg.PyCfg) == 56
    c310, c311, c312, c313 = cfg((3, 10)), cfg((3, 11)), cfg((3, 12)), cfg((3, 13))
    assert c310.flags == pycfg.PYCFG_F_LASTI_INT and c310.frame_read == 104
    assert c311.flags == pycfg.PYCFG_F_CFRAME and c311.owner_skip == 255 and c311.f_owner == 0xFFFF
    assert c312.flags == pycfg.PYCFG_F_CFRAME and c312.cframe_current == 0 and c312.owner_skip == 3
    assert c313.flags == 0 and c313.ts_frame == 72
    for c in (c310, c311, c312, c313):
        assert c.frame_read <= 128 and c.pthread_spec1 == 0x310


def test_cflags() -> None:
    need(os.path.exists("/sys/kernel/btf/vmlinux"), "the kernel has no BTF (/sys/kernel/btf/vmlinux)")
    (flag,) = pycfg.cflags()
    assert flag.startswith("-DFSBASE_OFF=") and int(flag.split("=")[1]) > 0
