"""What the ELF cache kept between recordings saves (issue 33): the CPU to parse the libraries a training job maps.

The recorder resolves each new stack's native frames through the files they lie in: their PT_LOADs, symbols,
.eh_frame index and .debug_line table, parsed once per recording with pyelftools. tracer/recorder/elfcache.py keeps
those facts between recordings. This bench starts fixtures/workloads/train.py, reads the executable files it maps,
and times in this process (thread CPU, so other tenants of a shared machine barely move it), for each of N rounds:

- cold: every file parsed as a recording without the cache does (symbols, a line lookup, the unwind table);
- first: the same with an empty cache directory, and the cache's save (what the first recording pays);
- warm: the same files through the filled cache (what every later recording pays).

``--job torch`` reads the files of fixtures/workloads/torch_loader.py (real PyTorch: libtorch_cpu's 342 K symbols)
instead, into ``elf_cache_torch.json``.

    sudo .venv/bin/python -m bench.elf_cache [--runs N] [--job torch]
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.common import REPO, WORKLOADS, base_parser, build_fixtures, median, need_root, print_table, write_result
from tracer.recorder.symbolize import ElfCache
from tracer.recorder.unwind import UnwindTables


def mapped_files(pid: int) -> list[str]:
    """The executable file mappings of ``pid``."""
    out = set()
    with open(f"/proc/{pid}/maps") as f:
        for line in f:
            parts = line.split()
            if len(parts) >= 6 and "x" in parts[1] and parts[5].startswith("/"):
                out.add(parts[5])
    return sorted(out)


JOBS = {
    "train": [
        "/usr/bin/python3",
        str(WORKLOADS / "train.py"),
        "--workers",
        "2",
        "--persistent-workers",
        "--epochs",
        "1000",
    ],
    "torch": [str(REPO / ".venv" / "bin" / "python"), str(WORKLOADS / "torch_loader.py"), "--epochs", "1000"],
}


def job_files(cmd: list[str], timeout: float = 60.0) -> list[str]:
    """The executable files ``cmd`` maps once its CUDA library is loaded (its imports done)."""
    job = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        end = time.monotonic() + timeout
        while time.monotonic() < end and job.poll() is None:
            files = mapped_files(job.pid)
            if any("libcudart" in os.path.basename(f) for f in files):
                time.sleep(1.0)  # the rest of its start-up
                return mapped_files(job.pid)
            time.sleep(0.2)
        raise SystemExit(f"bench.elf_cache: {cmd[1]} did not load its CUDA library within {timeout:.0f} s")
    finally:
        job.kill()
        job.wait()


def parse_all(files: list[str], disk: Path | None) -> tuple[float, float]:
    """(thread CPU ms to get every file's symbols, a line and its unwind table; ms to save the cache after)."""
    t0 = time.thread_time()
    elves = ElfCache(disk=disk)
    tables = UnwindTables(elves)
    for p in files:
        elf = elves.get(p)
        if elf is not None and elf.text is not None:
            elf.lookup(elf.text[1] + 16)
            elf.line_for(elf.text[1] + 16)
        tables.table(p)
    t1 = time.thread_time()
    if disk is None:
        return (t1 - t0) * 1e3, 0.0
    elves.save()
    tables.save()
    return (t1 - t0) * 1e3, (time.thread_time() - t1) * 1e3


def main(argv: list[str] | None = None) -> int:
    p = base_parser(__doc__)
    p.add_argument("--runs", type=int, default=None, help="rounds (default 5, --quick 2)")
    p.add_argument("--job", choices=sorted(JOBS), default="train", help="whose files: train.py (default) or torch")
    args = p.parse_args(argv)
    need_root("bench.elf_cache (the cache trusts root's entries only)")
    build_fixtures()
    runs = args.runs or (2 if args.quick else 5)
    files = job_files(JOBS[args.job])
    rounds: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="bench-elf-cache-") as t:  # 0700, root's: a usable cache parent
        for i in range(runs):
            disk = Path(t) / f"cache{i}"
            cold, _ = parse_all(files, None)
            first, save = parse_all(files, disk)
            warm, _ = parse_all(files, disk)
            rounds.append({"cold_ms": cold, "first_ms": first, "save_ms": save, "warm_ms": warm})
            print(
                f"round {i}: cold {cold:.1f} ms, first {first:.1f} + save {save:.1f} ms, warm {warm:.1f} ms",
                file=sys.stderr,
            )
    res = {
        "files": files,
        **{k: median([r[k] for r in rounds]) for k in ("cold_ms", "first_ms", "save_ms", "warm_ms")},
        "rounds": rounds,
        "load1": os.getloadavg()[0],
    }
    print_table(
        [[len(files), res["cold_ms"], res["first_ms"], res["save_ms"], res["warm_ms"]]],
        ["files", "cold ms", "first ms", "save ms", "warm ms"],
    )
    name = "elf_cache" if args.job == "train" else f"elf_cache_{args.job}"
    print(f"wrote {write_result(name, {'job': args.job, **res}, args.out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
