"""A container-shaped cgroup for tests: a fresh cgroup whose path names a Kubernetes pod and a container, the way
the kubelet's cgroupfs driver lays them out (``.../kubepods/pod<uid>/<64-hex id>``), where a test can place a
process (``echo $$ > cgroup.procs``)."""

from __future__ import annotations

import contextlib
import os
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from tests.support.need import need

CGROUP_ROOT = Path("/sys/fs/cgroup")


@dataclass(frozen=True)
class Box:
    procs: Path  # its cgroup.procs file
    container_id: str
    pod_uid: str


@contextlib.contextmanager
def container_cgroup() -> Iterator[Box]:
    """Make ``<root>/tracer-test-PID/kubepods/pod<uid>/<id>`` in the v2 tree, or else in v1's cpu controller;
    remove it after."""
    need(os.geteuid() == 0, "needs root (a cgroup)")
    v2 = (CGROUP_ROOT / "cgroup.controllers").exists()
    base = CGROUP_ROOT if v2 else CGROUP_ROOT / "cpu"
    need((base / "cgroup.procs").exists(), f"needs a cgroup tree at {base}")
    uid, cid = str(uuid.uuid4()), uuid.uuid4().hex + uuid.uuid4().hex
    top = base / f"tracer-test-{os.getpid()}"
    leaf = top / "kubepods" / f"pod{uid}" / cid
    leaf.mkdir(parents=True)
    try:
        yield Box(leaf / "cgroup.procs", cid, uid)
    finally:
        for d in (leaf, leaf.parent, leaf.parent.parent, top):
            remove_cgroup(d)


def remove_cgroup(d: Path) -> None:
    """rmdir a test's cgroup, retrying for 5 s while its last processes are still exiting."""
    for _ in range(50):
        try:
            d.rmdir()
            return
        except OSError:
            time.sleep(0.1)
