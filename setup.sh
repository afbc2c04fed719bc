#!/usr/bin/env bash
# One-step set-up for cuda-host-tracer on Debian/Ubuntu, as root. Safe to run again.
#
#   1. Debian packages: bcc (python3-bpfcc), compilers, venv, and kernel headers. Where the running kernel has
#      no headers package (custom or cloud kernels), the newest available headers are installed and wired where
#      bcc looks (/lib/modules/$(uname -r)/{build,source}); uprobes and tracepoints only need them for types.
#   2. .venv on /usr/bin/python3 with --system-site-packages (bcc is a Debian package, not a PyPI one), with the
#      project installed editable with its dev extras (torch==2.13.0 from the machine's disk; nvidia-nccl-cu13, the
#      real libnccl.so.2, from the index; pyspark, ~1 min and ~490 MB, whose local Spark needs java >= 17, which
#      is checked first), every package at the version constraints.txt pins; skipped when already there.
#   3. /usr/local/bin/tracer, so `sudo tracer ...` works.
#   4. The stand-in CUDA libraries and C fixtures in fixtures/build/.
set -euo pipefail
cd "$(dirname "$0")"
ROOT=$(pwd)
say() { printf '\033[1m==> %s\033[0m\n' "$*"; }
warn() { printf '\033[33mwarning: %s\033[0m\n' "$*" >&2; }

if [ "$(id -u)" -ne 0 ]; then
    echo "error: setup.sh installs system packages and must run as root (sudo ./setup.sh)" >&2
    exit 3
fi

export DEBIAN_FRONTEND=noninteractive
KVER=$(uname -r)
# prometheus: promtool checks deploy/prometheus/alerts.yml, and its server scrapes `tracer record --metrics` in
# tests/integration/test_metrics_real.py
PKGS=(python3-bpfcc bpfcc-tools python3-venv python3-dev gcc g++ make binutils prometheus)
need_apt=0
for p in "${PKGS[@]}"; do dpkg -s "$p" >/dev/null 2>&1 || need_apt=1; done
[ -e "/lib/modules/$KVER/build/include" ] || need_apt=1
if [ "$need_apt" = 1 ]; then
    say "installing Debian packages: ${PKGS[*]}"
    apt-get update -qq
    apt-get install -y -qq "${PKGS[@]}" >/dev/null
fi

if [ ! -e "/lib/modules/$KVER/build/include" ]; then
    if apt-cache show "linux-headers-$KVER" >/dev/null 2>&1; then
        say "installing linux-headers-$KVER"
        apt-get install -y -qq "linux-headers-$KVER" >/dev/null
    else
        arch=$(dpkg --print-architecture)
        say "no linux-headers-$KVER package: installing the newest Debian headers (linux-headers-$arch)"
        apt-get install -y -qq "linux-headers-$arch" >/dev/null
        hdr=$(ls -d /usr/src/linux-headers-*-"$arch" 2>/dev/null | sort -V | tail -n 1)
        common=$(ls -d /usr/src/linux-headers-*-common 2>/dev/null | sort -V | tail -n 1)
        if [ -z "$hdr" ]; then
            echo "error: could not find installed kernel headers under /usr/src" >&2
            exit 3
        fi
        mkdir -p "/lib/modules/$KVER"
        ln -sfn "$hdr" "/lib/modules/$KVER/build"
        [ -n "$common" ] && ln -sfn "$common" "/lib/modules/$KVER/source"
        warn "kernel $KVER has no headers package; using $(basename "$hdr") for bcc. Uprobes and tracepoints only"
        warn "need them for type definitions; task_struct offsets are read from /sys/kernel/btf/vmlinux at run time."
    fi
fi

# Spark 4 (pyspark, dev extras: tests/test_export_spark.py runs the Parquet dataset's query in it) runs on Java 17+:
# installed from Debian when missing or older.
java_major() {
    local v=""
    if command -v java >/dev/null; then
        v=$(java -version 2>&1 | sed -n 's/.* version "\([^"]*\)".*/\1/p' | head -n 1) || true
    fi
    v=${v#1.}          # Java 8 says "1.8.0_402"
    echo "${v%%[!0-9]*}"  # "17.0.15", "21-ea" -> 17, 21
}
jm=$(java_major)
if [ -z "$jm" ] || [ "$jm" -lt 17 ]; then
    say "installing Java 17 for Spark (openjdk-17-jre-headless)"
    apt-get update -qq
    apt-get install -y -qq openjdk-17-jre-headless >/dev/null
    jm=$(java_major)
    if [ -z "$jm" ] || [ "$jm" -lt 17 ]; then
        echo "error: Spark 4 (pyspark, for tests/test_export_spark.py) needs Java >= 17 as \`java\` on PATH;" \
            "found ${jm:-no java} after installing openjdk-17-jre-headless. Put Java 17+ first on PATH." >&2
        exit 3
    fi
fi

if [ ! -x .venv/bin/python ]; then
    say "creating .venv on /usr/bin/python3 (--system-site-packages, for bcc)"
    /usr/bin/python3 -m venv --system-site-packages .venv
fi
# True when .venv already holds this checkout, editable, with pyproject.toml's version and scripts and every
# requirement (dev extras included) at a version it and constraints.txt allow: then pip is not run, so a second run
# reinstalls nothing.
installed() {
    [ -x .venv/bin/tracer ] || return 1
    # -I: not the checkout's own cuda_host_tracer.egg-info from the working directory
    .venv/bin/python -I - "$ROOT" >/dev/null 2>&1 <<'PY'
import json, sys, tomllib
from importlib import metadata
from pathlib import Path
from packaging.requirements import Requirement

root = Path(sys.argv[1])
project = tomllib.loads((root / "pyproject.toml").read_text())["project"]
dist = metadata.distribution(project["name"])
url = json.loads(dist.read_text("direct_url.json") or "{}")
assert url.get("dir_info", {}).get("editable") and url.get("url") == root.as_uri()
assert dist.version == project["version"]
assert {e.name: e.value for e in dist.entry_points if e.group == "console_scripts"} == project.get("scripts", {})
for req in map(Requirement, project["dependencies"] + project["optional-dependencies"]["dev"]):
    assert req.specifier.contains(metadata.version(req.name), prereleases=True), req
for line in (root / "constraints.txt").read_text().splitlines():
    if line.strip() and not line.startswith("#"):
        req = Requirement(line)
        assert req.specifier.contains(metadata.version(req.name), prereleases=True), req
PY
}

# torch==2.13.0 (dev extras) is a CPU build that lies on this kind of machine's disk: pip finds it through the
# find-links of its config (pip config list), which sudo's clean environment may drop ($PIP_FIND_LINKS). Name
# every local directory that holds the wheel, so the install never falls back to a download of another build.
find_links=()
for d in ${PIP_FIND_LINKS:-} /opt/wheels; do
    case " ${find_links[*]} " in *" $d "*) continue ;; esac
    if compgen -G "$d/torch-2.13.0[+-]*.whl" >/dev/null; then find_links+=(--find-links "$d"); fi
done
if installed; then
    say "cuda-host-tracer and its requirements are already installed in .venv"
else
    say "installing cuda-host-tracer into .venv (with torch==2.13.0 and nvidia-nccl-cu13 for the tests)"
    [ ${#find_links[@]} -gt 0 ] || warn "no torch-2.13.0 wheel on this disk: pip will look for it in the index"
    .venv/bin/python -m pip install -q --upgrade pip >/dev/null
    .venv/bin/python -m pip install -q "${find_links[@]}" -c constraints.txt -e ".[dev]"
fi

cat > /usr/local/bin/tracer <<LAUNCHER
#!/bin/sh
exec "$ROOT/.venv/bin/tracer" "\$@"
LAUNCHER
chmod 755 /usr/local/bin/tracer

# bcc removes a perf-event uprobe through tracefs (uprobe_events): without tracefs mounted, every detach fails
# ("Failed to detach BPF from uprobe"). Some VM images boot without it.
if [ ! -e /sys/kernel/tracing/uprobe_events ] && [ ! -e /sys/kernel/debug/tracing/uprobe_events ]; then
    say "mounting tracefs at /sys/kernel/tracing"
    mount -t tracefs nodev /sys/kernel/tracing || warn "could not mount tracefs: bcc cannot detach uprobes"
fi

say "building the stand-in CUDA libraries and fixtures"
make -s -C fixtures

.venv/bin/python -c "import bcc, duckdb, mcp, pyspark, torch" || {
    echo "error: the virtualenv cannot import bcc/duckdb/mcp/pyspark/torch" >&2
    exit 3
}
# The first `tracer record` compiles the BPF program (seconds of clang) and caches it in
# /var/cache/cuda-host-tracer/bpf (root's, 0700); compiled here once, every `tracer record` loads it from there.
say "compiling the BPF program into /var/cache/cuda-host-tracer/bpf (tracer record then starts without clang)"
.venv/bin/python -c "import sys; from tracer.recorder.preflight import verify_program; e = verify_program(); print(e or '', file=sys.stderr); sys.exit(1 if e else 0)" ||
    warn "the BPF program did not compile here: run tracer doctor"
say "done. Next: .venv/bin/pytest   (tests)   and   sudo tracer demo   (a recorded investigation)"
