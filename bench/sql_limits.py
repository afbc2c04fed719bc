"""run_sql limits: what the worker pool costs an ordinary query, and what each class of hostile query gets.

Ordinary latency is measured end to end, as an assistant sees it: the real MCP SDK client calling ``run_sql``
on a real ``tracer mcp serve --http`` subprocess over a trace DB of ``--rows`` cuda_calls rows. With
``--baseline-src DIR`` (a source tree of an earlier commit, e.g. ``git archive HEAD~1 | tar -x -C DIR``) a second
server runs that tree on the same DB and calls alternate between the two, so both see the same machine load;
the figure that matters is the difference of the medians (the issue's budget: the pool may add <= 20 ms). It
also times ``tracer sql`` (a process per call; the CLI spawns one query worker) for both trees.

With ``--corpus`` it then sends the hostile-query corpus (``bench/hostile_corpus.py``) to the current server and
records, per attack: the outcome, how long it took, how long a plain ``run_sql("select 1")`` and
``get_trace_stats`` took right after, and the peak RSS of the server and its query workers above idle.

With ``--fairness N`` (issue 17) one client floods ``run_sql`` with N parallel queries that run to the 10 s limit,
and 2 s later a second client sends ``select 1`` and ``get_trace_stats`` at once; it records how long each took
(and the baseline tree's figures with ``--baseline-src``, which must read the generated DB).

With ``--saturate`` (issue 30) a third client's ``get_trace_stats`` and ``select 1`` are timed unloaded, while
two other peers each keep a query worker busy with queries that run to the limit, and while a fourth peer also keeps
the short lane busy with queries DuckDB cannot interrupt. With ``--corpus`` another client
(another address) also probes both throughout the corpus, and the served DB's sha256 is compared after it.

    .venv/bin/python -m bench.sql_limits [--quick] [--baseline-src DIR] [--calls N] [--corpus] [--fairness N]
        [--saturate]
"""

from __future__ import annotations

import hashlib
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from bench.common import REPO, base_parser, median, print_table, spread, write_result
from bench.synthetic import generate_large

ROWS, QUICK_ROWS = 1_000_000, 100_000
CALLS, QUICK_CALLS = 40, 10
CLI_RUNS, QUICK_CLI_RUNS = 7, 3
QUERIES = {
    "select_1": "SELECT 1",
    "group_by_op": "SELECT op, count(*) AS calls, avg(dur_ns) AS mean_ns, max(dur_ns) AS max_ns "
    "FROM cuda_calls GROUP BY op ORDER BY op",
    "rows_1000": "SELECT ts_ns, dur_ns, pid, tid, op, bytes FROM cuda_calls ORDER BY ts_ns LIMIT 1000",
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def server(src: Path, db: Path) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    """Run ``tracer mcp serve --http`` from source tree ``src`` on ``db``; yield (MCP URL, process)."""
    import httpx

    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(src)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "tracer.commands.cli", "mcp", "serve", "--db", str(db), "--http", f"127.0.0.1:{port}"],
        cwd=src,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.1)
        else:
            raise RuntimeError(f"server from {src} did not start")
        yield f"http://127.0.0.1:{port}/mcp", proc
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


async def _timed_calls(urls: dict[str, str], calls: int) -> dict[str, dict[str, list[float]]]:
    from mcp import Client

    out: dict[str, dict[str, list[float]]] = {name: {q: [] for q in QUERIES} for name in urls}
    async with Client(urls["current"]) as cur:
        clients = {"current": cur}
        if "baseline" in urls:
            base = Client(urls["baseline"])
            clients["baseline"] = await base.__aenter__()
        try:
            for c in clients.values():  # warm-up: first connect, first worker start, DuckDB caches
                for q in QUERIES.values():
                    for _ in range(2):
                        r = await c.call_tool("run_sql", {"query": q})
                        assert not r.is_error, r.content
            for _ in range(calls):
                for q_name, q in QUERIES.items():
                    for name, c in clients.items():  # alternate trees call by call: same load for both
                        t = time.perf_counter()
                        r = await c.call_tool("run_sql", {"query": q})
                        out[name][q_name].append((time.perf_counter() - t) * 1e3)
                        assert not r.is_error, r.content
        finally:
            if "baseline" in clients:
                await base.__aexit__(None, None, None)
    return out


def cli_ms(src: Path, db: Path, runs: int) -> list[float]:
    """Wall ms of ``tracer sql --db DB "SELECT 1"`` run from ``src`` (one process per call)."""
    env = {**os.environ, "PYTHONPATH": str(src)}
    ms = []
    for _ in range(runs):
        t = time.perf_counter()
        subprocess.run(
            [sys.executable, "-m", "tracer.commands.cli", "sql", "--db", str(db), "SELECT 1"],
            cwd=src,
            env=env,
            check=True,
            capture_output=True,
        )
        ms.append((time.perf_counter() - t) * 1e3)
    return ms


def corpus_module() -> Any:
    from bench import hostile_corpus

    return hostile_corpus


def run_corpus(db: Path) -> dict[str, Any]:
    """Send every attack of the corpus to a fresh server; return per-attack outcomes and a per-class summary."""
    import anyio

    hc = corpus_module()
    attacks: list[dict[str, Any]] = []
    sha_before = hashlib.sha256(db.read_bytes()).hexdigest()
    with server(REPO, db) as (url, proc):
        anyio.run(hc.liveness, url)
        time.sleep(1.0)
        idle = hc.tree_rss_bytes(proc.pid)
        # the probes' own cost on this DB, before any attack: what the figures after each attack compare with
        quiet = [anyio.run(hc.liveness, url) for _ in range(5)]
        quiet_s = {k: median([q[k] for q in quiet]) for k in quiet[0]}
        windows: list[tuple[str, float, float]] = []
        load_before = os.getloadavg()
        with Prober(url) as throughout:
            for attack in hc.ATTACKS:
                t0 = time.perf_counter()
                attacks.append(_one_attack(hc, url, proc, db, attack, idle))
                windows.append((attacks[-1]["attack"], t0, time.perf_counter()))
        load_after = os.getloadavg()
    sha_after = hashlib.sha256(db.read_bytes()).hexdigest()
    classes: dict[str, dict[str, Any]] = {}
    for r in attacks:
        c = classes.setdefault(
            r["cls"],
            {"attacks": 0, "held": 0, "max_attack_s": 0.0, "max_liveness_s": 0.0, "max_rss_above_idle_bytes": 0},
        )
        c["attacks"] += 1
        c["held"] += int(r["ok"] and r["liveness_s"] is not None)
        c["max_attack_s"] = max(c["max_attack_s"], r["seconds"])
        if r["liveness_s"]:
            c["max_liveness_s"] = max(c["max_liveness_s"], *r["liveness_s"].values())
        c["max_rss_above_idle_bytes"] = max(c["max_rss_above_idle_bytes"], r["peak_rss_above_idle_bytes"])
    return {
        "size": len(attacks),
        "held": sum(c["held"] for c in classes.values()),
        "server_idle_rss_bytes": idle,
        "liveness_before_attacks_median_s": quiet_s,
        "classes": classes,
        "db_sha256_unchanged": sha_before == sha_after,
        # another client (another address) probing run_sql('select 1') and get_trace_stats in a loop meanwhile
        "other_client_throughout": throughout.summary(windows),
        # the machine's load average (1, 5, 15 min) before and after the corpus: the probe's figures move with it
        "load_average_before": load_before,
        "load_average_after": load_after,
        "attacks": attacks,
    }


def _one_attack(hc: Any, url: str, proc: Any, db: Path, attack: Any, idle: int) -> dict[str, Any]:
    import anyio

    with hc.RssSampler(proc.pid) as rss:
        result, seconds = anyio.run(hc.call, url, attack.tool, hc.arguments(attack, db))
    out = hc.evaluate(attack, result, seconds)
    row = {**out.__dict__, "peak_rss_above_idle_bytes": rss.peak - idle}
    try:
        row["liveness_s"] = anyio.run(hc.liveness, url)
    except AssertionError as e:
        row["liveness_s"], row["liveness_error"] = None, str(e)
    return row


def client_at(url: str, addr: str) -> Any:
    """An MCP SDK client connecting from loopback address ``addr``: another peer, so another fair-queue share
    (without MCP sessions every client on 127.0.0.1 is one client)."""
    import httpx2
    from mcp import Client
    from mcp.client.streamable_http import streamable_http_client

    hc = httpx2.AsyncClient(transport=httpx2.AsyncHTTPTransport(local_address=addr), timeout=60)
    return Client(streamable_http_client(url, http_client=hc), read_timeout_seconds=60)


class Prober:
    """While in its ``with``: another client (127.0.0.2) calls run_sql('select 1') and get_trace_stats in turn,
    in a thread of its own; :meth:`summary` gives each one's calls, errors, median and max seconds."""

    def __init__(self, url: str) -> None:
        import threading

        self.url = url
        self.seconds: dict[str, list[float]] = {"run_sql": [], "get_trace_stats": []}
        self.calls: list[tuple[str, float, float]] = []  # (tool, perf_counter at its start, seconds)
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Prober:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(120)

    def _run(self) -> None:
        import anyio

        async def go() -> None:
            async with client_at(self.url, "127.0.0.2") as c:
                while not self._stop.is_set():
                    for tool, args in (("run_sql", {"query": "select 1"}), ("get_trace_stats", {})):
                        t = time.perf_counter()
                        r = await c.call_tool(tool, args)
                        self.seconds[tool].append(time.perf_counter() - t)
                        self.calls.append((tool, t, self.seconds[tool][-1]))
                        if r.is_error:
                            self.errors.append(f"{tool}: {r.content[0].text[:160]}")
                    await anyio.sleep(0.2)

        try:
            anyio.run(go)
        except Exception as e:  # reported, not raised: the figures say the probe broke
            self.errors.append(f"probe stopped: {e!r}"[:300])

    def summary(self, windows: list[tuple[str, float, float]] | None = None) -> dict[str, Any]:
        """Per tool: calls, median and max seconds; with ``windows`` (attack name, perf_counter start, end) also
        the slowest calls and the attacks that ran while each was waiting (which attack a slow probe met)."""
        out: dict[str, Any] = {
            k: {"calls": len(v), "median_s": median(v) if v else None, "max_s": max(v, default=None)}
            for k, v in self.seconds.items()
        } | {"errors": self.errors[:10], "error_count": len(self.errors)}
        if windows is not None:
            slow = sorted(self.calls, key=lambda c: -c[2])[:8]
            out["slowest"] = [
                {
                    "tool": tool,
                    "seconds": took,
                    "during": [n for n, a, b in windows if a < t0 + took and b > t0],
                }
                for tool, t0, took in slow
            ]
        return out


def print_corpus(res: dict[str, Any]) -> None:
    print(f"hostile-query corpus: {res['held']} of {res['size']} attacks held (expected answer, server live after)")
    quiet = ", ".join(f"{k} {v:.3f} s" for k, v in res["liveness_before_attacks_median_s"].items())
    print(f"probes before any attack (median of 5): {quiet}")
    print_table(
        [
            [k, v["attacks"], v["held"], v["max_attack_s"], v["max_liveness_s"], v["max_rss_above_idle_bytes"] / 2**20]
            for k, v in res["classes"].items()
        ],
        ["class", "attacks", "held", "max attack s", "max live s", "max RSS +MiB"],
    )
    print(f"served DB byte-identical after the corpus (sha256): {res['db_sha256_unchanged']}")
    t = res["other_client_throughout"]
    for k in ("run_sql", "get_trace_stats"):
        v = t[k]
        if v["calls"]:
            print(
                f"another client throughout, {k}: {v['calls']} calls, "
                f"median {v['median_s']:.3f} s, max {v['max_s']:.3f} s"
            )
    print(f"load average before / after the corpus: {res['load_average_before']} / {res['load_average_after']}")
    for c in t.get("slowest", [])[:3]:
        print(f"  slow probe: {c['tool']} {c['seconds']:.2f} s during {', '.join(c['during'][:4]) or 'no attack'}")
    if t["error_count"]:
        print(f"  another client's errors: {t['error_count']}, e.g. {t['errors'][:2]}")
    for r in res["attacks"]:
        if not r["ok"] or r["liveness_s"] is None:
            print(f"  NOT HELD: {r['attack']}: {r['text'][:200]} {r.get('liveness_error', '')}")


def latency(db: Path, baseline: Path | None, calls: int, cli_runs: int) -> dict[str, Any]:
    import anyio

    tree_rss_bytes = corpus_module().tree_rss_bytes

    trees = {"current": REPO, **({"baseline": baseline} if baseline else {})}
    with server(REPO, db) as (cur_url, cur_proc):
        urls = {"current": cur_url}
        if baseline:
            with server(baseline, db) as (base_url, _):
                urls["baseline"] = base_url
                runs = anyio.run(_timed_calls, urls, calls)
        else:
            runs = anyio.run(_timed_calls, urls, calls)
        idle_rss = tree_rss_bytes(cur_proc.pid)
    res: dict[str, Any] = {"mcp_run_sql": {}, "server_idle_rss_bytes": idle_rss}
    for q_name in QUERIES:
        row: dict[str, Any] = {"query": QUERIES[q_name]}
        for name in trees:
            ms = runs[name][q_name]
            row[name] = {"median_ms": median(ms), "spread": spread(ms), "runs_ms": ms}
        if baseline:
            row["added_median_ms"] = row["current"]["median_ms"] - row["baseline"]["median_ms"]
        res["mcp_run_sql"][q_name] = row
    res["cli_sql_select_1"] = {}
    for name, src in trees.items():
        ms = cli_ms(src, db, cli_runs)
        res["cli_sql_select_1"][name] = {"median_ms": median(ms), "runs_ms": ms}
    return res


SLOW_QUERY = "SELECT count(*) FROM range(1000000) a, range(1000000) b WHERE a.range + b.range = 7"


async def _flooded(url: str, flood: int) -> dict[str, Any]:
    """What a second client gets while a first floods run_sql with ``flood`` queries that run to the time limit."""
    import anyio
    from mcp import Client
    from mcp.types import Implementation

    out: dict[str, Any] = {}
    answers: list[str] = []

    async def one(c: Any) -> None:
        r = await c.call_tool("run_sql", {"query": SLOW_QUERY})
        answers.append(r.content[0].text[:80] if r.is_error else "ok")

    async def flooder() -> None:
        async with Client(url, read_timeout_seconds=120) as c, anyio.create_task_group() as tg:
            for _ in range(flood):
                tg.start_soon(one, c)

    async def timed(c: Any, tool: str, args: dict[str, Any]) -> None:
        t = time.perf_counter()
        r = await c.call_tool(tool, args)
        out[tool] = {"seconds": time.perf_counter() - t, "error": r.content[0].text[:160] if r.is_error else None}

    async with anyio.create_task_group() as tg:
        tg.start_soon(flooder)
        await anyio.sleep(2.0)  # the flood is running and queued
        other = Implementation(name="another-assistant", version="1")
        async with Client(url, read_timeout_seconds=120, client_info=other) as c, anyio.create_task_group() as both:
            both.start_soon(timed, c, "run_sql", {"query": "SELECT 1"})
            both.start_soon(timed, c, "get_trace_stats", {})
        tg.cancel_scope.cancel()
    out["flood_answers_by_then"] = sorted(set(answers))
    return out


def fairness(db: Path, baseline: Path | None, flood: int) -> dict[str, Any]:
    """:func:`_flooded` on a fresh server of each tree."""
    import anyio

    res: dict[str, Any] = {"flood": flood, "slow_query": SLOW_QUERY}
    for name, src in {"current": REPO, **({"baseline": baseline} if baseline else {})}.items():
        with server(src, db) as (url, _):
            res[name] = anyio.run(_flooded, url, flood)
    return res


async def _victim(url: str, samples: int) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {"run_sql": [], "get_trace_stats": []}
    async with client_at(url, "127.0.0.2") as c:
        for _ in range(samples):
            for tool, args in (("run_sql", {"query": "SELECT 1"}), ("get_trace_stats", {})):
                t = time.perf_counter()
                await c.call_tool(tool, args)
                out[tool].append(time.perf_counter() - t)
    return out


# a query DuckDB cannot interrupt: a worker running it in the short lane is killed (issue 30's lane bound)
UNINTERRUPTIBLE = "SELECT levenshtein(repeat('a', 100000), repeat('b', 100000))"


async def _saturated(url: str, samples: int, lane_hog: bool = False) -> dict[str, list[float]]:
    """The victim's seconds while two other peers each hold a query worker with SLOW_QUERY, sent again as soon as
    it is stopped (so every one of the victim's calls meets both held); with ``lane_hog`` a fourth peer also keeps
    the short lane busy with queries DuckDB cannot interrupt (each killed 2 s in, its worker replaced)."""
    import anyio

    async def hog(addr: str, query: str) -> None:
        async with client_at(url, addr) as c:
            while True:
                await c.call_tool("run_sql", {"query": query})

    async with anyio.create_task_group() as tg:
        for addr in ("127.0.0.1", "127.0.0.3"):
            tg.start_soon(hog, addr, SLOW_QUERY)
        await anyio.sleep(1.5)
        if lane_hog:
            tg.start_soon(hog, "127.0.0.4", UNINTERRUPTIBLE)
            await anyio.sleep(1.0)
        got = await _victim(url, samples)
        tg.cancel_scope.cancel()
    return got


def saturation(db: Path, samples: int = 5) -> dict[str, Any]:
    """Issue 30: a third client's get_trace_stats and select 1, unloaded, while two peers saturate run_sql (the
    query workers run at nice +5 below the server; the third is answered in the short lane), and while a fourth
    peer also keeps the short lane busy."""
    import anyio

    with server(REPO, db) as (url, _):
        anyio.run(_victim, url, 1)
        idle = anyio.run(_victim, url, samples)
        busy = anyio.run(_saturated, url, samples)
        lane = anyio.run(_saturated, url, samples, True)
    return {
        tool: {
            "unloaded_median_s": median(idle[tool]),
            "saturated_median_s": median(busy[tool]),
            "saturated_max_s": max(busy[tool]),
            "lane_hogged_median_s": median(lane[tool]),
            "lane_hogged_max_s": max(lane[tool]),
            "unloaded_s": idle[tool],
            "saturated_s": busy[tool],
            "lane_hogged_s": lane[tool],
        }
        for tool in idle
    }


def main(argv: list[str] | None = None) -> int:
    p = base_parser(__doc__)
    p.add_argument("--rows", type=int, default=None, help=f"cuda_calls rows to generate (default {ROWS:,})")
    p.add_argument("--calls", type=int, default=None, help=f"calls per query and tree (default {CALLS})")
    p.add_argument("--baseline-src", type=Path, default=None, help="source tree of the commit to compare with")
    p.add_argument("--corpus", action="store_true", help="also run the hostile-query corpus and record results")
    p.add_argument("--fairness", type=int, default=0, metavar="N", help="also flood with N queries (issue 17)")
    p.add_argument("--saturate", action="store_true", help="also time a third client while two saturate run_sql")
    args = p.parse_args(argv)
    rows = args.rows or (QUICK_ROWS if args.quick else ROWS)
    calls = args.calls or (QUICK_CALLS if args.quick else CALLS)
    with tempfile.TemporaryDirectory(prefix="bench-sql-limits-") as tmp:
        db = generate_large(Path(tmp) / "large.duckdb", rows)
        res: dict[str, Any] = {"cuda_calls_rows": rows, "calls_per_query": calls}
        res.update(latency(db, args.baseline_src, calls, QUICK_CLI_RUNS if args.quick else CLI_RUNS))
        if args.corpus:
            res["corpus"] = run_corpus(db)
        if args.fairness:
            res["fairness"] = fairness(db, args.baseline_src, args.fairness)
        if args.saturate:
            res["saturation"] = saturation(db)
    table = []
    for q_name, row in res["mcp_run_sql"].items():
        table.append(
            [
                f"run_sql {q_name}",
                row["current"]["median_ms"],
                row.get("baseline", {}).get("median_ms"),
                row.get("added_median_ms"),
            ]
        )
    cli = res["cli_sql_select_1"]
    table.append(["tracer sql SELECT 1", cli["current"]["median_ms"], cli.get("baseline", {}).get("median_ms"), None])
    if "baseline" in cli:
        table[-1][3] = cli["current"]["median_ms"] - cli["baseline"]["median_ms"]
    print(f"{rows:,} cuda_calls rows, {calls} calls per query and tree")
    print_table(table, ["call", "median ms", "baseline ms", "added ms"])
    print(f"server + workers idle RSS: {res['server_idle_rss_bytes'] / 2**20:.0f} MiB")
    if "corpus" in res:
        print_corpus(res["corpus"])
    for name in ("current", "baseline"):
        f = res.get("fairness", {}).get(name)
        if f:
            took = ", ".join(
                f"{k} {v['seconds']:.2f} s{' (' + v['error'] + ')' if v['error'] else ''}"
                for k, v in f.items()
                if k != "flood_answers_by_then"
            )
            print(f"second client during a flood of {res['fairness']['flood']} ({name}): {took}")
    for tool, v in res.get("saturation", {}).items():
        print(
            f"{tool} from a third client: median {v['unloaded_median_s']:.3f} s unloaded, "
            f"{v['saturated_median_s']:.3f} s (max {v['saturated_max_s']:.3f} s) while two peers saturate run_sql, "
            f"{v['lane_hogged_median_s']:.3f} s (max {v['lane_hogged_max_s']:.3f} s) with a fourth hogging the lane"
        )
    print(f"wrote {write_result('sql_limits', res, args.out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
