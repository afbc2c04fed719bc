"""tracer.views.export: Chrome trace-event JSON checked against the format's documented fields, the DB rows it came
from, and a real consumer (Holistic Trace Analysis' trace parser); window, budget and CLI behaviour."""

from __future__ import annotations

import gzip
import inspect
import json
from collections import Counter, defaultdict
from pathlib import Path

import duckdb
import pytest
from tracedb import MAIN_PID, S, TraceBuilder, builder, insert_rows

from tracer.analysis.db import open_trace
from tracer.commands.cli import main
from tracer.views.export import DEFAULT_MAX_EVENTS, export_trace
from tracer.views.export.chrome import HOST_PID, PID_LIMIT

HOG = 4242
TRACER_PID = 900
PIN_TID, UNNAMED_TID = MAIN_PID + 7, MAIN_PID + 9


def py(file: str, function: str, line: int) -> tuple:
    return ("python", file, function, file, line)


MAIN = py("/w/train.py", "main", 131)
TRAIN_STEP = [MAIN, py("/w/train.py", "train_step", 88)]
# a library frame inside the user's line: the line is the user's (train.py:131 main)
IN_TORCH = [MAIN, py("/usr/lib/python3/dist-packages/torch/nn/modules/module.py", "_call_impl", 1520)]
PIN = [py("/w/pin.py", "pin", 10)]
COPY = [py("/w/pin.py", "copy", 20)]
MEMCPY = [("native", "/lib/x86_64-linux-gnu/libc.so.6", "memcpy", None, None)]
# (pid, tid, sec) -> (stack, samples, in_call, kernel) rows, and the line each stack names
SAMPLES = {
    (MAIN_PID, MAIN_PID, 3): [(TRAIN_STEP, 50, False, False), (TRAIN_STEP, 5, True, False),
                              (IN_TORCH, 30, False, False), (IN_TORCH, 2, False, True)],
    (MAIN_PID, MAIN_PID, 4): [(IN_TORCH, 70, False, False), (TRAIN_STEP, 10, False, False)],
    (MAIN_PID, MAIN_PID, 6): [(TRAIN_STEP, 20, False, False)],
    (MAIN_PID, PIN_TID, 3): [(PIN, 40, False, False), (COPY, 30, False, False), (MEMCPY, 20, False, True),
                             (None, 10, False, False)],
    (MAIN_PID, UNNAMED_TID, 30): [(PIN, 3, False, False)],
}  # fmt: skip
LINE = {
    id(TRAIN_STEP): "train.py:88 train_step",
    id(IN_TORCH): "train.py:131 main",
    id(PIN): "pin.py:10 pin",
    id(COPY): "pin.py:20 copy",
    id(MEMCPY): "libc.so.6 memcpy",
    id(None): "?",
}
HZ = 99
PAGE_ALLOC = {(MAIN_PID, 3): 40 << 20, (MAIN_PID + 1, 3): 8 << 20}  # (pid, sec) -> bytes
PHASES = {"X", "i", "C", "M", "s", "f"}
METADATA = {"process_name", "process_labels", "process_sort_index", "thread_name", "thread_sort_index"}


def contention(path: Path) -> TraceBuilder:
    """The cpu_contention scenario plus what schema v2 adds: wakers, a tracer process, a named extra thread and
    per-thread page allocation; and the on-CPU samples of SAMPLES."""
    b = builder("cpu_contention")
    for r in b.sched:
        if r["pid"] != MAIN_PID and r["reason"] == "io":
            r.update(waker_pid=MAIN_PID, waker_tid=MAIN_PID, waker_comm="python3")
    b.processes.append(dict(pid=TRACER_PID, ppid=1, comm="tracer", cmdline="tracer record", first_ns=0, role="tracer"))
    b.call(3 * S + 123_456, 7_891, "cudaMalloc", tid=MAIN_PID + 7, bytes=1 << 20)  # a call on a second thread
    b.thread(MAIN_PID, MAIN_PID + 7, "pin_memory")
    for (pid, tid, sec), rows in SAMPLES.items():
        for stack, n, in_call, kernel in rows:
            sid = b.stack(stack) if stack else None
            b.samples(sec, sid, n, pid=pid, tid=tid, in_call=in_call, kernel=kernel, hz=HZ)
    b.write(path)
    con = duckdb.connect(str(path))
    try:
        # exactly these rows, whatever the builder derives itself
        con.execute("DELETE FROM thread_breakdown")
        insert_rows(
            con,
            "thread_breakdown",
            [dict(sec=sec, pid=pid, tid=pid, page_alloc_bytes=v) for (pid, sec), v in PAGE_ALLOC.items()],
        )
    finally:
        con.close()
    return b


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> tuple[Path, TraceBuilder]:
    p = tmp_path_factory.mktemp("export") / "c.duckdb"
    return p, contention(p)


@pytest.fixture(scope="module")
def exported(built, tmp_path_factory) -> tuple[dict, str, TraceBuilder]:
    db, b = built
    out = tmp_path_factory.mktemp("json") / "trace.json"
    with open_trace(db) as conn:
        export_trace(conn, out, max_events=None)
    text = out.read_text()
    return json.loads(text), text, b


def by_ph(trace: dict, ph: str) -> list[dict]:
    return [e for e in trace["traceEvents"] if e["ph"] == ph]


def test_every_event_has_the_documented_fields(exported):
    trace, _, _ = exported
    assert trace["displayTimeUnit"] == "ms" and trace["schemaVersion"] == 1
    for e in trace["traceEvents"]:
        assert e["ph"] in PHASES, e
        assert isinstance(e["name"], str) and isinstance(e["pid"], int) and isinstance(e["tid"], int), e
        assert isinstance(e["ts"], (int, float)), e
        if e["ph"] == "X":
            assert e["dur"] >= 0 and isinstance(e["cat"], str), e
        if e["ph"] == "i":
            assert e["s"] in ("g", "p", "t"), e
        if e["ph"] in ("s", "f"):
            assert isinstance(e["id"], int) and e["cat"], e
        if e["ph"] == "f":
            assert e["bp"] == "e", e
        if e["ph"] == "C":
            assert e["args"] and all(isinstance(v, (int, float)) for v in e["args"].values()), e
        if e["ph"] == "M":
            assert e["name"] in METADATA, e


def test_base_time_is_the_session_start(exported, built):
    trace, _, _ = exported
    with duckdb.connect(str(built[0]), read_only=True) as c:
        start_ns = c.execute("SELECT epoch_ns(started_at) FROM session").fetchall()[0][0]
    assert trace["baseTimeNanoseconds"] == start_ns


def test_cuda_calls_are_complete_events_with_their_row(exported):
    trace, text, b = exported
    calls = [e for e in by_ph(trace, "X") if e["cat"].startswith("cuda_")]
    assert len(calls) == len(b.cuda_calls)
    assert Counter(e["cat"] for e in calls) == Counter(f"cuda_{r['layer']}" for r in b.cuda_calls)
    assert Counter((e["name"], e["pid"], e["tid"]) for e in calls) == Counter(
        (r["op"], r["pid"], r["tid"]) for r in b.cuda_calls
    )
    # sub-µs precision survives: ts and dur are µs with three decimals, written from integer ns
    assert '"ts":3000123.456,"dur":7.891' in text
    # the slowest call that waited in the run queue (inside a sync, behind the hog)
    slow = max((r for r in b.cuda_calls if r.get("runq_ns")), key=lambda r: r["dur_ns"])
    e = next(e for e in calls if round(e["ts"] * 1000) == slow["ts_ns"] and e["name"] == slow["op"])
    assert round(e["dur"] * 1000) == slow["dur_ns"]
    assert e["args"]["runq_us"] == slow["runq_ns"] / 1e3 and e["args"]["off_cpu_us"] == slow["off_cpu_ns"] / 1e3
    assert e["args"]["python"] == "train.py:88 train_step"
    assert e["args"]["stack"] == [
        "train.py:140 <module>",
        "train.py:131 main",
        "train.py:88 train_step",
        "libtorch_cuda.so at::native::_local_scalar_dense_cuda",
        "libcudart.so.12 cudaStreamSynchronize",
    ]
    copy = next(e for e in calls if e["name"] == "cudaMemcpyAsync")
    assert copy["args"]["bytes"] == 4 << 20 and copy["args"]["kind"] == "HtoD" and copy["args"]["stream"] == 7


def test_off_cpu_slices_say_who_held_the_cpu_and_who_woke_the_thread(exported):
    trace, _, b = exported
    off = [e for e in by_ph(trace, "X") if e["name"].startswith("off-CPU")]
    assert len(off) == len(b.sched)
    assert Counter(e["name"] for e in off) == Counter(f"off-CPU {r['reason']}" for r in b.sched)
    hog = [e for e in off if e["args"].get("held_cpu_pid") == HOG]
    assert len(hog) == sum(r["preempted_by_pid"] == HOG for r in b.sched) and hog[0]["args"]["held_cpu"] == (
        f"stress-ng ({HOG})"
    )
    woken = Counter(e["args"]["woken_by"] for e in off if "woken_by" in e["args"])
    assert woken == Counter(
        f"{r['waker_comm']} ({r['waker_pid']}/{r['waker_tid']})" for r in b.sched if r.get("waker_pid") is not None
    )
    assert woken[f"python3 ({MAIN_PID}/{MAIN_PID})"] > 0


def _enclosing(slices: list[dict], pid: int, tid: int, ts: float) -> list[dict]:
    return [e for e in slices if e["pid"] == pid and e["tid"] == tid and e["ts"] <= ts <= e["ts"] + e["dur"]]


def test_flows_link_the_waiting_call_to_the_process_that_held_the_cpu(exported):
    trace, _, b = exported
    x = by_ph(trace, "X")
    starts = {e["id"]: e for e in by_ph(trace, "s")}
    ends = {e["id"]: e for e in by_ph(trace, "f")}
    assert starts.keys() == ends.keys()
    # the hog's waits inside syncs (the run-queue time ending a sleep) start flows; the Python-gap preemptions and
    # the worker's short ones (t = 0.3, 5.3 s...) fall inside no call
    in_calls = [
        r
        for r in b.sched
        if r["preempted_by_pid"] is not None
        and any(c["tid"] == r["tid"] and c["ts_ns"] <= r["ts_ns"] < c["ts_ns"] + c["dur_ns"] for c in b.cuda_calls)
    ]
    assert len(starts) == len(in_calls) > 0
    for fid, s in starts.items():
        around = _enclosing(x, s["pid"], s["tid"], s["ts"])
        assert "cudaStreamSynchronize" in {e["name"] for e in around}, around
        assert any(e["name"].startswith("off-CPU") and e["args"].get("held_cpu_pid") == HOG for e in around), around
        f = ends[fid]
        held = _enclosing(x, f["pid"], f["tid"], f["ts"])
        assert f["pid"] == HOG and [e["name"] for e in held] == ["held the CPU"]
        assert f["tid"] > PID_LIMIT and f["ts"] >= s["ts"]
    names = {(e["pid"], e["name"]): e["args"] for e in by_ph(trace, "M")}
    assert names[(HOG, "process_name")] == {"name": "stress-ng"}
    assert "not traced" in names[(HOG, "process_labels")]["labels"]


def test_tracks_are_named_and_the_main_process_comes_first(exported):
    trace, _, b = exported
    meta = by_ph(trace, "M")
    names = {e["pid"]: e["args"]["name"] for e in meta if e["name"] == "process_name"}
    assert {p["pid"]: p["comm"] for p in b.processes}.items() <= names.items()
    labels = {e["pid"]: e["args"]["labels"] for e in meta if e["name"] == "process_labels"}
    assert labels[MAIN_PID] == "main" and labels[MAIN_PID + 1] == "DataLoader worker"
    assert labels[TRACER_PID] == "tracer" and names[HOST_PID] == "host"
    order = {e["pid"]: e["args"]["sort_index"] for e in meta if e["name"] == "process_sort_index"}
    assert order[MAIN_PID] == min(order.values()) and order[TRACER_PID] > order[MAIN_PID + 1]
    threads = {(e["pid"], e["tid"]): e["args"]["name"] for e in meta if e["name"] == "thread_name"}
    assert threads[(MAIN_PID, MAIN_PID)] == f"thread {MAIN_PID} (python3)"
    assert threads[(MAIN_PID, MAIN_PID + 7)] == f"thread {MAIN_PID + 7} (pin_memory)"
    # every thread that carries an event has a name
    carried = {(e["pid"], e["tid"]) for e in by_ph(trace, "X")}
    assert carried <= threads.keys()


def test_lifecycle_and_chains_are_instants(exported):
    trace, _, b = exported
    inst = by_ph(trace, "i")
    life = [e for e in inst if e.get("cat") == "process"]
    assert Counter((e["name"], e["pid"], round(e["ts"] * 1000)) for e in life) == Counter(
        (r["kind"], r["pid"], r["ts_ns"]) for r in b.process_events
    )
    assert all(e["s"] == "p" for e in life)
    chains = [e for e in inst if e.get("cat") == "causal_chain"]
    # the hog's chain first; the GPU-bound note the scenario's long syncs also earn comes after it
    assert [e["name"] for e in chains] == ["HIGH cpu_contention", "LOW gpu_bound"] and chains[0]["s"] == "g"
    assert "stress-ng" in chains[0]["args"]["summary"] and 20 <= chains[0]["ts"] / 1e6 < 40


def test_host_samples_and_page_allocation_are_counters(exported):
    trace, _, b = exported
    counters = by_ph(trace, "C")
    busy = [e for e in counters if e["name"] == "CPU busy" and e["pid"] == HOST_PID]
    assert [(round(e["ts"] / 1e6), e["args"]["%"]) for e in busy] == [
        (h["ts_ns"] // S, round(h["cpu_busy_pct"], 3)) for h in b.host_samples
    ]
    host_alloc = [e["args"]["MB/s"] for e in counters if e["name"] == "page alloc host"]
    # samples 1 s apart: bytes in the interval are bytes per second
    assert host_alloc == [round(h["page_alloc_bytes"] / 1e6, 3) for h in b.host_samples]
    per_pid = {(e["pid"], round(e["ts"] / 1e6)): e["args"]["MB/s"] for e in counters if e["name"] == "page alloc"}
    assert per_pid == {k: round(v / 1e6, 3) for k, v in PAGE_ALLOC.items()}


def sampled_seconds() -> dict[tuple[int, int, int], dict]:
    """(pid, tid, sec) -> what SAMPLES says of that thread-second: samples and cpu_ns by line, in/kernel counts."""
    out = {}
    for key, rows in SAMPLES.items():
        n, ns = Counter(), Counter()
        for stack, k, _, _ in rows:
            n[LINE[id(stack)]] += k
            ns[LINE[id(stack)]] += k * S // HZ
        out[key] = dict(
            n=n,
            ns=ns,
            in_call=sum(k for _, k, ic, _ in rows if ic),
            kernel=sum(k for _, k, _, kern in rows if kern),
        )
    return out


def test_on_cpu_samples_are_instants_on_the_thread_track_named_by_the_top_line(exported):
    trace, _, _ = exported
    inst = [e for e in by_ph(trace, "i") if e.get("cat") == "cpu_samples"]
    # one instant per sampled thread-second, on that thread's track, at the start of the second
    got = {(e["pid"], e["tid"], round(e["ts"] / 1e6)): e for e in inst}
    assert len(inst) == len(got) == len(SAMPLES) and got.keys() == SAMPLES.keys()
    for key, want in sampled_seconds().items():
        e = got[key]
        top = sorted(want["n"], key=lambda line: -want["n"][line])[:3]
        assert e["s"] == "t" and e["ts"] == key[2] * 1e6 and e["name"] == f"on-CPU {top[0]}"
        assert e["args"]["lines"] == [
            {"line": line, "samples": want["n"][line], "cpu_ms": round(want["ns"][line] / 1e6, 3)} for line in top
        ]
        assert e["args"]["samples"] == sum(want["n"].values())
        assert e["args"]["cpu_ms"] == round(sum(want["ns"].values()) / 1e6, 3)
        assert e["args"].get("in_call_samples") == (want["in_call"] or None)
        assert e["args"].get("kernel_samples") == (want["kernel"] or None)
        assert e["args"].get("more_lines") == (len(want["n"]) - len(top) or None)
    # by hand: second 3 of the main thread ran train_step most (55 of 87 samples, 5 inside a CUDA call); its
    # library frames count for the user's line that called them (train.py:131)
    main3 = got[(MAIN_PID, MAIN_PID, 3)]
    assert main3["name"] == "on-CPU train.py:88 train_step"
    assert [(x["line"], x["samples"]) for x in main3["args"]["lines"]] == [
        ("train.py:88 train_step", 55),
        ("train.py:131 main", 32),
    ]
    assert (main3["args"]["samples"], main3["args"]["in_call_samples"], main3["args"]["kernel_samples"]) == (87, 5, 2)
    assert got[(MAIN_PID, MAIN_PID, 4)]["name"] == "on-CPU train.py:131 main"
    # the pin thread ran four lines that second: the top three are listed (a native one by its function), the
    # fourth (a stack not captured) counted
    pin = got[(MAIN_PID, PIN_TID, 3)]["args"]
    assert [x["line"] for x in pin["lines"]] == ["pin.py:10 pin", "pin.py:20 copy", "libc.so.6 memcpy"]
    assert pin["more_lines"] == 1 and pin["samples"] == 100
    # a thread known only by its samples gets a named track too
    threads = {(e["pid"], e["tid"]): e["args"]["name"] for e in by_ph(trace, "M") if e["name"] == "thread_name"}
    assert threads[(MAIN_PID, UNNAMED_TID)] == f"thread {UNNAMED_TID} (python3)"
    assert {(e["pid"], e["tid"]) for e in inst} <= threads.keys()


def test_on_cpu_time_is_a_counter_per_thread_that_falls_to_zero(exported):
    trace, _, _ = exported
    cpu = [e for e in by_ph(trace, "C") if e["name"].startswith("on-CPU")]
    assert all(e["name"] == f"on-CPU thread {e['tid']}" and e["pid"] == MAIN_PID for e in cpu)
    got = {(e["tid"], e["ts"] / 1e6): e["args"]["ms/s"] for e in cpu}
    ms = {(tid, sec): round(sum(w["ns"].values()) / 1e6, 3) for (_, tid, sec), w in sampled_seconds().items()}
    # each sampled second, then 0 in the first second after it that was not sampled
    zeros = {(MAIN_PID, 5): 0, (MAIN_PID, 7): 0, (PIN_TID, 4): 0, (UNNAMED_TID, 31): 0}
    assert len(cpu) == len(got) and got == {**ms, **zeros}
    assert got[(MAIN_PID, 3)] == round(87 * (S // HZ) / 1e6, 3)


def test_on_cpu_samples_keep_to_the_window(built, tmp_path):
    out = tmp_path / "w.json"
    with open_trace(built[0]) as conn:
        s = export_trace(conn, out, start_s=4.0, end_s=6.5, max_events=None)
    trace = json.loads(out.read_text())
    inst = [(e["tid"], e["ts"] / 1e6) for e in by_ph(trace, "i") if e.get("cat") == "cpu_samples"]
    cpu = [(e["tid"], e["ts"] / 1e6, e["args"]["ms/s"]) for e in by_ph(trace, "C") if e["name"].startswith("on-CPU")]
    assert inst == [(MAIN_PID, 4), (MAIN_PID, 6)] and s.events["cpu_samples"] == 2
    # the zero after second 6 (at 7 s) is past the window's end
    assert [(t, ts) for t, ts, _ in cpu] == [(MAIN_PID, 4), (MAIN_PID, 5), (MAIN_PID, 6)] and cpu[1][2] == 0


def test_a_recording_without_samples_exports(tmp_path):
    p = tmp_path / "old.duckdb"
    b = contention(p)
    with duckdb.connect(str(p)) as c:
        c.execute("DROP TABLE cpu_samples")
    with open_trace(p) as conn:
        s = export_trace(conn, tmp_path / "old.json")
    trace = json.loads((tmp_path / "old.json").read_text())
    assert "cpu_samples" not in s.events and s.calls_written == len(b.cuda_calls)
    assert not [e for e in trace["traceEvents"] if e["name"].startswith("on-CPU")]
    threads = {e["tid"] for e in by_ph(trace, "M") if e["name"] == "thread_name"}
    assert UNNAMED_TID not in threads and PIN_TID in threads


def test_window_keeps_what_overlaps_it(built, tmp_path):
    db, b = built
    out = tmp_path / "w.json"
    with open_trace(db) as conn:
        s = export_trace(conn, out, start_s=20.0, end_s=21.0, max_events=None)
    trace = json.loads(out.read_text())
    t0, t1 = 20 * S, 21 * S
    want_calls = [r for r in b.cuda_calls if r["ts_ns"] < t1 and r["ts_ns"] + r["dur_ns"] > t0]
    calls = [e for e in by_ph(trace, "X") if e["cat"].startswith("cuda_")]
    assert len(calls) == s.calls_written == s.calls_in_window == len(want_calls)
    assert all(t0 / 1e3 <= e["ts"] + e["dur"] and e["ts"] < t1 / 1e3 for e in by_ph(trace, "X"))
    assert all(t0 / 1e3 <= e["ts"] < t1 / 1e3 for e in by_ph(trace, "C") + by_ph(trace, "i"))
    assert s.window_start_s == 20.0 and s.window_end_s == 21.0


def test_max_events_keeps_the_longest_and_says_what_it_dropped(built, tmp_path):
    db, b = built
    out = tmp_path / "m.json"
    n = 500
    with open_trace(db) as conn:
        s = export_trace(conn, out, max_events=n)
    trace = json.loads(out.read_text())
    rows = sorted([r["dur_ns"] for r in b.cuda_calls] + [r["dur_ns"] for r in b.sched], reverse=True)
    written = [e for e in by_ph(trace, "X") if e["cat"].startswith("cuda_") or e["name"].startswith("off-CPU")]
    assert len(written) == s.calls_written + s.off_cpu_written
    assert n <= len(written) <= n + rows.count(rows[n - 1])  # ties at the cut are kept together
    assert min(round(e["dur"] * 1000) for e in written) == rows[n - 1] == round(s.min_kept_dur_us * 1e3)
    assert s.calls_in_window == len(b.cuda_calls) and s.off_cpu_in_window == len(b.sched)
    note = [e for e in by_ph(trace, "i") if e["name"] == "export note"]
    dropped = next(x for x in s.notes if "--max-events" in x)
    assert dropped in [e["args"]["note"] for e in note] and dropped in trace["cudaHostTracer"]["notes"]
    assert f"left out {len(b.cuda_calls) - s.calls_written:,} calls" in dropped


def test_hta_parses_the_file_as_a_pytorch_trace(exported, tmp_path):
    """A real consumer: Holistic Trace Analysis (PyTorch's trace analysis library) loads the file with its own
    parser and sees the CUDA runtime and driver calls with their streams and durations."""
    from hta.common.trace import Trace

    trace, text, b = exported
    (tmp_path / "rank0.json").write_text(text)
    t = Trace(trace_dir=str(tmp_path))
    t.parse_traces()
    df = t.get_trace(0)
    sym = t.symbol_table.get_sym_table()
    cats = Counter(sym[i] for i in df["cat"])
    assert cats["cuda_runtime"] == sum(r["layer"] == "runtime" for r in b.cuda_calls)
    assert cats["cuda_driver"] == sum(r["layer"] == "driver" for r in b.cuda_calls)
    names = df["name"].map(lambda i: sym[i])
    syncs = df[names == "cudaStreamSynchronize"]
    assert len(syncs) == sum(r["op"] == "cudaStreamSynchronize" for r in b.cuda_calls)
    assert set(syncs["stream"]) == {7} and set(syncs["pid"]) == {MAIN_PID}
    # HTA rounds ns traces to whole µs (ts up, end down): each duration within 1 µs of ours
    want = sorted(r["dur_ns"] / 1e3 for r in b.cuda_calls if r["op"] == "cudaStreamSynchronize")
    assert all(abs(a - w) <= 1.0 for a, w in zip(sorted(syncs["dur"]), want, strict=True))


def test_v1_db_without_the_v2_columns_exports(tmp_path):
    p = tmp_path / "v1.duckdb"
    b = builder("cpu_contention")
    b.write(p)
    c = duckdb.connect(str(p))
    for table, col in [
        ("sched", "waker_pid"),
        ("sched", "in_call"),
        ("processes", "role"),
        ("cuda_calls", "kernel_note"),
    ]:
        c.execute(f"ALTER TABLE {table} DROP COLUMN {col}")
    c.execute("DROP TABLE threads")
    c.execute("DROP TABLE thread_breakdown")
    c.execute("UPDATE meta SET value = '1' WHERE key = 'schema_version'")
    c.close()
    with open_trace(p) as conn:
        s = export_trace(conn, tmp_path / "v1.json")
    trace = json.loads((tmp_path / "v1.json").read_text())
    assert s.calls_written == len(b.cuda_calls) and len(by_ph(trace, "s")) == len(by_ph(trace, "f")) > 0


def test_gzip_output(built, tmp_path):
    out = tmp_path / "t.json.gz"
    with open_trace(built[0]) as conn:
        s = export_trace(conn, out, max_events=100)
    with gzip.open(out, "rt") as fh:
        trace = json.load(fh)
    assert len(trace["traceEvents"]) == sum(s.events.values())


# -- CLI ----------------------------------------------------------------------------------------------------------


def test_cli_writes_the_file_and_says_so(built, tmp_path, capsys):
    out = tmp_path / "cli.json"
    assert main(["export", "--db", str(built[0]), "-o", str(out), "--max-events", "300", "--json"]) == 0
    cap = capsys.readouterr()
    summary = json.loads(cap.out)
    assert summary["path"] == str(out) and summary["calls_written"] + summary["off_cpu_written"] >= 300
    err = " ".join(cap.err.split())
    assert f"wrote {out}" in err and "ui.perfetto.dev" in err and "--max-events 300: kept the longest" in err
    assert len(json.loads(out.read_text())["traceEvents"]) == sum(summary["events"].values())


def test_cli_streams_to_stdout(built, capsys):
    assert main(["export", "--db", str(built[0]), "-o", "-", "--start", "30", "--end", "31"]) == 0
    trace = json.loads(capsys.readouterr().out)
    assert by_ph(trace, "X") and all(e["ts"] < 31e6 for e in by_ph(trace, "X"))


@pytest.mark.parametrize(
    "args,needle",
    [
        (["--format", "svg"], "unknown format 'svg'"),
        (["--start", "5", "--end", "5"], "--end 5 is not after --start 5"),
        (["--start", "-1"], "before the recording began"),
        (["--max-events", "-3"], "negative"),
        (["-o", "/nonexistent-dir/t.json"], "no directory /nonexistent-dir"),
        (["-o", "-", "--json"], "both write to stdout"),
    ],
)
def test_cli_usage_errors(built, tmp_path, capsys, args, needle):
    argv = ["export", "--db", str(built[0])]
    if "-o" not in args:
        argv += ["-o", str(tmp_path / "x.json")]
    assert main(argv + args) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert needle in err and "Traceback" not in err
    assert not (tmp_path / "x.json").exists()


def test_cli_refuses_to_overwrite_without_force(built, tmp_path, capsys):
    out = tmp_path / "keep.json"
    out.write_text("mine")
    assert main(["export", "--db", str(built[0]), "-o", str(out)]) == 2
    assert "--force" in capsys.readouterr().err and out.read_text() == "mine"
    assert main(["export", "--db", str(built[0]), "-o", str(out), "--force"]) == 0
    assert json.loads(out.read_text())["traceEvents"]


def test_cli_default_budget_is_the_library_default():
    from tracer.commands.analysis import export

    assert inspect.signature(export).parameters["max_events"].default == DEFAULT_MAX_EVENTS


def test_failed_export_leaves_no_file(built, tmp_path, monkeypatch):
    import tracer.views.export.chrome as chrome

    def boom(*a, **k):
        raise RuntimeError("disk full")

    monkeypatch.setattr(chrome, "_counters", boom)
    out = tmp_path / "half.json"
    with open_trace(built[0]) as conn, pytest.raises(RuntimeError):
        export_trace(conn, out)
    assert list(tmp_path.iterdir()) == []


def test_flow_ids_are_unique_and_pairs_ordered(exported):
    trace, _, _ = exported
    ids = defaultdict(list)
    for e in by_ph(trace, "s") + by_ph(trace, "f"):
        ids[e["id"]].append(e["ph"])
    assert ids and all(sorted(v) == ["f", "s"] for v in ids.values())


def test_each_rank_leads_with_its_own_track_named_with_rank_and_host(tmp_path):
    from tests.test_ranks import AGENT, RANK_PIDS, job

    # GIVEN a 3-rank job under torchrun's agent (the builder's host is gpu-box-1)
    job().write(tmp_path / "job.duckdb")
    with open_trace(tmp_path / "job.duckdb") as conn:
        export_trace(conn, tmp_path / "job.json", max_events=None)
    meta = [e for e in json.loads((tmp_path / "job.json").read_text())["traceEvents"] if e["ph"] == "M"]
    names = {e["pid"]: e["args"]["name"] for e in meta if e["name"] == "process_name"}
    order = {e["pid"]: e["args"]["sort_index"] for e in meta if e["name"] == "process_sort_index"}
    # THEN each rank's process is named with its rank and host, and the ranks come first, in rank order
    assert [names[p] for p in RANK_PIDS] == [f"rank {r}: python on gpu-box-1" for r in range(3)]
    assert sorted(order, key=order.get)[:3] == list(RANK_PIDS)
    # AND the agent, no rank, keeps its own name after them
    assert not names[AGENT].startswith("rank") and order[AGENT] > max(order[p] for p in RANK_PIDS)
