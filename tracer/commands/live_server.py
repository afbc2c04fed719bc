"""The live MCP server's process: ``python -m tracer.commands.live_server RECORDER_PID SNAPSHOT_DIR ARGS...`` runs
``tracer ARGS`` (the recorder's :class:`tracer.live.LiveServer` passes ``mcp serve --live ...``) in a process tied
to the recorder (:func:`tracer.live.tie_to_recorder`): it never outlives it."""

from __future__ import annotations

import sys
from pathlib import Path

from tracer.live import tie_to_recorder


def main(argv: list[str]) -> int:
    """Tie this process to the recorder, then run the CLI on the rest of ``argv``; return its exit code."""
    if not tie_to_recorder(int(argv[0]), Path(argv[1])):
        print("tracer: the recorder is gone; the live MCP server is not started", file=sys.stderr)
        return 1
    from tracer.commands.cli import main as cli_main

    return cli_main(argv[2:])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
