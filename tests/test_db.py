"""tracer.db: a trace DB opens read-only; anything else is refused with a StoreError that says why."""

from __future__ import annotations

import duckdb
import pytest
from tracedb import build

from tracer.db import open_trace
from tracer.errors import StoreError


def test_opens_and_is_read_only(tmp_path):
    build("healthy", tmp_path / "t.duckdb")
    with open_trace(tmp_path / "t.duckdb") as c:
        assert c.execute("SELECT count(*) FROM session").fetchone() == (1,)
        with pytest.raises(duckdb.Error):
            c.execute("DELETE FROM meta")


@pytest.mark.parametrize(
    "setup,needle",
    [
        ("missing", "no trace DB"),
        ("garbage", "not a DuckDB file"),
        ("foreign", "not a cuda-host-tracer trace DB"),
        ("newer", "schema version 99"),
        ("recording", "still being recorded"),
    ],
)
def test_refusals(tmp_path, setup, needle):
    p = tmp_path / "t.duckdb"
    if setup == "garbage":
        p.write_text("hello")
    elif setup == "foreign":
        duckdb.connect(str(p)).execute("CREATE TABLE x (a INT)").close()
    elif setup in ("newer", "recording"):
        build("healthy", p)
        c = duckdb.connect(str(p))
        if setup == "newer":
            c.execute("UPDATE meta SET value = '99' WHERE key = 'schema_version'")
        else:
            c.execute("UPDATE session SET status = 'recording'")
        c.close()
    with pytest.raises(StoreError) as e:
        open_trace(p)
    assert needle in e.value.message
    assert e.value.exit_code == 5 and e.value.hint


def test_recording_allowed_for_live_server(tmp_path):
    p = build("healthy", tmp_path / "t.duckdb") and tmp_path / "t.duckdb"
    c = duckdb.connect(str(p))
    c.execute("UPDATE session SET status = 'recording'")
    c.close()
    open_trace(p, allow_recording=True).close()


def test_locked_by_writer(tmp_path):
    import subprocess
    import sys

    p = tmp_path / "t.duckdb"
    build("healthy", p)
    # another process holding the write lock (the recorder)
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            f"import duckdb,sys,time; c=duckdb.connect({str(p)!r}); print('ok', flush=True); time.sleep(30)",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "ok"
        with pytest.raises(StoreError) as e:
            open_trace(p)
        assert "being written" in e.value.message and "MCP" in e.value.hint
    finally:
        holder.kill()
        holder.wait()
