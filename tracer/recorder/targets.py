"""The traced process tree and the CUDA libraries it uses.

Targets are processes (tgids): the one given by ``--pid`` (or launched after ``--``) and every descendant. The
descendants alive at attach are found from /proc; later ones join in kernel (lifecycle.bpf.c, task_newtask).

Libraries (the CUDA runtime and driver, and NCCL's libnccl.so.2) are found three ways: mapped in a target
(``/proc/PID/maps``, through ``/proc/PID/root`` so container paths resolve), given with ``--lib``, and in the usual
install places (CUDA toolkit dirs, the ld.so cache, site-packages ``nvidia/*/lib`` and ``torch/lib``). Each file
is attached once, keyed by (device, inode), since a uprobe belongs to the file and fires in every process that
maps it.
"""

from __future__ import annotations

import glob
import os
import re
import subprocess
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import numpy as np

from probes.catalog import LIBRARY_MARKERS, LIBRARY_PATTERNS
from tracer import procfs
from tracer.errors import TargetError

_LIB_RES = {lib: re.compile(pat) for lib, pat in LIBRARY_PATTERNS.items()}


def library_kind(path: str) -> str | None:
    """Return "cudart", "cuda" or "nccl" when the file name is a CUDA runtime, driver or NCCL library, else
    None."""
    base = os.path.basename(path)
    for lib, rx in _LIB_RES.items():
        if rx.match(base):
            return lib
    return None


@lru_cache(maxsize=256)
def _exports(path: str, mtime_ns: int) -> dict[str, int]:
    from elftools.elf.elffile import ELFFile

    from tracer.recorder.symbolize import ELF64_SYM

    out: dict[str, int] = {}
    with open(path, "rb") as f:
        elf = ELFFile(f)
        dynsym = elf.get_section_by_name(".dynsym")
        if dynsym is None or dynsym["sh_entsize"] != ELF64_SYM.itemsize:
            return out
        loads = [(s["p_offset"], s["p_vaddr"], s["p_filesz"]) for s in elf.iter_segments() if s["p_type"] == "PT_LOAD"]
        strtab = elf.get_section(dynsym["sh_link"]).data()
        syms = np.frombuffer(dynsym.data(), dtype=ELF64_SYM)
        kind = syms["st_info"] & 0xF
        # functions (STT_FUNC, STT_GNU_IFUNC) defined here (not SHN_UNDEF)
        syms = syms[((kind == 2) | (kind == 10)) & (syms["st_shndx"] != 0) & (syms["st_value"] != 0)]
        for value, name_off in zip(syms["st_value"].tolist(), syms["st_name"].tolist(), strict=True):
            end = strtab.find(b"\0", name_off)
            name = strtab[name_off:end].decode(errors="replace").split("@")[0]
            for p_off, p_vaddr, p_size in loads:
                if p_vaddr <= value < p_vaddr + p_size:
                    out.setdefault(name, value - p_vaddr + p_off)
                    break
    return out


def exported_offsets(path: str) -> dict[str, int]:
    """Return the functions ``path`` defines in its dynamic symbol table, name -> file offset (what a uprobe
    attaches to)."""
    return _exports(path, os.stat(path).st_mtime_ns)


def exported_functions(path: str) -> frozenset[str]:
    """Return the names of the functions ``path`` defines in its dynamic symbol table."""
    return frozenset(exported_offsets(path))


@dataclass(frozen=True)
class LibraryFile:
    path: str  # as opened by the tracer (through /proc/PID/root for container paths)
    kind: str  # "cudart" | "cuda" | "nccl"
    dev: int
    ino: int


def _file_key(path: str) -> tuple[int, int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino


def mapped_cuda(pid: int) -> tuple[list[LibraryFile], tuple[int, int] | None]:
    """Return, from one read of /proc/PID/maps, the CUDA libraries mapped in ``pid`` and the [lo, hi) span of its
    libcudart's executable mapping (None if none); ([], None) if the process is gone."""
    from tracer.recorder.procmaps import read_maps

    try:
        maps = read_maps(pid)
    except (ProcessLookupError, PermissionError):
        return [], None
    libs: dict[str, LibraryFile] = {}
    span = None
    for m in maps:
        kind = library_kind(m.path)
        if kind is None or not m.host_path:
            continue
        if kind == "cudart" and "x" in m.perms:
            span = (m.start, m.end)
        key = _file_key(m.host_path)
        if m.path not in libs and key:
            libs[m.path] = LibraryFile(m.host_path, kind, *key)
    return list(libs.values()), span


def libraries_mapped(pid: int) -> list[LibraryFile]:
    """Return the CUDA libraries mapped in ``pid``; [] if the process is gone."""
    return mapped_cuda(pid)[0]


def driver_for(runtime_path: str) -> list[LibraryFile]:
    """Return the libcuda a runtime at ``runtime_path`` will load: beside it (RPATH $ORIGIN installs), else from
    the usual places."""
    here = [str(p) for p in Path(runtime_path).parent.glob("libcuda.so*")]
    libs = [x for x in resolve_libraries(here) if x.kind == "cuda"]
    if libs:
        return libs
    return [x for x in resolve_libraries(usual_library_paths()) if x.kind == "cuda"]


def _ldconfig_paths() -> list[str]:
    try:
        out = subprocess.run(["ldconfig", "-p"], capture_output=True, text=True, timeout=5).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return [line.rsplit("=>", 1)[1].strip() for line in out.splitlines() if "=>" in line]


def usual_library_paths() -> list[str]:
    """Return CUDA library files found in the usual install places on this host."""
    patterns = [
        "/usr/local/cuda*/lib64/libcudart.so*",
        "/usr/local/cuda*/compat/libcuda.so*",
        "/usr/lib/x86_64-linux-gnu/libcuda.so*",
        "/usr/lib/aarch64-linux-gnu/libcuda.so*",
        "/usr/lib64/libcuda.so*",
        "/opt/conda/lib/libcudart.so*",
        "/usr/local/cuda*/lib64/libnccl.so*",
        "/usr/lib/x86_64-linux-gnu/libnccl.so*",
        "/usr/lib/aarch64-linux-gnu/libnccl.so*",
        "/opt/conda/lib/libnccl.so*",
    ]
    for sp in {p for p in sys.path if p.endswith("site-packages")} | set(
        glob.glob("/usr/local/lib/python3*/*-packages") + glob.glob("/opt/conda/lib/python3*/site-packages")
    ):
        patterns += [
            f"{sp}/nvidia/*/lib/libcudart.so*",
            f"{sp}/nvidia/cu*/lib/libcudart.so*",
            f"{sp}/torch/lib/libcudart*.so*",
            f"{sp}/nvidia/nccl/lib/libnccl.so*",  # nvidia-nccl-cu12 / -cu13, what torch's CUDA wheels load
        ]
    # LD_LIBRARY_PATH's libcud* files are the recorder's own search (session.py); its libnccl ones are here
    patterns += [f"{d}/libnccl.so*" for d in os.environ.get("LD_LIBRARY_PATH", "").split(":") if d]
    paths = [p for pat in patterns for p in glob.glob(pat)]
    paths += [p for p in _ldconfig_paths() if library_kind(p)]
    return paths


def resolve_libraries(paths: list[str]) -> list[LibraryFile]:
    """Return the distinct CUDA library files among ``paths`` (symlinks followed, deduplicated by inode)."""
    out: dict[tuple[int, int], LibraryFile] = {}
    for p in paths:
        real = os.path.realpath(p)
        kind = library_kind(p) or library_kind(real)
        key = _file_key(real)
        if kind and key and key not in out:
            out[key] = LibraryFile(real, kind, *key)
    return list(out.values())


def check_library_arg(path: str) -> LibraryFile:
    """Validate a ``--lib`` path; raise TargetError with the reason when it cannot be probed."""
    if not os.path.exists(path):
        raise TargetError(f"library {path} does not exist", "check the --lib path")
    real = os.path.realpath(path)
    kind = library_kind(path) or library_kind(real)
    if kind is None:
        try:
            names = exported_functions(real)
        except Exception as e:
            raise TargetError(f"{path} is not an ELF shared library ({e})") from None
        kind = next((k for k, marker in LIBRARY_MARKERS.items() if marker in names), None)
    if kind is None:
        raise TargetError(
            f"{path} exports no CUDA runtime, driver or NCCL API functions",
            "--lib takes a libcudart.so*, libcuda.so* or libnccl.so* file",
        )
    key = _file_key(real)
    assert key is not None
    return LibraryFile(real, kind, *key)


# --- processes ---------------------------------------------------------------------------------------------


def proc_stat(pid: int) -> tuple[str, int] | None:
    """Return (comm, ppid) of ``pid``, or None if it is gone."""
    st = procfs.stat(pid)
    return None if st is None else (st.comm, st.ppid)


def proc_cmdline(pid: int) -> str:
    """Return the command line of ``pid`` ('' if gone or a kernel thread)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


is_alive = procfs.is_alive


def descendants(root: int) -> list[int]:
    """Return ``root`` and every living descendant process (tgids), parents before children."""
    children: dict[int, list[int]] = {}
    for pid, st in procfs.processes().items():
        children.setdefault(st.ppid, []).append(pid)
    out, todo = [], [root]
    while todo:
        pid = todo.pop(0)
        out.append(pid)
        todo += sorted(children.get(pid, []))
    return out


def cuda_processes(exclude: Iterable[int] = ()) -> list[int]:
    """Return every living process that maps a CUDA library (libcudart, libcuda, libnccl), and each one's
    descendants, parents before children: what the node agent traces at start. ``exclude``: the tracer's own."""
    skip = set(exclude)
    out: list[int] = []
    for pid in sorted(procfs.processes()):
        if pid in skip or pid in out:
            continue
        if libraries_mapped(pid):
            out += [p for p in descendants(pid) if p not in skip and p not in out]
    return out


def check_pid(pid: int) -> None:
    """Raise TargetError unless ``pid`` is a living process."""
    if pid <= 0 or not is_alive(pid):
        raise TargetError(f"no process with pid {pid}", "check the pid with `ps -ef` (the job may have exited)")
    if pid == os.getpid():
        raise TargetError("the tracer cannot trace itself")
