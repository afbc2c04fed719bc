"""The values user space writes into probes/pyframes.h's maps: ``pycfg`` (one configured process) and
``py_binaries`` (one interpreter file, configured by the kernel in every process that maps it), and the -D
flags the header is compiled with."""

from __future__ import annotations

import ctypes as ct

from tracer.recorder import btf
from tracer.recorder.cpython.layouts import V310, PyTarget, ascii_data_offset

PTHREAD_SPECIFIC_1ST = 0x310  # glibc x86_64 2.27-2.38: offsetof(struct pthread, specific_1stblock)
PTHREAD_SPECIFIC_2ND = 0x510  # offsetof(struct pthread, specific)
NO_OFFSET = 0xFFFF

NOT_PYTHON = 2  # py_bin.is_lib of a file named like an interpreter that does not embed CPython (pyframes.h)
# py_cfg.flags, as in probes/pyframes.h
PYCFG_F_LASTI_INT = 1
PYCFG_F_CFRAME = 2
PYCFG_F_TAGGED = 4


class PyCfg(ct.Structure):
    """ctypes mirror of struct py_cfg in probes/pyframes.h (56 bytes)."""

    _fields_ = [
        ("tss_key_addr", ct.c_uint64),
        ("runtime_addr", ct.c_uint64),
        ("version", ct.c_uint16),
        ("flags", ct.c_uint16),
        ("ts_frame", ct.c_uint16),
        ("cframe_current", ct.c_uint16),
        ("f_previous", ct.c_uint16),
        ("f_code", ct.c_uint16),
        ("f_instr", ct.c_uint16),
        ("f_owner", ct.c_uint16),
        ("co_adaptive", ct.c_uint16),
        ("frame_read", ct.c_uint16),
        ("pthread_spec1", ct.c_uint16),
        ("pthread_spec2", ct.c_uint16),
        ("co_filename", ct.c_uint16),
        ("co_name", ct.c_uint16),
        ("co_firstlineno", ct.c_uint16),
        ("co_linetable", ct.c_uint16),
        ("str_data", ct.c_uint16),
        ("owner_skip", ct.c_uint8),
        ("_pad", ct.c_uint8 * 5),
    ]


def build_cfg(t: PyTarget) -> PyCfg:
    """The pycfg map value for a configured process."""
    o = t.binary.offsets
    ver = t.version
    flags = 0
    if ver <= V310:
        flags |= PYCFG_F_LASTI_INT
    if o.get("cframe_current") is not None:
        flags |= PYCFG_F_CFRAME
    if ver >= (3, 14):
        flags |= PYCFG_F_TAGGED
    owner = o.get("f_owner")
    read = max(o["f_previous"] or 0, o["f_code"] or 0, o["f_instr"] or 0) + 8
    if owner is not None:
        read = max(read, owner + 1)
    return PyCfg(
        tss_key_addr=t.tss_key_addr,
        runtime_addr=t.runtime_addr,
        version=ver[0] << 8 | ver[1],
        flags=flags,
        ts_frame=o["ts_frame"] or 0,
        cframe_current=o.get("cframe_current") or 0,
        f_previous=o["f_previous"] or 0,
        f_code=o["f_code"] or 0,
        f_instr=o["f_instr"] or 0,
        f_owner=owner if owner is not None else NO_OFFSET,
        co_adaptive=o.get("co_adaptive") or 0,
        frame_read=min((read + 7) & ~7, 128),
        pthread_spec1=PTHREAD_SPECIFIC_1ST,
        pthread_spec2=PTHREAD_SPECIFIC_2ND,
        co_filename=o["co_filename"] or 0,
        co_name=o.get("co_qualname") or o["co_name"] or 0,
        co_firstlineno=o["co_firstlineno"] or 0,
        co_linetable=o["co_linetable"] or 0,
        str_data=ascii_data_offset(ver),
        owner_skip=3 if owner is not None else 255,
    )


def cflags() -> list[str]:
    """The -D flags pyframes.h needs: FSBASE_OFF, offsetof(task_struct, thread.fsbase) from kernel BTF."""
    return [f"-DFSBASE_OFF={btf.member_offset('task_struct', 'thread.fsbase')}"]
