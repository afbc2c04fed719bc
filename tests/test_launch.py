"""tracer.commands.launch's start-up path: for `tracer record`, the CLI registers the recording commands alone and
imports none of the analyses' command modules before the recording starts (half a second on a 2-vCPU VM); for
`tracer dump`, the dump alone."""

from __future__ import annotations

import json
import subprocess
import sys

PROBE = """
import json, sys
import tracer.commands
tracer.commands.ONLY = {only!r}
from tracer.commands import cli
names = sorted(c.name or c.callback.__name__ for c in cli.app.registered_commands)
print(json.dumps({{"names": names, "analysis": "tracer.commands.analysis" in sys.modules}}))
"""


def _registered(only: str | None) -> dict:
    out = subprocess.run([sys.executable, "-c", PROBE.format(only=only)], capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


def test_recording_only_registers_the_recording_commands() -> None:
    got = _registered("record")
    assert got["names"] == ["demo", "doctor", "record"]
    assert not got["analysis"]


def test_otherwise_every_command_is_registered() -> None:
    got = _registered(None)
    assert {"record", "stats", "chains", "breakdown"} <= set(got["names"])
    assert got["analysis"]


def test_dump_only_registers_the_dump() -> None:
    got = _registered("dump")
    assert got["names"] == ["dump"]
    assert not got["analysis"]


def test_tracer_dump_runs_without_the_analyses(tmp_path) -> None:
    # GIVEN a process to read; WHEN `tracer dump --json` runs through the console entry point
    import os

    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        probe = (
            "import json, sys; sys.argv = ['tracer', 'dump', '--pid', sys.argv[1], '--json']\n"
            "from tracer.commands.launch import main\n"
            "rc = main()\n"
            "print(json.dumps({'rc': rc, 'analysis': 'tracer.commands.analysis' in sys.modules}), file=sys.stderr)"
        )
        out = subprocess.run(
            [sys.executable, "-c", probe, str(child.pid)], capture_output=True, text=True, timeout=120, check=True
        )
    finally:
        child.kill()
        child.wait()
    # THEN it dumps the process's threads (as root: its memory is readable) without importing the analyses
    got = json.loads(out.stderr.strip().splitlines()[-1])
    assert got == {"rc": 0, "analysis": False}, out.stderr
    threads = json.loads(out.stdout)
    assert [t["pid"] for t in threads] == [child.pid] or os.geteuid() != 0
