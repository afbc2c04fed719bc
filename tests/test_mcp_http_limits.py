"""Issue 17, HTTP side: session exhaustion, the Host check before redirects, symlinks out of the served directory,
and stopping within a second of SIGTERM.

The session limits are tested twice: on :class:`mcp_server.sessions.SessionLimits` over a stand-in for the SDK's
app (which sessions it ends, exactly), and end to end, with a flood of ``initialize`` POSTs against a real
``serve_http`` subprocess (what the issue measured: 503 for everyone, +380 MB). Every test ends by checking that
the server still answers.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest
from mcp import Client
from tracedb import build

from bench.hostile_corpus import liveness
from mcp_server.server import build_server
from mcp_server.sessions import SessionLimits
from tests.support.serving import wait_healthy
from tracer import procfs

REPO = Path(__file__).resolve().parent.parent
INIT = {
    "jsonrpc": "2.0",
    "id": 1,
    "method": "initialize",
    "params": {"protocolVersion": "2025-06-18", "capabilities": {}, "clientInfo": {"name": "t", "version": "1"}},
}
PING = {"jsonrpc": "2.0", "id": 2, "method": "ping"}
ACCEPT = {"accept": "application/json, text/event-stream"}
SERVE = "import sys; from mcp_server.http import serve_http; serve_http(sys.argv[1], '127.0.0.1', int(sys.argv[2]))"
FLOOD = 1500  # initialize POSTs: ~57 MB of sessions kept by an unlimited server (38 KB each, measured)
RSS_GROWTH = 30 << 20


# -- SessionLimits over a stand-in SDK -------------------------------------------------------------------------
class FakeSdk:
    """Answers like the SDK's streamable HTTP app: a POST without a session opens one (its id in the
    ``mcp-session-id`` header), a request for a live session answers 200 (DELETE ends it), any other id 404.
    A request with ``?hold`` waits for ``release``."""

    def __init__(self) -> None:
        self.alive: set[str] = set()
        self.release = anyio.Event()
        self.deleted: list[str] = []

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        await receive()
        headers = dict(scope["headers"])
        sid = headers.get(b"mcp-session-id", b"").decode() or None
        out: list[tuple[bytes, bytes]] = []
        if sid is None:
            sid = uuid.uuid4().hex
            self.alive.add(sid)
            status, out = 200, [(b"mcp-session-id", sid.encode())]
        elif sid not in self.alive:
            status = 404
        else:
            status = 200
            if scope["method"] == "DELETE":
                self.alive.discard(sid)
                self.deleted.append(sid)
            elif scope.get("query_string") == b"hold":
                await self.release.wait()
        await send({"type": "http.response.start", "status": status, "headers": out})
        await send({"type": "http.response.body", "body": b""})


def request(app: Any, client: str, method: str = "POST", sid: str | None = None, query: bytes = b"") -> Any:
    """Send one request through ``app`` as ``client``; return (status, session id answered)."""

    async def go() -> tuple[int, str | None]:
        headers = [(b"host", b"127.0.0.1:8090")] + ([(b"mcp-session-id", sid.encode())] if sid else [])
        scope = {"type": "http", "method": method, "path": "/mcp", "headers": headers, "client": (client, 5000)}
        scope["query_string"] = query
        got: dict[str, Any] = {}

        async def receive() -> dict[str, Any]:
            return {"type": "http.request", "body": b"", "more_body": False}

        async def send(m: dict[str, Any]) -> None:
            if m["type"] == "http.response.start":
                got["status"] = m["status"]
                got["sid"] = dict(m["headers"]).get(b"mcp-session-id", b"").decode() or None

        await app(scope, receive, send)
        return got["status"], got["sid"]

    return go()


def run(coro: Any) -> Any:
    async def main() -> Any:
        return await coro

    return anyio.run(main)


def test_a_client_over_its_cap_loses_its_least_used_session_first():
    sdk = FakeSdk()
    app = SessionLimits(sdk, per_client=3, total=100)
    s1, s2, s3 = (run(request(app, "10.0.0.1"))[1] for _ in range(3))
    assert run(request(app, "10.0.0.1", sid=s2)) == (200, None)  # s2 is used; s1 and s3 only opened
    _, s4 = run(request(app, "10.0.0.1"))
    assert sdk.deleted == [s1]  # the oldest unused one
    _, s5 = run(request(app, "10.0.0.1"))
    assert sdk.deleted == [s1, s3] and sdk.alive == {s2, s4, s5}
    assert run(request(app, "10.0.0.1", sid=s1))[0] == 404
    # another address is not charged for this one's sessions
    for _ in range(3):
        run(request(app, "10.0.0.2"))
    assert len(sdk.deleted) == 2 and app.open_sessions("10.0.0.2") == 3


def test_past_the_total_the_biggest_holder_pays():
    sdk = FakeSdk()
    app = SessionLimits(sdk, per_client=3, total=4)
    flood = [run(request(app, "10.0.0.1"))[1] for _ in range(3)]
    _, mine = run(request(app, "10.0.0.2"))
    _, mine2 = run(request(app, "10.0.0.2"))  # the 5th session: one of the flood's ends, not one of mine
    assert sdk.deleted == [flood[0]] and {mine, mine2} <= sdk.alive and app.open_sessions() == 4


def test_requests_of_one_session_take_turns_and_the_queue_is_bounded():
    sdk = FakeSdk()
    app = SessionLimits(sdk, in_flight=2, queued=1)

    async def go() -> tuple[list[int], list[int]]:
        _, sid = await request(app, "10.0.0.1")
        first: list[int] = []  # the answers while two requests are held
        later: list[int] = []

        async def one(out: list[int], query: bytes = b"") -> None:
            out.append((await request(app, "10.0.0.1", sid=sid, query=query))[0])

        async with anyio.create_task_group() as tg:
            tg.start_soon(one, later, b"hold")
            tg.start_soon(one, later, b"hold")
            await anyio.sleep(0.05)
            tg.start_soon(one, later)  # the third waits for a turn...
            await anyio.sleep(0.05)
            await one(first)  # ...and a fourth finds the queue full
            await anyio.sleep(0.05)
            first.append(len(later))  # nothing answered yet: the third is still waiting
            sdk.release.set()
        return first, later

    assert run(go()) == ([429, 0], [200, 200, 200])


def test_ended_and_idle_sessions_are_forgotten():
    now = [0.0]
    sdk = FakeSdk()
    app = SessionLimits(sdk, per_client=2, idle_s=300, clock=lambda: now[0])
    _, a = run(request(app, "10.0.0.1"))
    _, b = run(request(app, "10.0.0.1"))
    assert run(request(app, "10.0.0.1", "DELETE", sid=a))[0] == 200 and app.open_sessions() == 1
    sdk.alive.discard(b)  # the SDK ends b (idle): the next request for it answers 404, and b is forgotten
    assert run(request(app, "10.0.0.1", sid=b))[0] == 404 and app.open_sessions() == 0
    _, c = run(request(app, "10.0.0.1"))
    now[0] = 301.0  # c idle past the timeout: the SDK has ended it, so it no longer counts
    _, d = run(request(app, "10.0.0.1"))
    _, e = run(request(app, "10.0.0.1"))
    assert sdk.deleted == [a] and app.open_sessions() == 2 and {d, e} <= sdk.alive


# -- a real server ------------------------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def db(tmp_path_factory: pytest.TempPathFactory) -> Path:
    p = tmp_path_factory.mktemp("limits") / "trace.duckdb"
    build("healthy", p)
    return p


@contextmanager
def server(db: Path) -> Iterator[tuple[subprocess.Popen[bytes], str]]:
    """``serve_http`` on ``db`` in a subprocess; killed at the end if a test left it running."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-c", SERVE, str(db), str(port)], cwd=REPO, stderr=subprocess.PIPE)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(proc, base)
        yield proc, base
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def rss(pid: int) -> int:
    return int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def children(pid: int) -> list[int]:
    return procfs.children(pid)


def test_a_flood_of_sessions_leaves_room_for_other_clients(db: Path):
    with server(db) as (proc, base):
        url = f"{base}/mcp"
        anyio.run(liveness, url)  # warm: workers started, the DB opened
        idle = rss(proc.pid)

        async def go() -> dict[str, Any]:
            out: dict[str, Any] = {"codes": {}, "ids": [], "during": [], "other": None}
            done = anyio.Event()
            async with Client(url) as good:  # a well-behaved client, on the flood's own address
                await good.call_tool("get_trace_stats", {})
                async with httpx.AsyncClient(timeout=30) as flood:

                    async def flooder(n: int) -> None:
                        for _ in range(n):
                            r = await flood.post(url, json=INIT, headers=ACCEPT)
                            out["codes"][r.status_code] = out["codes"].get(r.status_code, 0) + 1
                            out["ids"].append(r.headers.get("mcp-session-id"))

                    async def meanwhile() -> None:
                        other = httpx.AsyncHTTPTransport(local_address="127.0.0.2")  # a second client
                        async with httpx.AsyncClient(transport=other, timeout=30) as c:
                            out["other"] = (await c.post(url, json=INIT, headers=ACCEPT)).status_code
                        while not done.is_set():
                            out["during"].append((await good.call_tool("run_sql", {"query": "select 1"})).is_error)
                            await anyio.sleep(0.2)

                    async with anyio.create_task_group() as tg:
                        tg.start_soon(meanwhile)
                        async with anyio.create_task_group() as floods:
                            for _ in range(16):
                                floods.start_soon(flooder, FLOOD // 16)
                        done.set()
                    # the first sessions of the flood are gone; the good client's is not
                    first = [
                        await flood.post(url, json=PING, headers={**ACCEPT, "mcp-session-id": s})
                        for s in out["ids"][:50]
                    ]
                    out["first_alive"] = sum(r.status_code == 200 for r in first)
                out["after"] = (await good.call_tool("get_trace_stats", {})).is_error
            return out

        out = anyio.run(go)
        grown = rss(proc.pid) - idle
        assert out["codes"] == {200: FLOOD // 16 * 16}  # nobody was refused
        assert out["other"] == 200
        assert out["during"] and not any(out["during"]) and out["after"] is False
        assert out["first_alive"] == 0
        assert grown < RSS_GROWTH, grown >> 20
        anyio.run(liveness, url)  # and it serves, right (its speed under load: bench/sql_limits)


def test_host_is_checked_before_the_slash_redirect(db: Path):
    with server(db) as (_, base):
        evil = httpx.get(f"{base}/mcp/", headers={"host": "evil.com"})
        assert evil.status_code == 421 and "location" not in evil.headers
        evil = httpx.get(f"{base}/mcp/", headers={"origin": "http://evil.com"})
        assert evil.status_code == 403 and "location" not in evil.headers
        assert httpx.get(f"{base}/anything/", headers={"host": "evil.com"}).status_code == 421
        ok = httpx.get(f"{base}/mcp/")
        assert ok.status_code == 307 and ok.headers["location"] == f"{base}/mcp"
        health = httpx.get(f"{base}/healthz", headers={"host": "evil.com"})  # answers everyone, names nothing
        assert health.status_code == 200 and "db" not in health.json()
        # and the refusals left the server serving: warmed first (on a loaded machine the query workers' start-up
        # made the first select 1 take 5.9 s, which is not what this test is about)
        # (liveness raises unless both answer right, within its own timeout; how fast they answer under load is
        # bench/sql_limits' to measure, not a test's: a suite run under two loads read 2.2 s)
        anyio.run(liveness, f"{base}/mcp")
        anyio.run(liveness, f"{base}/mcp")


def test_sigterm_stops_without_waiting_for_a_query_in_flight(db: Path):
    with server(db) as (proc, base):
        anyio.run(liveness, f"{base}/mcp")
        workers = children(proc.pid)
        assert workers  # the query workers, which must go with it
        started = threading.Event()

        def slow_query() -> None:
            async def go() -> None:
                async with Client(f"{base}/mcp") as c:
                    started.set()
                    await c.call_tool("run_sql", {"query": "SELECT count(*) FROM range(100000000000)"})

            try:
                anyio.run(go)
            except Exception:  # the server goes away under it
                pass

        threading.Thread(target=slow_query, daemon=True).start()
        assert started.wait(30)
        time.sleep(0.5)  # the query is running in a worker
        t = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        proc.wait(10)
        stopped = time.monotonic() - t
        # The query would run for minutes, and without the deadline the stop waited 7 s for it (issue 17); with it
        # the server is gone STOP_S after the signal, plus the time a loaded machine takes to run the timer, kill
        # the workers and exit (0.6-1.06 s seen under two loads on 2 CPUs): bounded here well under the 7 s
        assert stopped < 3.0, stopped
        assert proc.returncode == -signal.SIGTERM
        time.sleep(0.2)
        assert not [w for w in workers if _alive(w)], "query workers outlived the server"


def _alive(pid: int) -> bool:
    return procfs.is_alive(pid)


# -- compare_traces and symlinks ------------------------------------------------------------------------------
def test_compare_traces_refuses_links_out_of_the_directory(tmp_path: Path, db: Path):
    served, outside = tmp_path / "served", tmp_path / "outside"
    served.mkdir()
    outside.mkdir()
    build("healthy", served / "a.duckdb")
    (outside / "secret.duckdb").write_bytes(db.read_bytes())  # a readable trace DB, but not in the directory
    (served / "abs.duckdb").symlink_to(outside / "secret.duckdb")
    (served / "rel.duckdb").symlink_to(Path("..") / "outside" / "secret.duckdb")
    (served / "notes.duckdb").symlink_to("notes.txt")  # in the directory, but not a recording's name
    (served / "notes.txt").write_text("private")
    (served / "same.duckdb").symlink_to("a.duckdb")

    async def go() -> dict[str, Any]:
        async with Client(build_server(served / "a.duckdb")) as c:
            names = ("abs", "rel", "notes", "same")
            out = {n: await c.call_tool("compare_traces", {"before": f"{n}.duckdb"}) for n in names}
            out["stats"] = await c.call_tool("get_trace_stats", {})
            return out

    out = anyio.run(go)
    for n in ("abs", "rel", "notes"):
        text = out[n].content[0].text
        assert out[n].is_error and "leads out of the served recording's directory" in text, text
        assert "abs.duckdb" not in text.split("recordings here:")[1]  # not offered as a name either
    assert not out["same"].is_error, out["same"].content[0].text  # a link within the directory is followed
    assert not out["stats"].is_error


# -- issue 30: no error names a server path ------------------------------------------------------------------------
HOLD_WRITE_LOCK = "import duckdb, sys, time; c = duckdb.connect(sys.argv[1]); print('ok', flush=True); time.sleep(60)"


def test_compare_traces_errors_name_files_relative_to_the_directory(tmp_path: Path):
    # GIVEN a served directory whose other .duckdb files are each unreadable in their own way
    served = tmp_path / "srv2"
    served.mkdir()
    build("healthy", served / "a.duckdb")
    os.mkfifo(served / "fifo.duckdb")
    (served / "dir.duckdb").mkdir()
    (served / "empty.duckdb").write_bytes(b"")
    (served / "text.duckdb").write_text("not a database\n" * 100)
    import duckdb

    duckdb.connect(str(served / "foreign.duckdb")).execute("CREATE TABLE x (a INT)").close()
    build("healthy", served / "locked.duckdb")
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD_WRITE_LOCK, str(served / "locked.duckdb")], stdout=subprocess.PIPE
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().startswith(b"ok")

        async def go() -> dict[str, Any]:
            async with Client(build_server(served / "a.duckdb")) as c:
                names = ("fifo", "dir", "empty", "text", "foreign", "locked", "missing")
                return {n: await c.call_tool("compare_traces", {"before": f"{n}.duckdb"}) for n in names}

        out = anyio.run(go)
    finally:
        holder.kill()
        holder.wait()
    # THEN each is refused, naming the file as the client named it and never the server's directory
    for n, r in out.items():
        text = r.content[0].text
        assert r.is_error, (n, text)
        assert str(tmp_path) not in text and "srv2" not in text, (n, text)
    assert "locked.duckdb is being written by another process" in out["locked"].content[0].text
    assert "fifo.duckdb is a FIFO" in out["fifo"].content[0].text


# -- issue 30: Host and Origin compared whole, not by prefix -----------------------------------------------------
@pytest.mark.parametrize(
    "headers,want",
    [
        ({"host": "127.0.0.1:8090"}, None),
        ({"host": "localhost"}, None),
        ({"host": "[::1]:8090", "origin": "http://[::1]:8090"}, None),
        ({"host": "127.0.0.1:8090", "origin": "http://localhost:8090"}, None),
        ({"host": "127.0.0.1:evil.com"}, 421),
        ({"host": "127.0.0.1:8090.evil.com"}, 421),
        ({"host": "localhost.evil.com:8090"}, 421),
        ({"host": "127.0.0.1:8090", "origin": "http://localhost:8090.evil.com"}, 403),
        ({"host": "127.0.0.1:8090", "origin": "http://localhost:evil.com"}, 403),
        ({"host": "127.0.0.1:8090", "origin": "http://localhost:8090/x"}, 403),
        ({"host": "127.0.0.1:8090", "origin": "http://user@localhost:8090"}, 403),
        ({"host": "127.0.0.1:8090", "origin": "ftp://localhost:8090"}, 403),
    ],
)
def test_host_and_origin_are_parsed_whole(headers: dict[str, str], want: int | None):
    from mcp_server.http import security_for, strict_refusal

    scope = {"headers": [(k.encode(), v.encode()) for k, v in headers.items()]}
    got = strict_refusal(scope, security_for("127.0.0.1", 8090, []))
    assert (got[0] if got else None) == want


# -- issue 30: HTTP read deadlines, keep-alive and a connection cap --------------------------------------------
async def _hello(scope: dict[str, Any], receive: Any, send: Any) -> None:
    if scope["type"] != "http":
        return
    while (await receive()).get("more_body"):
        pass
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
    await send({"type": "http.response.body", "body": b"ok"})


@pytest.fixture
def bounded(monkeypatch: pytest.MonkeyPatch) -> Iterator[int]:
    """A uvicorn server on :func:`mcp_server.http.http_config` with a 1 s read deadline and 3 connections at most."""
    import uvicorn

    from mcp_server import http

    port = free_port()
    config = http.http_config(_hello, "127.0.0.1", port)
    monkeypatch.setattr(http.BoundedH11Protocol, "read_s", 1.0)
    monkeypatch.setattr(http.BoundedH11Protocol, "max_connections", 3)
    server = uvicorn.Server(config)
    th = threading.Thread(target=server.run, daemon=True)
    th.start()
    deadline = time.monotonic() + 10
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.05)
    yield port
    server.should_exit = True
    th.join(10)


def _closed_within(sock: socket.socket, seconds: float) -> bool:
    """True when the server closes ``sock`` within ``seconds`` (it reads EOF or a reset)."""
    sock.settimeout(seconds)
    try:
        while sock.recv(4096):
            pass
        return True
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


@pytest.mark.parametrize(
    "sent",
    [
        b"",
        b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\n",
        b"POST / HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 100\r\n\r\nx",
    ],
    ids=["nothing", "half a head", "a tenth of a body"],
)
def test_a_request_must_arrive_within_the_read_deadline(bounded: int, sent: bytes):
    with socket.create_connection(("127.0.0.1", bounded)) as s:
        s.sendall(sent)
        assert _closed_within(s, 6.0)  # 1 s deadline; generous on a loaded host, and never without it


def test_complete_requests_answer_and_connections_are_capped(bounded: int):
    idle = [socket.create_connection(("127.0.0.1", bounded)) for _ in range(3)]
    try:
        with socket.create_connection(("127.0.0.1", bounded)) as extra:  # the fourth: closed before it is read
            assert _closed_within(extra, 3.0)
    finally:
        for s in idle:
            s.close()
    time.sleep(0.5)
    with socket.create_connection(("127.0.0.1", bounded)) as s:  # slots free again: a whole request is answered
        s.sendall(b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        s.settimeout(5)
        assert s.recv(4096).startswith(b"HTTP/1.1 200")


def test_the_server_raises_its_own_file_limit():
    code = (
        "import resource; N = resource.RLIMIT_NOFILE; resource.setrlimit(N, (256, resource.getrlimit(N)[1]));"
        "from mcp_server.http import raise_file_limit; print(raise_file_limit(), resource.getrlimit(N)[1])"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert int(out[0]) > 256 and out[0] == out[1]


# -- issue 30: who a request is, for the fair queue, is what the client cannot choose -------------------------
class HoldingApp:
    """Records who each request was taken for (the scope's CLIENT_KEY) and holds ``?hold`` requests until
    ``release``; a POST without a session opens one, like the SDK."""

    def __init__(self) -> None:
        self.seen: list[str] = []
        self.release = anyio.Event()

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        from mcp_server.sessions import CLIENT_KEY

        await receive()
        self.seen.append(scope[CLIENT_KEY])
        headers = dict(scope["headers"])
        out: list[tuple[bytes, bytes]] = []
        if b"mcp-session-id" not in headers and scope.get("query_string") != b"hold":
            out = [(b"mcp-session-id", uuid.uuid4().hex.encode())]
        if scope.get("query_string") == b"hold":
            await self.release.wait()
        await send({"type": "http.response.start", "status": 200, "headers": out})
        await send({"type": "http.response.body", "body": b""})


def test_a_forged_session_id_counts_as_the_peer_and_a_real_one_as_its_session():
    app = HoldingApp()
    limits = SessionLimits(app)
    _, sid = run(request(limits, "10.0.0.1"))
    run(request(limits, "10.0.0.1", sid=sid))
    run(request(limits, "10.0.0.1", sid="forged-" + uuid.uuid4().hex))
    run(request(limits, "10.0.0.1", sid="another-forged"))
    assert app.seen == ["peer:10.0.0.1", f"session:{sid}", "peer:10.0.0.1", "peer:10.0.0.1"]


def test_requests_without_a_session_are_capped_per_address():
    app = HoldingApp()
    limits = SessionLimits(app, in_flight=8, queued=64)

    async def go() -> list[int]:
        statuses: list[int] = []

        async def one(addr: str, sid: str | None) -> None:
            statuses.append((await request(limits, addr, sid=sid, query=b"hold"))[0])

        async with anyio.create_task_group() as tg:
            for i in range(80):  # half with a forged session id: still the same address's requests
                tg.start_soon(one, "10.0.0.1", None if i % 2 else f"forged-{i}")
            await anyio.sleep(0.5)
            assert sorted(statuses) == [429] * 8  # 72 held, the rest refused at once
            tg.start_soon(one, "10.0.0.2", None)  # another address is not charged
            await anyio.sleep(0.2)
            app.release.set()
        return statuses

    statuses = anyio.run(go)
    assert statuses.count(200) == 73 and statuses.count(429) == 8


def test_sql_client_ignores_what_the_client_declares():
    from types import SimpleNamespace

    from mcp_server.tools.sql import sql_client

    forged = [(b"mcp-session-id", b"forged")]
    request_ = SimpleNamespace(
        scope={"tracer.client": "peer:127.0.0.1", "headers": forged}, headers={"mcp-session-id": "forged"}
    )
    info = SimpleNamespace(client_info=SimpleNamespace(name="attacker-1", version="1"))
    ctx = SimpleNamespace(
        request_context=SimpleNamespace(request=request_, session=SimpleNamespace(client_params=info))
    )
    assert sql_client(ctx) == "peer:127.0.0.1"  # type: ignore[arg-type]


# -- issue 30: tools under a time budget, argument sizes capped --------------------------------------------------
def test_compare_traces_on_a_crafted_recording_stops_at_the_budget(tmp_path: Path):
    import duckdb

    from mcp_server.state import ToolLimits

    # GIVEN a recording whose cuda_calls is a view that burns CPU (billions of hashes per scan)
    build("healthy", tmp_path / "a.duckdb")
    build("healthy", tmp_path / "crafted.duckdb")
    with duckdb.connect(str(tmp_path / "crafted.duckdb")) as c:
        c.execute("ALTER TABLE cuda_calls RENAME TO cc_real")
        c.execute(
            "CREATE VIEW cuda_calls AS SELECT c.* FROM cc_real c, range(5000000) r "
            "WHERE r.range = 0 OR hash(r.range, c.ts_ns) = 0"
        )

    async def go() -> tuple[Any, float, Any]:
        async with Client(build_server(tmp_path / "a.duckdb", limits=ToolLimits(tool_budget_s=2.0))) as c:
            t = time.monotonic()
            r = await c.call_tool("compare_traces", {"before": "crafted.duckdb"})
            return r, time.monotonic() - t, await c.call_tool("get_trace_stats", {})

    r, took, stats = anyio.run(go)
    # THEN it is stopped at its budget, says so, and the server answers the next call
    assert r.is_error and "stopped after 2 s" in r.content[0].text, r.content[0].text
    assert took < 15, took
    assert not stats.is_error


def test_compare_processes_refuses_two_thousand_pids(db: Path):
    async def go() -> Any:
        async with Client(build_server(db)) as c:
            t = time.monotonic()
            r = await c.call_tool("compare_processes", {"pids": list(range(1, 2001))})
            return r, time.monotonic() - t

    r, took = anyio.run(go)
    assert r.is_error and "2,000 pids is too many: pass at most 64" in r.content[0].text, r.content[0].text
    assert took < 2


# -- issue 30: what a client declares at initialize is kept for the session's life: capped ---------------------
def _init_with(client_info_bytes: int, capabilities_bytes: int = 0) -> dict[str, Any]:
    m = {**INIT, "params": dict(INIT["params"])}  # type: ignore[arg-type]
    m["params"]["clientInfo"] = {"name": "n" * client_info_bytes, "version": "1"}
    m["params"]["capabilities"] = (
        {"experimental": {"x": {"pad": "c" * capabilities_bytes}}} if capabilities_bytes else {}
    )
    return m


def test_an_initialize_declaring_too_much_is_refused_before_the_sdk_keeps_it():
    import json

    from mcp_server.sessions import MAX_CLIENT_DECLARED

    seen: list[bytes] = []

    async def sdk(scope: dict[str, Any], receive: Any, send: Any) -> None:
        seen.append((await receive())["body"])
        await send({"type": "http.response.start", "status": 200, "headers": [(b"mcp-session-id", b"s1")]})
        await send({"type": "http.response.body", "body": b""})

    async def post(body: bytes, chunks: int = 3) -> tuple[int, dict[str, Any]]:
        scope = {"type": "http", "method": "POST", "path": "/mcp", "headers": [], "client": ("10.0.0.1", 1)}
        step = max(1, len(body) // chunks)
        parts = [body[i : i + step] for i in range(0, len(body), step)] or [b""]
        got: dict[str, Any] = {}

        async def receive() -> dict[str, Any]:
            chunk = parts.pop(0)
            return {"type": "http.request", "body": chunk, "more_body": bool(parts)}

        async def send(m: dict[str, Any]) -> None:
            if m["type"] == "http.response.start":
                got["status"] = m["status"]
            elif m.get("body"):
                got["body"] = json.loads(m["body"])

        await SessionLimits(sdk)(scope, receive, send)
        return got["status"], got.get("body", {})

    # a real client's declaration passes, its body whole (sent in three pieces, handed over in one)
    ok = json.dumps(_init_with(MAX_CLIENT_DECLARED - 100)).encode()
    assert run(post(ok))[0] == 200 and seen == [ok]
    # a megabyte of clientInfo, or of capabilities, never reaches the SDK
    for big in (_init_with(1 << 20), _init_with(10, 1 << 20), [_init_with(10, MAX_CLIENT_DECLARED + 1)]):
        status, body = run(post(json.dumps(big).encode()))
        assert status == 400 and "at most 16,384 are accepted" in body["error"]["message"], body
    # an over-long body is refused unread past the cap
    status, body = run(post(b"[" + b" " * (5 << 20) + b"]", chunks=64))
    assert status == 413 and len(seen) == 1


def test_sessions_with_large_declarations_cost_little(db: Path):
    # GIVEN a served recording  WHEN clients open sessions declaring as much as they may, or a megabyte more
    n = 40
    with server(db) as (proc, base):
        url = f"{base}/mcp"
        anyio.run(liveness, url)
        idle = rss(proc.pid)
        with httpx.Client(timeout=30) as c:
            big = [c.post(url, json=_init_with(1 << 20, 1 << 20), headers=ACCEPT) for _ in range(n)]
            kept = [c.post(url, json=_init_with(15 << 10, 15 << 10), headers=ACCEPT) for _ in range(n)]
        grown = rss(proc.pid) - idle
        # THEN the megabyte ones are refused, the others kept, for well under the 3.6 MB a session cost before
        assert {r.status_code for r in big} == {400} and {r.status_code for r in kept} == {200}
        assert grown < n * (400 << 10), f"{grown / n / 1024:.0f} KB per session"
        anyio.run(liveness, url)  # and it serves, right (its speed under load: bench/sql_limits)
