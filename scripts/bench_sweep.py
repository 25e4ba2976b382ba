"""Wall-clock makespan of a real sweep: plora's packed plan against one adapter per job.

Writes a space file (16 configurations by default, random-init model of a given shape, the
built-in task), runs ``plora sweep`` on it twice -- as planned, and with
``planner.max_adapters_per_job: 1`` (today's practice: one configuration per job) -- and
reports each run's makespan (first job start to last job end, from the run's journal), its
wall time, and how many adapters finished. The cost-model profile is measured (or found in
the cache) before either run, so neither pays for it.

    python scripts/bench_sweep.py --shape qwen2.5-0.5b --device cuda --out DIR
    python scripts/bench_sweep.py --model builtin:tiny-llama --device cpu --out DIR   # smoke test
    ... --profile scripts/profiles/qwen2.5-0.5b-seq256.json   # reuse a profile of this GPU kind

Writes DIR/sweep_bench.json and prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import yaml
from plora.models.families.targets import LLAMA_TARGETS  # noqa: E402


def space(args: argparse.Namespace, one_per_job: bool) -> dict:
    return {
        "name": "one-per-job" if one_per_job else "packed",
        "model": {"path": args.model or f"shape:{args.shape}", "dtype": args.dtype, "max_seq_len": args.seq},
        "data": {"task": "builtin:shift", "num_train": args.num_train, "num_eval": 64, "max_eval_samples": 64},
        "lora": {"targets": list(LLAMA_TARGETS), "dropout": 0.0},
        "space": {
            "strategy": "grid",
            "rank": [8, 16, 32, 64],
            "alpha": {"relative": [2]},
            "learning_rate": [1e-4, 3e-4],
            "batch_size": [2, 4],
        },
        "training": {"epochs": args.epochs, "scheduler": "cosine", "warmup_ratio": 0.03, "grad_clip": 1.0},
        "eval": {"metrics": ["loss"]},
        "hardware": {"device": args.device, "gpus": args.gpus} if args.device == "cuda" else {"device": "cpu"},
        "planner": {"max_adapters_per_job": 1 if one_per_job else args.max_adapters},
        "output": {"dir": str(args.out / "runs")},
    }


def journal_makespan(run_dir: Path) -> tuple[float | None, int, dict[str, int]]:
    con = sqlite3.connect(run_dir / "journal.sqlite")
    try:
        rows = con.execute("SELECT started, ended FROM jobs WHERE started IS NOT NULL").fetchall()
        status = dict(con.execute("SELECT status, COUNT(*) FROM adapters GROUP BY status").fetchall())
    finally:
        con.close()
    ends = [e for _, e in rows if e is not None]
    span = (max(ends) - min(s for s, _ in rows)) if rows and ends else None
    return span, len(rows), status


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="qwen2.5-0.5b")
    ap.add_argument("--model", default=None, help="model.path instead of shape:<shape>")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--gpus", type=int, default=1)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--num-train", type=int, default=512)
    ap.add_argument("--epochs", type=int, default=1)
    ap.add_argument("--max-adapters", type=int, default=16)
    ap.add_argument("--only", choices=["packed", "one-per-job"], default=None)
    ap.add_argument("--out", type=Path, default=Path("bench-sweep"))
    ap.add_argument("--profile", type=Path, default=None,
                    help="a profile.json of this model on this GPU kind: used instead of profiling again")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    plora = [sys.executable, "-m", "plora.cli"]
    variants = [False, True] if args.only is None else [args.only == "one-per-job"]
    # the profile first (cached per machine), so neither timed run pays for it
    first = args.out / f"{'one-per-job' if variants[0] else 'packed'}.yaml"
    first.write_text(yaml.safe_dump(space(args, variants[0]), sort_keys=False))
    if args.profile is not None:  # a private cache holding the given profile, for both runs
        from plora.cost.profiling.cache import sweep_cache_path
        from plora.cost.profiling.record import Profile
        from plora.spec.loading import load_spec

        os.environ["PLORA_CACHE_DIR"] = str((args.out / "cache").resolve())
        try:
            prof = Profile.load(args.profile)
        except Exception as e:  # noqa: BLE001 - say which file and why, then stop
            raise SystemExit(f"--profile {args.profile}: {e} (give a profile.json that `plora profile` or "
                             "scripts/profile_models.py wrote)") from None
        prof.save(sweep_cache_path(load_spec(first)))
    t0 = time.time()
    subprocess.run(plora + ["profile", str(first)], check=True)
    profile_s = time.time() - t0
    rows = []
    for one in variants:
        path = args.out / f"{'one-per-job' if one else 'packed'}.yaml"
        path.write_text(yaml.safe_dump(space(args, one), sort_keys=False))
        run_dir = args.out / "runs" / ("one-per-job" if one else "packed")
        t0 = time.time()
        proc = subprocess.run(plora + ["sweep", str(path), "--restart"])
        wall = time.time() - t0
        span, jobs, status = journal_makespan(run_dir)
        rows.append({"variant": "one adapter per job" if one else "plora packed", "exit_code": proc.returncode,
                     "jobs": jobs, "adapters": status, "makespan_s": span, "wall_s": wall})
        print(json.dumps(rows[-1]), flush=True)
    device = "cpu"
    if args.device == "cuda":
        import torch

        device = torch.cuda.get_device_name()
    result = {"shape": args.model or args.shape, "device": device, "gpus": args.gpus, "seq": args.seq,
              "num_train": args.num_train, "profile_s": profile_s, "rows": rows}
    (args.out / "sweep_bench.json").write_text(json.dumps(result, indent=2))
    print(f"\n{result['shape']} on {device} × {args.gpus}, 16 configurations (rank 8-64, lr, batch size 2/4)")
    print(f"{'variant':22} {'jobs':>5} {'done':>5} {'makespan s':>11} {'wall s':>8}")
    for r in rows:
        ms = f"{r['makespan_s']:.1f}" if r["makespan_s"] is not None else "-"
        print(f"{r['variant']:22} {r['jobs']:>5} {r['adapters'].get('done', 0):>5} {ms:>11} {r['wall_s']:>8.1f}")
    if len(rows) == 2 and all(r["makespan_s"] for r in rows):
        print(f"speed-up (makespan): {rows[1]['makespan_s'] / rows[0]['makespan_s']:.2f}×")


if __name__ == "__main__":
    main()
