"""`tracer record` on programs built with nvcc against the real CUDA 13 runtime (libcudart.so.13, no driver, no
GPU): every call runs the runtime's real entry code and returns 35 (cudaErrorInsufficientDriver).

The programs (fixtures/real_cuda: rc_ops and its librc_model.so) launch templated kernels in namespaces and
``extern "C"`` kernels, with ``<<<...>>>`` and with cudaLaunchKernel, from the executable and from a separately
compiled shared library, and call the stream-ordered allocator, async copies, events and stream waits. They count
every call themselves (entry point, return code, size) and the tests compare the recording with those counts,
never with the tracer's own numbers.

Recordings, each made once per module:
  short     ``tracer record -- default/rc_ops 100``: the run that lost its kernel names when the process exited
            before user space symbolized (issue 12)
  children  ``tracer record -- sh -c 'ptsz/rc_ops 100 && stripped/rc_ops 100'``: two short-lived children, one
            built with --default-stream per-thread (the _ptsz/_ptds entry points), one whose library is stripped
  long      ``tracer record --pid`` on ``default/rc_ops 20000``, attached while it waits on stdin

Skipped where nvcc or libcudart.so.13 is missing (``NVCC``/``CUDART`` override their paths), or not root.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import struct
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import cxxfilt
import pytest
from conftest import (
    ROOT,
    SYMBOL_TO_OP,
    TRACER,
    query,
    read_counts,
    record,
    start_record,
    wait_for_line,
)
from elftools.elf.elffile import ELFFile
from elftools.elf.sections import SymbolTableSection

from probes.catalog import CATALOG, MEMCPY_KIND_NAMES, NO_ARG, MemcpyKind, OpClass, spec_of
from tests.support.need import need_nothing_missing

pytestmark = pytest.mark.bpf

NVCC = Path(os.environ.get("NVCC", "/usr/local/cuda/bin/nvcc"))
CUDART = Path(os.environ.get("CUDART", "/usr/local/cuda/lib64/libcudart.so.13"))
SOURCES = ROOT / "fixtures" / "real_cuda"
SHORT, LONG = 100, 20_000
INSUFFICIENT_DRIVER = 35  # cudaErrorInsufficientDriver: what every call returns on a machine without a driver

# nvcc 13's launch stub calls __cudaLaunchKernel[_ptsz], which libcudart.so.13 implements as a tail jump into
# cudaLaunchKernel[_ptsz] (checked by test_chevron_entry_is_a_tail_jump_into_cudaLaunchKernel): a <<<...>>> launch
# therefore hits the cudaLaunchKernel probe, with the handle __cudaGetKernel returned as its function pointer.
TAIL_JUMPS = {"__cudaLaunchKernel": "cudaLaunchKernel", "__cudaLaunchKernel_ptsz": "cudaLaunchKernel_ptsz"}

# Kernels launched from librc_model.so (rc_model.cu), as rc_ops labels them; the others live in rc_ops itself.
LIBRARY_KERNELS = {
    "void nn::layers::bias_kernel<double>(double*, double, int)",
    "nn::layers::norm_kernel(float*, int)",
}
# The call chain of every CUDA call of the training step (rc_ops.cu), outermost first.
STEP_CHAIN = ["main", "rc::run(rc::Ctx&, long)", "rc::step(rc::Ctx&)"]


def _why_not() -> str | None:
    if not NVCC.exists():
        return f"needs nvcc (the CUDA toolkit) at {NVCC}; set NVCC= to another path"
    if not CUDART.exists():
        return f"needs the real CUDA runtime at {CUDART}; set CUDART= to another path"
    if shutil.which("make") is None or shutil.which("strip") is None:
        return "needs make and strip (binutils)"
    return None


@pytest.fixture(scope="session")
def rc_build(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Build fixtures/real_cuda once per session (nvcc takes seconds per file); return the build directory."""
    need_nothing_missing(_why_not())
    build = tmp_path_factory.mktemp("real_cuda")
    subprocess.run(["make", "-s", "-C", str(SOURCES), f"BUILD={build}", f"NVCC={NVCC}"], check=True)
    return build


# --- the programs' own counts ------------------------------------------------------------------------------


@dataclass
class Program:
    """One rc_ops process: its variant (default | ptsz | stripped), binary, and what it counted."""

    variant: str
    binary: Path
    report: dict[str, Any]

    @property
    def pid(self) -> int:
        return int(self.report["pid"])

    @property
    def streams(self) -> list[int]:
        return [int(s) for s in self.report["streams"]]

    def ops(self) -> dict[str, int]:
        """Calls per catalog op: entry points folded by the catalog, <<<...>>> launches by their tail jump."""
        out: dict[str, int] = {}
        for sym, n in self.report["counts"].items():
            op = SYMBOL_TO_OP.get(TAIL_JUMPS.get(sym, sym))
            if op is not None:
                out[op] = out.get(op, 0) + n
        return out

    def codes(self, op: str) -> set[int]:
        """Return codes the program saw from the entry points of ``op``."""
        return {
            int(code)
            for sym, by_code in self.report["codes"].items()
            if SYMBOL_TO_OP.get(TAIL_JUMPS.get(sym, sym)) == op
            for code in by_code
        }

    def bytes_of(self, op: str) -> int | None:
        sizes = {n for sym, n in self.report["bytes"].items() if SYMBOL_TO_OP.get(sym) == op}
        assert len(sizes) <= 1
        return sizes.pop() if sizes else None

    @property
    def kernels(self) -> dict[str, int]:
        return dict(self.report["kernels"])

    @property
    def library(self) -> Path:
        return self.binary.parent / "librc_model.so"


@dataclass
class RealRecording:
    db: Path
    programs: list[Program]
    by_variant: dict[str, Program] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.by_variant = {p.variant: p for p in self.programs}


def _programs(build: Path, counts: Path, variants: list[str]) -> list[Program]:
    out = []
    for v in variants:
        reports = read_counts(counts / v)
        assert len(reports) == 1, f"{v}: expected one counts file, got {len(reports)}"
        out.append(Program(v, build / v / "rc_ops", reports[0]))
    return out


def _rc(build: Path, variant: str, iterations: int, counts: Path, *extra: str) -> list[str]:
    (counts / variant).mkdir(parents=True, exist_ok=True)
    return [str(build / variant / "rc_ops"), str(iterations), "--counts-dir", str(counts / variant), *extra]


# --- recordings, one each per module -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def tmp(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("real_cuda_rec")


@pytest.fixture(scope="module")
def short(rc_build: Path, tmp: Path) -> RealRecording:
    db, counts = tmp / "short.duckdb", tmp / "short-counts"
    proc = record(["--db", str(db), "--", *_rc(rc_build, "default", SHORT, counts)])
    assert proc.returncode == 0, proc.stderr
    return RealRecording(db, _programs(rc_build, counts, ["default"]))


@pytest.fixture(scope="module")
def children(rc_build: Path, tmp: Path) -> RealRecording:
    db, counts = tmp / "children.duckdb", tmp / "children-counts"
    script = " && ".join(shlex.join(_rc(rc_build, v, SHORT, counts)) for v in ("ptsz", "stripped"))
    proc = record(["--db", str(db), "--", "/bin/sh", "-c", script])
    assert proc.returncode == 0, proc.stderr
    return RealRecording(db, _programs(rc_build, counts, ["ptsz", "stripped"]))


@pytest.fixture(scope="module")
def long(rc_build: Path, tmp: Path) -> RealRecording:
    """rc_ops 20000 attached by --pid: it prints "ready PID" and waits on stdin until the probes are in place."""
    db, counts = tmp / "long.duckdb", tmp / "long-counts"
    target = subprocess.Popen(
        _rc(rc_build, "default", LONG, counts, "--wait-stdin"),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    assert target.stdin is not None and target.stdout is not None
    try:
        assert target.stdout.readline().split() == ["ready", str(target.pid)]
        rec = start_record(["--db", str(db), "--pid", str(target.pid)], verbose=True)
        try:
            head = wait_for_line(rec, f"to {os.path.realpath(CUDART)}")
        finally:
            target.stdin.write("go\n")
            target.stdin.close()
        assert target.wait(timeout=120) == 0
        _out, err = rec.communicate(timeout=120)
    finally:
        if target.poll() is None:
            target.kill()
            target.wait()
    assert rec.returncode == 0, "".join(head) + err
    return RealRecording(db, _programs(rc_build, counts, ["default"]))


RECORDINGS = ["short", "children", "long"]
SHORT_RECORDINGS = ["short", "children"]  # every call stored: nothing duty-cycled or lost


# --- the fixtures and the runtime, as the tests assume them --------------------------------------------------


def _symtab(path: Path) -> dict[int, str]:
    """Address -> name of every FUNC symbol in .symtab (local ones included)."""
    with path.open("rb") as f:
        elf = ELFFile(f)
        sec = elf.get_section_by_name(".symtab")
        assert isinstance(sec, SymbolTableSection), f"{path} has no .symtab"
        return {s["st_value"]: s.name for s in sec.iter_symbols() if s["st_info"]["type"] == "STT_FUNC"}


@pytest.fixture(scope="session")
def untraced(rc_build: Path) -> Program:
    """The default build run once (1 iteration) without a tracer: what it calls and how it labels its kernels."""
    counts = rc_build / "untraced-counts"
    subprocess.run(_rc(rc_build, "default", 1, counts), check=True, capture_output=True)
    return _programs(rc_build, counts, ["default"])[0]


def test_kernel_labels_are_the_demangled_host_stubs(rc_build: Path, untraced: Program) -> None:
    # GIVEN the names rc_ops counts its launches under
    labels = set(untraced.kernels)
    # WHEN the host stubs' symbols (local, .symtab only) of the executable and the library are demangled
    names = {
        cxxfilt.demangle(n)
        for lib in ("rc_ops", "librc_model.so")
        for n in _symtab(rc_build / "default" / lib).values()
    }
    # THEN every label is exactly the demangled symbol a tracer should store
    assert labels <= names, labels - names
    assert LIBRARY_KERNELS <= labels
    # AND the library's stubs are local symbols: absent from .dynsym, so the stripped copy has no name for them
    with (rc_build / "stripped" / "librc_model.so").open("rb") as f:
        elf = ELFFile(f)
        assert elf.get_section_by_name(".symtab") is None
        dynsym = elf.get_section_by_name(".dynsym")
        assert isinstance(dynsym, SymbolTableSection)
        dyn = {cxxfilt.demangle(s.name) for s in dynsym.iter_symbols() if s.name}
    assert "rc_model_forward" in dyn
    assert not (LIBRARY_KERNELS & dyn)


def test_fixture_calls_every_runtime_op_of_the_catalog(untraced: Program) -> None:
    # GIVEN rc_ops's own counts; THEN they cover every runtime op the catalog probes, each returning 35
    runtime_ops = {s.op for s in CATALOG if s.library == "cudart"}  # libcudart's: NCCL's are on the runtime layer too
    assert set(untraced.ops()) == runtime_ops
    assert all(untraced.codes(op) == {INSUFFICIENT_DRIVER} for op in runtime_ops)


def test_chevron_entry_is_a_tail_jump_into_cudaLaunchKernel() -> None:
    # GIVEN the real runtime's exported entry points
    need_nothing_missing(_why_not())
    with CUDART.open("rb") as f:
        elf = ELFFile(f)
        dynsym = elf.get_section_by_name(".dynsym")
        addr = {s.name: s["st_value"] for s in dynsym.iter_symbols() if s["st_value"]}
        text = elf.get_section_by_name(".text")
        base, data = text["sh_addr"], text.data()
    for stub, target in TAIL_JUMPS.items():
        # WHEN the first instructions of __cudaLaunchKernel[_ptsz] are decoded
        code = data[addr[stub] - base : addr[stub] - base + 16]
        i = 4 if code.startswith(b"\xf3\x0f\x1e\xfa") else 0  # endbr64
        if code[i : i + 5] == b"\x55\x48\x89\xe5\x5d":  # push %rbp; mov %rsp,%rbp; pop %rbp
            i += 5
        # THEN they are one jmp rel32 to cudaLaunchKernel[_ptsz]: the launch reaches that probe unchanged
        assert code[i] == 0xE9, f"{stub} is no longer a tail jump: {code.hex()} (re-measure TAIL_JUMPS)"
        (rel,) = struct.unpack_from("<i", code, i + 1)
        assert addr[stub] + i + 5 + rel == addr[target]


# --- 1. exact counts and return codes per op ---------------------------------------------------------------


def _hot(op: str) -> bool:
    """True for the kernel launches, the hot path the recorder may duty-cycle (recorder/budget.py). A graph launch
    carries no kernel and comes once a step, like a sync: sampling it saves nothing, and a once-called
    cudaGraphLaunch that falls in a closed window disappears from op_stats altogether (seen in the long run)."""
    spec = spec_of(op)
    return spec is not None and spec.op_class == OpClass.LAUNCH and spec.func_arg != NO_ARG


@pytest.mark.parametrize("name", RECORDINGS)
def test_counts_equal_the_programs_own(name: str, request: pytest.FixtureRequest) -> None:
    rec: RealRecording = request.getfixturevalue(name)
    for prog in rec.programs:
        # WHEN op_stats is read for the program's pid
        rows = query(
            rec.db, "SELECT op, layer, calls, sampled_fraction, error_pct FROM op_stats WHERE pid = ?", [prog.pid]
        )
        got = {op: (layer, calls, frac, err) for op, layer, calls, frac, err in rows}
        want = prog.ops()
        # THEN every op the program called is there, and nothing else (no driver op: there is no libcuda)
        assert set(got) == set(want), f"{prog.variant}: recorded {sorted(got)}, called {sorted(want)}"
        for op, n in want.items():
            layer, calls, frac, err = got[op]
            assert layer == "runtime"
            spec = spec_of(op)
            assert spec is not None
            if not _hot(op):
                assert frac == 1.0, f"{op} was duty-cycled; only kernel launches (the hot path) may be"
            if frac == 1.0:
                # exact: every call counted
                assert calls == n, f"{prog.variant} {op}: recorded {calls}, the program made {n}"
            else:
                # duty-cycled launches: scaled, within the error bound the recorder states for them
                assert abs(calls - n) <= n * err / 100, f"{op}: {calls} vs {n} (+-{err}%)"


@pytest.mark.parametrize("name", SHORT_RECORDINGS)
def test_return_codes_are_the_programs_own(name: str, request: pytest.FixtureRequest) -> None:
    rec: RealRecording = request.getfixturevalue(name)
    for prog in rec.programs:
        # GIVEN a program that saw 35 from every call (no driver)
        for op in prog.ops():
            assert prog.codes(op) == {INSUFFICIENT_DRIVER}
            # WHEN the stored rows of that op are read
            rets = query(
                rec.db, "SELECT ret, count(*) FROM cuda_calls WHERE pid = ? AND op = ? GROUP BY ret", [prog.pid, op]
            )
            # THEN each has the code the program saw, and every call has its row (short runs store them all)
            assert {r for r, _ in rets} == prog.codes(op), f"{prog.variant} {op}: {rets}"
            assert sum(n for _, n in rets) == prog.ops()[op]


@pytest.mark.parametrize("name", SHORT_RECORDINGS)
def test_arguments_decoded_from_the_real_abi(name: str, request: pytest.FixtureRequest) -> None:
    rec: RealRecording = request.getfixturevalue(name)
    for prog in rec.programs:
        s1, s2 = prog.streams
        kinds = {"cudaMemcpy": MemcpyKind.DEVICE_TO_HOST, "cudaMemcpyAsync": MemcpyKind.HOST_TO_DEVICE}
        for op in prog.ops():
            spec = spec_of(op)
            assert spec is not None
            # GIVEN what rc_ops passed: its sizes, copy directions, and streams (s2 only for the stream wait)
            want_bytes = prog.bytes_of(op) if spec.bytes_arg != NO_ARG else None
            want_kind = MEMCPY_KIND_NAMES[kinds[op]] if op in kinds else None
            want_stream = None if spec.stream_arg == NO_ARG else s2 if op == "cudaStreamWaitEvent" else s1
            # WHEN the stored rows are read
            got = query(
                rec.db, "SELECT DISTINCT bytes, kind, stream FROM cuda_calls WHERE pid = ? AND op = ?", [prog.pid, op]
            )
            # THEN every row carries them (cudaLaunchKernel's stream is its 8th, stack-passed argument)
            assert got == [(want_bytes, want_kind, want_stream)], f"{prog.variant} {op}"


# --- 2. kernel names from the host stub -------------------------------------------------------------------


def _launch_rows(db: Path, pid: int) -> list[tuple[str | None, str | None, int]]:
    return query(
        db,
        "SELECT kernel, kernel_note, count(*) FROM cuda_calls WHERE pid = ? AND op = 'cudaLaunchKernel' GROUP BY ALL",
        [pid],
    )


def _build_id(path: Path) -> str:
    with path.open("rb") as f:
        for sec in ELFFile(f).iter_sections():
            if sec.name == ".note.gnu.build-id":
                for note in sec.iter_notes():
                    return str(note["n_desc"])
    raise AssertionError(f"{path} has no build-id")


@pytest.mark.parametrize("name", RECORDINGS)
def test_kernels_are_named_from_the_host_stub(name: str, request: pytest.FixtureRequest) -> None:
    rec: RealRecording = request.getfixturevalue(name)
    for prog in rec.programs:
        if prog.variant == "stripped":
            continue  # test_stripped_library_kernels_say_why
        # GIVEN the kernels the program launched: from rc_ops and from librc_model.so, <<<...>>> and explicit
        want = prog.kernels
        # WHEN the stored launch rows are grouped by name
        rows = _launch_rows(rec.db, prog.pid)
        named = {k: n for k, note, n in rows if k is not None}
        # THEN every stored launch is named, after the process exited, with the demangled host stub's name
        assert [r for r in rows if r[0] is None] == [], f"{prog.variant}: launches left unnamed"
        assert set(named) == set(want)
        if name in SHORT_RECORDINGS:
            assert named == want  # every launch stored: the counts per kernel are exact too


def test_stripped_library_kernels_say_why(children: RealRecording) -> None:
    # GIVEN rc_ops with a stripped librc_model.so: the library's host stubs have no symbol left
    prog = children.by_variant["stripped"]
    bid = _build_id(prog.library)
    want = prog.kernels
    # WHEN its launch rows are read
    rows = _launch_rows(children.db, prog.pid)
    named = {k: n for k, _note, n in rows if k is not None}
    unnamed = [(note, n) for k, note, n in rows if k is None]
    # THEN the executable's kernels are still named, each launch
    assert named == {k: n for k, n in want.items() if k not in LIBRARY_KERNELS}
    # AND the library's are not guessed: kernel is NULL and the note says why, with the build-id for debuginfo
    assert sum(n for _, n in unnamed) == sum(n for k, n in want.items() if k in LIBRARY_KERNELS)
    for note, _n in unnamed:
        assert note and "librc_model.so" in note and "stripped" in note and bid in note, note
    # AND a named launch carries no note
    assert all(note is None for k, note, _n in rows if k is not None)


# --- 3. native stacks from main, no Python -----------------------------------------------------------------


@dataclass
class Stack:
    stack_id: int | None  # None: the stored calls that have no stack
    calls: int
    frames: list[dict[str, Any]]  # outermost first: kind, module, function


def _stacks(db: Path, op: str, pid: int) -> list[Stack]:
    """The stored calls of ``op`` by ``pid`` grouped by stack, read from the stacks table."""
    out = []
    for sid, n in query(
        db, "SELECT stack_id, count(*) FROM cuda_calls WHERE pid = ? AND op = ? GROUP BY stack_id", [pid, op]
    ):
        rows = query(db, "SELECT kind, module, function FROM stacks WHERE stack_id = ? ORDER BY depth", [sid])
        out.append(Stack(sid, n, [dict(kind=k, module=m, function=f) for k, m, f in rows]))
    return out


def _tail(frames: list[dict[str, Any]], n: int) -> list[tuple[str, str, str]]:
    return [(f["kind"], f["module"], f["function"]) for f in frames[-n:]]


@pytest.mark.parametrize("name", RECORDINGS)
def test_native_stack_runs_from_main_to_the_runtime(name: str, request: pytest.FixtureRequest) -> None:
    rec: RealRecording = request.getfixturevalue(name)
    # GIVEN a program without Python: no Python frame anywhere in the recording
    assert query(rec.db, "SELECT count(*) FROM stacks WHERE kind = 'python'") == [(0,)]
    for prog in rec.programs:
        # (the per-thread build calls cudaMemcpyAsync_ptsz: the same op, another entry point)
        for op in ("cudaMalloc", "cudaMemcpyAsync", "cudaStreamSynchronize"):
            # WHEN the op's stored calls are grouped by stack
            stacks = _stacks(rec.db, op, prog.pid)
            # THEN every one went through a single stack
            assert [s.stack_id is not None for s in stacks] == [True], f"{prog.variant} {op}: {stacks}"
            # AND it ends main -> rc::run -> rc::step -> the runtime entry, every native frame in rc_ops
            want = [*(("native", prog.binary.name, fn) for fn in STEP_CHAIN), ("cuda", "libcudart", op)]
            assert _tail(stacks[0].frames, 4) == want, stacks[0].frames


def test_tracer_stacks_shows_the_native_stack(short: RealRecording) -> None:
    # GIVEN the short recording; WHEN `tracer stacks --op cudaMalloc --json` is run
    prog = short.programs[0]
    r = subprocess.run(
        [str(TRACER), "stacks", "--db", str(short.db), "--op", "cudaMalloc", "--pid", str(prog.pid), "--json"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0, r.stderr
    res = json.loads(r.stdout)
    # THEN it shows the one stack every call went through, labelled with its innermost frame, from main down
    assert res["op_calls_total"] == res["stored_calls"] == prog.ops()["cudaMalloc"]
    (stack,) = res["stacks"]
    assert stack["calls"] == res["stored_calls"]
    assert stack["label"] == "cudaMalloc"
    want = [*(("native", "rc_ops", fn) for fn in STEP_CHAIN), ("cuda", "libcudart", "cudaMalloc")]
    assert _tail(stack["frames"], 4) == want


@pytest.mark.parametrize("name", SHORT_RECORDINGS)
def test_launch_stacks_pass_through_the_library_that_launched(name: str, request: pytest.FixtureRequest) -> None:
    rec: RealRecording = request.getfixturevalue(name)
    for prog in rec.programs:
        # WHEN the captured launch stacks are read (launch stacks are sampled: at least one)
        stacks = [st.frames for st in _stacks(rec.db, "cudaLaunchKernel", prog.pid) if st.stack_id is not None]
        assert stacks, f"{prog.variant}: no launch stack captured"
        for frames in stacks:
            fns = [f["function"] for f in frames]
            # THEN each runs main -> rc::run -> rc::step, then only through rc_ops's launch stub or librc_model.so's
            # rc_model_forward, into cudaLaunchKernel
            assert "main" in fns, fns
            i = fns.index("main")
            assert fns[i : i + 3] == STEP_CHAIN, fns
            between = frames[i + 3 : -1]
            assert _tail(frames, 1) == [("cuda", "libcudart", "cudaLaunchKernel")]
            assert all(f["module"] in (prog.binary.name, "librc_model.so") for f in between), between
            lib = [f for f in between if f["module"] == "librc_model.so"]
            if lib:
                assert lib[0]["function"] == "rc_model_forward", between
