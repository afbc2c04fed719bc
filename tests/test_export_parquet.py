"""`tracer export --format parquet` (issue 19): a hand-built 3-rank recording (tests.test_ranks.job: torchrun's
agent, no rank, and ranks 0-2) written as a hive-partitioned Parquet dataset, read back by DuckDB and by the
analyses, which must answer from the dataset exactly as from the .duckdb file."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import duckdb
import pytest

from tests.test_ranks import AGENT, RANK_PIDS, job
from tracer.analysis.db import open_trace
from tracer.analysis.ranks.report import ranks_report
from tracer.analysis.stats import trace_stats
from tracer.commands.cli import main
from tracer.errors import StoreError
from tracer.schema import TABLES
from tracer.views.export.parquet import NULL_PARTITION, by_rank

HOST = "gpu-box-1"  # the builder's session.host
HOST_TABLES = {t.name for t in TABLES if not by_rank(t)}
RANK_TABLES = {t.name for t in TABLES if by_rank(t)}


def _export(db: Path, out: Path, *extra: str) -> int:
    return main(["export", "--db", str(db), "--format", "parquet", "-o", str(out), *extra])


def _one_error(err: str, needle: str) -> None:
    assert "Traceback" not in err
    assert [line for line in err.splitlines() if line.startswith("error:")] == [
        next(line for line in err.splitlines() if line.startswith("error:"))
    ]
    assert needle in " ".join(err.split())


@pytest.fixture(scope="module")
def exported(tmp_path_factory) -> tuple[Path, Path]:
    d = tmp_path_factory.mktemp("parquet")
    job().write(d / "t.duckdb")
    assert _export(d / "t.duckdb", d / "ds") == 0
    return d / "t.duckdb", d / "ds"


def _held(db: Path) -> set[str]:
    """The tables the recording holds (a builder recording without placement rows has no placement tables)."""
    with duckdb.connect(str(db), read_only=True) as c:
        return {t for (t,) in c.execute("SELECT table_name FROM duckdb_tables()").fetchall()}


def _files(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*") if p.is_file()}


def test_the_partitions_are_as_documented(exported):
    db, ds = exported
    files = _files(ds)
    assert "schema.json" in files
    # every host table the recording holds (a recording without the placement tables, as before issue 28, has none)
    held = _held(db)
    assert {f"host={HOST}/{t}_0.parquet" for t in HOST_TABLES & held} <= files
    assert HOST_TABLES - held <= {"process_placement", "cgroup_cpu", "cpu_idle"}
    # no table of the whole host under a rank, and none with a pid outside one
    assert not {f for f in files if f.count("/") == 1 and f.split("/")[1].rsplit("_", 1)[0] in RANK_TABLES}
    assert not {f for f in files if f.count("/") == 2 and f.split("/")[2].rsplit("_", 1)[0] in HOST_TABLES}
    ranks = {p.name for p in (ds / f"host={HOST}").iterdir() if p.is_dir()}
    assert ranks == {"rank=0", "rank=1", "rank=2", f"rank={NULL_PARTITION}"}
    for r in range(3):
        assert f"host={HOST}/rank={r}/cuda_calls_0.parquet" in files
    # every table of the recording is there, an empty one as one empty file under the NULL rank
    assert f"host={HOST}/rank={NULL_PARTITION}/kernel_names_0.parquet" in files
    assert not [f for f in os.listdir(ds) if f.startswith(".")]  # no temporary directory left

    con = duckdb.connect()

    def read(table: str) -> str:
        return f"read_parquet('{ds}/**/{table}_[0-9]*.parquet', hive_partitioning = true, union_by_name = true)"

    # a process's rows lie under its rank, the launcher (no rank) under the NULL partition
    assert con.execute(f"SELECT DISTINCT host, rank, pid FROM {read('cuda_calls')} ORDER BY rank").fetchall() == [
        (HOST, r, pid) for r, pid in enumerate(RANK_PIDS)
    ]
    assert con.execute(f"SELECT pid, rank FROM {read('processes')} ORDER BY pid").fetchall() == [
        (AGENT, None),
        *((pid, r) for r, pid in enumerate(RANK_PIDS)),
    ]
    assert con.execute(f"SELECT DISTINCT host FROM {read('session')}").fetchall() == [(HOST,)]
    # sched_* does not take sched_stats' files
    assert con.execute(f"SELECT count(*) FROM {read('sched')}").fetchone()[0] == 1200
    # partition pruning: rank 2's files alone
    assert con.execute(f"SELECT count(DISTINCT pid) FROM {read('cuda_calls')} WHERE rank = 2").fetchone()[0] == 1


def test_schema_json_documents_every_column(exported):
    _, ds = exported
    doc = json.loads((ds / "schema.json").read_text())
    assert set(doc["partition_keys"]) == {"host", "rank"}
    for t in TABLES:
        entry = doc["tables"][t.name]
        assert entry["doc"] == t.doc
        assert entry["columns"] == [{"name": c.name, "type": c.type, "doc": c.doc} for c in t.columns]
        assert entry["partitioned_by"] == (["host", "rank"] if t.name in RANK_TABLES else ["host"])


def _same_tables(a: duckdb.DuckDBPyConnection, b: duckdb.DuckDBPyConnection) -> None:
    tables = [r[0] for r in a.execute("SELECT table_name FROM duckdb_tables() ORDER BY 1").fetchall()]
    assert tables == [
        r[0] for r in b.execute("SELECT view_name FROM duckdb_views() WHERE NOT internal ORDER BY 1").fetchall()
    ]
    for t in tables:
        assert a.execute(f"DESCRIBE {t}").fetchall() == b.execute(f"DESCRIBE {t}").fetchall(), t
        q = f"SELECT * FROM (SELECT CAST(COLUMNS(*) AS VARCHAR) FROM {t}) ORDER BY ALL"
        assert a.execute(q).fetchall() == b.execute(q).fetchall(), t


def test_the_analyses_answer_the_same_from_the_dataset(exported):
    db, ds = exported
    with open_trace(db) as a, open_trace(ds) as b:
        _same_tables(a, b)  # every table: the same columns, types and rows
        ranks = ranks_report(a)
        assert ranks.straggler is not None and ranks.ranks  # the job's straggler table, not an empty answer
        assert ranks_report(b).model_dump() == ranks.model_dump()
        assert trace_stats(b).model_dump() == trace_stats(a).model_dump()


def test_tracer_ranks_and_stats_take_the_dataset(exported, capsys):
    db, ds = exported
    for cmd in ("ranks", "stats"):
        assert main([cmd, "--db", str(db), "--json"]) == 0
        want = json.loads(capsys.readouterr().out)
        assert main([cmd, "--db", str(ds), "--json"]) == 0
        assert json.loads(capsys.readouterr().out) == want


def test_hosts_share_the_directory_and_a_host_is_not_overwritten(exported, tmp_path, capsys):
    db, _ = exported
    ds = tmp_path / "ds"
    assert _export(db, ds) == 0
    other = shutil.copy(db, tmp_path / "other.duckdb")
    with duckdb.connect(str(other)) as c:
        c.execute("UPDATE session SET host = 'gpu box/2'")
    assert _export(other, ds) == 0
    # the second host's partition, its name percent-encoded and read back decoded
    assert {p.name for p in ds.iterdir() if p.is_dir()} == {f"host={HOST}", "host=gpu%20box%2F2"}
    capsys.readouterr()

    part = ds / f"host={HOST}"
    before = {f: (part / f).stat().st_mtime_ns for f in _files(part)}
    assert _export(db, ds) == 2
    _one_error(capsys.readouterr().err, f"host={HOST} exists")
    assert {f: (part / f).stat().st_mtime_ns for f in _files(part)} == before  # untouched

    assert _export(db, ds, "--force", "--json") == 0
    assert json.loads(capsys.readouterr().out)["replaced"] is True
    assert _files(part) == set(before)
    assert (ds / "host=gpu%20box%2F2").is_dir()  # the other host's partition stays

    with open_trace(ds) as both:  # every host's rows
        assert both.execute("SELECT DISTINCT host FROM session ORDER BY 1").fetchall() == [("gpu box/2",), (HOST,)]
        assert both.execute("SELECT count(*) FROM cuda_calls").fetchone()[0] == 2 * 2700
    with open_trace(other) as a, open_trace(ds / "host=gpu%20box%2F2") as one:  # one host's partition alone
        assert ranks_report(one).model_dump() == ranks_report(a).model_dump()


@pytest.mark.parametrize(
    ("out", "code", "needle"),
    [
        ("file", 2, "is not a directory"),
        ("file/sub", 2, "no directory"),
        ("/proc/tracer-dataset", 5, "cannot create /proc/tracer-dataset"),
    ],
)
def test_a_bad_output_is_one_error_line(exported, tmp_path, capsys, out, code, needle):
    db, _ = exported
    (tmp_path / "file").write_text("x")
    target = Path(out) if out.startswith("/") else tmp_path / out
    assert _export(db, target) == code
    _one_error(capsys.readouterr().err, needle)


def test_an_unwritable_output_is_one_error_line(exported, capsys):
    # GIVEN an output directory no one may create, root included (sysfs refuses new entries)
    db, _ = exported
    assert _export(db, Path("/sys/tracer-dataset")) == 5
    _one_error(capsys.readouterr().err, "cannot create /sys/tracer-dataset")


def test_usage_errors(exported, tmp_path, capsys):
    db, ds = exported
    assert main(["export", "--db", str(db), "--format", "parquet"]) == 2
    _one_error(capsys.readouterr().err, "-o DIR")
    assert _export(db, tmp_path / "x", "--start", "1") == 2
    _one_error(capsys.readouterr().err, "--start/--end apply to --format chrome")
    assert _export(ds, tmp_path / "y") == 2  # a dataset is not exported again
    _one_error(capsys.readouterr().err, "is a directory")


def test_a_directory_that_is_no_dataset_is_refused(tmp_path, exported, capsys):
    with pytest.raises(StoreError, match="is a directory, not a trace DB file"):
        open_trace(tmp_path)
    # tracer sql reads a .duckdb file: it says so of a dataset
    assert main(["sql", "--db", str(exported[1]), "SELECT 1"]) == 5
    _one_error(capsys.readouterr().err, "is a Parquet dataset")


def test_a_recording_without_ranks_has_no_rank_partitions(tmp_path):
    db = tmp_path / "v2.duckdb"
    job().write(db)
    with duckdb.connect(str(db)) as c:  # what schema v3 added to processes
        for col in ("rank", "local_rank", "node_rank", "world_size", "job_id", "launcher"):
            c.execute(f"ALTER TABLE processes DROP COLUMN {col}")
        c.execute("UPDATE meta SET value = '2' WHERE key = 'schema_version'")
    assert _export(db, tmp_path / "ds") == 0
    part = tmp_path / "ds" / f"host={HOST}"
    assert not [p for p in part.iterdir() if p.is_dir()]
    assert {p.name for p in part.iterdir()} == {f"{t.name}_0.parquet" for t in TABLES if t.name in _held(db)}
    with open_trace(db) as a, open_trace(tmp_path / "ds") as b:
        _same_tables(a, b)  # processes has no rank column, as in the file
        assert ranks_report(b).model_dump() == ranks_report(a).model_dump()
