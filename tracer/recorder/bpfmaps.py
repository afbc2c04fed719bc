"""Whole BPF hash maps to numpy arrays and back, with the batch syscalls (BPF_MAP_LOOKUP_BATCH, DELETE_BATCH).

bcc's Table API makes a ctypes object per entry (and its batch helpers allocate the map's maximum size each call);
the recorder drains its per-second aggregates every second, so it reads them straight into structured arrays whose
dtypes mirror probes/common.h (tracer/recorder/events.py), and deletes the finished entries in one call.
"""

from __future__ import annotations

import ctypes as ct
import errno
import os
from typing import Any

import numpy as np

CHUNK = 4096  # entries per BPF_MAP_LOOKUP_BATCH call


def _lib() -> Any:
    from bcc.libbcc import lib

    return lib


def dump(table: Any, key_dtype: np.dtype, val_dtype: np.dtype) -> tuple[np.ndarray, np.ndarray]:
    """Return (keys, values) of every entry of a BPF hash map, as structured arrays.

    Raises:
        OSError: the kernel refused the batch lookup (other than "no more entries").
    """
    lib = _lib()
    if key_dtype.itemsize != ct.sizeof(table.Key) or val_dtype.itemsize != ct.sizeof(table.Leaf):
        raise ValueError(f"dtype sizes {key_dtype.itemsize}/{val_dtype.itemsize} do not match the map's")
    keys_out: list[np.ndarray] = []
    vals_out: list[np.ndarray] = []
    token_in, token_out = ct.c_uint32(0), ct.c_uint32(0)
    first = True
    while True:
        keys = np.empty(CHUNK, dtype=key_dtype)
        vals = np.empty(CHUNK, dtype=val_dtype)
        count = ct.c_uint32(CHUNK)
        res = lib.bpf_lookup_batch(
            table.map_fd,
            None if first else ct.byref(token_in),
            ct.byref(token_out),
            keys.ctypes.data_as(ct.c_void_p),
            vals.ctypes.data_as(ct.c_void_p),
            ct.byref(count),
        )
        err = ct.get_errno()
        n = int(count.value)
        keys_out.append(keys[:n])
        vals_out.append(vals[:n])
        if res != 0:
            if err not in (errno.ENOENT, 0):
                raise OSError(err, f"BPF_MAP_LOOKUP_BATCH: {os.strerror(err)}")
            break
        if n == 0:
            break
        first = False
        token_in.value = token_out.value
    return np.concatenate(keys_out), np.concatenate(vals_out)


def delete(table: Any, keys: np.ndarray) -> None:
    """Delete these keys (a structured array of the map's key dtype) in one call; missing keys are ignored."""
    if len(keys) == 0:
        return
    keys = np.ascontiguousarray(keys)
    count = ct.c_uint32(len(keys))
    if _lib().bpf_delete_batch(table.map_fd, keys.ctypes.data_as(ct.c_void_p), ct.byref(count)) != 0:
        # a key deleted meanwhile (ENOENT) stops the batch where it is: delete the rest one by one
        for i in range(int(count.value), len(keys)):
            try:
                del table[table.Key.from_buffer_copy(keys[i : i + 1].tobytes())]
            except KeyError:
                pass
