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
