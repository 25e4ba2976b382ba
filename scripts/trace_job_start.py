"""Where a job's start goes: each stage timed in a fresh interpreter, as a job process pays it.

A job is a new process (`tune run` of plora's recipe), and on a GPU machine its start was
measured at 16 s against 3.6 s on a CPU box. Each row below is a fresh ``python -c`` that
runs the stages up to it; the difference between rows is that stage's share. Each row runs
``--repeat`` times (the first may pay for writing bytecode caches).

    python scripts/trace_job_start.py --out DIR            # on the GPU machine
    python scripts/trace_job_start.py --device cpu         # here

Writes DIR/job_start.json and prints a table.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

STAGES = [
    ("interpreter", "pass"),
    ("import torch", "import torch"),
    ("cuda context", "import torch; torch.zeros(1, device='{device}'); torch.cuda.synchronize() if '{device}' == 'cuda' else None"),
    ("import triton", "import torch, triton; torch.zeros(1, device='{device}')"),
    ("import torchtune", "import torch, torchtune; torch.zeros(1, device='{device}')"),
    ("import recipe", "import torch; torch.zeros(1, device='{device}'); import plora.train.packed_lora"),
    ("tune CLI + recipe", "import torch; torch.zeros(1, device='{device}'); import torchtune._cli.tune, plora.train.packed_lora"),
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("job-start"))
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    rows = []
    for name, code in STAGES:
        times = []
        for _ in range(args.repeat):
            t0 = time.perf_counter()
            subprocess.run([sys.executable, "-c", code.format(device=args.device)], check=True,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            times.append(time.perf_counter() - t0)
        rows.append({"stage": name, "seconds": times})
        print(f"{name:<20} " + "  ".join(f"{t:6.2f}" for t in times), flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "job_start.json").write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
