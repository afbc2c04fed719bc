"""What every thread of a process tree is doing now, read without stopping any process: the kernel's view from
/proc (:mod:`.kernel`) and the Python frames read from the interpreter's memory (:mod:`.python`), joined per
thread by :mod:`.dump`. Shared by the ``tracer dump`` command and the recorder (which stores such snapshots);
it imports the recorder's CPython layouts and symbolizer, never the analyses."""
