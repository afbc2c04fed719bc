"""`tracer record` on NCCL collectives (issue 19), with real eBPF: the stand-in libnccl.so.2 across rank processes,
and the real libnccl.so.2 of nvidia-nccl-cu13 (no GPU: its calls run their entry code and return an error).

Recordings, each made once per module:
  ranks     ``-- nccl_ranks.py --ranks 3 --slow-rank 2 --group``: three ranks, torchrun's environment, each loading
            the stand-in libnccl after start (the library-open hold attaches it), rank 2 asleep SLOW_MS longer
            every step, so ranks 0 and 1 wait for it in their cudaStreamSynchronize
  by_pid    ``--pid`` on the launcher of 2 ranks that already have libnccl mapped (set up, waiting on a go file)
  renamed   ``--lib X -- nccl_ranks.py --nccl-lib X``: the stand-in under a name no pattern knows, and the same
            without ``--lib`` (nothing of it recorded)
  real      ``-- python real_nccl.py``: the real libnccl.so.2 from .venv's nvidia/nccl/lib, ncclGetVersion and
            collectives with a NULL communicator (ncclInvalidArgument, 4)

Expected numbers come from the workloads themselves (their per-process call counts, their own timing of each
cudaStreamSynchronize), never from the tracer.
"""

from __future__ import annotations

import glob
import json
import shutil
import signal
import statistics
import struct
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
from conftest import (
    BUILD,
    PY,
    ROOT,
    TRACER,
    expected_ops,
    query,
    read_counts,
    recorded_ops,
    start_record,
    wait_for_line,
    workload,
)

from probes.catalog import specs_for
from tests.support.need import need

pytestmark = pytest.mark.bpf

MS = 1_000_000
RANKS, STEPS, SLOW_RANK, SLOW_MS = 3, 40, 2, 15.0
BYTES = 3 << 20  # each ncclAllReduce: 786432 float32
NCCL_OPS = {s.op for _, s in specs_for("nccl")}
INVALID_ARGUMENT = 4  # ncclInvalidArgument: a NULL communicator


@dataclass
class Recording:
    db: Path
    counts: Path
    reports: dict[int, dict]  # rank -> its rank-<R>.json
    stderr: str

    def pid(self, rank: int) -> int:
        return int(self.reports[rank]["pid"])


def _record(tmp: Path, name: str, tracer_args: list[str], cmd: list[str], timeout: float = 120) -> str:
    """Run ``tracer -v record --db <tmp>/<name>.duckdb TRACER_ARGS -- CMD``; return its stderr."""
    db = tmp / f"{name}.duckdb"
    proc = subprocess.run(
        [str(TRACER), "-v", "record", "--db", str(db), *tracer_args, "--", *cmd],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc.stderr


def _ranks_cmd(tmp: Path, name: str, *args: str) -> list[str]:
    return [
        PY,
        workload("nccl_ranks.py"),
        *("--counts-dir", str(tmp / f"{name}-counts"), "--report-dir", str(tmp / f"{name}-report")),
        *args,
    ]


def _reports(d: Path) -> dict[int, dict]:
    return {doc["rank"]: doc for doc in (json.loads(p.read_text()) for p in d.glob("rank-*.json"))}


@pytest.fixture(scope="module")
def tmp(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("nccl")


@pytest.fixture(scope="module")
def ranks(tmp: Path) -> Recording:
    args = ("--ranks", str(RANKS), "--steps", str(STEPS), "--bytes", str(BYTES), "--group")
    slow = ("--slow-rank", str(SLOW_RANK), "--slow-ms", str(SLOW_MS))
    err = _record(tmp, "ranks", [], _ranks_cmd(tmp, "ranks", *args, *slow))
    return Recording(tmp / "ranks.duckdb", tmp / "ranks-counts", _reports(tmp / "ranks-report"), err)


@pytest.fixture(scope="module")
def by_pid(tmp: Path) -> Recording:
    """2 ranks set up (libnccl mapped, communicator made) before the recorder attaches to their launcher."""
    go = tmp / "go"
    launcher = subprocess.Popen(
        _ranks_cmd(tmp, "by-pid", "--ranks", "2", "--steps", "10", "--go-file", str(go)),
        cwd=tmp,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        end = time.monotonic() + 60
        while not all(Path(f"{go}.ready-{r}").exists() for r in range(2)):
            assert time.monotonic() < end and launcher.poll() is None, "the ranks never got set up"
            time.sleep(0.05)
        db = tmp / "by-pid.duckdb"
        rec = start_record(["--db", str(db), "--pid", str(launcher.pid)], verbose=True)
        head: list[str] = []
        try:
            # every library the ranks map is attached (one line each, in no set order) before they go on
            for lib in ("libcuda.so.1", "libcudart.so.12", "libnccl.so.2"):
                if not any(f"to {BUILD / lib}" in line for line in head):
                    head += wait_for_line(rec, f"to {BUILD / lib}")
        finally:
            go.touch()
        _, err = rec.communicate(timeout=90)
        assert rec.returncode == 0, "".join(head) + err
        assert launcher.wait(timeout=30) == 0
    finally:
        if launcher.poll() is None:
            launcher.send_signal(signal.SIGKILL)
    return Recording(db, tmp / "by-pid-counts", _reports(tmp / "by-pid-report"), "".join(head) + err)


@pytest.fixture(scope="module")
def renamed(tmp: Path) -> tuple[Recording, Recording]:
    """The stand-in libnccl as libcollectives_renamed.so: recorded with --lib naming it, and without."""
    d = tmp / "renamed-lib"
    d.mkdir(exist_ok=True)
    lib = d / "libcollectives_renamed.so"
    shutil.copy(BUILD / "libnccl.so.2", lib)
    out = []
    for name, extra in (("with-lib", ["--lib", str(lib)]), ("without-lib", [])):
        cmd = _ranks_cmd(tmp, name, "--ranks", "2", "--steps", "6", "--nccl-lib", str(lib))
        err = _record(tmp, name, extra, cmd)
        out.append(Recording(tmp / f"{name}.duckdb", tmp / f"{name}-counts", _reports(tmp / f"{name}-report"), err))
    return out[0], out[1]


REAL_SCRIPT = r"""
import ctypes, json, sys
from ctypes import c_int, c_size_t, c_void_p
lib = ctypes.CDLL(sys.argv[1])
counts, calls = {}, []
def call(name, argtypes, *args):
    fn = getattr(lib, name)
    fn.argtypes, fn.restype = argtypes, c_int
    counts[name] = counts.get(name, 0) + 1
    rc = fn(*args)
    calls.append((name, rc))
    return rc
v = c_int()
call("ncclGetVersion", [ctypes.POINTER(c_int)], ctypes.byref(v))
AR = [c_void_p, c_void_p, c_size_t, c_int, c_int, c_void_p, c_void_p]
for i in range(5):  # 1000 x bfloat16 (9) on stream 0x5000 + i, a NULL communicator
    call("ncclAllReduce", AR, None, None, 1000, 9, 0, None, 0x5000 + i)
# ncclReduce: 8 arguments, its stream the second on the stack; 10 x float64 (8)
call("ncclReduce", [c_void_p, c_void_p, c_size_t, c_int, c_int, c_int, c_void_p, c_void_p], None, None, 10, 8, 0, 0,
     None, 0x7000)
call("ncclGroupStart", [])
call("ncclSend", [c_void_p, c_size_t, c_int, c_int, c_void_p, c_void_p], None, 10, 7, 0, None, 0x6000)
call("ncclGroupEnd", [])
json.dump({"version": v.value, "counts": counts, "calls": calls}, open(sys.argv[2], "w"))
"""


def _real_nccl() -> Path | None:
    hits = sorted(glob.glob(str(ROOT / ".venv" / "lib" / "python3*" / "site-packages" / "nvidia" / "nccl" / "lib")))
    lib = Path(hits[0]) / "libnccl.so.2" if hits else None
    return lib if lib and lib.exists() else None


@pytest.fixture(scope="module")
def real(tmp: Path) -> tuple[Path, dict, str]:
    lib = _real_nccl()
    need(lib is not None, "the real libnccl.so.2 is not in .venv: run ./setup.sh (pip install nvidia-nccl-cu13)")
    assert lib is not None
    script, out = tmp / "real_nccl.py", tmp / "real_nccl.json"
    script.write_text(REAL_SCRIPT)
    err = _record(tmp, "real", [], [PY, str(script), str(lib), str(out)])
    return tmp / "real.duckdb", json.loads(out.read_text()), err


# --- the stand-in, three ranks ---------------------------------------------------------------------------------


def test_each_ranks_op_counts_equal_its_own(ranks: Recording) -> None:
    # GIVEN three ranks that loaded libnccl after they started, and counted every call they made
    assert sorted(ranks.reports) == list(range(RANKS))
    for rank in range(RANKS):
        pid = ranks.pid(rank)
        # WHEN the recording's op_stats of that pid are read
        got = recorded_ops(ranks.db, {pid})
        # THEN they equal the rank's own counts, NCCL ops included
        want = expected_ops(ranks.counts, {pid})
        assert got == want, rank
        assert {op for op in want if op in NCCL_OPS} == {
            "ncclAllReduce",
            "ncclCommInitRank",
            "ncclGroupStart",
            "ncclGroupEnd",
        }
        assert got["ncclAllReduce"] == got["ncclGroupEnd"] == STEPS
    # AND the launcher, which made no CUDA call, has none
    launcher = {f["pid"] for f in read_counts(ranks.counts) if not f["counts"]}
    assert len(launcher) == 1 and not recorded_ops(ranks.db, launcher)


def test_allreduce_bytes_are_count_times_the_datatype_size(ranks: Recording) -> None:
    # GIVEN each ncclAllReduce: BYTES / 4 float32 elements
    for rank in range(RANKS):
        pid = ranks.pid(rank)
        assert ranks.reports[rank]["bytes"] == BYTES
        calls = "SELECT bytes, stream, ret FROM cuda_calls WHERE pid = ? AND op = ?"
        rows = query(ranks.db, calls, [pid, "ncclAllReduce"])
        # THEN every stored call says BYTES, on the rank's stream (the one it synchronizes), with success
        (sync_stream,) = {s for _, s, _ in query(ranks.db, calls, [pid, "cudaStreamSynchronize"])}
        assert len(rows) == STEPS
        assert {(b, s, r) for b, s, r in rows} == {(BYTES, sync_stream, 0)}
        assert sync_stream != 0
        # AND op_stats adds them up exactly
        ((total,),) = query(ranks.db, "SELECT bytes FROM op_stats WHERE pid = ? AND op = 'ncclAllReduce'", [pid])
        assert total == STEPS * BYTES


def test_fast_ranks_wait_for_the_slow_rank_in_their_sync(ranks: Recording) -> None:
    # GIVEN each rank's recorded cudaStreamSynchronize durations, and its own timing of the same calls
    rec: dict[int, list[float]] = {}
    for rank in range(RANKS):
        durs = query(
            ranks.db,
            "SELECT dur_ns FROM cuda_calls WHERE pid = ? AND op = 'cudaStreamSynchronize' ORDER BY ts_ns",
            [ranks.pid(rank)],
        )
        rec[rank] = [d / MS for (d,) in durs]
        own = ranks.reports[rank]["sync_ms"]
        assert len(rec[rank]) == len(own) == STEPS
        # THEN each recorded wait is within the rank's own timing of it (the probe is inside), and typically
        # less only by the Python call around it (one can be ms more: the GIL retaken on a busy host)
        gaps = [o - r for r, o in zip(rec[rank], own, strict=True)]
        assert min(gaps) > -0.05, (rank, gaps)
        assert statistics.median(gaps) < 0.5, (rank, gaps)
    med = {rank: statistics.median(v) for rank, v in rec.items()}
    own_med = {rank: statistics.median(ranks.reports[rank]["sync_ms"]) for rank in range(RANKS)}
    # AND the fast ranks' waits are longer than the slow rank's by about the slow rank's extra time per step
    for fast in (r for r in range(RANKS) if r != SLOW_RANK):
        extra = med[fast] - med[SLOW_RANK]
        assert 0.7 * SLOW_MS < extra < SLOW_MS + 10, (fast, med)
        assert abs(extra - (own_med[fast] - own_med[SLOW_RANK])) < 1.0, (med, own_med)
    # AND the slow rank hardly waits: its collective completes a transfer after its own arrival
    assert med[SLOW_RANK] < 0.5 * SLOW_MS


def test_collective_time_is_launch_time_in_the_breakdown(ranks: Recording) -> None:
    # GIVEN a fast rank's thread breakdown and its exact per-op totals
    pid = ranks.pid(0)
    ((launch_ns, sync_ns),) = query(
        ranks.db, "SELECT sum(launch_ns), sum(sync_ns) FROM thread_breakdown WHERE pid = ?", [pid]
    )
    totals = dict(query(ranks.db, "SELECT op, total_ns FROM op_stats WHERE pid = ?", [pid]))
    launches = sum(totals.get(op, 0) for op in ("cudaLaunchKernel", "ncclAllReduce", "ncclGroupStart", "ncclGroupEnd"))
    # THEN the launch part holds the kernel launches and the collectives (within the breakdown's 1%), and the wait
    # for the slow rank is in the sync part
    assert abs(launch_ns - launches) <= 0.01 * launches + 100_000, (launch_ns, launches)
    assert sync_ns >= 0.9 * totals["cudaStreamSynchronize"]


def test_ranks_are_named_from_their_environment(ranks: Recording) -> None:
    # GIVEN torchrun's variables in each rank's environment  THEN the recording names every rank
    rows = dict(
        ((pid, (rank, world)) for pid, rank, world in query(ranks.db, "SELECT pid, rank, world_size FROM processes"))
    )
    for rank in range(RANKS):
        assert rows[ranks.pid(rank)] == (rank, RANKS)


def fnv1a64_words(data: bytes) -> int:
    """FNV-1a, 64-bit, over ``data`` as little-endian 8-byte words (what probes/nccl_comm.bpf.c computes)."""
    h = 0xCBF29CE484222325
    for (w,) in struct.iter_unpack("<Q", data):
        h = ((h ^ w) * 0x100000001B3) & 0xFFFFFFFFFFFFFFFF
    return h


def test_each_rank_names_its_communicator(ranks: Recording) -> None:
    # GIVEN ranks that each joined one communicator with ncclCommInitRank
    rows = query(ranks.db, "SELECT pid, rank, nranks, comm, id_hash, ret, dur_ns FROM nccl_comms ORDER BY rank")
    # THEN each rank's row says what it passed and got: its rank, the size, the handle the call made (as the
    # rank reported it), the hash of the 128-byte id (read from the stack, where the by-value struct lies), success
    want = [
        (ranks.pid(r), r, RANKS, ranks.reports[r]["comm"], fnv1a64_words(bytes.fromhex(ranks.reports[r]["unique_id"])))
        for r in range(RANKS)
    ]
    assert [row[:5] for row in rows] == want
    assert all(ret == 0 and dur > 0 for *_, ret, dur in rows)
    # AND one id across the ranks: the communicator they share
    assert len({row[4] for row in rows}) == 1
    # AND each rank's collectives counted on that handle (nccl_progress, issue 29): every step's ncclAllReduce
    progress = query(ranks.db, "SELECT pid, op, comm, calls FROM nccl_progress ORDER BY pid")
    assert progress == [(ranks.pid(r), "ncclAllReduce", ranks.reports[r]["comm"], STEPS) for r in range(RANKS)]


# --- attach paths ---------------------------------------------------------------------------------------------


def test_nccl_already_mapped_at_attach_is_probed(by_pid: Recording) -> None:
    # GIVEN 2 ranks that had loaded libnccl and made their communicator before the recorder attached by pid
    assert f"to {BUILD / 'libnccl.so.2'}" in by_pid.stderr
    for rank in range(2):
        pid = by_pid.pid(rank)
        got = recorded_ops(by_pid.db, {pid})
        want = expected_ops(by_pid.counts, {pid})
        # THEN every call after the attach is counted; the ncclCommInitRank before it is not
        assert want.pop("ncclCommInitRank") == 1
        assert got == want
        assert got["ncclAllReduce"] == got["cudaStreamSynchronize"] == 10


def test_lib_option_attaches_a_renamed_nccl(renamed: tuple[Recording, Recording]) -> None:
    with_lib, without = renamed
    for rank in range(2):
        # GIVEN the stand-in libnccl under a name neither the patterns nor the load hold know
        # WHEN it is given with --lib  THEN its calls are counted exactly
        pid = with_lib.pid(rank)
        got, want = recorded_ops(with_lib.db, {pid}), expected_ops(with_lib.counts, {pid})
        assert got == want and got["ncclAllReduce"] == 6
        # AND without --lib nothing of it is (so --lib is what attached it), the CUDA calls still are
        pid = without.pid(rank)
        got, want = recorded_ops(without.db, {pid}), expected_ops(without.counts, {pid})
        assert not NCCL_OPS & set(got)
        assert got == {op: n for op, n in want.items() if op not in NCCL_OPS}


# --- the real library ----------------------------------------------------------------------------------------


def test_the_real_libnccl_is_attached_and_its_calls_counted(real: tuple[Path, dict, str]) -> None:
    db, own, err = real
    # GIVEN a process that loaded the real libnccl.so.2 and called it without a GPU or a communicator
    assert own["version"] >= 22000 and own["calls"][0] == ["ncclGetVersion", 0]
    codes = [rc for op, rc in own["calls"] if op in NCCL_OPS]  # what each probed call returned, in order
    assert codes[:5] == [INVALID_ARGUMENT] * 5
    # THEN the recorder attached every NCCL op to it (none skipped: the ncclX / pncclX exports are found)
    assert "libnccl.so.2" in err and "libnccl.so.2: not exported" not in err
    # AND counted each call as the process did
    got = recorded_ops(db)
    want = {op: n for op, n in own["counts"].items() if op in NCCL_OPS}
    assert want == {"ncclAllReduce": 5, "ncclReduce": 1, "ncclGroupStart": 1, "ncclSend": 1, "ncclGroupEnd": 1}
    assert got == want
    # AND read its arguments where nccl.h puts them: bytes = count x size, the stream (on the stack for
    # ncclAllReduce's 7th and ncclReduce's 8th argument), and the code each call returned (ncclGroupEnd reports
    # the failed ncclSend of its group)
    rows = query(db, "SELECT op, bytes, stream, ret FROM cuda_calls ORDER BY ts_ns")
    assert [(op, b, s) for op, b, s, _ in rows] == [
        *[("ncclAllReduce", 2000, 0x5000 + i) for i in range(5)],
        ("ncclReduce", 80, 0x7000),
        ("ncclGroupStart", None, None),
        ("ncclSend", 40, 0x6000),
        ("ncclGroupEnd", None, None),
    ]
    assert [r for *_, r in rows] == codes
    # AND each collective counted per communicator (nccl_progress, issue 29), the handle read where nccl.h puts it
    # (ncclReduce's 7th argument on the stack): NULL here, as the script passed
    assert query(db, "SELECT op, comm, calls FROM nccl_progress ORDER BY op") == [
        ("ncclAllReduce", 0, 5),
        ("ncclReduce", 0, 1),
        ("ncclSend", 0, 1),
    ]


def test_the_communicator_leaves_nothing_in_dev_shm(ranks: Recording) -> None:
    # GIVEN the finished recording  THEN the communicator's shared object (named with rank 0's pid) is gone
    assert not glob.glob(f"/dev/shm/fake_nccl_{ranks.pid(0)}_*")


@pytest.fixture(scope="module")
def straggler(tmp: Path) -> Recording:
    """3 ranks for 100 steps, rank 2 asleep 20 ms longer each step: long enough (~2.5 s) for whole seconds."""
    args = ("--ranks", "3", "--steps", "100", "--slow-rank", str(SLOW_RANK), "--slow-ms", "20")
    err = _record(tmp, "straggler", [], _ranks_cmd(tmp, "straggler", *args))
    return Recording(tmp / "straggler.duckdb", tmp / "straggler-counts", _reports(tmp / "straggler-report"), err)


def test_the_straggler_chain_names_the_slow_rank_and_the_others_wait_in_the_collective(straggler: Recording) -> None:
    from tracer.analysis.chains import compute_chains
    from tracer.analysis.db import open_trace
    from tracer.analysis.ranks.phases import COLLECTIVE
    from tracer.analysis.ranks.report import ranks_report

    # GIVEN 3 ranks meeting in ncclAllReduce, rank 2 asleep 20 ms longer each step; WHEN analysed
    with open_trace(straggler.db) as c:
        chains = compute_chains(c, limit=100).chains
        table = ranks_report(c)
    # THEN the fast ranks' waits in their syncs after an allreduce are collective waits, not GPU work: as long as
    # the workload's own timing of those syncs (mean per step), less the CPU waits inside them (runq) on a busy host
    by_rank = {r.rank: r.phases_ms_per_step for r in table.ranks}
    own = {r: statistics.mean(straggler.reports[r]["sync_ms"]) for r in range(3)}
    for fast in (r for r in range(3) if r != SLOW_RANK):
        # (a phase under 0.1 ms in all is left out of the table: none is 0)
        coll, runq = by_rank[fast][COLLECTIVE], by_rank[fast].get("runq", 0.0)
        assert coll <= 1.05 * own[fast] and coll + runq >= 0.85 * own[fast], (by_rank[fast], own)
        assert by_rank[fast].get("sync", 0.0) < 0.1 * own[fast]
    # AND the straggler chain names rank 2, and the others' wait for it in collectives
    (ch,) = [c for c in chains if c.category == "straggler_rank"]
    assert ch.severity == "HIGH" and ch.culprit.pid == straggler.pid(SLOW_RANK) and ch.evidence.phase == "asleep"
    assert f"Rank {SLOW_RANK} (pid {straggler.pid(SLOW_RANK)}" in ch.summary and "in collectives" in ch.summary
    # per step, what the fast ranks wait beyond the slow rank's own sync (the workload's own timings)
    extra = statistics.mean(own[r] for r in range(3) if r != SLOW_RANK) - own[SLOW_RANK]
    assert 0.7 * extra <= ch.evidence.lost_ms_per_step <= 1.1 * extra, (ch.evidence.lost_ms_per_step, extra)
