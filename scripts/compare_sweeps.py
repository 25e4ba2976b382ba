"""How far two runs of the same sweep differ per adapter: train and eval loss from their
results.parquet, and the largest difference of any adapter weight (their PEFT folders).

A check for a change that must not change what a sweep trains (on a GPU the kernels' bf16
atomics make two runs of the same code differ a little: compare with two runs of one side):

    python scripts/compare_sweeps.py RUN_A RUN_B [--tolerance 5e-3]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import pandas as pd
import torch
from safetensors.torch import load_file


def weights_diff(a: Path, b: Path) -> float:
    """The largest absolute difference of any tensor of two PEFT adapter folders."""
    wa, wb = load_file(str(a / "adapter_model.safetensors")), load_file(str(b / "adapter_model.safetensors"))
    if set(wa) != set(wb):
        return float("inf")
    return max(((wa[k].float() - wb[k].float()).abs().max().item() for k in wa), default=0.0)


def compare(run_a: Path, run_b: Path) -> dict:
    ra = pd.read_parquet(run_a / "results.parquet").set_index("adapter_id")
    rb = pd.read_parquet(run_b / "results.parquet").set_index("adapter_id")
    out: dict = {"adapters": len(ra), "same_ids": sorted(ra.index) == sorted(rb.index), "columns": {}}
    for col in ("train_loss", "eval_loss", "status", "steps"):
        if col in ra and col in rb:
            a, b = ra[col], rb.loc[ra.index, col]
            if a.dtype.kind in "fi":
                out["columns"][col] = float((a - b).abs().max())
            else:
                out["columns"][col] = int((a != b).sum())  # adapters that differ
    out["weights"] = max((weights_diff(run_a / "adapters" / i, run_b / "adapters" / i) for i in ra.index
                          if (run_a / "adapters" / i / "adapter_model.safetensors").is_file()), default=0.0)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run_a", type=Path)
    ap.add_argument("run_b", type=Path)
    ap.add_argument("--tolerance", type=float, default=None, help="exit 1 where a loss differs by more")
    args = ap.parse_args()
    res = compare(args.run_a, args.run_b)
    print(json.dumps(res, indent=1))
    if args.tolerance is not None:
        worst = max((v for k, v in res["columns"].items() if k in ("train_loss", "eval_loss")), default=0.0)
        if worst > args.tolerance or not res["same_ids"] or res["columns"].get("status", 0):
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
