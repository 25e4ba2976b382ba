"""Whether a spare's CUDA start (context, cuBLAS, first kernels) can run beside its imports:
times, in fresh processes, the spare's imports then its CUDA start in turn, and the CUDA start
on a thread begun right after ``import torch`` while the rest is imported.

    python scripts/probe_spare_warm.py --out DIR [--repeats 3]

Writes DIR/probe_spare_warm.json (each process's stages, in seconds from its start).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

CHILD = r'''
import json, sys, threading, time
t0 = time.perf_counter()
mode = sys.argv[1]
import torch
at = {"torch": time.perf_counter() - t0}

def cuda_start():
    s = time.perf_counter()
    torch.cuda.init()
    x = torch.zeros(1, device="cuda"); torch.cuda.synchronize()
    at["ctx"] = time.perf_counter() - t0
    a = torch.randn(64, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    b = torch.randn(64, 64, device="cuda", dtype=torch.bfloat16)
    y = torch.nn.functional.linear(a, b, torch.zeros(64, device="cuda", dtype=torch.bfloat16))
    (torch.nn.functional.silu(y) * y).float().sum().backward(); torch.cuda.synchronize()
    at["blas"] = time.perf_counter() - t0
    at["cuda_s"] = time.perf_counter() - s

th = None
if mode == "thread":
    th = threading.Thread(target=cuda_start); th.start()
from plora.models.torchtune_imports import import_job_modules, lean_job_imports
lean_job_imports()
from torchtune import config as tune_config  # noqa: F401
from plora.train import preload  # noqa: F401
from plora.train.packed_lora import recipe_main  # noqa: F401
import_job_modules()
at["imports"] = time.perf_counter() - t0
if th is None:
    cuda_start()
else:
    th.join()
at["done"] = time.perf_counter() - t0
print(json.dumps({"mode": mode, **{k: round(v, 4) for k, v in at.items()}}))
'''


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("probe-out"))
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    rows = []
    for _ in range(args.repeats):
        for mode in ("turn", "thread"):
            p = subprocess.run([sys.executable, "-c", CHILD, mode], capture_output=True, text=True)
            line = p.stdout.strip().splitlines()[-1] if p.stdout.strip() else json.dumps({"mode": mode, "err": p.stderr[-500:]})
            print(line, flush=True)
            rows.append(json.loads(line))
    (args.out / "probe_spare_warm.json").write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
