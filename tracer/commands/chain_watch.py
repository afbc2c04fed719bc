"""The chain watch's process (``python -m tracer.commands.chain_watch RECORDER_PID SNAPSHOT_DIR ACTIVE_S``), the
child half of :class:`tracer.live.ChainWatch`: for each snapshot path read on stdin, compute the causal chains over
it (`tracer chains`' analysis) and write one JSON line on stdout, ``{"active": [[category, severity], ...]}``: the
HIGH and MEDIUM chains whose affected range ended less than ACTIVE_S before the snapshot's data ends (or
``{"error": ...}``). It runs at nice 19 and ends at its stdin's EOF or with the recorder (tie_to_recorder)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from tracer.live import tie_to_recorder

ACTIVE_SEVERITIES = ("HIGH", "MEDIUM")


def active_chains(db: str, active_s: float) -> list[tuple[str, str]]:
    """The (category, severity) of the HIGH and MEDIUM chains of recording ``db`` whose range ended within
    ``active_s`` of the end of its data (session.flushed_ns; the last call's time if the session row lacks it)."""
    from tracer.analysis.chains import compute_chains
    from tracer.analysis.db import open_trace

    with open_trace(db) as conn:
        end = conn.execute("SELECT max(flushed_ns) FROM session").fetchone()[0]
        if end is None:
            end = conn.execute("SELECT max(ts_ns) FROM cuda_calls").fetchone()[0] or 0
        found = compute_chains(conn, limit=1000)
    since = end - int(active_s * 1e9)
    return sorted(
        {(c.category, c.severity) for c in found.chains if c.severity in ACTIVE_SEVERITIES and c.end_ns >= since}
    )


def main(argv: list[str]) -> int:
    if not tie_to_recorder(int(argv[0]), Path(argv[1])):
        return 1
    active_s = float(argv[2])
    os.nice(19)  # after the job and the recorder
    for line in sys.stdin:
        try:
            msg: dict = {"active": active_chains(line.strip(), active_s)}
        except Exception as e:  # any analysis failure: the recorder keeps the last values
            msg = {"error": f"{type(e).__name__}: {e}"}
        sys.stdout.write(json.dumps(msg) + "\n")
        sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
