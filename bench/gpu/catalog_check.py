"""On a machine with a real GPU and PyTorch: which CUDA libraries a torch job maps, and which catalog symbols
they export (dlsym). Prints JSON. No BPF needed; run with the interpreter that has torch."""

import ctypes
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import re

import torch

from probes.catalog import CATALOG, LIBRARY_PATTERNS

x = torch.randn(256, 256, device="cuda")
y = (x @ x).sum().item()  # cuBLAS GEMM + reduction + DtoH sync
maps = Path("/proc/self/maps").read_text().splitlines()
libs = sorted(
    {
        line.split()[-1]
        for line in maps
        if "/" in line and ("libcud" in line or "libcublas" in line or "libnccl" in line)
    }
)
out = {"torch": torch.__version__, "cuda": torch.version.cuda, "mapped": libs, "exports": {}}
for path in libs:
    base = Path(path).name
    kind = next((k for k, pat in LIBRARY_PATTERNS.items() if re.match(pat, base)), None)
    if kind is None:
        continue
    lib = ctypes.CDLL(path)
    found, missing = [], []
    for spec in CATALOG:
        if spec.library != kind:
            continue
        for sym in spec.symbols:
            (found if hasattr(lib, sym) else missing).append(sym)
    out["exports"][path] = {"kind": kind, "found": found, "missing": missing}
print(json.dumps(out, indent=1))
