"""tracer.commands.launch's start-up path: for `tracer record`, the CLI registers the recording commands alone and
imports none of the analyses' command modules before the recording starts (half a second on a 2-vCPU VM)."""

from __future__ import annotations

import json
import subprocess
import sys

PROBE = """
import json, sys
import tracer.commands
tracer.commands.RECORDING_ONLY = {only}
from tracer.commands import cli
names = sorted(c.name or c.callback.__name__ for c in cli.app.registered_commands)
print(json.dumps({{"names": names, "analysis": "tracer.commands.analysis" in sys.modules}}))
"""


def _registered(only: bool) -> dict:
    out = subprocess.run([sys.executable, "-c", PROBE.format(only=only)], capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


def test_recording_only_registers_the_recording_commands() -> None:
    got = _registered(True)
    assert got["names"] == ["demo", "doctor", "record"]
    assert not got["analysis"]


def test_otherwise_every_command_is_registered() -> None:
    got = _registered(False)
    assert {"record", "stats", "chains", "breakdown"} <= set(got["names"])
    assert got["analysis"]
