"""The stand-in CUDA libraries and workloads behave as the tracer's tests assume (no BPF, no GPU)."""

from __future__ import annotations

import ctypes
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
FIXTURES = REPO / "fixtures"
BUILD = FIXTURES / "build"
WORKLOADS = FIXTURES / "workloads"

RUNTIME_SYMBOLS = {
    "cudaMalloc",
    "cudaFree",
    "cudaMallocManaged",
    "cudaMallocAsync",
    "cudaFreeAsync",
    "cudaHostAlloc",
    "cudaFreeHost",
    "cudaLaunchKernel",
    "cudaMemcpy",
    "cudaMemcpyAsync",
    "cudaMemset",
    "cudaStreamSynchronize",
    "cudaDeviceSynchronize",
    "cudaEventSynchronize",
    "cudaStreamWaitEvent",
    "cudaGraphLaunch",
    "cudaStreamCreate",
    "cudaEventCreate",
    "cudaEventRecord",
    "cudaGetDeviceCount",
    "cudaSetDevice",
}
DRIVER_SYMBOLS = {
    "cuInit",
    "cuMemAlloc_v2",
    "cuMemFree_v2",
    "cuLaunchKernel",
    "cuLaunchKernelEx",
    "cuMemcpyHtoD_v2",
    "cuMemcpyDtoH_v2",
    "cuMemcpyAsync",
    "cuMemcpyHtoDAsync_v2",
    "cuStreamSynchronize",
    "cuCtxSynchronize",
    "cuEventSynchronize",
    "cuGraphLaunch",
    "cuModuleGetFunction",
    "cuStreamCreate",
    "cuEventCreate",
    "cuEventRecord",
}


@pytest.fixture(scope="session")
def built() -> Path:
    subprocess.run(["make", "-s", "--no-print-directory", "-C", str(FIXTURES)], check=True)
    return BUILD


@pytest.fixture(scope="session")
def fakecuda(built):
    sys.path.insert(0, str(WORKLOADS))
    import fakecuda as mod

    return mod


def _dynsyms(path: Path) -> set[str]:
    out = subprocess.run(["nm", "-D", "--defined-only", str(path)], check=True, capture_output=True, text=True)
    return {line.split()[-1] for line in out.stdout.splitlines() if line.strip()}


def _dynamic(path: Path) -> str:
    return subprocess.run(["readelf", "-d", str(path)], check=True, capture_output=True, text=True).stdout


def run_workload(name: str, *args: str, counts_dir: Path, timeout: float = 20) -> dict[int, dict]:
    """Run a workload to completion and return its counts files by pid."""
    proc = subprocess.run(
        [sys.executable, str(WORKLOADS / f"{name}.py"), "--counts-dir", str(counts_dir), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.strip(), "every workload prints a summary on stderr"
    return {int(p.stem): json.loads(p.read_text()) for p in counts_dir.glob("*.json")}


def _main_and_children(docs: dict[int, dict]) -> tuple[dict, list[dict]]:
    pids = set(docs)
    (main,) = [d for d in docs.values() if d["ppid"] not in pids]
    return main, [d for d in docs.values() if d is not main]


# ------------------------------------------------------------------------------------------------ libraries


def test_build_is_idempotent_and_quiet(built):
    out = subprocess.run(
        ["make", "-s", "--no-print-directory", "-C", str(FIXTURES)],
        capture_output=True,
        text=True,
        check=True,
    )
    assert out.stdout == "" and out.stderr == ""


def test_exported_symbols(built):
    assert RUNTIME_SYMBOLS <= _dynsyms(built / "libcudart.so.12")
    assert DRIVER_SYMBOLS <= _dynsyms(built / "libcuda.so.1")
    assert {"vector_add_kernel", "sgemm_kernel", "softmax_kernel"} <= _dynsyms(built / "libkernels.so")


def test_sonames_needed_and_rpath(built):
    rt = _dynamic(built / "libcudart.so.12")
    assert "Library soname: [libcudart.so.12]" in rt
    assert "Shared library: [libcuda.so.1]" in rt
    assert "(RPATH)" in rt and "[$ORIGIN]" in rt
    assert "Library soname: [libcuda.so.1]" in _dynamic(built / "libcuda.so.1")


def test_runtime_calls_driver_through_dynamic_symbols(built):
    relocs = subprocess.run(
        ["readelf", "-r", str(built / "libcudart.so.12")], capture_output=True, text=True, check=True
    ).stdout
    for sym in (
        "cuMemAlloc_v2",
        "cuLaunchKernel",
        "cuStreamSynchronize",
        "cuCtxSynchronize",
        "cuMemcpyDtoH_v2",
    ):
        assert re.search(rf"JUMP_SLO.*\b{sym}\b", relocs), sym


def test_kernel_stubs_have_distinct_addresses(fakecuda):
    cuda = fakecuda.FakeCuda()
    addrs = {cuda.kernel(k) for k in fakecuda.KERNEL_NAMES}
    assert len(addrs) == 3


def test_sync_sleeps_off_cpu_until_queued_work_is_done(fakecuda):
    cuda = fakecuda.FakeCuda()
    stream = cuda.cudaStreamCreate()
    stub = cuda.kernel("sgemm_kernel")
    cuda.cudaLaunchKernel(stub, fakecuda.grid_for_us(2500), 256, stream)
    cpu0, wall0 = time.thread_time(), time.monotonic()
    cuda.cudaStreamSynchronize(stream)
    cpu, wall = time.thread_time() - cpu0, time.monotonic() - wall0
    assert wall >= 0.002
    assert cpu < wall / 4, (cpu, wall)


def test_device_sync_and_event_sync_wait(fakecuda):
    cuda = fakecuda.FakeCuda()
    s = cuda.cudaStreamCreate()
    stub = cuda.kernel("softmax_kernel")
    cuda.cudaLaunchKernel(stub, fakecuda.grid_for_us(2000), 256, s)
    ev = cuda.cudaEventCreate()
    cuda.cudaEventRecord(ev, s)
    t0 = time.monotonic()
    cuda.cudaEventSynchronize(ev)
    assert time.monotonic() - t0 >= 0.0015
    cuda.cudaLaunchKernel(stub, fakecuda.grid_for_us(2000), 256, s)
    t0 = time.monotonic()
    cuda.cudaDeviceSynchronize()
    assert time.monotonic() - t0 >= 0.0015


def test_allocation_fails_with_error_2_when_heap_is_full(built, tmp_path):
    code = (
        "import sys; sys.path.insert(0, sys.argv[1]); import fakecuda as f\n"
        "c = f.FakeCuda(); p = c.cudaMalloc(600 << 20)\n"
        "rc, q = c.cudaMalloc(600 << 20, check=False); assert (rc, q) == (2, 0), rc\n"
        "c.cudaFree(p); q = c.cudaMalloc(600 << 20); c.cudaFree(q)\n"
        "assert c.cudaFree(q, check=False) == 1\n"
    )
    env = dict(os.environ, FAKE_CUDA_DEVICE_BYTES=str(1 << 30))
    subprocess.run([sys.executable, "-c", code, str(WORKLOADS)], env=env, check=True, timeout=20)


def test_cufunction_handles_are_stable_and_named(fakecuda):
    cuda = fakecuda.FakeCuda()
    f1 = cuda.cuModuleGetFunction(None, "triton_k")
    assert f1 == cuda.cuModuleGetFunction(None, "triton_k")
    assert ctypes.string_at(f1) == b"triton_k"
    cuda.cuLaunchKernelEx(f1, 4, 64)
    cuda.cuCtxSynchronize()


# ------------------------------------------------------------------------------------------------ workloads


@pytest.mark.parametrize("persistent", [False, True])
def test_train_counts(built, tmp_path, persistent):
    flags = ["--persistent-workers"] if persistent else []
    docs = run_workload(
        "train",
        "--steps",
        "5",
        "--epochs",
        "2",
        "--workers",
        "2",
        "--driver-launches",
        "3",
        "--worker-cuda",
        "--worker-cpu-ms",
        "0.5",
        *flags,
        counts_dir=tmp_path,
    )
    main, workers = _main_and_children(docs)
    assert main["counts"] == {
        "cudaSetDevice": 1,
        "cudaStreamCreate": 1,
        "cudaMalloc": 1,
        "cudaFree": 1,
        "cudaMemcpyAsync": 10,
        "cudaLaunchKernel": 200,
        "cudaStreamSynchronize": 10,
        "cuModuleLoadData": 1,
        "cuModuleGetFunction": 1,
        "cuLaunchKernel": 30,
    }
    assert len(workers) == (2 if persistent else 4)
    assert {w["comm"] for w in workers} == {"pt_data_worker"}
    assert all(w["ppid"] == main["pid"] for w in workers)
    assert sum(w["counts"]["cudaMemcpy"] for w in workers) == 10
    assert all(w["counts"]["cudaHostAlloc"] == 1 == w["counts"]["cudaFreeHost"] for w in workers)


def test_train_workers_are_visible_by_comm(built, tmp_path):
    proc = subprocess.Popen(
        [
            sys.executable,
            str(WORKLOADS / "train.py"),
            "--duration",
            "1.5",
            "--persistent-workers",
            "--worker-cpu-ms",
            "1",
        ],
        stderr=subprocess.PIPE,
    )
    try:
        deadline = time.monotonic() + 1.2
        comms: list[str] = []
        while time.monotonic() < deadline and comms.count("pt_data_worker") < 2:
            time.sleep(0.05)
            comms = []
            for child in Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split():
                try:
                    comms.append(Path(f"/proc/{child}/comm").read_text().strip())
                except FileNotFoundError:
                    pass
        assert comms.count("pt_data_worker") == 2, comms
    finally:
        assert proc.wait(timeout=10) == 0


def test_alloc_stress_counts_and_site(built, tmp_path):
    docs = run_workload("alloc_stress", "--iterations", "10", "--size-mb", "8", counts_dir=tmp_path)
    (doc,) = docs.values()
    assert doc["counts"] == {"cudaSetDevice": 1, "cudaMalloc": 40, "cudaFree": 40, "cudaLaunchKernel": 10}
    src = (WORKLOADS / "alloc_stress.py").read_text()
    assert re.search(r"def allocate_batch\(.*\n\s+ptr = cuda\.cudaMalloc\(nbytes\)  # ALLOC_SITE", src)


def test_sync_heavy_counts_and_waits(built, tmp_path):
    t0 = time.monotonic()
    docs = run_workload("sync_heavy", "--steps", "4", "--kernel-us", "2000", counts_dir=tmp_path)
    assert time.monotonic() - t0 >= 4 * 3 * 0.002
    (doc,) = docs.values()
    assert doc["counts"] == {
        "cudaSetDevice": 1,
        "cudaStreamCreate": 1,
        "cudaMalloc": 1,
        "cudaFree": 1,
        "cudaLaunchKernel": 60,
        "cudaStreamSynchronize": 4,
        "cudaDeviceSynchronize": 4,
        "cudaMemcpy": 4,
    }


@pytest.mark.parametrize("graph", [False, True])
def test_healthy_counts(built, tmp_path, graph):
    flags = ["--use-graph"] if graph else []
    docs = run_workload("healthy", "--steps", "25", "--sync-every", "10", *flags, counts_dir=tmp_path)
    main, workers = _main_and_children(docs)
    launches = (
        {"cudaGraphCreate": 1, "cudaGraphInstantiate": 1, "cudaGraphLaunch": 25} if graph else {"cudaLaunchKernel": 250}
    )
    assert main["counts"] == {
        "cudaSetDevice": 1,
        "cudaStreamCreate": 1,
        "cudaMalloc": 1,
        "cudaHostAlloc": 1,
        "cudaFree": 1,
        "cudaFreeHost": 1,
        "cudaMemcpyAsync": 25,
        "cudaStreamSynchronize": 3,
        **launches,
    }
    assert len(workers) == 2 and all(w["counts"] == {} for w in workers)


def test_memory_pressure_counts(built, tmp_path):
    docs = run_workload(
        "memory_pressure", "--gb", "0.05", "--rounds", "2", "--steps-per-round", "3", counts_dir=tmp_path
    )
    (doc,) = docs.values()
    assert doc["counts"] == {
        "cudaSetDevice": 1,
        "cudaStreamCreate": 1,
        "cudaLaunchKernel": 60,
        "cudaStreamSynchronize": 6,
    }


def test_cpu_hog_burns_cpu(built):
    t0 = time.monotonic()
    r0 = os.times()
    subprocess.run(
        [sys.executable, str(WORKLOADS / "cpu_hog.py"), "--seconds", "0.4", "--threads", "2"],
        check=True,
        capture_output=True,
        timeout=10,
    )
    r1 = os.times()
    cpu = (r1.children_user + r1.children_system) - (r0.children_user + r0.children_system)
    assert cpu >= 0.3 and time.monotonic() - t0 < 5


def test_late_load_maps_cuda_only_after_delay(built, tmp_path):
    proc = subprocess.Popen(
        [
            sys.executable,
            str(WORKLOADS / "late_load.py"),
            "--delay",
            "0.8",
            "--linger",
            "0.8",
            "--counts-dir",
            str(tmp_path),
        ],
        stderr=subprocess.PIPE,
    )
    try:
        time.sleep(0.4)
        assert "libcudart" not in Path(f"/proc/{proc.pid}/maps").read_text()
        time.sleep(0.9)
        maps = Path(f"/proc/{proc.pid}/maps").read_text()
        assert "libcudart.so.12" in maps and "libcuda.so.1" in maps
    finally:
        assert proc.wait(timeout=10) == 0
    (doc,) = [json.loads(p.read_text()) for p in tmp_path.glob("*.json")]
    assert doc["counts"] == {
        "cudaMalloc": 1,
        "cudaLaunchKernel": 10,
        "cudaStreamSynchronize": 1,
        "cudaFree": 1,
    }


def _marked_line(marker: str) -> int:
    for i, text in enumerate((WORKLOADS / "nested.py").read_text().splitlines(), 1):
        if text.rstrip().endswith(f"# CALL: {marker}"):
            return i
    raise AssertionError(marker)


@pytest.mark.parametrize("mode", ["main", "thread", "fork"])
def test_nested_expected_frames(built, tmp_path, mode, fakecuda):
    expect = tmp_path / "expect.json"
    counts = tmp_path / "counts"
    docs = run_workload(
        "nested",
        "--mode",
        mode,
        "--threads",
        "2",
        "--repeat",
        "2",
        "--expect",
        str(expect),
        counts_dir=counts,
    )
    doc = json.loads(expect.read_text())
    chain = [
        ["run_chain", _marked_line("a")],
        ["a", _marked_line("b")],
        ["b", _marked_line("Model.forward")],
        ["Model.forward", _marked_line("c")],
        ["c", _marked_line("cudaMalloc")],
    ]
    if sys.version_info < (3, 11):
        chain[3][0] = "forward"
    frames = doc["frames"]
    start = frames.index(chain[0])
    assert frames[start : start + 5] == chain
    assert frames[-1] == [frames[-1][0], fakecuda.c_call_line()]
    assert frames[-1][0].endswith("call")
    nthreads = 2 if mode == "thread" else 1
    mallocs = [c for c in doc["calls"] if c["op"] == "cudaMalloc"]
    assert len(mallocs) == nthreads and len({c["tid"] for c in mallocs}) == nthreads
    if mode == "thread":
        names = [[f[0] for f in c["frames"]] for c in mallocs]
        entry = sorted(n[n.index("run_chain") - 1] for n in names)
        assert entry == ["thread_worker_0", "thread_worker_1"]
    main, children = _main_and_children(docs)
    chain_counts = {"cudaMalloc": 2 * nthreads, "cudaLaunchKernel": 2 * nthreads}
    if mode == "fork":
        assert main["counts"] == {"cudaSetDevice": 1}
        (child,) = children
        assert child["counts"] == chain_counts and doc["pid"] == child["pid"]
    else:
        assert main["counts"] == {"cudaSetDevice": 1, **chain_counts}


@pytest.mark.parametrize(
    "script",
    ["train", "alloc_stress", "sync_heavy", "healthy", "memory_pressure", "cpu_hog", "late_load", "nested"],
)
def test_help(script):
    out = subprocess.run(
        [sys.executable, str(WORKLOADS / f"{script}.py"), "--help"],
        capture_output=True,
        text=True,
        check=True,
        timeout=10,
    )
    assert "usage:" in out.stdout


def test_lock_io_reads_from_a_storage_service_outside_it(built, tmp_path):
    # GIVEN the storage service writing a record every 8 ms into a named pipe, started on its own
    fifo = tmp_path / "p.fifo"
    os.mkfifo(fifo)
    feeder = subprocess.Popen([sys.executable, str(WORKLOADS / "lock_io.py"), "--feed", str(fifo)])
    try:
        counts = tmp_path / "counts"
        counts.mkdir()
        # WHEN the loop runs 20 steps with its reader on that pipe
        docs = run_workload("lock_io", "--steps", "20", "--fifo", str(fifo), counts_dir=counts)
    finally:
        feeder.kill()
        feeder.wait()
    # THEN one process made the loop's calls (the reader is a thread of it; the storage service is not counted)
    ((_, main),) = docs.items()
    assert main["counts"]["cudaStreamSynchronize"] == 20 and main["counts"]["cudaLaunchKernel"] == 80
    # and without a pipe it says what it needs, without a traceback
    r = subprocess.run([sys.executable, str(WORKLOADS / "lock_io.py")], capture_output=True, text=True, timeout=20)
    assert r.returncode == 2 and "--fifo is required" in r.stderr and "Traceback" not in r.stderr
