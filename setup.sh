#!/usr/bin/env bash
# One-step set-up for cuda-host-tracer on Debian/Ubuntu, as root. Safe to run again.
#
#   1. Debian packages: bcc (python3-bpfcc), compilers, venv, and kernel headers. Where the running kernel has
#      no headers package (custom or cloud kernels), the newest available headers are installed and wired where
#      bcc looks (/lib/modules/$(uname -r)/{build,source}); uprobes and tracepoints only need them for types.
#   2. .venv on /usr/bin/python3 with --system-site-packages (bcc is a Debian package, not a PyPI one), with the
#      project installed editable with its dev extras.
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
PKGS=(python3-bpfcc bpfcc-tools python3-venv python3-dev gcc g++ make binutils)
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

if [ ! -x .venv/bin/python ]; then
    say "creating .venv on /usr/bin/python3 (--system-site-packages, for bcc)"
    /usr/bin/python3 -m venv --system-site-packages .venv
fi
say "installing cuda-host-tracer into .venv"
.venv/bin/python -m pip install -q --upgrade pip >/dev/null
.venv/bin/python -m pip install -q -e ".[dev]"

cat > /usr/local/bin/tracer <<LAUNCHER
#!/bin/sh
exec "$ROOT/.venv/bin/tracer" "\$@"
LAUNCHER
chmod 755 /usr/local/bin/tracer

say "building the stand-in CUDA libraries and fixtures"
make -s -C fixtures

.venv/bin/python -c "import bcc, duckdb, mcp" || { echo "error: the virtualenv cannot import bcc/duckdb/mcp" >&2; exit 3; }
say "done. Next: .venv/bin/pytest   (tests)   and   sudo tracer demo   (a recorded investigation)"
