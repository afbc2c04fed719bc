"""Which container and Kubernetes pod a process runs in, from its cgroup path and its environment (issue 32).

The runtimes name the cgroup after the container (the 64-hex id) and the kubelet after the pod (its UID), in two
layouts each: the cgroupfs driver's paths (``/docker/<id>``, ``/kubepods/burstable/pod<uid>/<id>``) and the
systemd driver's unit names (``docker-<id>.scope``, ``kubepods-burstable-pod<uid_with_underscores>.slice/
cri-containerd-<id>.scope``, ``crio-<id>.scope``, ``libpod-<id>.scope``, and containerd's
``...slice:cri-containerd:<id>``). The pod's name and namespace are not in the path: the kubelet sets ``HOSTNAME``
to the pod name, and a pod spec may pass both through the downward API (``POD_NAME``, ``POD_NAMESPACE`` and the
usual spellings below). Shared by the recorder (placement rows, metric labels) and any reader.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from tracer import procfs

_CONTAINER_ID = re.compile(r"(?:^|[/\-:])([0-9a-f]{64})(?:\.scope)?(?=$|/)")
_POD_UID = re.compile(
    r"pod([0-9a-f]{8}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{12})(?:\.slice)?(?=$|/|:)"
)
POD_NAME_VARS = ("POD_NAME", "MY_POD_NAME", "K8S_POD_NAME", "KUBERNETES_POD_NAME")
POD_NAMESPACE_VARS = ("POD_NAMESPACE", "MY_POD_NAMESPACE", "K8S_POD_NAMESPACE", "KUBERNETES_NAMESPACE")
SHORT_ID = 12  # the id as `docker ps` and `crictl ps` show it: the metric label


@dataclass(frozen=True)
class Identity:
    cgroup: str | None  # the process's cgroup path (v2, else the first v1 controller's that names a container)
    container_id: str | None  # the full 64-hex id
    pod_uid: str | None  # with dashes, as `kubectl get pod -o jsonpath={.metadata.uid}` prints it
    pod_name: str | None = None
    pod_namespace: str | None = None

    @property
    def container(self) -> str:
        """The short container id ('' outside a container): the ``container`` metric label."""
        return (self.container_id or "")[:SHORT_ID]


def parse_cgroup(path: str) -> tuple[str | None, str | None]:
    """Return (container id, pod UID) named by the cgroup ``path``; None for each it does not name."""
    ids = _CONTAINER_ID.findall(path)
    pods = _POD_UID.findall(path)
    return (ids[-1] if ids else None), (pods[-1].replace("_", "-") if pods else None)


def from_cgroups(lines: dict[str, str], env: dict[str, str] | None = None) -> Identity:
    """The identity from a process's cgroups (procfs.cgroups: controller -> path, "" keying the v2 tree) and its
    environment."""
    paths = list(lines.items())
    # a path that names a container (v1 controllers all agree); else the v2 one, else the v1 cpu controller's
    v2 = [p for c, p in paths if c == ""]
    named = [p for _, p in paths if parse_cgroup(p) != (None, None)]
    cpu = [p for c, p in paths if "cpu" in c.split(",")]
    cgroup = next(iter(named + [p for p in v2 if p != "/"] + cpu + v2), None)
    cid, uid = parse_cgroup(cgroup) if cgroup else (None, None)
    env = env or {}
    name = next((env[k] for k in POD_NAME_VARS if env.get(k)), None)
    if name is None and uid is not None:
        name = env.get("HOSTNAME") or None  # the kubelet sets it to the pod's name
    ns = next((env[k] for k in POD_NAMESPACE_VARS if env.get(k)), None)
    return Identity(cgroup, cid, uid, name, ns)


def read(pid: int) -> Identity | None:
    """Return ``pid``'s identity now; None when it is gone."""
    lines = procfs.cgroups(pid)
    return from_cgroups(lines, procfs.environ(pid)) if lines else None
