"""Long rows and gradient accumulation on one GPU (issue 48's acceptance for both).

Two parts, on a random-init model of a known shape (default Qwen2.5-0.5B, built from its
config: no weights on disk, as the other benchmarks do):

* ``rows``: the packed step's real tokens per second at long rows against short ones. The
  same pack (``--adapters`` adapters of rank ``--rank`` on every linear, ``--batch`` rows
  each) trains ``--steps`` steps on rows of ``--short`` tokens (fixed), then on rows of
  varied length around ``--long`` tokens (uniform between ``--long-min`` and
  ``--long-max``), flattened without padding. Each run is the sweep's own job config of that
  pack (`plora.job.from_spec.job_config`: activation checkpointing as ``auto`` resolves it
  for the rows), trained in this process (`PackedLoRARecipe`). Tokens/s counts real tokens
  of the steps after the first (which pays kernel compilation and graph capture) over their
  time; the acceptance is long/short >= 1 / 1.25.
* ``sweep``: `plora sweep` in a fresh process on a space whose ``batch_size`` includes
  ``--effective-batch`` (default 64) at rows of about ``--sweep-row`` tokens (1k), without a
  ``training.micro_batch_size``: the planner chooses each adapter's micro-batch where its
  batch does not fit one pass (`plora.planner.micro_batch`). Reported: the plan's
  micro-batches, predicted and measured makespan (acceptance: within 15 %), out-of-memory
  jobs (acceptance: none), adapters done.

    python scripts/bench_long_rows.py --out DIR                 # one GPU, both parts
    python scripts/bench_long_rows.py --out DIR --parts rows    # the step speed only (a few minutes)
    python scripts/bench_long_rows.py --out DIR --parts sweep --warm   # the sweep, then again on what it measured
    python scripts/bench_long_rows.py --out DIR --parts sweep --sweep-row 8192 --sweep-min-row 1024 \
        --sweep-rows 256 --effective-batch 16                  # a sweep of varied 1k-8k rows (mean 4.6k)
    python scripts/bench_long_rows.py --smoke --out DIR         # CPU, a tiny model: the plumbing, < 1 min

Writes DIR/long_rows.json and DIR/long_rows.md (a short table), and prints the table.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path
from typing import Any

import yaml

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import bench_first_sweep as bfs  # noqa: E402
from bench_rows import sentence_text, write_jsonl  # noqa: E402

#: tokens of every row's answer (the loss is over them and the prompt is context)
ANSWER_TOKENS = 64


def rows_file(path: Path, n: int, lo: int, hi: int, seed: int) -> Path:
    """``n`` rows whose length in tokens is uniform in [lo, hi] (about one token a character
    under the shape folders' tokenizers: `bench_rows`)."""
    rng = random.Random(seed)
    write_jsonl(path, [{"input": sentence_text(rng, rng.randint(lo, hi) - ANSWER_TOKENS),
                        "output": sentence_text(rng, ANSWER_TOKENS)} for _ in range(n)])
    return path


def model_path(args) -> str:
    if args.smoke:
        from bench_real_data import smoke_model

        return str(smoke_model(args.out))
    return f"shape:{args.model}"


def space(args, name: str, train: Path, seq: int, batch_sizes: list[int], learning_rates: list[float],
          **training: Any) -> dict:
    return {
        "name": name,
        "model": {"path": model_path(args), "dtype": args.dtype, "max_seq_len": seq},
        "data": {"train": str(train), "max_eval_samples": args.eval_samples},
        "lora": {"targets": "all-linear", "dropout": 0.0},
        "space": {"strategy": "grid", "rank": [args.rank], "alpha": [2 * args.rank], "learning_rate": learning_rates,
                  "batch_size": batch_sizes},
        "training": {"activation_checkpointing": "auto", **training},
        "eval": {"metrics": ["loss"], "max_new_tokens": 8},
        "hardware": {"device": "cpu"} if args.smoke else {"device": "cuda", "gpus": 1},
        "output": {"dir": str(args.out / "runs")},
    }


def pack_speed(args, label: str, train: Path, seq: int) -> dict:
    """The pack's real tokens/s on ``train``'s rows (steps after the first)."""
    from plora.job.from_spec import job_config
    from plora.planner.plan import Job
    from plora.spec.loading import load_spec
    from plora.sweep import prepare
    from plora.train.packed_lora import PackedLoRARecipe

    lrs = [1e-4 * (1 + k) for k in range(args.adapters)]
    path = bfs.write_space(args, label, space(args, label, train, seq, [args.batch], lrs, steps=args.steps))
    prep = prepare(load_spec(path))
    job = Job(id=f"rows-{label}", adapters=[c.id for c in prep.configs], tp=1)
    cfg = job_config(prep.spec, job, prep.configs, prep.steps, args.out / "runs" / label, eval_base=False,
                     length_buckets=prep.length_buckets, row_layout=prep.row_layout, hardware=prep.hardware)
    data = cfg.model_dump(mode="json")
    data["training"].update(checkpoint_every_steps=None, checkpoint_every_minutes=None)
    data["eval"]["every_steps"] = None
    summary = PackedLoRARecipe(data).run()
    steps = max(1, summary["steps"])
    real = summary["tokens"]["real"] * (steps - 1) / steps  # the first step's share, on average
    timed = summary["step_time_s"]
    return {"label": label, "steps": steps, "real_tokens": summary["tokens"]["real"],
            "stepped_tokens": summary["tokens"]["stepped"], "step_time_s": timed,
            "tokens_per_s": real / timed if timed > 0 else None, "row_layout": cfg.training.row_layout,
            "activation_checkpointing": cfg.training.activation_checkpointing,
            "adapters": summary["adapters"]}


def part_rows(args) -> dict:
    data = args.out / "data"
    data.mkdir(parents=True, exist_ok=True)
    short = rows_file(data / "short.jsonl", args.rows, args.short, args.short, seed=1)
    long = rows_file(data / "long.jsonl", args.rows, args.long_min, args.long_max, seed=2)
    out = {"short": pack_speed(args, "short", short, args.short + 16),
           "long": pack_speed(args, "long", long, args.long_max + 16)}
    s, g = out["short"]["tokens_per_s"], out["long"]["tokens_per_s"]
    out["long_over_short"] = g / s if s and g else None
    out["within_1_25x"] = bool(out["long_over_short"] and out["long_over_short"] >= 1 / 1.25)
    return out


def trained_micro_batches(run_dir: Path) -> dict[str, int]:
    """What each adapter trained at, where it accumulated: its entry in the job.yaml of the
    job it started in, or in the control.json join that sent it into a running job (the
    first plan's choice, or a re-plan's once the jobs measured memory)."""
    out: dict[str, int] = {}
    for job_dir in sorted(run_dir.glob("jobs/*")):
        entries = []
        if (job_dir / "job.yaml").is_file():
            entries += yaml.safe_load((job_dir / "job.yaml").read_text()).get("adapters", [])
        if (job_dir / "control.json").is_file():
            entries += json.loads((job_dir / "control.json").read_text()).get("join", [])
        out.update((a["id"], int(a["micro_batch_size"])) for a in entries if a.get("micro_batch_size"))
    return out


def part_sweep(args) -> dict:
    from plora.planner.plan import Plan
    from plora.spec.loading import load_spec

    data = args.out / "data"
    data.mkdir(parents=True, exist_ok=True)
    low = args.sweep_min_row or args.sweep_row // 2
    train = rows_file(data / "sweep.jsonl", args.sweep_rows, low, args.sweep_row, seed=3)
    batches = sorted({args.effective_batch // 4, args.effective_batch})
    path = bfs.write_space(args, "sweep", space(args, "sweep", train, args.sweep_row + 16, batches,
                                                [1e-4, 3e-4], epochs=1))
    run_dir = load_spec(path).run_dir(None)

    def run(label: str) -> dict:
        out = bfs.run_sweep(args, path, args.out / "caches", label, fresh=False)
        plan = Plan.of_run(run_dir)
        out["planned_micro_batches"] = dict(plan.micro_batches) if plan else {}
        out["micro_batches"] = trained_micro_batches(run_dir)
        out["notes"] = list(plan.notes) if plan else []
        ratio = out.get("measured_over_predicted")
        out["within_15pct"] = bool(ratio and abs(ratio - 1) <= 0.15)
        return out

    out = run("sweep")
    if args.warm:  # the same sweep again: planned with what the first measured (plora's cache)
        out["warm"] = run("sweep-warm")
    return out


def sweep_lines(part: str, sw: dict) -> list[str]:
    """A sweep's rows of the table."""
    ratio = sw.get("measured_over_predicted")
    return [f"| {part} | measured / predicted makespan | {ratio:.2f} |" if ratio else
            f"| {part} | measured / predicted makespan | n/a |",
            f"| {part} | out-of-memory jobs | {sw.get('oom_jobs')} |",
            f"| {part} | micro-batches chosen | {len(sw.get('micro_batches', {}))} adapters |",
            f"| {part} | adapters | {sw.get('adapters')} |"]


def table(result: dict) -> list[str]:
    lines = ["| part | figure | value |", "| --- | --- | --- |"]
    rows = result.get("rows")
    if rows:
        for k in ("short", "long"):
            r = rows[k]
            tps = r["tokens_per_s"]
            lines.append(f"| rows | {k} tokens/s (checkpointing {r['activation_checkpointing']}) | "
                         f"{tps:.0f} |" if tps else f"| rows | {k} tokens/s | n/a |")
        ratio = rows["long_over_short"]
        lines.append(f"| rows | long / short | {ratio:.2f} |" if ratio else "| rows | long / short | n/a |")
    sw = result.get("sweep")
    if sw:
        lines += sweep_lines("sweep", sw)
        if sw.get("warm"):
            lines += sweep_lines("sweep again", sw["warm"])
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=Path("bench-long-rows"))
    ap.add_argument("--parts", nargs="+", default=["rows", "sweep"], choices=["rows", "sweep"])
    ap.add_argument("--smoke", action="store_true", help="tiny model, short rows, CPU")
    ap.add_argument("--model", default="qwen2.5-0.5b", help="the shape preset")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--adapters", type=int, default=4, help="adapters of the timed pack")
    ap.add_argument("--batch", type=int, default=2, help="rows a step of each adapter of the timed pack")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--rows", type=int, default=256, help="training rows of each row length")
    ap.add_argument("--short", type=int, default=512)
    ap.add_argument("--long-min", type=int, default=1024)
    ap.add_argument("--long-max", type=int, default=8192)
    ap.add_argument("--effective-batch", type=int, default=64)
    ap.add_argument("--sweep-row", type=int, default=1024)
    ap.add_argument("--sweep-rows", type=int, default=512, help="training rows of the sweep (one epoch)")
    ap.add_argument("--warm", action="store_true", help="run the sweep a second time, planned on what the first measured")
    ap.add_argument("--sweep-min-row", type=int, default=None,
                    help="the sweep's shortest row in tokens (default half of --sweep-row; rows are uniform between)")
    ap.add_argument("--eval-samples", type=int, default=16)
    args = ap.parse_args()
    if args.smoke:
        args.dtype, args.adapters, args.batch, args.steps, args.rows = "float32", 2, 2, 3, 16
        args.short, args.long_min, args.long_max = 32, 64, 192
        args.effective_batch, args.sweep_row, args.sweep_rows, args.eval_samples = 8, 96, 16, 4
    args.out.mkdir(parents=True, exist_ok=True)
    result: dict = {"model": "tiny (smoke)" if args.smoke else args.model, "args": {
        k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}}
    if "rows" in args.parts:
        result["rows"] = part_rows(args)
    if "sweep" in args.parts:
        result["sweep"] = part_sweep(args)
    (args.out / "long_rows.json").write_text(json.dumps(result, indent=2, default=str))
    lines = table(result)
    (args.out / "long_rows.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
