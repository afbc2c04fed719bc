"""Which CUDA library files the probes are on, and attaching them: in advance, or when a target opens one.

The libraries are the CUDA runtime (libcudart), the driver (libcuda) and NCCL (libnccl.so.2, its collectives):
``targets.library_kind`` tells them by name, ``--lib`` files by what they export. At start every candidate is
attached: the files the targets map, ``--lib``, ``LD_LIBRARY_PATH``, the CUDA toolkit directories, the ld.so cache,
``site-packages/nvidia/*/lib`` (``nvidia/nccl/lib`` too) and ``torch/lib``. A uprobe belongs to the file, so a
target that loads one of them later needs nothing more, and is never stopped. Each attached file is written to the
``attached_files`` BPF map; a target that opens another ``libcud*`` or ``libnccl.*`` file is stopped by
libload.bpf.c until :meth:`Attacher.handle_opens` has attached it (a hold, counted with its duration). NCCL needs
nothing else: its probes are never duty-cycled, and its own kernel launches (through libcuda, from inside a
collective) fold into the collective's call as nested calls.

Launch probes (``--launch-probes``): ``driver`` probes launches once, in libcuda, and a launch whose return address
lies in libcudart keeps its runtime name (one trap per launch); ``both`` probes both layers (two traps, the nested
driver call folded into the runtime one); ``auto`` (the default) starts with both and, once a few hundred runtime
launches have each been seen to reach libcuda's exported launch function, drops the runtime's launch probes. A
runtime that reached the driver some other way would have its launches missed by driver-only probing, so ``auto``
checks rather than assumes.
"""

from __future__ import annotations

import ctypes as ct
import logging
import os
import signal
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from elftools.common.exceptions import ELFError

from probes.catalog import DRIVER_COVERED, OP_IDS
from tracer.recorder import events, targets
from tracer.recorder.budget import DutyCycler
from tracer.recorder.links import LinkError, close_together
from tracer.recorder.procmaps import FileResolver, kernel_dev
from tracer.recorder.program import AttachedLibrary, ProbeSet, Programs, attach_library

log = logging.getLogger(__name__)

AUTO_CHECK_LAUNCHES = 300  # runtime launches to see, all reaching the driver, before dropping their probes
# Test hook: seconds to wait before handling a library-load hold, so a test can kill the recorder while a target
# is stopped and check that the guardian continues it (tests/integration/test_guardian_bpf.py). Unset in real use.
HOLD_DELAY_ENV = "TRACER_TEST_HOLD_DELAY_S"


@dataclass
class HoldStats:
    count: int = 0
    held_ms: float = 0.0


@dataclass
class Attacher:
    """The attached library files and the launch-probe mode; see the module docstring."""

    bpf: Any
    progs: Programs
    resolver: FileResolver
    cycler: DutyCycler
    launch_probes: str = "auto"  # "auto" | "driver" | "both"
    notes: list[str] = field(default_factory=list)
    attached: dict[tuple[int, int], AttachedLibrary] = field(default_factory=dict)
    holds: HoldStats = field(default_factory=HoldStats)
    driver_attached: bool = False
    runtime_launches: list[AttachedLibrary] = field(default_factory=list)  # runtime libraries with launch probes
    _auto_seen: int = 0
    _auto_done: bool = False
    _driver_only: bool = False  # auto: runtime launches were seen to reach the driver

    def _mark(self, lib: targets.LibraryFile) -> None:
        """Tell the probes this file is attached (and whether it is a runtime, whose text locates launches)."""
        table = self.bpf["attached_files"]
        k = table.Key()
        k.ino = lib.ino
        k.dev = (os.major(lib.dev) << 20) | os.minor(lib.dev)
        table[k] = ct.c_uint8(events.C.FILE_RUNTIME if lib.kind == "cudart" else events.C.FILE_ATTACHED)

    def attach(self, found: Iterable[targets.LibraryFile]) -> list[AttachedLibrary]:
        """Attach to each new library file, driver files first; return what was attached."""
        new = [lib for lib in found if (lib.dev, lib.ino) not in self.attached]
        for lib in [x for x in new if x.kind == "cudart"]:
            # libcudart dlopens libcuda.so.1 at CUDA init: attach it now, so the runtime's launches are seen
            # (and relabelled) by the driver probes
            new += targets.driver_for(lib.path)
        new.sort(key=lambda x: x.kind != "cuda")
        done = []
        for lib in new:
            key = (lib.dev, lib.ino)
            if key in self.attached:
                continue
            skip: frozenset[str] = frozenset()
            if lib.kind == "cudart" and self.driver_attached and (self.launch_probes == "driver" or self._driver_only):
                skip = DRIVER_COVERED
            try:
                res = attach_library(self.progs, lib.path, lib.kind, targets.exported_offsets(lib.path), skip=skip)
            except (OSError, LinkError, ValueError, ELFError) as e:  # ELFError: a file named libcud* that is no ELF
                self.notes.append(f"could not attach to {lib.path}: {e}")
                continue
            self.attached[key] = res
            self._mark(lib)
            if lib.kind == "cuda" and res.hot is not None:
                self.driver_attached = True
            if res.hot is not None:
                self.cycler.add(res.hot, outer=lib.kind == "cudart")
                if lib.kind == "cudart":
                    self.runtime_launches.append(res)
            if res.skipped:
                self.notes.append(f"{os.path.basename(lib.path)}: not exported, skipped: {', '.join(res.skipped)}")
            log.info("attached %d ops to %s", len(res.ops), lib.path)
            done.append(res)
        return done

    def handle_opens(self, ev: Any, on_continue: Callable[[int], None]) -> None:
        """A batch of MAP_LIB_OPEN map_events: targets stopped at the open of a CUDA library not attached yet.
        Attach it, then continue the process (``on_continue(pid)`` runs first, while it is still stopped)."""
        delay = float(os.environ.get(HOLD_DELAY_ENV, "0") or 0)
        if delay > 0:
            time.sleep(delay)
        for e in ev:
            pid = int(e["pid"])
            dev, ino = kernel_dev(int(e["dev"])), int(e["ino"])
            names = events.map_names(e["names"], int(e["depth"]))
            path = self.resolver.resolve(dev, ino, names, pid) or _open_fd_path(pid, dev, ino)
            try:
                if path and targets.library_kind(path):
                    self.attach(targets.resolve_libraries([path]))
                elif path is None:
                    self.notes.append(f"pid {pid} opened {names[-1] if names else '?'}, which could not be located")
            finally:
                on_continue(pid)
                self.release(pid)

    def release(self, pid: int) -> None:
        """SIGCONT a held process and count the hold."""
        table = self.bpf["held"]
        key = table.Key(pid)
        try:
            since = int(table[key].value)
        except KeyError:
            since = 0
        try:
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            pass
        try:
            del table[key]
        except KeyError:
            pass
        if since:
            self.holds.count += 1
            self.holds.held_ms += (time.monotonic_ns() - since) / 1e6

    def release_stale(self, older_than_ns: int, on_lost: Callable[[int], None] | None = None) -> None:
        """Continue held processes whose open event never arrived (a lost event must not leave one stopped).
        ``on_lost(pid)`` runs first, while it is still stopped: what the event would have done (the node agent
        registers a process that joined in kernel; the library it opened is attached from its open fds)."""
        now = time.monotonic_ns()
        for k, v in list(self.bpf["held"].items()):
            if now - int(v.value) > older_than_ns:
                pid = int(k.value)
                self.notes.append(f"pid {pid} was continued without its library open event (lost)")
                try:
                    if on_lost is not None:
                        on_lost(pid)
                    self.attach(targets.resolve_libraries(open_libraries(pid)))
                except Exception as e:  # never a reason to leave it stopped
                    log.warning("pid %d, whose library open event was lost: %s", pid, e)
                finally:
                    self.release(pid)

    def release_all(self) -> None:
        for k, _ in list(self.bpf["held"].items()):
            self.release(int(k.value))

    def note_runtime_launches(
        self, total: int, nested: int, on_closed: Callable[[int, list[ProbeSet]], None] | None = None
    ) -> None:
        """``auto``: runtime launch events seen (stored rows) and how many made a nested driver launch. Once
        AUTO_CHECK_LAUNCHES have all reached the driver, drop the runtime's launch probes (one trap per launch)."""
        if self.launch_probes != "auto" or self._auto_done or not self.driver_attached:
            return
        if nested < total:
            self._auto_done = True
            self.notes.append(
                f"{total - nested} of {total} runtime launches did not reach libcuda's exported launch functions: "
                "both layers stay probed (two traps per launch)"
            )
            return
        self._auto_seen += total
        if self._auto_seen >= AUTO_CHECK_LAUNCHES:
            self._auto_done = self._driver_only = True
            closed = []
            for lib in self.runtime_launches:
                if lib.hot is not None:
                    self.cycler.remove(lib.hot)
                    lib.hot.close()
                    closed.append(lib.hot)
                    lib.hot = None
            if on_closed is not None:
                on_closed(time.monotonic_ns(), closed)
            log.info("runtime launches reach the driver: runtime launch probes dropped")

    def close(self) -> None:
        """Detach every probe (idempotent): every entry link, then every return link, each group closed together
        (each close waits for an RCU grace period; together they wait for about one). Entries first: once they are
        gone, every call that entered has returned through its return probe."""
        sets = [p for lib in self.attached.values() for p in lib.probe_sets()]
        close_together([p.close_entries for p in sets])
        close_together([p.close_returns for p in sets])


def _open_fd_path(pid: int, dev: int, ino: int) -> str | None:
    """The path of an fd of a (stopped) process that is the file (dev, ino): it has just opened it."""
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return None
    for fd in fds:
        link = f"/proc/{pid}/fd/{fd}"
        try:
            st = os.stat(link)
        except OSError:
            continue
        if st.st_dev == dev and st.st_ino == ino:
            try:
                target = os.readlink(link)
            except OSError:
                return link
            root = f"/proc/{pid}/root{target}"
            return root if os.path.exists(root) else target if os.path.exists(target) else link
    return None


def open_libraries(pid: int) -> list[str]:
    """The CUDA libraries among ``pid``'s open files (through /proc/PID/root: a container's paths): a process held
    at its open of one, whose event was lost, has it open and not yet mapped."""
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return []
    out = []
    for fd in fds:
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("/") and targets.library_kind(target):
            root = f"/proc/{pid}/root{target}"
            out.append(root if os.path.exists(root) else target)
    return out


def runtime_launch_op_ids() -> frozenset[int]:
    """Op ids of the runtime launch ops that the driver can cover."""
    return frozenset(OP_IDS[op] for op in DRIVER_COVERED)
