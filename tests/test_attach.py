"""tracer.recorder.attach: a node agent meets every file a process opens under a CUDA library's name; one that is
not an ELF file (a test's stand-in, a truncated download) is noted and skipped, never the end of the recording."""

from __future__ import annotations

from types import SimpleNamespace

from tracer.recorder import targets
from tracer.recorder.attach import Attacher


def test_a_libcuda_named_file_that_is_no_elf_is_noted_not_fatal(tmp_path):
    bogus = tmp_path / "libcuda.so.1"
    bogus.write_bytes(b"not an ELF file\n" * 8)
    a = Attacher(bpf=None, progs=SimpleNamespace(), resolver=None, cycler=None)  # type: ignore[arg-type]
    assert a.attach(targets.resolve_libraries([str(bogus)])) == []
    assert a.notes and "could not attach" in a.notes[0] and str(bogus) in a.notes[0]
    assert a.attached == {}


class _Held:
    """The ``held`` BPF map's interface: pid -> the monotonic ns its hold began."""

    def __init__(self, held: dict[int, int]) -> None:
        self.d = held

    def Key(self, pid: int) -> SimpleNamespace:  # noqa: N802 (bcc's name)
        return SimpleNamespace(value=pid)

    def items(self):
        return [(SimpleNamespace(value=p), SimpleNamespace(value=t)) for p, t in self.d.items()]

    def __getitem__(self, k):
        return SimpleNamespace(value=self.d[k.value])

    def __delitem__(self, k):
        del self.d[k.value]


def test_a_hold_whose_open_event_was_lost_is_registered_then_continued(tmp_path):
    import signal
    import subprocess
    import sys
    import time
    from pathlib import Path

    lib = Path(__file__).resolve().parents[1] / "fixtures" / "build" / "libcudart.so.12"
    # GIVEN a process stopped right after opening a CUDA runtime (as libload.bpf.c holds a joining process), whose
    # open event never reached the recorder
    code = f"import os, signal; f = open({str(lib)!r}, 'rb'); os.kill(os.getpid(), signal.SIGSTOP); print('ran')"
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 30
        while Path(f"/proc/{proc.pid}/stat").read_text().split(") ")[1][0] != "T":
            assert time.monotonic() < deadline, "the stand-in never stopped"
            time.sleep(0.02)
        a = Attacher(bpf={"held": _Held({proc.pid: 1})}, progs=SimpleNamespace(), resolver=None, cycler=None)  # type: ignore[arg-type]
        seen: list[tuple[str, object]] = []
        a.attach = lambda found: seen.append(("attach", sorted(x.kind for x in found))) or []  # type: ignore[method-assign]
        # WHEN its hold is found stale
        a.release_stale(older_than_ns=0, on_lost=lambda pid: seen.append(("lost", pid)))
        # THEN it is registered (on_lost), its open library attached, while still stopped; then it runs on
        assert seen == [("lost", proc.pid), ("attach", ["cudart"])]
        assert proc.communicate(timeout=30)[0].strip() == "ran"
        assert a.bpf["held"].d == {} and "lost" in a.notes[0]
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGCONT)
            proc.kill()
            proc.wait()


def test_the_node_agent_registers_a_lost_join_only_if_it_joined_in_kernel():
    from tracer.recorder.session import Recorder

    calls: list[tuple[str, int]] = []

    def fake(all_cuda: bool, in_kernel: set[int], in_tree: set[int]) -> SimpleNamespace:
        return SimpleNamespace(
            all_cuda=all_cuda,
            tree=SimpleNamespace(procs=dict.fromkeys(in_tree)),
            bpf={"targets": _Targets(in_kernel)},
            _join=lambda pid: calls.append(("join", pid)),
            _before_continue=lambda pid: calls.append(("configure", pid)),
        )

    Recorder._lost_join(fake(True, {7}, set()), 7)  # type: ignore[arg-type]
    Recorder._lost_join(fake(True, set(), set()), 8)  # type: ignore[arg-type]  (never joined: a target's own hold)
    Recorder._lost_join(fake(True, {9}, {9}), 9)  # type: ignore[arg-type]  (already registered)
    Recorder._lost_join(fake(False, {10}, set()), 10)  # type: ignore[arg-type]  (--pid / a command: no joins)
    assert calls == [("join", 7), ("configure", 7), ("configure", 8), ("configure", 9), ("configure", 10)]


class _Targets:
    def __init__(self, pids: set[int]) -> None:
        self.pids = pids

    def get(self, k):
        return 1 if k.value in self.pids else None
