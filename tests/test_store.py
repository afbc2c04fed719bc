"""tracer/recorder/store.py: batched writes through the writer thread, NULL for missing columns, one recording per file,
and a closed DB that opens read-only with every schema table."""

from __future__ import annotations

from pathlib import Path

import duckdb
import numpy as np
import pyarrow as pa
import pytest

from tracer.errors import StoreError
from tracer.recorder.store import FLUSH_ROWS, MEMORY_LIMIT, Store
from tracer.schema import APP_ID, TABLES


def _calls(n: int, start: int = 0) -> dict[str, object]:
    return {
        "ts_ns": np.arange(start, start + n, dtype=np.int64),
        "dur_ns": np.full(n, 1000, dtype=np.int64),
        "pid": np.full(n, 42, dtype=np.int32),
        "tid": np.full(n, 43, dtype=np.int32),
        "op": ["cudaLaunchKernel"] * n,
        "layer": pa.array(["runtime"] * n),
        "ret": [0] * n,
    }


def test_batches_are_written_in_full_and_missing_columns_are_null(tmp_path: Path) -> None:
    # GIVEN a new store
    db = tmp_path / "t.duckdb"
    s = Store(db)
    # WHEN several batches (more rows than one flush) are queued without bytes/stack_id, then it is closed
    for i in range(3):
        s.put("cuda_calls", _calls(FLUSH_ROWS, start=i * FLUSH_ROWS))
    s.put("cuda_calls", _calls(0))  # empty batches are ignored
    s.sync()
    assert s.rows_written["cuda_calls"] == 3 * FLUSH_ROWS
    s.close()
    s.close()  # idempotent
    assert s.error is None
    # THEN every row is there, in order, with NULL where no column was given
    c = duckdb.connect(str(db), read_only=True)
    n, lo, hi, nulls = c.execute(
        "SELECT count(*), min(ts_ns), max(ts_ns), count(*) FILTER (bytes IS NULL AND stack_id IS NULL "
        "AND kernel IS NULL) FROM cuda_calls"
    ).fetchone()
    assert (n, lo, hi, nulls) == (3 * FLUSH_ROWS, 0, 3 * FLUSH_ROWS - 1, 3 * FLUSH_ROWS)
    assert c.execute("SELECT DISTINCT op, layer, pid FROM cuda_calls").fetchall() == [
        ("cudaLaunchKernel", "runtime", 42)
    ]


def test_closed_db_opens_with_every_schema_table(tmp_path: Path) -> None:
    db = tmp_path / "t.duckdb"
    Store(db).close()
    c = duckdb.connect(str(db), read_only=True)
    tables = {r[0] for r in c.execute("SELECT table_name FROM information_schema.tables").fetchall()}
    assert {t.name for t in TABLES} <= tables
    assert dict(c.execute("SELECT key, value FROM meta").fetchall())["app"] == APP_ID
    assert not db.with_name(db.name + ".wal").exists()  # checkpointed


def test_statements_keep_their_place_after_batches(tmp_path: Path) -> None:
    # GIVEN rows then a DELETE queued after them; THEN the DELETE sees the rows (order kept across the queue)
    db = tmp_path / "t.duckdb"
    s = Store(db)
    s.put("cuda_calls", _calls(10))
    s.execute("DELETE FROM cuda_calls WHERE ts_ns < ?", [4])
    s.close()
    c = duckdb.connect(str(db), read_only=True)
    assert c.execute("SELECT count(*) FROM cuda_calls").fetchone()[0] == 6


def test_existing_file_is_refused_without_force(tmp_path: Path) -> None:
    # GIVEN a DB already holding a recording
    db = tmp_path / "t.duckdb"
    s = Store(db)
    s.put("cuda_calls", _calls(5))
    s.close()
    # WHEN a new store opens it without force; THEN it is refused with a hint naming --force
    with pytest.raises(StoreError) as e:
        Store(db)
    assert "--force" in e.value.hint
    # AND with force it starts empty
    Store(db, force=True).close()
    c = duckdb.connect(str(db), read_only=True)
    assert c.execute("SELECT count(*) FROM cuda_calls").fetchone()[0] == 0


def test_missing_directory_is_refused(tmp_path: Path) -> None:
    with pytest.raises(StoreError, match="no directory"):
        Store(tmp_path / "nope" / "t.duckdb")


def _count_inserts(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    inserts: list[int] = []
    real = Store._insert

    def counting(self: Store, table: str, parts: list[pa.Table]) -> int:
        inserts.append(sum(p.num_rows for p in parts))
        return real(self, table, parts)

    monkeypatch.setattr(Store, "_insert", counting)
    return inserts


def test_small_batches_wait_and_go_in_one_insert(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # GIVEN a writer that holds rows up to a minute (so nothing but sync() flushes them here)
    monkeypatch.setattr("tracer.recorder.store.FLUSH_S", 60.0)
    inserts = _count_inserts(monkeypatch)
    s = Store(tmp_path / "t.duckdb")
    # WHEN 20 small batches are queued, as 20 drains would
    for i in range(20):
        s.put("cuda_calls", _calls(50, start=i * 50))
    s.sync()
    # THEN they went into the table as one insert of all 1000 rows
    assert inserts == [1000] and s.rows_written["cuda_calls"] == 1000
    s.close()


def test_rows_are_written_within_the_flush_interval_without_a_sync(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import time

    monkeypatch.setattr("tracer.recorder.store.FLUSH_S", 0.05)
    s = Store(tmp_path / "t.duckdb")
    # GIVEN one small batch and no sync, WHEN its interval passes, THEN the writer inserts it on its own
    s.put("cuda_calls", _calls(10))
    deadline = time.monotonic() + 30
    while s.rows_written.get("cuda_calls", 0) < 10 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert s.rows_written.get("cuda_calls") == 10
    s.close()


def test_batches_of_a_table_with_dictionary_and_plain_columns_go_in_together(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # GIVEN batches whose kernel column is dictionary-encoded in one, plain in another, absent in a third
    monkeypatch.setattr("tracer.recorder.store.FLUSH_S", 60.0)
    inserts = _count_inserts(monkeypatch)
    s = Store(tmp_path / "t.duckdb")
    a = _calls(3)
    a["kernel"] = pa.DictionaryArray.from_arrays(pa.array([0, 1, None], pa.int32()), pa.array(["k0", "k1"]))
    b = _calls(2, start=3)
    b["kernel"] = pa.array(["k2", None])
    s.put("cuda_calls", a)
    s.put("cuda_calls", b)
    s.put("cuda_calls", _calls(1, start=5))
    s.sync()
    # THEN one insert wrote all six rows with their values, and the store is still writing
    assert inserts == [6] and not s.failed
    s.close()
    c = duckdb.connect(str(tmp_path / "t.duckdb"), read_only=True)
    assert c.execute("SELECT kernel FROM cuda_calls ORDER BY ts_ns").fetchall() == [
        ("k0",),
        ("k1",),
        (None,),
        ("k2",),
        (None,),
        (None,),
    ]


def test_a_batch_that_cannot_be_written_fails_the_store_instead_of_killing_its_writer(tmp_path: Path) -> None:
    # GIVEN a batch whose column cannot become the table's type (text in ts_ns)
    s = Store(tmp_path / "t.duckdb")
    bad = _calls(2)
    bad["ts_ns"] = ["not", "a number"]
    s.put("cuda_calls", bad)
    s.sync()
    # THEN the store reports the failure (the recorder then stops with a clear error), not a silent dead thread
    assert s.failed
    with pytest.raises(StoreError) as e:
        s.put("cuda_calls", _calls(1))
    # AND the error names the table and the cause, not the aborted transaction that followed it
    assert "cuda_calls" in str(e.value) and "Conversion" in str(e.value), e.value
    assert "transaction is aborted" not in str(e.value)
    s.close()


def test_row_batches_do_not_wake_the_writer_until_a_table_fills_or_a_statement_comes():
    from tracer.recorder.store import _Inbox

    box = _Inbox()
    small = pa.table({"x": list(range(10))})
    box.put_rows("cuda_calls", small)
    box.put_rows("sched", small)
    # GIVEN small row batches THEN the writer sleeps on (it wakes every FLUSH_S on its own)
    assert not box._wake.is_set()
    # WHEN one table reaches FLUSH_ROWS THEN it is woken; everything queued comes out in order
    box.put_rows("cuda_calls", pa.table({"x": list(range(FLUSH_ROWS))}))
    assert box._wake.is_set()
    got = box.take(0)
    assert [(i[0], i[1], i[2].num_rows) for i in got] == [
        ("rows", "cuda_calls", 10),
        ("rows", "sched", 10),
        ("rows", "cuda_calls", FLUSH_ROWS),
    ]
    assert not box._wake.is_set() and box.take(0) == []
    # a statement (and the end marker) wakes it at once
    box.put_rows("cuda_calls", small)
    box.put("sql", "SELECT 1", [])
    assert box._wake.is_set() and [i[0] for i in box.take(0)] == ["rows", "sql"]


def test_each_periodic_write_moves_the_session_flushed_ns_to_its_newest_rows(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import time

    monkeypatch.setattr("tracer.recorder.store.FLUSH_S", 0.05)
    start = time.monotonic_ns() - 5_000_000_000  # a session that started 5 s ago
    s = Store(tmp_path / "t.duckdb", start_mono_ns=start)
    s.execute("INSERT INTO session (session_id, status, flushed_ns) VALUES (1, 'recording', 1)")
    # GIVEN a batch queued now, with no sync and no session write after it
    queued = time.monotonic_ns() - start
    s.put("cuda_calls", _calls(10))
    deadline = time.monotonic() + 30
    while s.rows_written.get("cuda_calls", 0) < 10 and time.monotonic() < deadline:
        time.sleep(0.01)
    # THEN the write that took it also moved flushed_ns to when it was queued (a killed recorder's DB says so)
    s.sync()  # the writer is idle from here (nothing pending: the sync itself writes nothing)
    flushed = s.conn.execute("SELECT flushed_ns FROM session").fetchone()[0]
    assert queued <= flushed < queued + 1_000_000_000
    s.close()


def test_duckdb_memory_is_capped_and_what_spills_leaves_no_directory(tmp_path: Path) -> None:
    # the recorder's DuckDB keeps at most MEMORY_LIMIT (issue 21: its cache of written blocks grew with the file)
    s = Store(tmp_path / "t.duckdb")
    limit = s.conn.execute("SELECT current_setting('memory_limit'), current_setting('temp_directory')").fetchone()
    s.close()
    assert limit == (f"{MEMORY_LIMIT >> 20}.0 MiB", str(tmp_path / "t.duckdb.tmp"))


@pytest.mark.parametrize("max_bytes", [None, 64 * 2**20])
def test_rows_over_the_memory_limit_spill_beside_the_file_and_the_spill_is_gone_after_close(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, max_bytes: int | None
) -> None:
    # GIVEN a store whose rows not yet checkpointed outgrow its memory limit (16 MiB, and no checkpoint before
    # the end), uncapped and under --max-db-size (whose default database is in memory: DuckDB would spill into
    # ./.tmp of the working directory unless told where)
    monkeypatch.setattr("tracer.recorder.store.MEMORY_LIMIT", 16 * 2**20)
    monkeypatch.setattr("tracer.recorder.store.CHECKPOINT_WAL", 2**30)
    monkeypatch.setattr("tracer.recorder.sizecap.WAL_MAX", 2**30)
    monkeypatch.setattr("tracer.recorder.sizecap.WAL_SHARE", 1.0)
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    db = tmp_path / "t.duckdb"
    s = Store(db, max_bytes=max_bytes)
    n = 40 * FLUSH_ROWS
    for i in range(0, n, FLUSH_ROWS):
        s.put("cuda_calls", _calls(FLUSH_ROWS, start=i))
        s.sync()  # one insert each: a transaction's own working set stays small (32 MiB holds 3 M rows in one)
    # THEN they spilled into <db>.tmp (not the working directory), the recording went on...
    assert s.failed is False
    assert [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")] == ["t.duckdb.tmp"]
    assert not any(cwd.iterdir())
    s.close()
    # ...and closing removed the directory, with every row in the file
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cwd", "t.duckdb"]
    with duckdb.connect(str(db), read_only=True) as c:
        assert c.execute("SELECT count(*), count(DISTINCT ts_ns) FROM cuda_calls").fetchone() == (n, n)


def test_summary_rows_wait_longer_than_calls_and_only_their_own_horizon_stops_before_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import time

    # GIVEN calls flushed every 0.05 s and the per-second summaries held for a minute
    monkeypatch.setattr("tracer.recorder.store.FLUSH_S", 0.05)
    monkeypatch.setattr("tracer.recorder.store.SUMMARY_FLUSH_S", 60.0)
    start = time.monotonic_ns() - 5_000_000_000
    s = Store(tmp_path / "t.duckdb", start_mono_ns=start)
    s.execute(
        "INSERT INTO session (session_id, status, flushed_ns, summaries_flushed_ns) VALUES (1, 'recording', 1, 1)"
    )
    s.sync()
    held_at = time.monotonic_ns() - start
    s.put("host_samples", {"ts_ns": [1], "load1": [0.5]})
    time.sleep(0.3)
    calls_at = time.monotonic_ns() - start
    s.put("cuda_calls", _calls(10))
    deadline = time.monotonic() + 30
    while s.rows_written.get("cuda_calls", 0) < 10 and time.monotonic() < deadline:
        time.sleep(0.01)
    # THEN the calls went in on their own, the summary row is still held back (one insert less per flush)
    assert s.rows_written.get("cuda_calls") == 10
    assert "host_samples" not in s.rows_written
    # AND (read by the writer's own connection, which sees its commits) the calls' horizon reached the calls: a
    # killed recording claims every call it holds (before, it stopped at the held summary row, 0.3 s earlier)...
    flushed, summaries = s.conn.execute("SELECT flushed_ns, summaries_flushed_ns FROM session").fetchone()
    assert flushed >= calls_at
    # ...while the summaries' horizon stops at the held row: a reader is not told that it is in the file
    assert held_at <= summaries < calls_at
    # WHEN a sync comes (a live snapshot, the end) THEN the held rows are written too
    s.sync()
    assert s.rows_written.get("host_samples") == 1
    s.close()
    c = duckdb.connect(str(tmp_path / "t.duckdb"), read_only=True)
    assert c.execute("SELECT count(*) FROM host_samples").fetchone()[0] == 1
