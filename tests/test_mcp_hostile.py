"""Issue 11: the hostile-query corpus (tests/hostile_corpus.py) through the real MCP SDK client against a real
``tracer mcp serve --http`` subprocess on a hand-built trace DB.

Each attack must get its expected answer, and right after it a plain ``run_sql("select 1")`` and
``get_trace_stats`` must answer within 2 s: a liveness check with a wide margin (each takes well under 0.2 s;
a wedged server never answers), not a benchmark. During the memory attacks the RSS of the server and its query
workers must stay within 1 GiB of idle. HTTP-level attacks (Host, Origin, token, body size, /healthz) follow.
"""

from __future__ import annotations

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
from hostile_corpus import ATTACKS, Attack, RssSampler, call, evaluate, liveness, tree_rss_bytes
from tracedb import build

REPO = Path(__file__).resolve().parent.parent
LIVE_S = 2.0  # the bound for the calls after an attack
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
        [sys.executable, "-m", "tracer.cli", "mcp", "serve", "--db", str(db), "--http", listen],
        cwd=REPO,
        env={**os.environ, **(env or {})},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, proc.stderr.read().decode() if proc.stderr else ""
            try:
                if httpx.get(f"{base}/healthz", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "server did not start"
            time.sleep(0.1)
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
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "Z"


@pytest.fixture(scope="module")
def db(tmp_path_factory) -> Path:
    p = tmp_path_factory.mktemp("hostile") / "trace.duckdb"
    build("healthy", p)
    return p


@pytest.fixture(scope="module")
def server(db) -> Iterator[Server]:
    with serve(db, f"127.0.0.1:{free_port()}") as s:
        anyio.run(liveness, s.url)  # warm: both query workers started, the DB opened
        time.sleep(1.0)
        s.idle_rss = tree_rss_bytes(s.proc.pid)
        yield s


def test_corpus_is_complete():
    # every class of the issue is present, and none of the attack names repeats
    classes = {a.cls for a in ATTACKS}
    assert classes == {"values", "time", "memory", "reply", "statement", "file_network", "write", "arguments"}
    assert len({a.name for a in ATTACKS}) == len(ATTACKS) >= 70


@pytest.mark.parametrize("attack", ATTACKS, ids=[a.name for a in ATTACKS])
def test_attack(server: Server, attack: Attack):
    # GIVEN the server  WHEN the attack is sent
    with RssSampler(server.proc.pid) as rss:
        result, seconds = anyio.run(call, server.url, attack.tool, attack.args)
    # THEN it gets the expected answer
    outcome = evaluate(attack, result, seconds)
    assert outcome.ok, outcome
    assert outcome.reply_bytes < 1 << 20  # the SDK client refuses a larger event
    if attack.memory:
        assert rss.peak - server.idle_rss <= RSS_ABOVE_IDLE, (rss.peak >> 20, server.idle_rss >> 20)
    # AND the server still answers both probes at once
    live = anyio.run(liveness, server.url)
    assert max(live.values()) < LIVE_S, live
    assert server.proc.poll() is None


def test_wrong_host_and_origin(server: Server):
    bad_host = httpx.post(server.url, json=INIT, headers={**ACCEPT, "host": "evil.example:80"})
    bad_origin = httpx.post(server.url, json=INIT, headers={**ACCEPT, "origin": "http://evil.example"})
    rebind = httpx.post(server.url, json=INIT, headers={**ACCEPT, "host": "127.0.0.1.nip.io:80"})
    assert (bad_host.status_code, bad_origin.status_code, rebind.status_code) == (421, 403, 421)
    assert max(anyio.run(liveness, server.url).values()) < LIVE_S


def test_healthz_names_the_db_only_to_allowed_hosts(server: Server, db: Path):
    assert httpx.get(f"{server.base}/healthz").json()["db"] == db.name
    for hdr in ({"host": "evil.example"}, {"origin": "http://evil.example"}):
        r = httpx.get(f"{server.base}/healthz", headers=hdr)
        assert r.status_code == 200 and db.name not in r.text and r.json()["status"] == "ok"


def test_request_body_limit(server: Server):
    # 5 MiB of JSON: refused before it is parsed
    big = {**INIT, "params": {**INIT["params"], "pad": "x" * (5 << 20)}}
    r = httpx.post(server.url, json=big, headers=ACCEPT, timeout=30)
    assert r.status_code == 413
    assert max(anyio.run(liveness, server.url).values()) < LIVE_S


def test_concurrent_slow_queries_then_answers(server: Server):
    # two queries DuckDB cannot interrupt, at once: both workers busy, both killed, both replaced
    levenshtein = {"query": "SELECT levenshtein(repeat('a', 100000), repeat('b', 100000))"}

    async def both() -> list[object]:
        results: list[object] = []

        async def one() -> None:
            results.append((await call(server.url, "run_sql", levenshtein))[0])

        async with anyio.create_task_group() as tg:
            tg.start_soon(one)
            tg.start_soon(one)
        return results

    results = anyio.run(both)
    assert all(r.is_error and "after 10 s" in r.content[0].text for r in results)  # type: ignore[attr-defined]
    assert max(anyio.run(liveness, server.url).values()) < LIVE_S


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
