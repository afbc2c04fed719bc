"""What a CPython binary looks like to the frame walker, independent of any recording: per-version struct
layouts (:mod:`.layouts`), the BPF map values built from them (:mod:`.pycfg`), the analysis of an ELF file
(:mod:`.elf`), line-table decoding (:mod:`.linetable`) and reads of another process's objects (:mod:`.memory`).
:mod:`tracer.recorder.pyruntime` uses them to configure and symbolise traced processes."""
