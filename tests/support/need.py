"""One rule for a test that cannot run on this machine: it skips on a developer's machine and fails in CI.

A skipped test is a test that checked nothing, and a suite of skips is green. In CI (``CI=true``) the machine is
set up by ``setup.sh`` to run everything (root, BPF, bcc, compilers, the interpreters), so a missing piece there
is a broken set-up that must show, as a failure naming what is missing.
"""

from __future__ import annotations

import importlib
import os
from types import ModuleType

import pytest

IN_CI = os.environ.get("CI", "").strip().lower() in ("1", "true", "yes")


def need(condition: object, why: str) -> None:
    """Go on when ``condition`` holds; else skip the test with ``why``, or fail it under ``CI=true``."""
    if condition:
        return
    if IN_CI:
        pytest.fail(f"{why} (CI=true: what a test needs must be installed, so this fails rather than skips)")
    pytest.skip(why)


def need_nothing_missing(missing: str | None) -> None:
    """For a check that returns what is missing (None: nothing): go on, or skip (fail in CI) saying what."""
    if missing is not None:
        need(False, missing)


def need_root(what: str = "BPF") -> None:
    """The test loads BPF programs, mounts or attaches probes: root only."""
    need(os.geteuid() == 0, f"needs root ({what})")


def need_module(name: str) -> ModuleType:
    """The module ``name`` (bcc, say), imported; skip (or fail in CI) when it cannot be."""
    try:
        return importlib.import_module(name)
    except ImportError as e:
        need(False, f"cannot import {name}: {e}")
        raise  # not reached: need() raised a skip or a failure
