"""Tensor-parallel packed jobs on the GPU: TP = 1, 2, 4 agree, and what each step costs.

Runs the real job the engine runs (`tune run [--nproc_per_node d] plora/train/packed_lora.py`,
CUDA_VISIBLE_DEVICES = the job's GPUs) on a random-init model of a preset shape with
synthetic data, once per TP degree, then (``--concurrent``) two jobs at once on disjoint
GPU sets (TP=2 on GPUs 0,1 and 2,3; TP=1 on GPUs 0 and 1 of a 2-GPU machine), as the
engine places them. Per job: wall time, median step time (from
the recipe's own metrics.jsonl timestamps: every step ends in a host sync, so they are
step boundaries), tokens/s, and the largest per-step loss difference from TP = 1.

    python scripts/bench_tp.py --shape qwen2.5-3b --tp 1,2,4 --steps 10 --concurrent --out DIR

Writes DIR/tp_bench.json and prints a table; exits 1 if a job fails or the losses of a TP
degree differ from TP = 1 by more than the tolerance (float rounding of the split
contractions: larger in bf16 than in fp32).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from plora.models.families.targets import LLAMA_TARGETS
from plora.engine.local import JobProcess, launch
from plora.job.config import JobConfig
from plora.job.synthetic import synthetic_job_config
from plora.models.loading import write_shape_folder
from plora.models.shape import ModelShape
from plora.settings import settings

#: |loss(TP=d) - loss(TP=1)| allowed, per dtype (losses are ~12 on a random-init model)
TOLERANCE = {"float32": 5e-3, "bfloat16": 1e-1, "float16": 5e-2}


def job_config(model_dir: Path, out: Path, job_id: str, args: argparse.Namespace, tp: int) -> JobConfig:
    """The bench's job: the library's synthetic job (`plora.job.synthetic`) of ``args.adapters``
    adapters cycling through ``args.ranks``, on every linear layer."""
    ranks = [int(r) for r in args.ranks.split(",")]
    adapters = [(ranks[k % len(ranks)], args.batch_size) for k in range(args.adapters)]
    return synthetic_job_config(job_id, model_dir, adapters, seq_len=args.seq, dtype=args.dtype, device=args.device,
                                targets=LLAMA_TARGETS, output_dir=out, tp=tp, steps=args.steps, learning_rate=args.lr,
                                num_samples=512, adapter_ids=[f"a{k}-r{r}" for k, (r, _) in enumerate(adapters)])


def start(cfg: JobConfig, gpus: list[int]) -> tuple[JobProcess, Path, float]:
    """The job started as the engine starts it (`plora.engine.local.launch`: its environment,
    its GPUs, `tune run` with ``--nproc_per_node`` for TP)."""
    job_dir = cfg.job_dir
    job_dir.mkdir(parents=True, exist_ok=True)
    cfg.write(job_dir / "job.yaml")
    slot = f"cuda:{gpus[0]}" if cfg.device == "cuda" else "cpu:0"
    job = launch(cfg.job_id, job_dir, slot, gpus=gpus if cfg.device == "cuda" else (), nproc=len(gpus),
                 extra_env={"PYTHONUNBUFFERED": "1"})
    return job, job_dir, job.started


def collect(cfg: JobConfig, job: JobProcess, job_dir: Path, started: float, gpus: list[int], timeout: float) -> dict:
    try:
        rc = job.proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        job.proc.kill()
        rc = "timeout"
    if job.log:
        job.log.close()
    wall = time.time() - started
    metrics = cfg.job_dir / "metrics.jsonl"
    rows = [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.is_file() else []
    losses = {(r["step"], r["adapter"]): r["loss"] for r in rows}
    starts: dict[int, float] = {}
    for r in rows:
        starts.setdefault(r["step"], r["time"])
    steps = sorted(starts)
    deltas = [starts[b] - starts[a] for a, b in zip(steps, steps[1:])]
    timed = deltas[2:] if len(deltas) > 4 else deltas  # the first steps compile kernels
    step_s = statistics.median(timed) if timed else float("nan")
    tokens = sum(a.batch_size for a in cfg.adapters) * cfg.model.max_seq_len
    result = {
        "job": cfg.job_id, "tp": cfg.tp, "gpus": gpus, "returncode": rc, "wall_s": round(wall, 1),
        "steps_logged": len(steps), "step_ms": step_s * 1e3, "tokens_per_s": tokens / step_s if timed else None,
        "losses": losses,
    }
    if rc != 0:
        result["log_tail"] = (job_dir / "log.txt").read_text()[-3000:]
    return result


def loss_diff(a: dict, b: dict) -> float:
    keys = a.keys() & b.keys()
    if not keys or keys != a.keys():
        return float("inf")
    return max(abs(a[k] - b[k]) for k in keys)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="qwen2.5-3b")
    ap.add_argument("--tp", default="1,2,4")
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--adapters", type=int, default=8)
    ap.add_argument("--ranks", default="8,16,32,64")
    ap.add_argument("--batch-size", type=int, default=2)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--concurrent", action="store_true",
                    help="also two jobs at once on disjoint GPUs: TP=2 on 0,1 and 2,3 (4 GPUs), TP=1 on 0 and 1 (2 GPUs)")
    ap.add_argument("--timeout", type=float, default=240)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--out", type=Path, default=Path("bench-out"))
    args = ap.parse_args()
    args.out = args.out.resolve()
    args.out.mkdir(parents=True, exist_ok=True)
    n_gpus = torch.cuda.device_count() if args.device == "cuda" else 4  # CPU: ranks, not GPUs
    shape = ModelShape.preset(args.shape)
    model_dir = write_shape_folder(shape, args.out / "model")
    tol = TOLERANCE.get(args.dtype, 1e-1)

    results = []
    for d in [int(x) for x in args.tp.split(",")]:
        if d > n_gpus:
            print(f"skip TP={d}: {n_gpus} GPU(s) visible", flush=True)
            continue
        cfg = job_config(model_dir, args.out / f"tp{d}", f"tp{d}", args, d)
        gpus = list(range(d))
        res = collect(cfg, *start(cfg, gpus), gpus, args.timeout)
        results.append(res)
        print(json.dumps({k: v for k, v in res.items() if k != "losses"}), flush=True)
    if args.concurrent and n_gpus >= 2:
        half = min(2, n_gpus // 2)  # two TP=2 jobs on 4 GPUs, two TP=1 jobs on 2
        pairs = [list(range(half)), list(range(half, 2 * half))]
        cfgs = [job_config(model_dir, args.out / f"pair{i}", f"tp{half}-gpus{''.join(map(str, p))}", args, half)
                for i, p in enumerate(pairs)]
        running = [(cfg, start(cfg, p), p) for cfg, p in zip(cfgs, pairs)]
        for cfg, launched, p in running:
            res = collect(cfg, *launched, p, args.timeout)
            res["concurrent"] = True
            results.append(res)
            print(json.dumps({k: v for k, v in res.items() if k != "losses"}), flush=True)

    ref = next((r for r in results if r["tp"] == 1 and r["returncode"] == 0), None)
    ok = all(r["returncode"] == 0 for r in results)
    for r in results:
        r["max_loss_diff_vs_tp1"] = loss_diff(ref["losses"], r["losses"]) if ref else None
        if ref is None or not r["max_loss_diff_vs_tp1"] <= tol:
            ok = False
    device = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    summary = {"shape": args.shape, "device": device, "gpus": n_gpus, "dtype": args.dtype, "seq": args.seq,
               "adapters": args.adapters, "ranks": args.ranks, "batch_size": args.batch_size, "steps": args.steps,
               "kernels": settings().kernels, "tolerance": tol, "ok": ok,
               "jobs": [{k: v for k, v in r.items() if k != "losses"} for r in results]}
    (args.out / "tp_bench.json").write_text(json.dumps(summary, indent=2, default=str))

    tokens = args.adapters * args.batch_size * args.seq
    print(f"\n{args.shape} {args.dtype} on {n_gpus}× {device}: {args.adapters} adapters (ranks {args.ranks}), "
          f"{tokens} tokens/step, {args.steps} steps, kernels={summary['kernels']}")
    print(f"{'job':>14} {'TP':>3} {'GPUs':>8} {'rc':>4} {'wall s':>7} {'step ms':>9} {'tokens/s':>10} {'Δloss vs TP1':>13}")
    for r in results:
        tps = f"{r['tokens_per_s']:.0f}" if r["tokens_per_s"] else "-"
        diff = r["max_loss_diff_vs_tp1"]
        diff = "-" if diff is None else f"{diff:.2e}"
        print(f"{r['job']:>14} {r['tp']:>3} {','.join(map(str, r['gpus'])):>8} {str(r['returncode']):>4} "
              f"{r['wall_s']:>7.1f} {r['step_ms']:>9.1f} {tps:>10} {diff:>13}")
    for r in results:
        if "log_tail" in r:
            print(f"\n--- {r['job']} log tail ---\n{r['log_tail']}")
    print("\nOK" if ok else f"\nFAILED (tolerance {tol})")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
