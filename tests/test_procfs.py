"""tracer.procfs: the one /proc/PID/stat parser, start ticks, boot id and environ, against real processes."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from tracer import procfs


def test_a_comm_with_spaces_and_parentheses_parses():
    # GIVEN a stat line whose comm holds ") (" and spaces (a thread may name itself anything)
    fields = ["S", "42"] + [str(i) for i in range(5, 22)] + ["777"] + ["0"] * 30
    st = procfs.parse_stat("123 (a) (b c) " + " ".join(fields))
    # THEN the fields are counted from the last ')'
    assert (st.comm, st.state, st.ppid, st.start_ticks) == ("a) (b c", "S", 42, 777)


def test_start_ticks_and_boot_id_match_the_kernel():
    # GIVEN this process  THEN its start ticks are field 22 as the kernel wrote it, before now
    raw = open("/proc/self/stat").read().rsplit(")", 1)[1].split()
    assert procfs.process_start_ticks(os.getpid()) == int(raw[22 - 3])
    uptime_ticks = float(open("/proc/uptime").read().split()[0]) * os.sysconf("SC_CLK_TCK")
    assert 0 < procfs.process_start_ticks(os.getpid()) <= uptime_ticks + 1
    assert 0 <= procfs.seconds_since_start() < float(open("/proc/uptime").read().split()[0]) + 1
    assert procfs.boot_id() == open("/proc/sys/kernel/random/boot_id").read().strip()


def test_a_zombie_and_a_reaped_process_are_gone():
    # GIVEN a child that exited but is not reaped yet (a zombie), then reaped
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    while (st := procfs.stat(p.pid)) is not None and not st.zombie:
        time.sleep(0.01)
    # THEN a zombie has a stat but is not alive and has no start ticks; once reaped it has nothing
    assert not procfs.is_alive(p.pid) and procfs.process_start_ticks(p.pid) is None
    p.wait()
    assert procfs.stat(p.pid) is None and not procfs.is_alive(p.pid)


def test_environ_is_what_the_process_was_started_with():
    # GIVEN a child started with launcher variables
    env = {**os.environ, "RANK": "2", "WORLD_SIZE": "3", "WEIRD": "a=b"}
    code = "import sys, time; print('up', flush=True); time.sleep(5)"
    p = subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE)
    try:
        assert p.stdout.readline() == b"up\n"  # past its exec: environ is the new image's
        got = procfs.environ(p.pid)
        # THEN they read back exactly, a value holding '=' included
        assert got is not None and (got["RANK"], got["WORLD_SIZE"], got["WEIRD"]) == ("2", "3", "a=b")
    finally:
        p.kill()
        p.wait()
    assert procfs.environ(p.pid) is None


def test_cpu_lists_parse_and_format():
    assert procfs.parse_cpu_list("0-2,5,7-8\n") == frozenset({0, 1, 2, 5, 7, 8})
    assert procfs.parse_cpu_list("") == frozenset()
    assert procfs.format_cpu_list({0, 1, 2, 5, 7, 8}) == "0-2,5,7-8"
    assert procfs.format_cpu_list({3}) == "3"


def test_affinity_of_a_pinned_child():
    # GIVEN a child pinned to one CPU of this machine
    cpu = min(os.sched_getaffinity(0))
    p = subprocess.Popen([sys.executable, "-c", f"import os,time; os.sched_setaffinity(0, {{{cpu}}}); time.sleep(5)"])
    try:
        deadline = time.monotonic() + 5
        while procfs.cpus_allowed(p.pid) != frozenset({cpu}) and time.monotonic() < deadline:
            time.sleep(0.02)
        # THEN its affinity reads as that CPU
        assert procfs.cpus_allowed(p.pid) == frozenset({cpu})
    finally:
        p.kill()
        p.wait()
    assert procfs.cpus_allowed(p.pid) is None  # gone


def test_cgroup_v2_quota_and_throttling(tmp_path, monkeypatch):
    # GIVEN a v2 tree (no v1 cpu controller) where /job has half a CPU and has been throttled 1.5 s
    root = tmp_path / "cg"
    (root / "job" / "step").mkdir(parents=True)
    (root / "cgroup.controllers").write_text("cpuset cpu\n")
    (root / "job" / "cpu.max").write_text("50000 100000\n")
    (root / "job" / "step" / "cpu.max").write_text("max 100000\n")
    (root / "job" / "cpu.stat").write_text("usage_usec 9\nnr_periods 40\nnr_throttled 30\nthrottled_usec 1500000\n")
    (root / "job" / "step" / "cpuset.cpus.effective").write_text("0-1\n")
    monkeypatch.setattr(procfs, "CGROUP_ROOT", str(root))
    monkeypatch.setattr(procfs, "_cgroup_lines", lambda pid: {"": "/job/step"})
    cg = procfs.cgroup_cpu(1)
    # THEN the quota is the ancestor's, with its throttling, and the cpuset the process's own cgroup's
    assert cg == procfs.CgroupCpu("/job/step", "/job", 50_000, 100_000, frozenset({0, 1}), 40, 30, 1_500_000_000)


def test_per_cpu_times_cover_every_cpu():
    t = procfs.cpu_times()
    assert set(t) >= set(os.sched_getaffinity(0)) and all(b >= 0 and i >= 0 for b, i in t.values())
