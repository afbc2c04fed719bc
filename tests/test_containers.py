"""tracer/containers.py: container ids and pod UIDs from the cgroup paths each runtime and cgroup driver writes, pod
name and namespace from the environment; and a real process placed in a cgroup the test creates."""

from __future__ import annotations

import subprocess
import time

import pytest

from tests.support.cgroups import container_cgroup
from tracer import containers

CID = "3f4d5b1a2c" + "0" * 44 + "9e8d7c6b5a"
UID = "0b1c2d3e-4f50-6172-8394-a5b6c7d8e9f0"
UID_ = UID.replace("-", "_")


@pytest.mark.parametrize(
    ("path", "cid", "uid"),
    [
        (f"/docker/{CID}", CID, None),  # docker, cgroupfs driver
        (f"/system.slice/docker-{CID}.scope", CID, None),  # docker, systemd driver
        (f"/kubepods/burstable/pod{UID}/{CID}", CID, UID),  # kubelet cgroupfs driver (containerd, CRI-O)
        (f"/kubepods/pod{UID}/{CID}", CID, UID),  # a Guaranteed pod
        (
            f"/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod{UID_}.slice/cri-containerd-{CID}.scope",
            CID,
            UID,
        ),
        (f"/kubepods.slice/kubepods-pod{UID_}.slice/crio-{CID}.scope", CID, UID),  # CRI-O, systemd driver
        (f"/system.slice/containerd.service/kubepods-burstable-pod{UID_}.slice:cri-containerd:{CID}", CID, UID),
        (f"/machine.slice/libpod-{CID}.scope/container", CID, None),  # podman, with a nested init cgroup
        (f"/kubepods/burstable/pod{UID}", None, UID),  # the pod's own cgroup (its pause sandbox's parent)
        ("/user.slice/user-0.slice/session-3.scope", None, None),
        ("/process_api/edf862f0e369b0b2e35ba87d1ac6aa65", None, None),  # 32 hex: not a container id
        ("/", None, None),
    ],
)
def test_each_runtime_layout(path, cid, uid):
    assert containers.parse_cgroup(path) == (cid, uid)


def test_v1_lines_a_container_named_by_any_controller_and_pod_names_from_the_environment():
    box = f"/kubepods/pod{UID}/{CID}"
    text = {"name=systemd": "/", "memory": box, "cpu": box, "cpuacct": box, "": "/"}  # v1, and v2's "0::/"
    ident = containers.from_cgroups(text, {"HOSTNAME": "trainer-0", "POD_NAMESPACE": "ml"})
    assert ident == containers.Identity(f"/kubepods/pod{UID}/{CID}", CID, UID, "trainer-0", "ml")
    assert ident.container == CID[:12]
    # a downward-API POD_NAME wins over HOSTNAME (which a pod spec may set to something else)
    named = containers.from_cgroups(text, {"HOSTNAME": "h", "MY_POD_NAME": "trainer-0"})
    assert named.pod_name == "trainer-0"
    # outside a pod, HOSTNAME is only the host's name
    plain = containers.from_cgroups({"": "/user.slice/session-1.scope"}, {"HOSTNAME": "gpu-node-3"})
    assert plain == containers.Identity("/user.slice/session-1.scope", None, None, None, None)
    assert plain.container == ""


def test_a_process_placed_in_a_cgroup_the_test_creates():
    with container_cgroup() as box:
        p = subprocess.Popen(
            ["sh", "-c", f"echo $$ > {box.procs} && exec sleep 30"],
            env={"PATH": "/usr/bin:/bin", "HOSTNAME": "trainer-7", "POD_NAMESPACE": "ml"},
        )
        try:
            for _ in range(100):
                ident = containers.read(p.pid)
                if ident is not None and ident.container_id:
                    break
                time.sleep(0.05)
            assert ident is not None
            assert (ident.container_id, ident.pod_uid) == (box.container_id, box.pod_uid)
            assert ident.cgroup is not None and ident.cgroup.endswith(f"/pod{box.pod_uid}/{box.container_id}")
            assert (ident.pod_name, ident.pod_namespace) == ("trainer-7", "ml")
        finally:
            p.kill()
            p.wait()
    assert containers.read(p.pid) is None  # gone
