"""tracer.analysis.sqlpool: queries run in worker processes that are killed at the wall clock, fail cleanly at the
memory limit, are replaced, and never outlive the process that started them (issue 11).

Time bounds here are liveness checks with generous margins (a killed query must not run for its natural 20+ s),
not benchmarks.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from tracedb import build

from tracer.analysis.sql import QueryOutOfMemory, QueryTimeout, SqlError, SqlLimits
from tracer.analysis.sqlpool import SqlPool
from tracer.errors import StoreError

LEVENSHTEIN = "SELECT levenshtein(repeat('a', 100000), repeat('b', 100000))"  # ~20 s of one scalar call


@pytest.fixture(scope="module")
def db(tmp_path_factory):
    p = tmp_path_factory.mktemp("pool") / "h.duckdb"
    build("healthy", p)
    return p


@pytest.fixture
def pool():
    p = SqlPool(size=2).start()
    yield p
    p.close()


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    return state != "Z"


def test_ordinary_query_and_worker_reuse(pool, db):
    assert pool.run(db, "SELECT count(*) FROM session").rows == [[1]]
    before = set(pool.worker_pids())
    for _ in range(5):
        assert pool.run(db, "SELECT 42").rows == [[42]]
    assert set(pool.worker_pids()) == before and len(before) == 2  # the same two processes served every call


def test_long_scalar_call_is_killed_and_replaced(pool, db):
    # GIVEN a query DuckDB cannot interrupt (one levenshtein call over 100 K chars)
    t = time.monotonic()
    with pytest.raises(QueryTimeout) as e:
        pool.run(db, LEVENSHTEIN, timeout_s=1.0)
    # THEN it is stopped near its limit (1 s + 1 s grace), not after its natural ~20 s, and says why
    assert time.monotonic() - t < 12
    assert "killed" in e.value.message and e.value.hint
    # AND the pool answers at once and is back to full strength
    assert pool.run(db, "SELECT 1").rows == [[1]]
    assert len(pool.worker_pids()) == 2


@pytest.mark.parametrize(
    "q",
    [
        "SELECT len(range(200000000))",  # a list DuckDB's memory_limit does not count
        "SELECT damerau_levenshtein(repeat('a', 16000), repeat('b', 16000))",  # 2.1 GiB before issue 11
    ],
)
def test_memory_limit(pool, db, q):
    pids = set(pool.worker_pids())
    with pytest.raises(QueryOutOfMemory) as e:
        pool.run(db, q, timeout_s=30)
    assert "out of memory" in e.value.message and "768 MiB" in e.value.message
    assert pool.run(db, "SELECT 1").rows == [[1]]
    assert set(pool.worker_pids()) != pids  # the worker that hit the limit was replaced


def test_worker_killed_mid_query(pool, db):
    # GIVEN a query running in a worker  WHEN something kills that worker (the kernel's OOM killer)
    result: list[BaseException] = []

    def slow() -> None:
        try:
            pool.run(db, LEVENSHTEIN, timeout_s=30)
        except BaseException as e:  # handed to the test thread
            result.append(e)

    pool.run(db, "SELECT 1")  # started and idle
    before = {pid: _cpu_ticks(pid) for pid in pool.worker_pids()}
    th = threading.Thread(target=slow)
    th.start()
    time.sleep(1.0)
    busy = max(before, key=lambda pid: _cpu_ticks(pid) - before[pid])  # the one running levenshtein
    os.kill(busy, signal.SIGKILL)
    th.join(30)
    # THEN the caller gets a clear error naming the crash, and the pool serves the next query
    assert result and isinstance(result[0], SqlError)
    assert isinstance(result[0], QueryOutOfMemory) and "crashed its worker process (SIGKILL)" in result[0].message
    assert pool.run(db, "SELECT 7").rows == [[7]]


def _cpu_ticks(pid: int) -> int:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])


def test_concurrent_queries(pool, db):
    out: list[object] = []
    ths = [threading.Thread(target=lambda i=i: out.append(pool.run(db, f"SELECT {i}").rows)) for i in range(6)]
    for t in ths:
        t.start()
    for t in ths:
        t.join(30)
    assert sorted(out) == [[[i]] for i in range(6)]


def test_db_errors_come_back_and_the_file_is_reread(pool, tmp_path):
    # GIVEN a DB served, then damaged underneath, then restored
    p, good = tmp_path / "t.duckdb", tmp_path / "good.duckdb"
    build("healthy", good)
    shutil.copy(good, p)
    assert pool.run(p, "SELECT count(*) FROM session").rows == [[1]]
    with open(p, "r+b") as f:
        f.truncate(p.stat().st_size // 3)
    with pytest.raises(StoreError) as e:  # THEN a clear error, not a crash
        pool.run(p, "SELECT count(*) FROM cuda_calls")
    assert "cannot be read" in e.value.message and "damaged or truncated" in e.value.hint
    shutil.copy(good, p)
    assert pool.run(p, "SELECT count(*) FROM session").rows == [[1]]  # AND it answers again
    os.unlink(p)
    with pytest.raises(StoreError, match="no trace DB"):
        pool.run(p, "SELECT 1")
    os.mkfifo(p)
    with pytest.raises(StoreError, match="FIFO"):
        pool.run(p, "SELECT 1")


def test_workers_die_with_their_parent(db, tmp_path):
    # GIVEN a process with a started pool  WHEN it is killed without closing the pool
    code = (
        "import sys, time\n"
        "from tracer.analysis.sqlpool import SqlPool\n"
        "p = SqlPool(2).start()\n"
        f"p.run({str(db)!r}, 'SELECT 1')\n"
        "print(*p.worker_pids(), flush=True)\n"
        "time.sleep(60)\n"
    )
    parent = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        pids = [int(x) for x in parent.stdout.readline().split()]
        assert len(pids) == 2 and all(alive(p) for p in pids)
    finally:
        parent.kill()
        parent.wait()
    # THEN its workers exit by themselves (they watch their parent every 0.5 s)
    deadline = time.monotonic() + 10
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(alive(p) for p in pids)


def test_close_kills_workers_and_refuses(db):
    pool = SqlPool(2).start(db)
    pool.run(db, "SELECT 1")
    pids = pool.worker_pids()
    pool.close()
    assert not any(alive(p) for p in pids)
    with pytest.raises(SqlError, match="shut down"):
        pool.run(db, "SELECT 1")


def test_custom_limits(db):
    # a pool with a small reply cap and value length: both come from its limits
    pool = SqlPool(1, SqlLimits(reply_bytes=2_000, value_chars=10))
    try:
        r = pool.run(db, "SELECT repeat('ab', 20) AS s FROM range(1000)")
        assert r.truncated and r.rows[0][0] == "ababababab…[cut: 30 more characters]" and "2,000 bytes" in r.note
    finally:
        pool.close()
