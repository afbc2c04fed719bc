"""The `tracer` console entry point: starts compiling the BPF program for `record`/`demo` before anything else.

Importing the CLI (typer, rich, duckdb, pyarrow, the analyses) takes most of a second; compiling the BPF program
takes seconds of clang that release the GIL. Started first, in a thread, the compile overlaps the imports, which
is most of what `tracer record` spends before its probes are live (issue 9: start-up).
"""

from __future__ import annotations

import importlib.abc
import os
import sys
from typing import Any


class _NoPandas(importlib.abc.MetaPathFinder):
    """Makes ``import pandas`` fail in the recording process (pyarrow then goes on without it). Cython's import
    fast path reads sys.modules directly, so a None entry there is not enough."""

    def find_spec(self, name: str, path: Any, target: Any = None) -> None:
        if name == "pandas" or name.startswith("pandas."):
            raise ModuleNotFoundError(f"{name} is not used while recording", name=name)
        return None


def main() -> int:
    """Run the CLI (tracer.commands.cli.main) on sys.argv; return its exit code."""
    argv = sys.argv[1:]
    cmd = next((a for a in argv if not a.startswith("-")), None)
    if cmd in ("record", "demo") and os.geteuid() == 0 and "--help" not in argv and "--" not in argv[:1]:
        import tracer.commands

        tracer.commands.ONLY = "record"  # tracer.commands.cli then registers the recording commands alone
        # pyarrow imports pandas, when installed, at its first pa.array(): 0.4 s and ~60 MB the recorder never uses
        sys.meta_path.insert(0, _NoPandas())
        try:
            from tracer.recorder import ProgramOptions, prewarm

            args = argv[: argv.index("--")] if "--" in argv else argv
            prewarm(ProgramOptions(with_pyframes="--no-python-stacks" not in args))
        except Exception:  # the recorder compiles (and reports) on its own
            pass
    elif cmd == "dump" and "--help" not in argv:
        import tracer.commands

        tracer.commands.ONLY = "dump"  # a hung job's dump, at once: none of the analyses' imports
    from tracer.commands.cli import main as cli_main

    return cli_main(argv)


if __name__ == "__main__":
    sys.exit(main())
