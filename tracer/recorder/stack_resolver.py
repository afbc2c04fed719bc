"""Raw stacks to frames, and launch targets to kernel names, each distinct one resolved once.

The kernel hashes every captured stack and sends it only the first time a process shows it (cuda.bpf.c), with a
copy of the user stack; calls then carry the hash. So resolution is per distinct stack, not per call: native
frames by unwinding the copy with .eh_frame (recorder/unwind.py), else the kernel's frame-pointer walk; Python frames
from the code objects BPF read (tracer/recorder/pyruntime.py); the two merged where the interpreter's eval loop is; the
stack gets a stack_id by its frames (the same code path in two workers is one stack). Nothing here reads /proc:
addresses resolve through the event-fed process maps (tracer/recorder/procmaps.py), so a process that has exited keeps
its names.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import pyarrow as pa

from probes.catalog import CATALOG
from tracer.recorder import elfcache, events
from tracer.recorder.columns import IS_LAUNCH, Frame
from tracer.recorder.procmaps import MapCache, Mapping
from tracer.recorder.symbolize import ElfCache, Symbolizer, demangle
from tracer.recorder.unwind import UnwindTables, unwind_record

log = logging.getLogger(__name__)

# Copies' native frames kept for other processes of the same image: a job shows a few hundred distinct ones (the demo
# ~110); 4,096 of ~30 frames is ~10 MB at most
NATIVE_MEMO_MAX = 4096


class _PidMap:
    """One process's view of the map cache, in the shape the unwinder asks for."""

    def __init__(self, maps: MapCache, pid: int) -> None:
        self.maps, self.pid = maps, pid

    def find(self, addr: int) -> Mapping | None:
        return self.maps.find(self.pid, addr)


def merge_stacks(py: list[Frame], native: list[Frame]) -> list[Frame]:
    """Merge Python frames into a native stack (both outermost first) where the interpreter's eval loop is."""
    if not py:
        return native
    eval_idx = [i for i, f in enumerate(native) if f[2] and "EvalFrame" in str(f[2])]
    if not eval_idx:
        return py + native
    return native[: eval_idx[0]] + py + native[eval_idx[-1] + 1 :]


class StackResolver:
    """Stack hashes -> stack_ids (writing each new stack once), and (pid, launch pointer) -> kernel names.

    Args:
        maps: the recording's process maps.
        pyrt: the Python frame resolver, or None without Python stacks.
        native_walk: addresses of a BPF_STACK_TRACE id (the frame-pointer walk), innermost first.
        put_stack: called once per new stack_id with its frames, outermost first (the recorder writes them).
        parent_of: a process's parent in the traced tree (a forked worker uses its parent's named handles).
    """

    def __init__(
        self,
        maps: MapCache,
        pyrt: Any,
        native_walk: Callable[[int], list[int]],
        put_stack: Callable[[int, Sequence[Frame]], None],
        parent_of: Callable[[int], int | None],
        more_codes: Callable[[], None] = lambda: None,
    ) -> None:
        self.maps = maps
        self.more_codes = more_codes  # drains the code objects' ring once more (see _stack_id)
        self._codes_redrained = False  # more_codes has run in this drain
        self.pyrt = pyrt
        self.native_walk = native_walk
        self.put_stack = put_stack
        self.parent_of = parent_of
        # the parsed ELF files are kept between recordings (elfcache.py): parsing them was most of a short
        # recording's CPU (issue 33)
        self.symbolizer = Symbolizer(maps, ElfCache(disk=elfcache.cache_dir()))
        self.unwind_tables = UnwindTables(self.symbolizer.elves)
        self._ustacks: dict[int, tuple[int, events.UstackRecord]] = {}  # hash -> (drain no., copy)
        self._drains = 0
        self._frames: dict[int, tuple[Frame, ...]] = {}  # stack hash -> frames without the CUDA entry point
        self._pending: dict[int, events.StackRecord] = {}  # stack hash -> a record waiting for its code objects
        self._ids: dict[tuple[Frame, ...], int] = {}  # full frames -> stack_id
        self._ref_op: dict[int, dict[int, int]] = {}  # stack hash -> op (-1: none) -> stack_id
        # The kernel's stack hashes are per process (cuda.bpf.c seeds them with the tgid): each process's, so that
        # forget() drops them with it
        self._refs_of: dict[int, list[int]] = {}
        self.handle_names: dict[int, dict[int, str]] = {}  # pid -> CUfunction/CUkernel -> name, from probes
        self._kernels: dict[int, dict[int, tuple[str | None, str | None]]] = {}  # pid -> launch target -> name
        self.resolved = 0  # distinct stacks resolved
        # native frames of an unwound copy by what decides them across processes of one image (_native_key): a
        # re-forked DataLoader worker sends again every stack its siblings sent (the kernel's hash is per process),
        # and unwinding + symbolizing a copy (~0.5 ms) was 30% of `tracer demo`'s recorder CPU (issue 33)
        self._native_memo: dict[tuple[Any, ...], tuple[Frame, ...]] = {}
        self.unwound = 0  # copies unwound (the rest were found in _native_memo)

    def save_caches(self) -> int:
        """Write what was parsed from ELF files to the cache kept between recordings; return the entries written.
        Never raises: the cache only saves the next recording time."""
        try:
            n = self.symbolizer.elves.save() + self.unwind_tables.save()
            elfcache.prune(self.symbolizer.elves.disk)
            return n
        except Exception as e:  # noqa: BLE001 - a cache that cannot be written costs the next run time, nothing else
            log.warning("elf cache: not written: %s", e)
            return 0

    # --- stacks ------------------------------------------------------------------------------------------------

    def add_ustacks(self, raws: Sequence[bytes]) -> None:
        """User-stack copies; each waits for the stack record with its hash (the kernel sends both together, but
        the two ring buffers are drained one after the other, so the record may come one drain later)."""
        for raw in raws:
            rec = events.decode_ustack(raw)
            self._ustacks[rec.stack_ref] = (self._drains, rec)

    def add_stacks(self, raws: Sequence[bytes]) -> None:
        """Resolve each stack record (a distinct stack of its process) to merged frames.

        A record whose Python code objects have not all arrived waits one drain (or until an event asks for its
        stack_id): the kernel submits a stack before the code objects it reads after it (pycode.h), so a drain
        between the two would name those frames ``<unresolved>`` once the process has exited. An event that
        refers to the stack resolves it at once, after one more read of the code objects' ring: an off-CPU interval
        is submitted after them, but a call whose stack was taken at its return before them (_stack_id)."""
        waited, self._pending = self._pending, {}
        self._codes_redrained = False
        for rec in waited.values():
            self._resolve(rec)
        for raw in raws:
            rec = events.decode_stack(raw)
            if rec.stack_ref in self._frames or rec.stack_ref in self._pending:
                continue  # resent after the kernel's LRU forgot it
            self._refs_of.setdefault(rec.pid, []).append(rec.stack_ref)
            if rec.frames and self.pyrt is not None and self.pyrt.codes_missing(rec.pid, rec.frames):
                self._pending[rec.stack_ref] = rec
            else:
                self._resolve(rec)
        self._drains += 1
        for ref in [r for r, (n, _) in self._ustacks.items() if n < self._drains - 2]:
            del self._ustacks[ref]  # its stack record was lost

    def _resolve(self, rec: events.StackRecord) -> None:
        native = self._native(rec)
        py: list[Frame] = []
        if rec.frames and self.pyrt is not None:
            try:
                infos = self.pyrt.resolve(rec.pid, list(rec.frames))
            except Exception as e:  # a stack that cannot be named is still a stack
                log.debug("python frames of %d unresolved: %s", rec.pid, e)
                infos = []
            py = [("python", fi.filename, fi.qualname, fi.filename, fi.line, fi.approx) for fi in reversed(infos)]
        self._frames[rec.stack_ref] = tuple(merge_stacks(py, native))
        self.resolved += 1

    def _native_key(self, rec: events.StackRecord, copy: events.UstackRecord) -> tuple[Any, ...]:
        """What decides a copy's native frames, short of unwinding it: the image (the same code at the same
        addresses, procmaps.MapCache.image_of), the Python frames (the kernel's own identity of a Python stack:
        cuda.bpf.c), the frame-pointer walk's id, the stack pointer and the file and offset of the instruction the
        copy was taken at. Two processes of one image that agree on all of these stopped at one instruction with one
        Python stack at one depth: in the demo's recordings every such pair unwound to the same frames (1,497 of
        1,497), where leaving out the stack pointer was wrong twice."""
        m = self.maps.find(rec.pid, copy.ip)
        at = (m.dev, m.ino, m.path, copy.ip - m.start + m.offset) if m is not None else copy.ip
        return (self.maps.image_of(rec.pid), rec.frames, rec.native_id, copy.sp, at)

    def _native(self, rec: events.StackRecord) -> list[Frame]:
        """Native frames outermost first: the unwound user-stack copy, else the frame-pointer walk."""
        addrs: list[int] = []
        got = self._ustacks.pop(rec.stack_ref, None)
        copy = got[1] if got else None
        key = self._native_key(rec, copy) if copy is not None else None
        if key is not None:
            known = self._native_memo.get(key)
            if known is not None:
                return list(known)
        if copy is not None:
            self.unwound += 1
            try:
                addrs = unwind_record(copy, _PidMap(self.maps, rec.pid), tables=self.unwind_tables)  # type: ignore[arg-type]
            except Exception as e:  # a corrupt copy only loses the native part
                log.debug("unwind for %d failed: %s", rec.pid, e)
        if not addrs and rec.native_id >= 0:
            try:
                addrs = self.native_walk(rec.native_id)
            except Exception:  # the id was recycled
                addrs = []
        out: list[Frame] = []
        for f in self.symbolizer.symbolize(rec.pid, addrs):
            if f.module:  # an FP walk through a library without frame pointers ends in a stack address
                out.append(("native", os.path.basename(f.module), f.function, f.file or None, f.line or None, False))
        if not out:
            out = [("native", "?", f"0x{a:x}", None, None, False) for a in addrs]
        out.reverse()
        if key is not None:
            if len(self._native_memo) >= NATIVE_MEMO_MAX:
                self._native_memo.clear()  # a job of many images: start over rather than grow
            self._native_memo[key] = tuple(out)
        return out

    def stack_ids(self, refs: np.ndarray, ops: np.ndarray) -> list[int | None]:
        """The stack_id of each call (None: no stack captured, or its stack record was lost)."""
        out: list[int | None] = [None] * len(refs)
        for i in np.nonzero(refs)[0].tolist():
            out[i] = self._stack_id(int(refs[i]), int(ops[i]))
        return out

    def plain_stack_ids(self, refs: np.ndarray) -> list[int | None]:
        """The stack_id of each off-CPU or sampled stack hash, which ends where the thread was (no CUDA entry point
        is appended); None: not captured, its record was lost, or it has no frame at all."""
        return [self._stack_id(r, None) if r else None for r in refs.tolist()]

    def _stack_id(self, ref: int, op: int | None) -> int | None:
        key = -1 if op is None else op
        known = self._ref_op.get(ref)
        if known is not None and key in known:
            return known[key]
        waiting = self._pending.pop(ref, None)
        if waiting is not None:
            # A call whose stack was taken at its return is submitted before that stack's code objects (cuda.bpf.c
            # call_with_stack sends the call, then tail-calls py_read_codes): drained in between, the call finds
            # them missing. By now the tail call has long ended, so the code objects' ring is read once more
            # before naming the frames (suite runs: a forked child gone by the next drain kept <unresolved>).
            if (
                not self._codes_redrained
                and self.pyrt is not None
                and self.pyrt.codes_missing(waiting.pid, waiting.frames)
            ):
                self._codes_redrained = True
                self.more_codes()
            self._resolve(waiting)
        frames = self._frames.get(ref)
        if frames is None:
            return None  # not cached: a later resend can still resolve it
        if op is None:
            if not frames:
                return None
            full = frames
        else:
            spec = CATALOG[op]
            full = frames + (("cuda", f"lib{spec.library}", spec.op, None, None, False),)
        sid = self._ids.get(full)
        if sid is None:
            sid = len(self._ids) + 1
            self._ids[full] = sid
            self.put_stack(sid, full)
        self._ref_op.setdefault(ref, {})[key] = sid
        return sid

    def forget(self, pid: int) -> None:
        """Drop what is kept for one process: its stack hashes and its launch targets' names (call once its last
        call and stack have been resolved, and its forked children's, which look names up through it). The
        stacks themselves (frames -> stack_id) are shared by every process and stay."""
        for ref in self._refs_of.pop(pid, ()):
            self._frames.pop(ref, None)
            self._pending.pop(ref, None)
            self._ref_op.pop(ref, None)
            self._ustacks.pop(ref, None)
        self.handle_names.pop(pid, None)
        self._kernels.pop(pid, None)

    # --- kernel names ------------------------------------------------------------------------------------------

    def add_knames(self, ev: np.ndarray) -> list[tuple[int, int, str]]:
        """Launch handles named by the driver (cuModuleGetFunction / cuLibraryGetKernel: the kernel's name) or the
        runtime (__cudaGetKernel: the host stub, named by its symbol); returns (pid, handle, name) rows."""
        rows = []
        for pid, handle, stub, raw in zip(
            ev["pid"].tolist(), ev["handle"].tolist(), ev["stub"].tolist(), events.cstr(ev["name"]), strict=True
        ):
            name = self.symbolizer.kernel_name(pid, stub)[0] if stub else demangle(raw) if raw else None
            if not name or not handle:
                continue
            self.handle_names.setdefault(pid, {})[handle] = name
            self._kernels.get(pid, {}).pop(handle, None)
            rows.append((pid, handle, name))
        return rows

    def kernel(self, pid: int, func: int) -> tuple[str | None, str | None]:
        """(name, None) of a launch target, or (None, why not): a handle named here or in an ancestor (forked
        workers inherit them), else the host stub's symbol in the mapped file."""
        hit = self._kernels.get(pid, {}).get(func)
        if hit is None:
            name = None
            p: int | None = pid
            seen: set[int] = set()
            while p and name is None and p not in seen:
                seen.add(p)
                name = self.handle_names.get(p, {}).get(func)
                p = self.parent_of(p)
            hit = (name, None) if name is not None else self.symbolizer.kernel_name(pid, func)
            self._kernels.setdefault(pid, {})[func] = hit
        return hit

    def kernels(self, ev: np.ndarray) -> tuple[pa.Array, pa.Array]:
        """Kernel names and why-not notes for a batch of call events, NULL for calls that are not launches; as
        dictionary-encoded columns (a batch has a handful of distinct kernels), without per-call Python work."""
        n = len(ev)
        ops = ev["op"].astype(np.int64)
        sel = np.nonzero(IS_LAUNCH[ops] & (ev["func"] != 0))[0]
        codes = np.zeros(n, dtype=np.int32)
        if len(sel) == 0:  # still dictionary-typed: the store appends batches of one type together
            null = pa.DictionaryArray.from_arrays(pa.nulls(n, pa.int32()), pa.array([], pa.string()))
            return null, null
        funcs, pids = ev["func"][sel], ev["pid"][sel]
        ufuncs, inverse = np.unique(funcs, return_inverse=True)  # a plain uint64 sort: few distinct targets
        inverse = inverse.reshape(-1)
        sel_codes = np.empty(len(sel), dtype=np.int32)
        resolved: list[tuple[str | None, str | None]] = []
        for j, func in enumerate(ufuncs.tolist()):
            at = inverse == j
            for pid in np.unique(pids[at]).tolist():  # usually one process per target
                here = at & (pids == pid)
                sel_codes[here] = len(resolved)
                resolved.append(self.kernel(pid, func))
        codes[sel] = sel_codes
        missing = np.ones(n, dtype=bool)
        missing[sel] = False
        names = pa.array([r[0] for r in resolved], type=pa.string())
        notes = pa.array([r[1] for r in resolved], type=pa.string())
        idx = pa.array(codes, mask=missing)
        return pa.DictionaryArray.from_arrays(idx, names), pa.DictionaryArray.from_arrays(idx, notes)
