"""A cache of the compiled BPF program, so that `tracer record` after the first run loads it without clang.

bcc compiles the program (probes/*.bpf.c) with clang and LLVM on every run: about 2.5 s of CPU on a small VM, most of
the start-up. bcc 0.26 has no way to load a compiled object, so the cache keeps what the compile produces:

- each function's bytecode, with every map reference (``ld_imm64`` of a map fd) rewritten to the map's index;
- each map's kernel spec (type, key and value sizes, max entries, flags: read back from the kernel, so they are what
  bcc created) and its key and leaf type descriptions (bcc's JSON, from which bcc.BPF builds the ctypes types);
- the license and kernel version bcc passed to the loader.

A hit (:class:`CachedBPF`) creates the maps with the bpf syscall, puts their fds back into the bytecode and loads
the functions as bcc would (the verifier still checks every program: the cache saves the compile, not the check).
It is a ``bcc.BPF`` otherwise: tables, ring buffers, perf events and tracepoints work through bcc's own code.

The key is a hash of the program text, the compile flags (which carry the kernel's struct offsets and the
interpreter layouts), the running kernel (release and build) and the bcc library file, so a change to any of them
misses. What is cached is code loaded into the kernel as root: the directory must be root's, a real directory, not
writable by group or others, and each entry a regular file of root's, not writable by others, whose content hashes
to the digest stored with it; anything else is ignored (and recompiled), never loaded.
"""

from __future__ import annotations

import base64
import ctypes as ct
import errno
import hashlib
import json
import logging
import os
import struct
import tempfile
from pathlib import Path
from typing import Any

from tracer.recorder.rootcache import dir_ok, ensure_dir, read_entry

log = logging.getLogger(__name__)

FORMAT = 1  # bump when what an entry holds changes: old entries then miss
DEFAULT_DIR = Path("/var/cache/cuda-host-tracer/bpf")
KEEP = 8  # entries kept, newest first: ~170 KB each
ENV_DIR = "TRACER_BPF_CACHE"  # another directory (bench.startup's cold runs, tests); "off": no cache


def cache_dir() -> Path | None:
    """The cache directory in use: $TRACER_BPF_CACHE, else :data:`DEFAULT_DIR`; None when the cache is off."""
    v = os.environ.get(ENV_DIR)
    if v == "off":
        return None
    return Path(v) if v else DEFAULT_DIR


_NR_BPF = {"x86_64": 321, "aarch64": 280}
_BPF_MAP_CREATE, _BPF_PROG_LOAD, _BPF_OBJ_GET_INFO_BY_FD = 0, 5, 15
_LD_IMM64 = 0x18
_PSEUDO_MAP_FD, _PSEUDO_MAP_VALUE = 1, 2
# bcc_prog_load_xattr's prefixes: a function named kprobe__x is loaded as "x" (the kernel keeps 15 characters)
_NAME_PREFIXES = (b"kprobe__", b"kretprobe__", b"tracepoint__", b"raw_tracepoint__", b"kfunc__", b"kretfunc__")

_libc = ct.CDLL(None, use_errno=True)
_libc.syscall.restype = ct.c_long


class CacheError(Exception):
    """The compiled program cannot be cached or loaded from the cache (the caller compiles instead)."""


def _bpf(cmd: int, attr: ct.Array[ct.c_char]) -> int:
    nr = _NR_BPF.get(os.uname().machine)
    if nr is None:
        raise CacheError(f"no bpf syscall number for {os.uname().machine}")
    return int(_libc.syscall(nr, cmd, attr, len(attr)))


# --- the key --------------------------------------------------------------------------------------------------


def _kernel_id() -> str:
    with open("/proc/sys/kernel/osrelease") as a, open("/proc/sys/kernel/version") as b:
        return a.read().strip() + " " + b.read().strip()


def _bcc_id() -> str:
    """The bcc library that compiles (its code generation is part of what is cached): path, size and time."""
    from bcc.libbcc import lib

    path = os.path.realpath(lib._name)
    try:
        st = os.stat(path)
        return f"{path} {st.st_size} {st.st_mtime_ns}"
    except OSError:
        return path


def cache_key(text: str, flags: list[str], kernel: str | None = None, bcc: str | None = None) -> str:
    """The entry's name: a hash of everything the compiled program depends on."""
    h = hashlib.sha256()
    for part in (str(FORMAT), text, "\0".join(flags), kernel if kernel is not None else _kernel_id()):
        h.update(part.encode() + b"\xff")
    h.update((bcc if bcc is not None else _bcc_id()).encode())
    return h.hexdigest()


# --- the directory and its entries ------------------------------------------------------------------------------


def load(d: Path, key: str) -> dict[str, Any] | None:
    """Return the entry ``key`` of the cache in ``d``, or None: absent, unsafe (see the module's doc) or corrupt."""
    if os.geteuid() != 0 or not dir_ok(d):
        return None
    raw = read_entry(d / f"{key}.json", "bpf cache")
    if raw is None:
        return None
    try:
        outer = json.loads(raw)
        body = outer["body"].encode()
        if outer.get("format") != FORMAT or hashlib.sha256(body).hexdigest() != outer["sha256"]:
            raise ValueError("digest or format mismatch")
        entry = json.loads(body)
        if entry["key"] != key:
            raise ValueError("entry of another key")
        _check_entry(entry)
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        log.warning("bpf cache: %s/%s.json is corrupt (%s): ignored", d, key, e)
        return None
    return entry


def _check_entry(entry: dict[str, Any]) -> None:
    """Raise ValueError unless the entry has the shape :class:`CachedBPF` reads (types, map indexes in range)."""
    maps = entry["maps"]
    for m in maps:
        for k in ("type", "key_size", "value_size", "max_entries", "flags"):
            if not isinstance(m[k], int):
                raise ValueError(f"map {m.get('name')}: {k}")
        if not isinstance(m["name"], str) or not isinstance(m["key_desc"], str) or not isinstance(m["leaf_desc"], str):
            raise ValueError("map name or descriptions")
    for f in entry["functions"]:
        insns = base64.b64decode(f["insns"], validate=True)
        if not isinstance(f["name"], str) or len(insns) % 8 or not insns:
            raise ValueError(f"function {f.get('name')}")
        for at, idx in f["relocs"]:
            if not (0 <= at < len(insns) // 8 - 1 and 0 <= idx < len(maps)):
                raise ValueError(f"function {f['name']}: relocation out of range")
    if not isinstance(entry["license"], str) or not isinstance(entry["kern_version"], int):
        raise ValueError("license or kernel version")


def store(d: Path, key: str, entry: dict[str, Any]) -> bool:
    """Write ``entry`` under ``key`` (atomically, mode 0600); False where the directory is not usable."""
    if os.geteuid() != 0 or not ensure_dir(d, "bpf cache"):
        return False
    body = json.dumps({**entry, "key": key}, separators=(",", ":"))
    outer = json.dumps({"format": FORMAT, "sha256": hashlib.sha256(body.encode()).hexdigest(), "body": body})
    try:
        fd, tmp = tempfile.mkstemp(dir=d, prefix=".tmp-", suffix=".json")  # mode 0600
        with os.fdopen(fd, "w") as f:
            f.write(outer)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, d / f"{key}.json")
        # entries of other kernels, flags or versions: the newest few stay (a kernel booted back), not all
        for old in sorted(d.glob("*.json"), key=lambda p: p.stat().st_mtime, reverse=True)[KEEP:]:
            old.unlink()
    except OSError as e:
        log.warning("bpf cache: cannot write %s: %s", d, e)
        return False
    return True


# --- taking an entry from a compiled program ----------------------------------------------------------------------


def _lib() -> Any:
    from bcc.libbcc import lib

    # libbcc exports these; bcc's Python binding does not declare them
    lib.bpf_num_tables.restype = ct.c_size_t
    lib.bpf_num_tables.argtypes = [ct.c_void_p]
    lib.bpf_table_name.restype = ct.c_char_p
    lib.bpf_table_name.argtypes = [ct.c_void_p, ct.c_size_t]
    return lib


def _map_info(fd: int) -> dict[str, int]:
    """The kernel's view of map ``fd`` (struct bpf_map_info's first fields)."""
    info = ct.create_string_buffer(88)
    attr = ct.create_string_buffer(struct.pack("=IIQ", fd, len(info), ct.addressof(info)), 16)
    if _bpf(_BPF_OBJ_GET_INFO_BY_FD, attr) < 0:
        raise CacheError(f"BPF_OBJ_GET_INFO_BY_FD: {os.strerror(ct.get_errno())}")
    mtype, _id, key_size, value_size, max_entries, flags = struct.unpack_from("=6I", info.raw)
    return {"type": mtype, "key_size": key_size, "value_size": value_size, "max_entries": max_entries, "flags": flags}


def _relocs(insns: bytes, fd_to_index: dict[int, int]) -> list[tuple[int, int]]:
    """(instruction index, map index) of every map reference; CacheError for one to a map not among the tables."""
    out = []
    i = 0
    n = len(insns) // 8
    while i < n:
        code, regs = insns[8 * i], insns[8 * i + 1]
        if code == _LD_IMM64:
            src = regs >> 4
            if src in (_PSEUDO_MAP_FD, _PSEUDO_MAP_VALUE):
                fd = struct.unpack_from("<i", insns, 8 * i + 4)[0]
                if fd not in fd_to_index:
                    raise CacheError(f"instruction {i} refers to fd {fd}, not a table")
                out.append((i, fd_to_index[fd]))
            elif src != 0:
                raise CacheError(f"instruction {i}: ld_imm64 of kind {src}")
            i += 2
        else:
            i += 1
    return out


def snapshot(bpf: Any) -> dict[str, Any]:
    """Return the cache entry of a compiled ``bcc.BPF`` (before any of its functions is loaded or attached)."""
    lib = _lib()
    mod = bpf.module
    maps, fd_to_index = [], {}
    for i in range(lib.bpf_num_tables(mod)):
        name = lib.bpf_table_name(mod, i)
        fd = lib.bpf_table_fd(mod, name)
        if fd < 0:
            raise CacheError(f"table {name!r} has no fd")
        fd_to_index[fd] = len(maps)
        maps.append(
            {
                "name": name.decode(),
                **_map_info(fd),
                "key_desc": (lib.bpf_table_key_desc(mod, name) or b"").decode(),
                "leaf_desc": (lib.bpf_table_leaf_desc(mod, name) or b"").decode(),
            }
        )
    functions = []
    for i in range(lib.bpf_num_functions(mod)):
        name = lib.bpf_function_name(mod, i)
        insns = ct.string_at(lib.bpf_function_start(mod, name), lib.bpf_function_size(mod, name))
        functions.append(
            {"name": name.decode(), "insns": base64.b64encode(insns).decode(), "relocs": _relocs(insns, fd_to_index)}
        )
    return {
        "maps": maps,
        "functions": functions,
        "license": lib.bpf_module_license(mod).decode(),
        "kern_version": int(lib.bpf_module_kern_version(mod)),
    }


# --- loading an entry ---------------------------------------------------------------------------------------------


def _create_map(m: dict[str, Any]) -> int:
    attr = ct.create_string_buffer(72)
    struct.pack_into("=6I", attr, 0, m["type"], m["key_size"], m["value_size"], m["max_entries"], m["flags"], 0)
    name = m["name"].encode()[:15]
    struct.pack_into(f"={len(name)}s", attr, 28, name)  # numa_node at 24, map_name at 28
    fd = _bpf(_BPF_MAP_CREATE, attr)
    if fd < 0:
        raise CacheError(f"creating map {m['name']}: {os.strerror(ct.get_errno())}")
    return fd


def _prog_name(name: bytes) -> bytes:
    for p in _NAME_PREFIXES:
        if name.startswith(p):
            return name[len(p) :][:15]
    return name[:15]


def _load_prog(name: bytes, prog_type: int, insns: bytes, license: bytes, kern_version: int, attach_type: int) -> int:
    """BPF_PROG_LOAD as bcc_func_load does it (without BTF line info); on refusal, again with the verifier's log."""
    buf = ct.create_string_buffer(insns, len(insns))
    lic = ct.create_string_buffer(license)

    def attempt(log_buf: ct.Array[ct.c_char] | None) -> int:
        attr = ct.create_string_buffer(128)
        struct.pack_into(
            "=IIQQIIQII",
            attr,
            0,
            prog_type,
            len(insns) // 8,
            ct.addressof(buf),
            ct.addressof(lic),
            1 if log_buf is not None else 0,
            len(log_buf) if log_buf is not None else 0,
            ct.addressof(log_buf) if log_buf is not None else 0,
            kern_version,
            0,
        )
        pname = _prog_name(name)
        struct.pack_into(f"={len(pname)}s", attr, 48, pname)  # prog_name[16] at 48
        struct.pack_into("=II", attr, 64, 0, max(attach_type, 0))  # prog_ifindex, expected_attach_type
        return _bpf(_BPF_PROG_LOAD, attr)

    # The verifier gives up with EAGAIN when a signal is pending (a profiler's, the terminal's): libbpf tries such a
    # load 5 times, and so do we.
    for _ in range(5):
        fd = attempt(None)
        if fd >= 0 or ct.get_errno() != errno.EAGAIN:
            break
    if fd < 0:
        err = ct.get_errno()
        log_buf = ct.create_string_buffer(1 << 20)
        attempt(log_buf)
        raise Exception(f"Failed to load BPF program {name!r}: {os.strerror(err)}\n{log_buf.value.decode()[-4000:]}")
    return fd


def cached_bpf(entry: dict[str, Any]) -> Any:
    """Return a ``bcc.BPF`` made from a cache entry: its maps created, its tracepoint functions attached."""
    from bcc import BPF

    class CachedBPF(BPF):  # type: ignore[misc,valid-type]
        """bcc.BPF without a bcc module: the maps and functions come from the cache entry."""

        def __init__(self, entry: dict[str, Any]) -> None:  # noqa: PLR0912 - mirrors BPF.__init__'s fields
            import atexit

            self.kprobe_fds: dict[Any, Any] = {}
            self.uprobe_fds: dict[Any, Any] = {}
            self.tracepoint_fds: dict[Any, Any] = {}
            self.raw_tracepoint_fds: dict[Any, Any] = {}
            self.kfunc_entry_fds: dict[Any, Any] = {}
            self.kfunc_exit_fds: dict[Any, Any] = {}
            self.lsm_fds: dict[Any, Any] = {}
            self.perf_buffers: dict[Any, Any] = {}
            self.open_perf_events: dict[Any, Any] = {}
            self._ringbuf_manager = None
            self.tracefile = None
            self.debug = 0
            self.funcs: dict[bytes, Any] = {}
            self.tables: dict[Any, Any] = {}
            self.module = None  # bcc's close() destroys a module only when there is one
            self._maps = entry["maps"]
            self._map_fds: list[int] = []
            self._license = entry["license"].encode()
            self._kern_version = entry["kern_version"]
            atexit.register(self.cleanup)
            try:
                for m in self._maps:
                    self._map_fds.append(_create_map(m))
                self._insns = {}
                for f in entry["functions"]:
                    insns = bytearray(base64.b64decode(f["insns"]))
                    for at, idx in f["relocs"]:
                        struct.pack_into("<i", insns, 8 * at + 4, self._map_fds[idx])
                    self._insns[f["name"].encode()] = bytes(insns)
                self._trace_autoload()
            except BaseException:
                self.cleanup()
                raise

        def _trace_autoload(self) -> None:
            for name in self._insns:
                if name.startswith(b"tracepoint__"):
                    fn = self.load_func(name, BPF.TRACEPOINT)
                    self.attach_tracepoint(tp=name[len(b"tracepoint__") :].replace(b"__", b":"), fn_name=fn.name)
                elif name.startswith((b"kprobe__", b"kretprobe__", b"raw_tracepoint__", b"kfunc__", b"lsm__")):
                    raise CacheError(f"{name!r}: an auto-attached kind the cache does not load")

        def load_func(self, func_name: Any, prog_type: int, device: Any = None, attach_type: int = -1) -> Any:
            name = func_name.encode() if isinstance(func_name, str) else bytes(func_name)
            if name in self.funcs:
                return self.funcs[name]
            if name not in self._insns:
                raise Exception(f"Unknown program {name!r}")
            fd = _load_prog(name, prog_type, self._insns[name], self._license, self._kern_version, attach_type)
            fn = BPF.Function(self, name, fd)
            self.funcs[name] = fn
            return fn

        def get_table(self, name: Any, keytype: Any = None, leaftype: Any = None, reducer: Any = None) -> Any:
            from bcc import table

            key = name.decode() if isinstance(name, bytes) else name
            idx = next((i for i, m in enumerate(self._maps) if m["name"] == key), None)
            if idx is None:
                raise KeyError(name)
            m = self._maps[idx]
            if keytype is None:
                keytype = BPF._decode_table_type(json.loads(m["key_desc"]))
            if leaftype is None:
                leaftype = BPF._decode_table_type(json.loads(m["leaf_desc"]))
            _install_table_shim()
            return table.Table(
                _TableModule(self, m), idx, self._map_fds[idx], keytype, leaftype, key.encode(), reducer=reducer
            )

        def close(self) -> None:
            super().close()
            for fd in self._map_fds:
                os.close(fd)
            self._map_fds = []

    return CachedBPF(entry)


class _TableModule:
    """What bcc's table classes read from ``table.bpf``: the BPF object, with ``module`` standing for the map's spec
    (the shim in :func:`_install_table_shim` answers the type, flags and size queries bcc makes with it)."""

    def __init__(self, bpf: Any, spec: dict[str, Any]) -> None:
        self._bpf = bpf
        self.module = _MapSpec(spec)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._bpf, name)


class _MapSpec:
    def __init__(self, spec: dict[str, Any]) -> None:
        self.spec = spec


class _LibShim:
    """bcc.table's ``lib``: libbcc, except that the three spec queries bcc's table classes make at construction
    are answered from a cached map's spec when the module is one (a :class:`_MapSpec`)."""

    def __init__(self, real: Any) -> None:
        self._real = real

    def __getattr__(self, name: str) -> Any:
        f = getattr(self._real, name)
        setattr(self, name, f)  # later look-ups are plain attributes, as on the real CDLL
        return f

    def bpf_table_type_id(self, module: Any, map_id: int) -> int:
        if isinstance(module, _MapSpec):
            return int(module.spec["type"])
        return int(self._real.bpf_table_type_id(module, map_id))

    def bpf_table_flags_id(self, module: Any, map_id: int) -> int:
        if isinstance(module, _MapSpec):
            return int(module.spec["flags"])
        return int(self._real.bpf_table_flags_id(module, map_id))

    def bpf_table_max_entries_id(self, module: Any, map_id: int) -> int:
        if isinstance(module, _MapSpec):
            return int(module.spec["max_entries"])
        return int(self._real.bpf_table_max_entries_id(module, map_id))


def _install_table_shim() -> None:
    from bcc import table

    if not isinstance(table.lib, _LibShim):
        table.lib = _LibShim(table.lib)
