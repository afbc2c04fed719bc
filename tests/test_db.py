"""tracer.analysis.db: a trace DB opens read-only; anything else is refused with a StoreError that says why; an
unfinished
recording opens with what it holds and says how it ended (issue 11)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading

import duckdb
import pytest
from tracedb import build, builder

from tracer.analysis.db import LIVE_HINT, open_trace, recording_state
from tracer.errors import StoreError
from tracer.procfs import boot_id, process_start_ticks


def test_opens_and_is_read_only(tmp_path):
    build("healthy", tmp_path / "t.duckdb")
    with open_trace(tmp_path / "t.duckdb") as c:
        assert c.execute("SELECT count(*) FROM session").fetchone() == (1,)
        with pytest.raises(duckdb.Error):
            c.execute("DELETE FROM meta")


def write(path, status="complete", **session):
    """Write the healthy scenario with the given session status and session columns."""
    b = builder("healthy")
    b.status = status
    b.session.update(session)
    b.write(path)
    return path


def dead_pid() -> tuple[int, int]:
    """(pid, start ticks) of a process that has exited and been reaped."""
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    ticks = None
    while ticks is None and p.poll() is None:
        ticks = process_start_ticks(p.pid)
    p.wait()
    return p.pid, ticks or 1


@pytest.mark.parametrize(
    "setup,needle",
    [
        ("missing", "no trace DB"),
        ("garbage", "not a DuckDB file"),
        ("foreign", "not a cuda-host-tracer trace DB"),
        ("newer", "schema version 99"),
        ("live", "still being recorded"),
        ("directory", "is a directory"),
        ("fifo", "is a FIFO"),
        ("device", "is a character device"),
        ("truncated", "cannot be read"),
        ("corrupt", "cannot be read"),
    ],
)
def test_refusals(tmp_path, setup, needle):
    p = tmp_path / "t.duckdb"
    if setup == "garbage":
        p.write_text("hello")
    elif setup == "foreign":
        duckdb.connect(str(p)).execute("CREATE TABLE x (a INT)").close()
    elif setup == "newer":
        build("healthy", p)
        duckdb.connect(str(p)).execute("UPDATE meta SET value = '99' WHERE key = 'schema_version'").close()
    elif setup == "live":  # this test process plays the recorder: same pid, start ticks and boot
        me = os.getpid()
        write(p, "recording", recorder_pid=me, recorder_start_ticks=process_start_ticks(me), boot_id=boot_id())
    elif setup == "directory":
        p.mkdir()
    elif setup == "fifo":
        os.mkfifo(p)
    elif setup == "device":
        p.symlink_to("/dev/zero")
    elif setup in ("truncated", "corrupt"):
        build("healthy", p)
        size = p.stat().st_size
        with open(p, "r+b") as f:
            if setup == "truncated":
                f.truncate(size // 3)
            else:  # a block of garbage over the header's checksum-covered area
                f.seek(4096)
                f.write(os.urandom(4096))
    # a FIFO would block open() forever: fail the test instead of hanging it
    result: list[BaseException | None] = []
    t = threading.Thread(target=lambda: result.append(_refusal(p)), daemon=True)
    t.start()
    t.join(20)
    assert result, f"open_trace({setup}) hung"
    e = result[0]
    assert isinstance(e, StoreError), e
    assert needle in e.message, e.message
    assert e.exit_code == 5 and e.hint
    assert "\n" not in e.message  # one line


def _refusal(p) -> BaseException | None:
    try:
        open_trace(p).close()
    except BaseException as e:  # returned to the test thread
        return e
    return None


def test_live_refusal_names_the_live_server(tmp_path):
    me = os.getpid()
    p = write(tmp_path / "t.duckdb", "recording", recorder_pid=me, recorder_start_ticks=process_start_ticks(me))
    with pytest.raises(StoreError) as e:
        open_trace(p)
    assert e.value.hint == LIVE_HINT and "tracer record --mcp-http" in LIVE_HINT and "Ctrl-C" in LIVE_HINT
    assert f"pid {me}" in e.value.message


@pytest.mark.parametrize("case", ["dead_pid", "reused_pid", "other_boot", "no_identity"])
def test_recording_whose_recorder_is_gone_opens(tmp_path, case):
    # GIVEN a DB left in status 'recording' by a recorder that is not running any more
    me = os.getpid()
    ident = {
        "dead_pid": dict(zip(("recorder_pid", "recorder_start_ticks"), dead_pid(), strict=True)),
        # the pid lives, but it is a later process: its start time differs
        "reused_pid": dict(recorder_pid=me, recorder_start_ticks=process_start_ticks(me) - 1),
        "other_boot": dict(recorder_pid=me, recorder_start_ticks=process_start_ticks(me), boot_id="another-boot"),
        "no_identity": {},  # written by a recorder that did not record its identity
    }[case]
    p = write(tmp_path / "t.duckdb", "recording", flushed_ns=12_500_000_000, **ident)
    # WHEN it is opened THEN it opens read-only with what it holds, and says the recorder is gone
    with open_trace(p) as c:
        assert c.execute("SELECT count(*) FROM cuda_calls").fetchone()[0] > 0
        st = recording_state(c)
    assert not st.live and not st.finished and st.status == "recording"
    assert "is gone: killed or crashed" in st.ended and "flushed_ns = 12,500,000,000 ns, 12.5 s" in st.ended
    if case == "dead_pid":
        assert st.recorder_pid == ident["recorder_pid"] and f"(pid {st.recorder_pid})" in st.ended


@pytest.mark.parametrize(
    "status,finished,needle",
    [
        ("complete", True, "finished"),
        ("interrupted", True, "Ctrl-C"),
        ("target_exited", True, "program exited"),
        ("disk_full", False, "ended when the disk filled up"),
        ("failed", False, "stopped on an error"),
    ],
)
def test_recording_state_says_how_it_ended(tmp_path, status, finished, needle):
    p = write(tmp_path / "t.duckdb", status)
    with open_trace(p) as c:
        st = recording_state(c)
    assert (st.status, st.live, st.finished) == (status, False, finished) and needle in st.ended


def test_locked_by_writer(tmp_path):
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
        assert "being written" in e.value.message and e.value.hint == LIVE_HINT
    finally:
        holder.kill()
        holder.wait()


def test_file_replaced_then_restored(tmp_path):
    # GIVEN a DB that is read, then overwritten by garbage, then restored (issue 11: swapped while serving)
    p, good = tmp_path / "t.duckdb", tmp_path / "good.duckdb"
    build("healthy", good)
    shutil.copy(good, p)
    open_trace(p).close()
    p.write_bytes(b"\0" * 8192)
    with pytest.raises(StoreError):
        open_trace(p)
    shutil.copy(good, p)
    with open_trace(p) as c:  # THEN it reads again: nothing of the bad file was kept
        assert c.execute("SELECT count(*) FROM session").fetchone() == (1,)
