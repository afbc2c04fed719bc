"""The Parquet dataset in a distributed engine (issue 19): :data:`STRAGGLER_SQL` runs unchanged in DuckDB and in a
real Spark (pyspark, local mode, its own JVM) over two hosts' exports, and both give the same straggler table.

The recordings are tests.test_ranks.job: host gpu-box-1's ranks 0-2 with rank 2 loading each batch 20 ms slower,
and host gpu-box-2's ranks 3-5, healthy. Each sync is moved by a fixed pseudo-random jitter (< 0.4 ms, so no call
changes order), so the steps differ: the median of an even count of steps and the p99 then have distinct values
to pick between, which is where two engines' percentile code can disagree.

Needs Java >= 17 (Spark 4) and pyspark (dev extras; setup.sh checks Java): skips without them, fails under CI.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import duckdb
import pytest

from tests.support.need import need, need_module
from tests.test_ranks import job
from tracer.views.export.parquet import STRAGGLER_SQL, export_parquet

HOSTS = {"gpu-box-1": 2, "gpu-box-2": None}  # host: its slow rank (the builder's ranks 0-2)
RANKS_PER_HOST = 3
SLOW_MS = 20.0
STEPS = 300  # an even count: a median averages the two middle steps
JITTER_NS = 400_000  # < the 0.5 ms between a step's last launch and its sync: the calls keep their order
README = Path(__file__).resolve().parent.parent / "docs" / "multi-host.md"
# pyspark 4.3 warns on import that it does not yet support pandas 3 (unused here: no pandas conversion)
pytestmark = pytest.mark.filterwarnings("ignore:PySpark does not yet fully support pandas:FutureWarning")


def _java_major() -> int | None:
    java = shutil.which("java")
    if java is None:
        return None
    out = subprocess.run([java, "-version"], capture_output=True, text=True, timeout=60)
    m = re.search(r'version "(\d+)(?:\.(\d+))?', out.stderr + out.stdout)
    if m is None:
        return None
    major = int(m.group(1))
    return int(m.group(2) or 0) if major == 1 else major  # "1.8.0_402" is Java 8


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("spark")
    for i, (host, slow) in enumerate(HOSTS.items()):
        db = job(slow_rank=slow, slow_ms=SLOW_MS, steps=STEPS + 1).write(d / f"{host}.duckdb")
        with duckdb.connect(str(db)) as c:
            c.execute("UPDATE session SET host = ?", [host])
            c.execute("UPDATE processes SET rank = rank + ? WHERE rank IS NOT NULL", [i * RANKS_PER_HOST])
            c.execute(
                "UPDATE cuda_calls SET ts_ns = ts_ns + hash(ts_ns, pid) % ? WHERE op = 'cudaStreamSynchronize'",
                [JITTER_NS],
            )
        export_parquet(db, d / "ds")
    return d / "ds"


@pytest.fixture(scope="module")
def spark(tmp_path_factory):
    """One local Spark per module (its JVM starts in ~10 s): one core, 512 MB, no UI, errors only in its log."""
    java = _java_major()
    need(java is not None and java >= 17, f"Spark 4 needs Java >= 17 on PATH (java: {java or 'not found'})")
    need_module("pyspark")
    from pyspark.sql import SparkSession

    local = tmp_path_factory.mktemp("spark-local")
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")  # no lookup of this machine's name or network
    session = (
        SparkSession.builder.master("local[1]")
        .appName("tracer-test-export-spark")
        .config("spark.ui.enabled", "false")
        .config("spark.driver.memory", "512m")
        .config("spark.sql.shuffle.partitions", "1")
        .config("spark.local.dir", str(local))
        .config("spark.sql.warehouse.dir", str(local / "warehouse"))
        .getOrCreate()
    )
    session.sparkContext.setLogLevel("ERROR")
    try:
        yield session
    finally:
        session.stop()


def _duckdb_table(ds: Path) -> list[tuple]:
    with duckdb.connect() as con:
        con.execute(
            f"CREATE VIEW cuda_calls AS SELECT * FROM read_parquet('{ds}/**/cuda_calls_[0-9]*.parquet', "
            "hive_partitioning = true, union_by_name = true)"
        )
        return con.execute(STRAGGLER_SQL).fetchall()


def _spark_table(spark, ds: Path) -> list[tuple]:
    # a table of the whole host has no rank= level; cuda_calls has one on every host of a schema >= 3 recording
    spark.read.option("basePath", str(ds)).parquet(
        f"{ds}/host=*/rank=*/cuda_calls_[0-9]*.parquet"
    ).createOrReplaceTempView("cuda_calls")
    return [tuple(r) for r in spark.sql(STRAGGLER_SQL).collect()]


def test_duckdb_and_spark_give_the_same_straggler_table(dataset, spark):
    want = _duckdb_table(dataset)
    got = _spark_table(spark, dataset)
    # exactly equal, p99 included: median and percentile_disc compute alike in both (see STRAGGLER_SQL)
    assert got == want

    # every rank of both hosts, each with all its steps
    assert sorted((h, r) for h, r, *_ in got) == [
        (h, r) for i, h in enumerate(HOSTS) for r in range(RANKS_PER_HOST * i, RANKS_PER_HOST * (i + 1))
    ]
    assert {steps for _, _, steps, *_ in got} == {STEPS}
    # the straggler first, and it is the builder's slow rank: 20 ms more work per step than any other rank, while
    # its host's other ranks wait those 20 ms in the all_reduce
    rows = {(h, r): dict(zip(("steps", "step_ms", "p99_ms", "work_ms", "wait_ms"), v, strict=True)) for h, r, *v in got}
    host, rank = got[0][:2]
    assert (host, rank) == ("gpu-box-1", 2)
    assert all(rows[host, rank]["work_ms"] - v["work_ms"] > SLOW_MS - 1 for k, v in rows.items() if k != (host, rank))
    for r in (0, 1):
        assert rows[host, r]["wait_ms"] - rows[host, rank]["wait_ms"] == pytest.approx(SLOW_MS, abs=1)
    # the steps vary (jitter), so the p99 is a step of its own above the median
    assert all(v["p99_ms"] > v["step_ms"] for v in rows.values())


def test_the_readme_shows_the_query():
    assert STRAGGLER_SQL.strip() in README.read_text(encoding="utf-8")
