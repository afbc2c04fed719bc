"""Issues 11 and 17: the hostile-query corpus (bench/hostile_corpus.py) through the real MCP SDK client against a
real ``tracer mcp serve --http`` subprocess on a hand-built trace DB.

Each attack must get its expected answer, and right after it a plain ``run_sql("select 1")`` and
``get_trace_stats`` must answer within 2 s, or within a few times their own latency measured just before the attack
when the machine is loaded (:func:`live_bounds`), or within 2 s less the time they waited for a CPU
(:func:`answered`): a liveness check with a wide margin (each takes well under 0.2 s
on a quiet machine; a wedged server never answers), not a benchmark. A fixed 2 s failed at load 14. The served
DB's bytes and its directory must be unchanged after each attack and after the whole corpus, no reply may name
the server's directory, and the server's temp directory must stay empty (nothing spills or is written). During
the memory attacks the RSS of the server and its query workers must stay within 1 GiB of idle. HTTP-level
attacks (Host, Origin, token, body size, /healthz) and a client saturating the query workers while another asks
follow.
"""

from __future__ import annotations

import hashlib
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import anyio
import httpx
import pytest
from tracedb import build

from bench.hostile_corpus import (
    ATTACKS,
    Attack,
    RssSampler,
    arguments,
    call,
    cpu_wait_s,
    evaluate,
    liveness,
    tree_pids,
    tree_rss_bytes,
)
from tests.support.serving import wait_healthy
from tracer import procfs

REPO = Path(__file__).resolve().parent.parent
LIVE_S = 2.0  # the bound for the calls after an attack, on a machine with a CPU to spare
RSS_ABOVE_IDLE = 1 << 30
INIT = {
    "jsonrpc": "2.0",
    "id": 1,
    "method": "initialize",
    "params": {"protocolVersion": "2025-06-18", "capabilities": {}, "clientInfo": {"name": "t", "version": "1"}},
}
ACCEPT = {"accept": "application/json, text/event-stream"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Server:
    proc: subprocess.Popen[bytes]
    base: str
    idle_rss: int = 0
    tmp: Path | None = None  # the server's TMPDIR

    @property
    def url(self) -> str:
        return f"{self.base}/mcp"


def descendants(pid: int) -> list[int]:
    """Pids of the living processes below ``pid`` (the query workers of a server)."""
    kids: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                fields = (d / "stat").read_text().rsplit(")", 1)[1].split()
            except (OSError, IndexError):
                continue
            if fields[0] != "Z":
                kids.setdefault(int(fields[1]), []).append(int(d.name))
    out, todo = [], [pid]
    while todo:
        for k in kids.get(todo.pop(), []):
            out.append(k)
            todo.append(k)
    return out


@contextmanager
def serve(db: Path, listen: str, env: dict[str, str] | None = None) -> Iterator[Server]:
    """Run ``tracer mcp serve --db DB --http LISTEN`` as a subprocess; stop it and check its workers are gone."""
    port = listen.rsplit(":", 1)[1]
    proc = subprocess.Popen(
        [sys.executable, "-m", "tracer.commands.cli", "mcp", "serve", "--db", str(db), "--http", listen],
        cwd=REPO,
        env={**os.environ, **(env or {})},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(proc, base)
        yield Server(proc, base)
    finally:
        workers = descendants(proc.pid)
        proc.terminate()  # SIGTERM must stop it (it was ignored by the wedged server of issue 11)
        try:
            proc.wait(20)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        deadline = time.monotonic() + 10
        while any(Path(f"/proc/{w}").exists() and _state(w) != "Z" for w in workers) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert proc.returncode in (0, -15), proc.returncode  # uvicorn re-raises SIGTERM once it has shut down
        left = [w for w in workers if Path(f"/proc/{w}").exists() and _state(w) != "Z"]
        assert not left, f"query workers outlived the server: {left}"


def _state(pid: int) -> str:
    st = procfs.stat(pid)
    return "Z" if st is None else st.state


@pytest.fixture(scope="module")
def db(tmp_path_factory) -> Path:
    p = tmp_path_factory.mktemp("hostile") / "trace.duckdb"
    build("healthy", p)
    return p


@dataclass(frozen=True)
class DiskState:
    """What the attacks must not change: the served DB's bytes and its directory's listing."""

    db_sha256: str
    listing: tuple[tuple[str, int], ...]


def disk_state(db: Path) -> DiskState:
    listing = tuple(sorted((p.name, p.stat().st_size) for p in db.parent.iterdir()))
    return DiskState(hashlib.sha256(db.read_bytes()).hexdigest(), listing)


@pytest.fixture(scope="module")
def pristine(db) -> DiskState:
    return disk_state(db)


@pytest.fixture(scope="module")
def server(db, pristine, tmp_path_factory) -> Iterator[Server]:
    tmp = tmp_path_factory.mktemp("server-tmp")  # where the server and its workers would put temp files
    with serve(db, f"127.0.0.1:{free_port()}", env={"TMPDIR": str(tmp)}) as s:
        anyio.run(liveness, s.url)  # warm: both query workers started, the DB opened
        time.sleep(1.0)
        s.idle_rss = tree_rss_bytes(s.proc.pid)
        s.tmp = tmp
        yield s


def live_bounds(url: str, samples: int = 3) -> dict[str, float]:
    """Per probe, the bound for its latency during or after what a test does: 2 s (the issue's), or three times the
    probe's own latency measured now plus a second, whichever is larger: a loaded machine moves the probe and its
    bound alike, while a server that waits for a hostile query (10 s) or is wedged still fails it. The latency now
    is the slowest of ``samples`` probes: one fast sample under a load that comes and goes (another test suite on
    the same CPUs) made a bound that the next ordinary sample passed (3.45 s against 2.03 s)."""
    runs = [anyio.run(liveness, url) for _ in range(samples)]
    return {k: max(LIVE_S, 3 * max(r[k] for r in runs) + 1.0) for k in runs[0]}


def within(live: dict[str, float], bounds: dict[str, float]) -> bool:
    return all(live[k] < bounds[k] for k in bounds)


@dataclass(frozen=True)
class Probe:
    """Both liveness probes' latencies, and how long the server's and this client's threads waited for a CPU
    meanwhile (summed over threads: at least the part of the latencies that was a wait for a CPU)."""

    seconds: dict[str, float]
    cpu_wait_s: float


def probe(server: Server) -> Probe:
    pids = [os.getpid(), *tree_pids(server.proc.pid)]
    before = cpu_wait_s(pids)
    live = anyio.run(liveness, server.url)
    return Probe(live, cpu_wait_s(pids) - before)


def answered(p: Probe, bounds: dict[str, float]) -> bool:
    """True when both probes answered within their bounds (:func:`live_bounds`), or within LIVE_S together once the
    time their threads waited for a CPU is taken out. Other tenants' load comes and goes between the bounds'
    samples and the probe (get_trace_stats took 3.94 s against a bound of 3.61 s after a one-row PIVOT); a server
    that waits for a hostile query, or is wedged, waits without wanting a CPU, and still fails."""
    return within(p.seconds, bounds) or sum(p.seconds.values()) - p.cpu_wait_s < LIVE_S


def test_corpus_is_complete():
    # every class of the issue is present, and none of the attack names repeats
    classes = {a.cls for a in ATTACKS}
    assert classes == {
        "values",
        "time",
        "memory",
        "reply",
        "statement",
        "file_network",
        "write",
        "arguments",
        "disclosure",
        "state",
        "errors",
    }
    assert len({a.name for a in ATTACKS}) == len(ATTACKS) >= 110


@pytest.mark.parametrize("attack", ATTACKS, ids=[a.name for a in ATTACKS])
def test_attack(server: Server, db: Path, pristine: DiskState, attack: Attack):
    # GIVEN the server, and its probes' latency now  WHEN the attack is sent
    bounds = live_bounds(server.url)
    with RssSampler(server.proc.pid) as rss:
        result, seconds = anyio.run(call, server.url, attack.tool, arguments(attack, db))
    # THEN it gets the expected answer, which names none of the server's directories
    outcome = evaluate(attack, result, seconds)
    assert outcome.ok, outcome
    assert outcome.reply_bytes < 1 << 20  # the SDK client refuses a larger event
    assert str(db.parent) not in result.model_dump_json()
    if attack.memory:
        assert rss.peak - server.idle_rss <= RSS_ABOVE_IDLE, (rss.peak >> 20, server.idle_rss >> 20)
    # AND the server still answers both probes at once
    live = probe(server)
    assert answered(live, bounds), (live, bounds)
    assert server.proc.poll() is None
    # AND nothing changed on disk: the recording, its directory, the server's temp directory
    assert disk_state(db) == pristine
    assert server.tmp is not None and not any(server.tmp.iterdir())


def test_wrong_host_and_origin(server: Server):
    bounds = live_bounds(server.url)
    bad_host = httpx.post(server.url, json=INIT, headers={**ACCEPT, "host": "evil.example:80"})
    bad_origin = httpx.post(server.url, json=INIT, headers={**ACCEPT, "origin": "http://evil.example"})
    rebind = httpx.post(server.url, json=INIT, headers={**ACCEPT, "host": "127.0.0.1.nip.io:80"})
    assert (bad_host.status_code, bad_origin.status_code, rebind.status_code) == (421, 403, 421)
    # issue 30: the SDK's 127.0.0.1:* is a prefix match; the whole host and port are compared
    port = server.base.rsplit(":", 1)[1]
    prefix_host = httpx.post(server.url, json=INIT, headers={**ACCEPT, "host": "127.0.0.1:evil.com"})
    prefix_origin = httpx.post(server.url, json=INIT, headers={**ACCEPT, "origin": f"http://localhost:{port}.evil.com"})
    assert (prefix_host.status_code, prefix_origin.status_code) == (421, 403)
    assert answered(probe(server), bounds)


def test_healthz_names_the_db_only_to_allowed_hosts(server: Server, db: Path):
    assert httpx.get(f"{server.base}/healthz").json()["db"] == db.name
    for hdr in ({"host": "evil.example"}, {"origin": "http://evil.example"}):
        r = httpx.get(f"{server.base}/healthz", headers=hdr)
        assert r.status_code == 200 and db.name not in r.text and r.json()["status"] == "ok"


def test_request_body_limit(server: Server):
    # 5 MiB of JSON: refused before it is parsed
    bounds = live_bounds(server.url)
    big = {**INIT, "params": {**INIT["params"], "pad": "x" * (5 << 20)}}
    r = httpx.post(server.url, json=big, headers=ACCEPT, timeout=30)
    assert r.status_code == 413
    assert answered(probe(server), bounds)


def test_concurrent_slow_queries_then_answers(server: Server):
    # two queries DuckDB cannot interrupt, at once from two clients: both workers busy, both killed, both replaced
    # 300k: a fast CPU finishes 100k inside the 10 s limit (bench/hostile_corpus.py)
    levenshtein = {"query": "SELECT levenshtein(repeat('a', 300000), repeat('b', 300000))"}
    bounds = live_bounds(server.url)

    async def both() -> list[object]:
        results: list[object] = []

        async def one(client: str) -> None:
            results.append((await call(server.url, "run_sql", levenshtein, client=client))[0])

        async with anyio.create_task_group() as tg:
            tg.start_soon(one, "assistant-1")
            tg.start_soon(one, "assistant-2")
        return results

    results = anyio.run(both)
    assert all(r.is_error and "after 10 s" in r.content[0].text for r in results)  # type: ignore[attr-defined]
    assert answered(probe(server), bounds)


def test_corpus_left_the_disk_as_it_was(server: Server, db: Path, pristine: DiskState):
    # after the whole corpus (this runs after test_attack): the DB's bytes, its directory, nothing spilled
    assert disk_state(db) == pristine
    assert server.tmp is not None and not any(server.tmp.iterdir())


SLOW = {"query": "SELECT count(*) FROM range(1000000) a, range(1000000) b WHERE a.range + b.range = 7"}


@pytest.mark.parametrize("mode", ["legacy", "auto"])  # with MCP sessions, and the sessionless 2026 protocol
def test_second_client_answers_while_one_saturates(db: Path, pristine: DiskState, mode: str):
    # GIVEN a server whose query workers one client floods with 20 parallel queries that run to the 10 s limit
    with serve(db, f"127.0.0.1:{free_port()}") as s:
        anyio.run(liveness, s.url)
        bounds = live_bounds(s.url)  # the victim's own latency, before the flood
        seconds: dict[str, float] = {}
        flood: list[str] = []

        async def scenario() -> None:
            from mcp import Client
            from mcp.types import Implementation

            async def flooder() -> None:
                async with Client(s.url, read_timeout_seconds=60, mode=mode) as c, anyio.create_task_group() as tg:
                    for _ in range(20):
                        tg.start_soon(_collect, c, flood)

            async with anyio.create_task_group() as tg:
                tg.start_soon(flooder)
                await anyio.sleep(2.0)  # the flood is queued and running
                # WHEN another client asks for a trivial query, and for a non-SQL tool
                other = Implementation(name="another-assistant", version="1")
                async with Client(s.url, read_timeout_seconds=30, mode=mode, client_info=other) as c:
                    for tool, args in (("run_sql", {"query": "select 1"}), ("get_trace_stats", {})):
                        t = time.perf_counter()
                        r = await c.call_tool(tool, args)
                        seconds[tool] = time.perf_counter() - t
                        if mode == "auto" and tool == "run_sql":
                            # issue 30: without sessions both clients are the peer 127.0.0.1; a clientInfo name
                            # buys no share of its own, so this one's query joins the flood's (refused at once)
                            continue
                        assert not r.is_error, r.content[0].text[:300]
                tg.cancel_scope.cancel()

        anyio.run(scenario)
    # THEN both answer about as fast as before the flood: the flooding client holds one of the two workers, the
    # other is kept free (a FIFO pool made run_sql wait for the flood's 10 s queries)
    assert within(seconds, bounds), (seconds, bounds)
    # AND the flood's extra queries were refused at once rather than queued without bound
    assert any("already running or waiting" in t for t in flood), flood[:3]
    assert disk_state(db) == pristine


async def _collect(c: object, out: list[str]) -> None:
    r = await c.call_tool("run_sql", SLOW)  # type: ignore[attr-defined]
    out.append(r.content[0].text if r.is_error else "ok")


def test_token_required(db: Path):
    # GIVEN a server on a non-loopback address: a bearer token is required
    port = free_port()
    with serve(db, f"0.0.0.0:{port}", env={"TRACER_MCP_TOKEN": "s3cret-token"}) as s:
        assert httpx.post(s.url, json=INIT, headers=ACCEPT).status_code == 401
        wrong = httpx.post(s.url, json=INIT, headers={**ACCEPT, "authorization": "Bearer s3cret-tokeX"})
        assert wrong.status_code == 401 and "s3cret" not in wrong.text
        assert db.name not in httpx.get(f"{s.base}/healthz").text  # no token: not even the file name

        async def with_token() -> object:
            from mcp import Client
            from mcp.client.streamable_http import streamable_http_client
            from mcp.shared._httpx_utils import create_mcp_http_client

            http = create_mcp_http_client(headers={"Authorization": "Bearer s3cret-token"})
            async with Client(streamable_http_client(s.url, http_client=http)) as c:
                return await c.call_tool("run_sql", {"query": "SELECT 'infinity'::DATE"})

        r = anyio.run(with_token)
        assert not r.is_error and r.structured_content["rows"] == [["infinity"]]  # type: ignore[attr-defined]
