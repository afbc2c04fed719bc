"""`tracer record --metrics`, for real: a fixture job recorded with the endpoint on, scraped while it runs and after
it exited, directly and by a real Prometheus server (Debian's prometheus, 1 s scrape interval, storage in tmp).

Oracle: the workload's own call counts (sync_heavy.py writes them to --counts-dir at exit); the endpoint's
``tracer_cuda_call_duration_seconds_count`` of its sync op, and Prometheus's query of it, must equal them exactly.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import time
import urllib.parse
import urllib.request
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from tests.integration.conftest import PY, open_db, read_counts, start_record, workload
from tests.support.cgroups import container_cgroup
from tests.support.need import need
from tracer.analysis.chains import compute_chains

STEPS = 30


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _scrape(port: int) -> dict[tuple[str, str, str], float]:
    """(sample name, op, pid) -> value of the call histogram's samples (le="+Inf" for the buckets)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name.startswith("tracer_cuda_call_duration_seconds") and s.labels.get("le", "+Inf") == "+Inf":
                out[(s.name.rpartition("_")[2], s.labels["op"], s.labels["pid"])] = s.value
    return out


def _wait(cond, timeout: float, what: str, proc: subprocess.Popen | None = None):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        v = cond()
        if v:
            return v
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"{what}: the recorder exited early:\n{proc.stderr.read() if proc.stderr else ''}")
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


def _start_prometheus(tmp: Path, target_port: int) -> tuple[subprocess.Popen, int]:
    binary = shutil.which("prometheus")
    need(binary, "the prometheus server is not installed (Debian's prometheus package: setup.sh installs it)")
    port = _free_port()
    cfg = tmp / "prometheus.yml"
    cfg.write_text(
        "global:\n  scrape_interval: 1s\n  scrape_timeout: 1s\n"
        f"scrape_configs:\n  - job_name: tracer\n    static_configs:\n      - targets: ['127.0.0.1:{target_port}']\n"
    )
    proc = subprocess.Popen(
        [
            str(binary),
            f"--config.file={cfg}",
            f"--storage.tsdb.path={tmp / 'tsdb'}",
            f"--web.listen-address=127.0.0.1:{port}",
        ],
        stdout=subprocess.DEVNULL,
        stderr=open(tmp / "prometheus.log", "w"),  # noqa: SIM115 (closed with the process)
    )
    return proc, port


def _prom_query(port: int, q: str) -> list[dict]:
    url = f"http://127.0.0.1:{port}/api/v1/query?" + urllib.parse.urlencode({"query": q})
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return json.loads(r.read())["data"]["result"]
    except OSError:
        return []  # not up yet


def test_prometheus_scrapes_the_exact_sync_count(tmp_path):
    counts, done, stop = tmp_path / "counts", tmp_path / "done", tmp_path / "stop"
    counts.mkdir()
    port = _free_port()
    prom, prom_port = _start_prometheus(tmp_path, port)
    # the job (30 steps of 3 x 50 ms waits: >= 4.5 s, so a scrape falls inside it) exits, then its parent shell
    # waits for the test: the recording (and the endpoint) goes on meanwhile
    job = (
        f"{PY} {workload('sync_heavy.py')} --steps {STEPS} --kernel-us 50000 --counts-dir {counts}; "
        f"touch {done}; while [ ! -e {stop} ]; do sleep 0.1; done"
    )
    rec = start_record(
        ["--db", str(tmp_path / "t.duckdb"), "--force", "--metrics", f"127.0.0.1:{port}", "--", "sh", "-c", job]
    )
    try:
        # GIVEN a scrape while the job runs: its syncs are counted as they happen
        def live_syncs():
            try:
                s = _scrape(port)
            except OSError:
                return None
            n = [v for (kind, op, _), v in s.items() if kind == "count" and op == "cudaStreamSynchronize"]
            return n and 0 < n[0] < STEPS and n[0]

        assert _wait(live_syncs, 120, "a scrape during the job", rec)
        _wait(done.exists, 120, "the job's end", rec)
        ((pid, own),) = [(c["pid"], c["counts"]) for c in read_counts(counts)]
        assert own["cudaStreamSynchronize"] == STEPS
        # WHEN the job has exited and left the traced tree (retired 5 s after its exit)
        time.sleep(6.5)
        s = _scrape(port)
        # THEN its series are still served, with its exact counts: _count and the +Inf bucket
        for op in ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaMemcpy"):
            assert s[("count", op, str(pid))] == own[op], op
            assert s[("bucket", op, str(pid))] == own[op], op
        # AND a real Prometheus server's query of the sync count equals the job's own count
        q = f'tracer_cuda_call_duration_seconds_count{{op="cudaStreamSynchronize",pid="{pid}"}}'
        res = _wait(
            lambda: [r for r in _prom_query(prom_port, q) if float(r["value"][1]) == STEPS],
            60,
            "Prometheus to hold the final count",
        )
        assert res[0]["metric"]["job"] == "tracer" and res[0]["metric"]["comm"] == "python3"
        stop.touch()
        out, err = rec.communicate(timeout=120)
        assert rec.returncode == 0, err
    finally:
        stop.touch()
        _end_agent(rec, [], prom)


def test_node_agent_traces_jobs_started_after_it(tmp_path):
    """`tracer record --metrics` with no target: two jobs started after it are both traced from their first CUDA
    library load, and Prometheus's query of each one's sync count equals the job's own count exactly."""
    counts = tmp_path / "counts"
    counts.mkdir()
    with container_cgroup() as box:
        port = _free_port()
        prom, prom_port = _start_prometheus(tmp_path, port)
        rec = start_record(["--db", str(tmp_path / "t.duckdb"), "--force", "--metrics", f"127.0.0.1:{port}"])
        jobs: list[subprocess.Popen] = []
        try:
            _agent_test_body(rec, jobs, prom_port, port, counts, box, tmp_path)
        finally:
            _end_agent(rec, jobs, prom)


def _end_agent(rec: subprocess.Popen, jobs: list[subprocess.Popen], prom: subprocess.Popen) -> None:
    for j in jobs:
        if j.poll() is None:
            j.kill()
            j.wait()
    if rec.poll() is None:
        rec.kill()
        rec.wait()
    prom.terminate()
    try:
        prom.wait(timeout=30)
    except subprocess.TimeoutExpired:
        prom.kill()
        prom.wait()


def _agent_test_body(rec, jobs, prom_port, port, counts, box, tmp_path) -> None:
    """The node agent test's steps, with the agent, its jobs, Prometheus and the cgroup cleaned up by the caller."""
    # GIVEN the agent is attached (it says so: "tracing every CUDA process ...") before any job exists
    for line in rec.stderr:
        if "tracing every CUDA process" in line:
            break
    else:
        raise AssertionError(f"the agent exited early: {rec.wait()}")
    # WHEN two jobs start after it (different step counts, so their series cannot be mistaken), the second in
    # a container-shaped cgroup (a pod's container, as the kubelet lays it out) with a pod's environment
    for steps in (STEPS, STEPS + 7):
        cmd = [PY, workload("sync_heavy.py"), "--steps", str(steps), "--kernel-us", "20000"]
        cmd += ["--counts-dir", str(counts)]
        if steps != STEPS:
            cmd = ["sh", "-c", f'echo $$ > {box.procs} && exec "$@"', "sh", *cmd]
        env = {**os.environ, "HOSTNAME": "trainer-1", "POD_NAMESPACE": "ml"}
        jobs.append(subprocess.Popen(cmd, stdout=subprocess.DEVNULL, env=env))
    for j in jobs:
        assert j.wait(timeout=120) == 0
    own = {str(c["pid"]): c["counts"] for c in read_counts(counts)}
    assert sorted(c["cudaStreamSynchronize"] for c in own.values()) == [STEPS, STEPS + 7]

    # THEN the endpoint serves each job's exact counts (fed by the recorder's tick, once a second: a second or
    # two after the exits under load; a count that overshoots or stays short times out)
    def exact():
        s = _scrape(port)
        ops = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaMemcpy")
        return all(s.get(("count", op, pid)) == c[op] for pid, c in own.items() for op in ops)

    _wait(exact, 30, "the endpoint to serve both jobs' exact counts", rec)
    # AND a real Prometheus server's query of the sync count equals each job's own count
    for pid, c in own.items():
        q = f'tracer_cuda_call_duration_seconds_count{{op="cudaStreamSynchronize",pid="{pid}"}}'
        _wait(
            lambda q=q, n=c["cudaStreamSynchronize"]: [
                r for r in _prom_query(prom_port, q) if float(r["value"][1]) == n
            ],
            60,
            f"Prometheus to hold pid {pid}'s final count",
        )
    # AND each job's steps (3 waits for the GPU a step) are counted with the analyses' step rule, exactly
    for pid, c in own.items():
        q = f'tracer_steps_total{{pid="{pid}"}}'
        n = c["cudaStreamSynchronize"]  # one a step
        _wait(
            lambda q=q, n=n: [r for r in _prom_query(prom_port, q) if float(r["value"][1]) == n], 60, f"{pid}'s steps"
        )
    # AND the container's job is labelled with its short container id, the other with none
    boxed = {pid: c for pid, c in own.items() if c["cudaStreamSynchronize"] != STEPS}
    for pid in own:
        q = f'tracer_cuda_call_duration_seconds_count{{op="cudaStreamSynchronize",pid="{pid}"}}'
        (r,) = _prom_query(prom_port, q)
        assert r["metric"].get("container", "") == (box.container_id[:12] if pid in boxed else ""), pid
    # AND the agent runs on after its jobs exited, until stopped
    time.sleep(1.0)
    assert rec.poll() is None
    rec.send_signal(signal.SIGINT)
    out, err = rec.communicate(timeout=120)
    assert rec.returncode == 0, err
    with open_db(tmp_path / "t.duckdb") as con:
        traced = {r[0] for r in con.execute("SELECT DISTINCT pid FROM cuda_calls").fetchall()}
        boxes = con.execute(
            "SELECT pid, container_id, pod_uid, pod_name, pod_namespace FROM process_placement WHERE pid = ?",
            [int(next(iter(boxed)))],
        ).fetchall()
    assert {int(p) for p in own} <= traced
    # AND its process row names the container and the pod (from its cgroup path and its environment)
    assert {b[1:] for b in boxes} == {(box.container_id, box.pod_uid, "trainer-1", "ml")}


def _chains_scraped(port: int) -> dict[tuple[str, str], float] | None:
    """(category, severity) -> tracer_chain_active's value; None when the scrape fails."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
            text = r.read().decode()
    except OSError:
        return None
    return {
        (s.labels["category"], s.labels["severity"]): s.value
        for fam in text_string_to_metric_families(text)
        if fam.name == "tracer_chain_active"
        for s in fam.samples
    }


def test_the_node_agent_shows_a_jobs_high_chain_active(tmp_path):
    """tracer_chain_active, for real: the agent (no target, --metrics, chains every 5 s) traces a job started after
    it whose known cause is a HIGH allocation_churn (test_diagnosis_real's alloc scenario: cudaMalloc/cudaFree of
    64-256 MB every step, cudaFree syncing the device; 87% of its steps' time at a load of 17 on 2 CPUs), and the
    endpoint serves that chain as active."""
    port = _free_port()
    rec = start_record(
        ["--db", str(tmp_path / "t.duckdb"), "--force", "--metrics", f"127.0.0.1:{port}", "--chains-every", "5"]
    )
    job = None
    try:
        for line in rec.stderr:
            if "tracing every CUDA process" in line:
                break
        else:
            raise AssertionError(f"the agent exited early: {rec.wait()}")
        # WHEN the job runs (1000 steps of 4 allocations and frees), ahead of the other tenants of a shared machine
        # (nice -15: a sync_stall job at a load of 17 waited for a CPU 56% of its time, which left its stall MEDIUM).
        # Other CUDA processes are traced too: chains of theirs may show; the job's own is checked below.
        cmd = ["nice", "-n", "-15", PY, workload("alloc_stress.py"), "--iterations", "1000"]
        job = subprocess.Popen(cmd, stdout=subprocess.DEVNULL)
        assert job.wait(timeout=120) == 0
        # THEN within a few computations its HIGH allocation_churn chain is served as active
        key = ("allocation_churn", "HIGH")
        _wait(lambda: (_chains_scraped(port) or {}).get(key) == 1, 90, "allocation_churn HIGH active", rec)
        rec.send_signal(signal.SIGINT)
        out, err = rec.communicate(timeout=120)
        assert rec.returncode == 0, err
        # AND it is the job's own: the analyses over the final recording find it HIGH for the job's pid
        with open_db(tmp_path / "t.duckdb") as con:
            found = compute_chains(con, pid=job.pid, limit=100).chains
        assert key in {(c.category, c.severity) for c in found}
    finally:
        if job is not None and job.poll() is None:
            job.kill()
        if rec.poll() is None:
            rec.kill()
            rec.wait()
