"""tests/support/need.py: a test that cannot run here skips on a developer's machine and fails under CI=true."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PROBE = """
from tests.support.need import need, need_module

def test_missing_install():
    need(False, "needs the frobnicator")

def test_missing_module():
    need_module("no_such_module_here")

def test_present():
    need(True, "never said")
"""


def _run(tmp_path: Path, ci: str | None) -> str:
    (tmp_path / "test_probe.py").write_text(PROBE)
    env = {k: v for k, v in os.environ.items() if k != "CI"} | ({"CI": ci} if ci is not None else {})
    env["PYTHONPATH"] = str(ROOT)
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rsf", "-p", "no:cacheprovider", str(tmp_path / "test_probe.py")],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=env,
        timeout=120,
    )
    return proc.stdout


@pytest.mark.parametrize("ci", [None, "false"])
def test_a_missing_install_skips_outside_ci(tmp_path: Path, ci: str | None) -> None:
    out = _run(tmp_path, ci)
    assert "2 skipped" in out and "1 passed" in out and "needs the frobnicator" in out, out


@pytest.mark.parametrize("ci", ["true", "1"])
def test_a_missing_install_fails_in_ci(tmp_path: Path, ci: str) -> None:
    out = _run(tmp_path, ci)
    assert "2 failed" in out and "1 passed" in out and "skipped" not in out, out
    assert "needs the frobnicator" in out and "cannot import no_such_module_here" in out, out
