"""Byte offsets of kernel struct members, read from the running kernel's BTF (``/sys/kernel/btf/vmlinux``).

bcc 0.26 compiles against whatever kernel headers are installed, and has no CO-RE relocation. On a kernel
newer than its headers (here: 6.18 with Debian 6.1 headers) a plain ``task->thread.fsbase`` reads the wrong
offset (5416 instead of 3128) and silently gets 0. So every ``task_struct`` access in our BPF goes through an
offset computed here and passed as a ``-D`` cflag.

Only what we need is parsed: type records are indexed once (about 0.07 s for the 6.18 vmlinux BTF), struct and
union members are decoded on demand, and results are cached in-process and on disk, keyed by the BTF blob's
size and a hash of its header plus the kernel release."""

from __future__ import annotations

import functools
import hashlib
import json
import os
import struct
from dataclasses import dataclass

VMLINUX_BTF = "/sys/kernel/btf/vmlinux"

BTF_MAGIC = 0xEB9F
# BTF kinds (include/uapi/linux/btf.h)
KIND_INT, KIND_PTR, KIND_ARRAY, KIND_STRUCT, KIND_UNION, KIND_ENUM, KIND_FWD, KIND_TYPEDEF = (
    1,
    2,
    3,
    4,
    5,
    6,
    7,
    8,
)
KIND_VOLATILE, KIND_CONST, KIND_RESTRICT, KIND_FUNC, KIND_FUNC_PROTO, KIND_VAR, KIND_DATASEC = (
    9,
    10,
    11,
    12,
    13,
    14,
    15,
)
KIND_FLOAT, KIND_DECL_TAG, KIND_TYPE_TAG, KIND_ENUM64 = 16, 17, 18, 19

# Bytes that follow the 12-byte btf_type header: (fixed, per vlen entry).
_EXTRA = {
    KIND_INT: (4, 0),
    KIND_ARRAY: (12, 0),
    KIND_STRUCT: (0, 12),
    KIND_UNION: (0, 12),
    KIND_ENUM: (0, 8),
    KIND_FUNC_PROTO: (0, 8),
    KIND_VAR: (4, 0),
    KIND_DATASEC: (0, 12),
    KIND_DECL_TAG: (4, 0),
    KIND_ENUM64: (0, 12),
}
# Kinds whose third word is a type id that names the same storage (we look through them).
_ALIASES = (KIND_TYPEDEF, KIND_VOLATILE, KIND_CONST, KIND_RESTRICT, KIND_TYPE_TAG)


class BtfError(Exception):
    """The BTF blob is missing, malformed, or lacks the struct or member asked for."""


@dataclass(frozen=True)
class Member:
    name: str
    type_id: int
    bit_offset: int


class Btf:
    """An indexed BTF blob: type headers by id, struct ids by name, members decoded lazily."""

    def __init__(self, data: bytes) -> None:
        if len(data) < 24:
            raise BtfError("BTF blob too short")
        magic, _version, _flags, hdr_len, type_off, type_len, str_off, str_len = struct.unpack_from(
            "<HBBIIIII", data, 0
        )
        if magic != BTF_MAGIC:
            raise BtfError(f"bad BTF magic {magic:#x} (big-endian BTF is not supported)")
        self._data = data
        self._types_start = hdr_len + type_off
        self._strs_start = hdr_len + str_off
        self._strs_end = self._strs_start + str_len
        # type id -> byte position of its btf_type header; id 0 is void.
        self._pos: list[int] = [0]
        self._by_name: dict[str, list[int]] = {}
        self._index(self._types_start, self._types_start + type_len)

    def _index(self, pos: int, end: int) -> None:
        data = self._data
        unpack = struct.unpack_from
        pos_list = self._pos
        by_name = self._by_name
        strs = self._strs_start
        while pos < end:
            name_off, info = unpack("<II", data, pos)
            kind = (info >> 24) & 0x1F
            vlen = info & 0xFFFF
            if kind in (KIND_STRUCT, KIND_UNION) and name_off:
                nul = data.index(b"\0", strs + name_off)
                by_name.setdefault(data[strs + name_off : nul].decode(), []).append(len(pos_list))
            pos_list.append(pos)
            fixed, per = _EXTRA.get(kind, (0, 0))
            pos += 12 + fixed + per * vlen

    def _str(self, off: int) -> str:
        start = self._strs_start + off
        return self._data[start : self._data.index(b"\0", start)].decode()

    def _header(self, type_id: int) -> tuple[int, int, int, int]:
        """(kind, vlen, kind_flag, size_or_type) of a type id."""
        pos = self._pos[type_id]
        _name, info, size_or_type = struct.unpack_from("<III", self._data, pos)
        return (info >> 24) & 0x1F, info & 0xFFFF, info >> 31, size_or_type

    def _resolve(self, type_id: int) -> int:
        """Looks through typedefs and qualifiers to the underlying type id."""
        for _ in range(64):
            kind, _vlen, _kf, ref = self._header(type_id)
            if kind not in _ALIASES:
                return type_id
            type_id = ref
        raise BtfError(f"type {type_id}: alias chain too long")

    def members(self, type_id: int) -> list[Member]:
        kind, vlen, kind_flag, _size = self._header(type_id)
        if kind not in (KIND_STRUCT, KIND_UNION):
            raise BtfError(f"type {type_id} is not a struct or union (kind {kind})")
        pos = self._pos[type_id] + 12
        out = []
        for i in range(vlen):
            name_off, mtype, off = struct.unpack_from("<III", self._data, pos + 12 * i)
            bit_off = off & 0xFFFFFF if kind_flag else off
            out.append(Member(self._str(name_off) if name_off else "", mtype, bit_off))
        return out

    def struct_ids(self, name: str) -> list[int]:
        return self._by_name.get(name, [])

    def _find(self, type_id: int, name: str) -> tuple[int, int] | None:
        """(bit offset, member type id) of `name` in a struct/union, searching anonymous members too."""
        for m in self.members(type_id):
            if m.name == name:
                return m.bit_offset, m.type_id
            if not m.name:
                inner = self._resolve(m.type_id)
                if self._header(inner)[0] in (KIND_STRUCT, KIND_UNION):
                    hit = self._find(inner, name)
                    if hit is not None:
                        return m.bit_offset + hit[0], hit[1]
        return None

    def member_offset(self, struct_name: str, path: str) -> int:
        """Byte offset of a dotted member path (``"thread.fsbase"``) inside ``struct struct_name``."""
        ids = [i for i in self.struct_ids(struct_name) if self._header(i)[1] > 0]
        if not ids:
            raise BtfError(f"struct {struct_name} not found in BTF")
        last_err = ""
        for type_id in ids:
            bits = 0
            cur = type_id
            ok = True
            for part in path.split("."):
                cur = self._resolve(cur)
                if self._header(cur)[0] not in (KIND_STRUCT, KIND_UNION):
                    ok, last_err = False, f"{part!r}: parent is not a struct"
                    break
                hit = self._find(cur, part)
                if hit is None:
                    ok, last_err = False, f"no member {part!r}"
                    break
                bits += hit[0]
                cur = hit[1]
            if ok:
                if bits % 8:
                    raise BtfError(f"{struct_name}.{path} is a bitfield (bit offset {bits})")
                return bits // 8
        raise BtfError(f"{struct_name}.{path}: {last_err}")


def _cache_dir() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "cuda-host-tracer")


@functools.lru_cache(maxsize=4)
def load(path: str = VMLINUX_BTF) -> Btf:
    """The parsed BTF at `path` (cached for the life of the process)."""
    try:
        with open(path, "rb") as f:
            return Btf(f.read())
    except OSError as e:
        raise BtfError(f"cannot read {path}: {e}") from e


def _blob_key(path: str) -> str:
    st = os.stat(path)
    with open(path, "rb") as f:
        head = f.read(4096)
    h = hashlib.sha1(head + str(st.st_size).encode() + os.uname().release.encode()).hexdigest()
    return h[:16]


@functools.lru_cache(maxsize=64)
def member_offset(struct_name: str, path: str, btf_path: str = VMLINUX_BTF) -> int:
    """Byte offset of ``struct_name.path`` in the running kernel, e.g. ``member_offset("task_struct",
    "thread.fsbase")`` -> 3128 on 6.18. Handles nested and anonymous structs and unions. Cached in-process and
    on disk (``$XDG_CACHE_HOME/cuda-host-tracer/btf-<key>.json``); an unwritable cache is ignored.

    Raises BtfError when the blob, the struct or the member is missing.
    """
    try:
        key = _blob_key(btf_path)
    except OSError as e:
        raise BtfError(f"cannot read {btf_path}: {e}") from e
    cache_file = os.path.join(_cache_dir(), f"btf-{key}.json")
    cached: dict[str, int] = {}
    try:
        with open(cache_file) as f:
            cached = json.load(f)
    except (OSError, ValueError):
        pass
    name = f"{struct_name}:{path}"
    if name in cached:
        return int(cached[name])
    off = load(btf_path).member_offset(struct_name, path)
    cached[name] = off
    try:
        os.makedirs(os.path.dirname(cache_file), exist_ok=True)
        tmp = f"{cache_file}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            json.dump(cached, f)
        os.replace(tmp, cache_file)
    except OSError:
        pass
    return off
