"""NCCL collectives (issue 19) without BPF: the catalog's NCCL entries against nccl.h's signatures (as the
stand-in declares them), the datatype sizes the BPF side multiplies by, the breakdown part a collective goes to,
which files are NCCL libraries, and the stand-in libnccl.so.2's cross-rank semantics."""

from __future__ import annotations

import glob
import json
import re
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from probes.catalog import (
    CALL_PARTS,
    CATALOG,
    NCCL_TYPE_SIZES,
    NO_ARG,
    SLOW_NS,
    Layer,
    OpClass,
    spec_of,
    specs_for,
)
from tests.support.need import need
from tracer.analysis.taxonomy import CALL_PART_NAMES, part_case_sql, part_name
from tracer.recorder import targets

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "fixtures"
BUILD = FIXTURES / "build"
STUB = FIXTURES / "cuda_stub" / "fake_nccl.c"
NCCL_OPS = (
    "ncclAllReduce",
    "ncclAllGather",
    "ncclReduceScatter",
    "ncclBroadcast",
    "ncclReduce",
    "ncclSend",
    "ncclRecv",
    "ncclGroupStart",
    "ncclGroupEnd",
    "ncclCommInitRank",
)
COLLECTIVES = NCCL_OPS[:9]


def _real_nccl() -> Path | None:
    hits = sorted(glob.glob(str(ROOT / ".venv" / "lib" / "python3*" / "site-packages" / "nvidia" / "nccl" / "lib")))
    return Path(hits[0]) / "libnccl.so.2" if hits and (Path(hits[0]) / "libnccl.so.2").exists() else None


@pytest.fixture(scope="module")
def built() -> Path:
    subprocess.run(["make", "-s", "--no-print-directory", "-C", str(FIXTURES)], check=True)
    return BUILD


def _stub_signatures() -> dict[str, list[str]]:
    """The stand-in's exported NCCL functions: name -> parameter declarations, in order (nccl.h's)."""
    text = STUB.read_text()
    out = {}
    for m in re.finditer(r"EXPORT\s+ncclResult_t\s+(nccl\w+)\(([^)]*)\)", text):
        params = [" ".join(p.split()) for p in m.group(2).split(",")]
        out[m.group(1)] = [] if params == ["void"] else params
    return out


# --- the catalog ---------------------------------------------------------------------------------------------


def test_collective_is_appended_and_the_other_classes_keep_their_values() -> None:
    # GIVEN the op classes, whose values are stored and cross the ring buffer
    # THEN the old ones are unchanged and COLLECTIVE comes after them; every class has a slow threshold
    assert [(c.name, int(c)) for c in OpClass] == [
        ("LAUNCH", 0),
        ("SYNC", 1),
        ("ALLOC", 2),
        ("FREE", 3),
        ("COPY", 4),
        ("OTHER", 5),
        ("COLLECTIVE", 6),
    ]
    assert set(SLOW_NS) == set(OpClass)


def test_every_nccl_op_is_catalogued_in_libnccl_with_its_profiling_alias() -> None:
    # GIVEN the catalog's NCCL entries
    nccl = {s.op: s for _, s in specs_for("nccl")}
    # THEN they are the ops, on the runtime layer, each also under the pncclX name the real library defines
    assert set(nccl) == set(NCCL_OPS)
    for s in nccl.values():
        assert s.layer == Layer.RUNTIME and s.symbols == (s.op, "p" + s.op)
        assert not s.duty_cycled and not s.waits_for_gpu and s.runtime_twin is None
    assert {op for op, s in nccl.items() if s.op_class == OpClass.COLLECTIVE} == set(COLLECTIVES)
    assert nccl["ncclCommInitRank"].op_class == OpClass.OTHER


def test_argument_positions_follow_the_nccl_h_signatures() -> None:
    # GIVEN nccl.h's signatures, as the stand-in declares them
    sigs = _stub_signatures()
    for op in NCCL_OPS:
        spec = spec_of(op)
        assert spec is not None
        params = sigs[op]

        def at(name: str, params: list[str] = params) -> int:
            hits = [i for i, p in enumerate(params) if p.split()[-1].lstrip("*") == name]
            return hits[0] if hits else NO_ARG

        # THEN the stream, the element count and the datatype are where the catalog reads them
        assert spec.stream_arg == at("stream"), op
        count = next((at(n) for n in ("count", "sendcount", "recvcount") if at(n) != NO_ARG), NO_ARG)
        assert spec.bytes_arg == count, op
        assert spec.dtype_arg == at("datatype"), op
    # AND ncclCommInitRank's rank is the third integer argument: the 128-byte id before it goes on the stack
    assert sigs["ncclCommInitRank"] == ["ncclComm_t *comm", "int nranks", "ncclUniqueId commId", "int rank"]
    init = spec_of("ncclCommInitRank")
    assert init is not None and (init.nranks_arg, init.rank_arg) == (1, 2)


def test_the_bpf_side_and_the_stand_in_know_the_same_datatype_sizes() -> None:
    # GIVEN the sizes the catalog documents, the switch cuda.bpf.c multiplies by, and the stand-in's table
    src = (ROOT / "probes" / "cuda.bpf.c").read_text()
    body = src[src.index("nccl_type_size(u64 t)") :]
    body = body[: body.index("default:")]
    bpf: dict[int, int] = {}
    for cases, size in re.findall(r"((?:case \d+: )+)return (\d+);", body):
        for c in re.findall(r"case (\d+):", cases):
            bpf[int(c)] = int(size)
    stub = re.search(r"sizes\[ncclNumTypes\] = \{([^}]*)\}", STUB.read_text())
    assert stub is not None
    stub_sizes = dict(enumerate(int(x) for x in stub.group(1).split(",")))
    # THEN all three agree: float32 4, bfloat16 2, float64 8, ...
    assert bpf == NCCL_TYPE_SIZES == stub_sizes
    assert (NCCL_TYPE_SIZES[7], NCCL_TYPE_SIZES[9], NCCL_TYPE_SIZES[8]) == (4, 2, 8)


def test_a_collective_goes_to_the_launch_part_and_the_parts_stay_six() -> None:
    # GIVEN the breakdown's parts
    # THEN a collective's time is launch time, its set-up call is other, and no seventh part appeared
    assert CALL_PART_NAMES == ("launch", "sync", "alloc", "free", "copy", "other")
    assert OpClass.COLLECTIVE not in CALL_PARTS
    for op in COLLECTIVES:
        assert part_name(op) == "launch"
    assert part_name("ncclCommInitRank") == "other"
    assert all(s.part in CALL_PARTS for s in CATALOG)
    # AND the SQL form says the same
    sql = part_case_sql()
    launch = sql[sql.index("WHEN") : sql.index("THEN 'launch'")]
    assert all(repr(op) in launch for op in COLLECTIVES)


# --- which files are NCCL --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "path, kind",
    [
        ("site-packages/nvidia/nccl/lib/libnccl.so.2", "nccl"),
        ("/usr/lib/x86_64-linux-gnu/libnccl.so.2.21.5", "nccl"),
        ("libnccl.so", "nccl"),
        ("libnccl-net.so", None),  # a network plugin NCCL dlopens
        ("libnccl_static.a", None),
        ("libnccl.so.2.bak", None),
    ],
)
def test_nccl_file_names(path: str, kind: str | None) -> None:
    assert targets.library_kind(path) == kind


def test_lib_option_tells_a_renamed_nccl_by_its_exports(built: Path, tmp_path: Path) -> None:
    # GIVEN the stand-in libnccl under a name no pattern matches
    copy = tmp_path / "libcollectives_renamed.so"
    shutil.copy(built / "libnccl.so.2", copy)
    # WHEN it is checked as a --lib argument  THEN it is an NCCL library
    assert targets.check_library_arg(str(copy)).kind == "nccl"


def test_the_real_libnccl_exports_every_catalogued_op(tmp_path: Path) -> None:
    # GIVEN the real libnccl.so.2 of nvidia-nccl-cu13 (setup.sh installs it into .venv)
    lib = _real_nccl()
    need(lib is not None, "nvidia-nccl-cu13 is not installed in .venv: run ./setup.sh")
    assert lib is not None
    # WHEN its dynamic symbols are read as the recorder reads them
    offsets = targets.exported_offsets(str(lib))
    # THEN every NCCL op is there, its ncclX name at the address of its pncclX one (one probe each)
    for _, s in specs_for("nccl"):
        assert s.op in offsets, s.op
        assert offsets[s.op] == offsets["p" + s.op], s.op
    assert targets.library_kind(str(lib)) == "nccl"
    # AND a recorder whose site-packages hold it finds it among the usual places
    sp = str(lib.parents[3])
    code = (
        f"import sys; sys.path.insert(0, {sp!r}); from tracer.recorder import targets; "
        "print(targets.usual_library_paths())"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT).stdout
    assert str(lib) in out


# --- the stand-in ----------------------------------------------------------------------------------------------


def test_the_stand_in_makes_fast_ranks_wait_for_the_slow_one(built: Path, tmp_path: Path) -> None:
    # GIVEN 2 ranks, rank 1 asleep 15 ms longer every step
    slow_ms = 15.0
    proc = subprocess.run(
        [
            sys.executable,
            str(FIXTURES / "workloads" / "nccl_ranks.py"),
            *("--ranks", "2", "--steps", "25", "--slow-rank", "1", "--slow-ms", str(slow_ms)),
            *("--counts-dir", str(tmp_path / "counts"), "--report-dir", str(tmp_path / "report")),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    reports = {d["rank"]: d for d in (json.loads(p.read_text()) for p in (tmp_path / "report").glob("*.json"))}
    # THEN the fast rank's cudaStreamSynchronize waits about the slow rank's extra time, the slow one's does not
    fast, slow = (statistics.median(reports[r]["sync_ms"]) for r in (0, 1))
    assert 0.7 * slow_ms < fast - slow < slow_ms + 10, (fast, slow)
    assert slow < 0.5 * slow_ms
    # AND both ranks ran in lockstep, and counted their own calls
    assert abs(reports[0]["steps_per_s"] - reports[1]["steps_per_s"]) < 0.2 * reports[1]["steps_per_s"]
    counts = [json.loads(p.read_text())["counts"] for p in (tmp_path / "counts").glob("*.json")]
    ranks = [c for c in counts if c]
    assert len(ranks) == 2
    assert all(c["ncclAllReduce"] == c["cudaStreamSynchronize"] == 25 and c["ncclCommInitRank"] == 1 for c in ranks)
    assert sorted(c.get("ncclGetUniqueId", 0) for c in ranks) == [0, 1]
    # AND the communicator's shared object is gone from /dev/shm (rank 0, whose pid names it, unlinked it)
    assert not glob.glob(f"/dev/shm/fake_nccl_{reports[0]['pid']}_*")
