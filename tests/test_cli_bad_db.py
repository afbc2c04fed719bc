"""Issue 11 on the command line: a damaged, truncated or non-regular --db gets one clear error and exit 5 from
every reader command, never a traceback or a hang; an unfinished recording opens and says how it ended; ``tracer
sql`` runs under the run_sql limits."""

from __future__ import annotations

import os
import threading
import time

import pytest
from tracedb import build, builder

from tracer.commands.cli import main

READERS = (
    ["stats"],
    ["chains"],
    ["stacks", "--op", "x"],
    ["sql", "SELECT 1"],
    ["timeline"],
    ["mcp", "serve", "--stdio"],
)


def run_cli(args: list[str], limit_s: float = 60) -> int:
    """main(args), failing the test if it does not return within ``limit_s`` (a FIFO must not hang it)."""
    out: list[int] = []
    t = threading.Thread(target=lambda: out.append(main(args)), daemon=True)
    t.start()
    t.join(limit_s)
    assert out, f"tracer {' '.join(args)} hung"
    return out[0]


@pytest.mark.parametrize("problem", ["truncated", "corrupt", "fifo", "directory", "device"])
def test_bad_files_exit_5_with_one_error(tmp_path, capsys, problem):
    p = tmp_path / "t.duckdb"
    if problem in ("truncated", "corrupt"):
        build("healthy", p)
        with open(p, "r+b") as f:
            if problem == "truncated":
                f.truncate(p.stat().st_size // 3)
            else:
                f.seek(4096)
                f.write(os.urandom(4096))
    elif problem == "fifo":
        os.mkfifo(p)
    elif problem == "directory":
        p.mkdir()
    else:
        p.symlink_to("/dev/zero")
    needle = {
        "truncated": "cannot be read",
        "corrupt": "cannot be read",
        "fifo": "is a FIFO",
        "directory": "is a directory",
        "device": "is a character device",
    }[problem]
    for cmd in READERS:
        assert run_cli([*cmd, "--db", str(p)]) == 5, cmd
        err = " ".join(capsys.readouterr().err.split())  # rich wraps long lines on stderr
        assert err.startswith("error:") and needle in err and "Traceback" not in err, (cmd, err)


@pytest.mark.parametrize(
    "status,session,note",
    [
        ("disk_full", {}, "ended when the disk filled up"),
        ("recording", {"recorder_pid": 2**22 + 17, "flushed_ns": 3_000_000_000}, "(pid 4194321) is gone"),
    ],
)
def test_unfinished_recording_opens_with_a_note(tmp_path, capsys, status, session, note):
    p = tmp_path / "t.duckdb"
    b = builder("healthy")
    b.status = status
    b.session.update(session)
    b.write(p)
    assert run_cli(["stats", "--db", str(p)]) == 0
    cap = capsys.readouterr()
    assert note in " ".join(cap.err.split()) and cap.out  # the note on stderr, the stats on stdout
    assert run_cli(["sql", "--db", str(p), "SELECT count(*) FROM cuda_calls"]) == 0


def test_sql_command_has_the_limits(tmp_path, capsys):
    p = tmp_path / "t.duckdb"
    build("healthy", p)
    t = time.monotonic()
    code = run_cli(
        ["sql", "--db", str(p), "--timeout", "1", "SELECT levenshtein(repeat('a', 100000), repeat('b', 100000))"]
    )
    # stopped near its limit although DuckDB cannot interrupt the call (its natural time is ~20 s)
    assert code == 2 and time.monotonic() - t < 15
    err = " ".join(capsys.readouterr().err.split())
    assert "stopped after 1 s" in err and "Traceback" not in err
    assert run_cli(["sql", "--db", str(p), "SELECT len(range(200000000))"]) == 2
    assert "out of memory" in " ".join(capsys.readouterr().err.split())
    assert run_cli(["sql", "--db", str(p), "--json", "SELECT 'infinity'::DATE AS d"]) == 0
    assert '"infinity"' in capsys.readouterr().out
