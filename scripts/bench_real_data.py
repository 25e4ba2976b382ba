"""A sweep on real-looking rows: plora's measured makespan against its plan, and against
`transformers` + PEFT training the same configurations one after another.

The sweep: 16 configurations (rank 8/16/32/64 x lr 1e-4/3e-4 x batch 2/4, alpha 2r, all
seven linears, one epoch, cosine) on a random-init model of a given shape (default the
Qwen2.5-0.5B shape, 152k vocabulary) in bf16, 512 training rows from a JSONL file written
here, 32 eval samples per adapter. Two data variants with about the same real tokens:

* ``fixed``: every row about 250 tokens (about 200 in, 48 out);
* ``varied``: 16-400 characters in, about 48 out.

Each runs through ``plora sweep`` (the real engine), after ``plora profile`` (cached,
timed apart). Measured makespan (first job start to last job end, from the run's journal)
against the plan's predicted makespan.

Then the baseline, as users run it today: the same configurations, rows, batch sizes,
steps, schedule and eval with `transformers` + PEFT, one job per configuration, one after
another: each a fresh interpreter that imports transformers and PEFT, loads the base model
from disk (written once before any timing), trains, evaluates and saves its adapter (on the
GPU image its path leaves ``/tmp/site``'s torchao out, which the image's peft refuses). Its
makespan is the sum of those jobs' wall times; the sum of their steps and evals alone (no
start, no load) is reported beside it. Real (non-padding) training tokens per second for
both. ``--baseline-configs N`` trains the first N configurations (interleaved over batch
sizes) and extrapolates the rest by batch size, reported as such. Each configuration's
result is a file of its own, so ``--parts`` and ``--baseline-budget-s`` spread one run
over several calls of a machine with a per-call limit (the same DIR, results merged):

    python scripts/bench_real_data.py --out DIR --parts plora                 # ~8 min with the profile
    python scripts/bench_real_data.py --out DIR --parts baseline --baseline-budget-s 500   # again till done
    python scripts/bench_real_data.py --smoke --out DIR                       # tiny model, CPU, a minute

On one H100 (0.5B shape): the profile ~3.5 minutes the first time (cached after), each plora
sweep about a minute, a PEFT job 20-40 s.

Writes DIR/real_data_bench.json and DIR/real_data_bench.md; prints a short table last.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import subprocess
import sys
import time
from pathlib import Path

from plora.models.families.targets import LLAMA_TARGETS

REPO = Path(__file__).resolve().parent.parent
TARGETS = list(LLAMA_TARGETS)


# ------------------------------------------------------------------------------ data
# The rows (shared with bench_streaming.py) live in bench_rows.py beside this script.
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_rows import make_rows, sentence_text, write_jsonl  # noqa: F401 - importable from here

# ---------------------------------------------------------------------------- plora


def space(args, variant: str, data_dir: Path) -> dict:
    device = {"device": "cpu"} if args.device == "cpu" else {"device": "cuda", "gpus": 1}
    return {
        "name": f"real-{variant}",
        "model": {"path": args.model, "dtype": args.dtype, "max_seq_len": args.seq},
        "data": {"train": str(data_dir / f"train-{variant}.jsonl"), "eval": str(data_dir / f"eval-{variant}.jsonl"),
                 "max_eval_samples": args.eval_samples},
        "lora": {"targets": TARGETS, "dropout": 0.0},
        "space": {"strategy": "grid", "rank": args.ranks, "alpha": {"relative": [2]},
                  "learning_rate": [1e-4, 3e-4], "batch_size": [2, 4]},
        "training": {"epochs": 1, "scheduler": "cosine", "grad_clip": 1.0},
        "eval": {"metrics": args.metrics, "max_new_tokens": args.max_new_tokens},
        "hardware": device,
        "planner": {"max_adapters_per_job": 16},
        "output": {"dir": str(args.out / "runs")},
    }


def real_tokens(spec) -> tuple[int, int]:
    """(real training tokens one epoch of one adapter sees, rows), as plora tokenizes them."""
    from plora.data.dataset import TextTokenizer, load_split, tokenize_examples
    from plora.models.loading import read_model_info
    from plora.data.check import data_config

    info = read_model_info(spec.model.resolved_path(), spec.model.family)
    tok = TextTokenizer(info.path, info.eos_token_id, info.pad_token_id)
    samples = tokenize_examples(load_split(data_config(spec), "train"), tok, int(spec.model.max_seq_len))
    return sum(len(s.tokens) for s in samples), len(samples)


def run_plora(args, variant: str, data_dir: Path) -> dict:
    from plora.engine.journal import measured_makespan
    from plora.planner.plan import Plan
    from plora.spec.loading import load_spec

    path = args.out / f"{variant}.yaml"  # written by main() with the data
    plora = [sys.executable, "-m", "plora.cli"]
    t0 = time.time()
    if not args.no_profile:
        with open(args.out / f"{variant}-profile.log", "w") as log:  # kept: what the profile measured, and how long
            subprocess.run(plora + ["profile", str(path)], check=True, stdout=log, stderr=subprocess.STDOUT)
    profile_s = time.time() - t0
    t0 = time.time()
    with open(args.out / f"{variant}-sweep.log", "w") as log:
        proc = subprocess.run(plora + ["sweep", str(path), "--restart"] + (["--no-profile"] if args.no_profile else []),
                              stdout=log, stderr=subprocess.STDOUT)
    wall = time.time() - t0
    spec = load_spec(path)
    run_dir = spec.run_dir(None)
    plan = Plan.of_run(run_dir)
    span = measured_makespan(run_dir)
    predicted = plan.expected_makespan if plan is not None else None
    tokens, rows = real_tokens(spec)
    configs = 4 * len(args.ranks)
    status = {}
    results = run_dir / "results.csv"
    if results.is_file():
        import pandas as pd

        status = pd.read_csv(results)["status"].value_counts().to_dict()
    ooms = sum(1 for p in (run_dir / "jobs").glob("*/oom.json")) if (run_dir / "jobs").is_dir() else 0
    for summary in sorted(run_dir.glob("jobs/*/summary.json")):  # each job's phases, beside the results
        (args.out / f"{variant}-{summary.parent.name}-summary.json").write_text(summary.read_text())
    return {"variant": variant, "exit_code": proc.returncode, "profile_s": profile_s, "wall_s": wall,
            "makespan_s": span, "predicted_makespan_s": predicted,
            "measured_over_predicted": span / predicted if span and predicted else None,
            "jobs": len(plan.jobs) if plan is not None else 0, "adapters": status, "oom_jobs": ooms,
            "real_tokens": tokens * configs, "rows": rows,
            "real_tokens_per_s": tokens * configs / span if span else None}


# ----------------------------------------------------------------------------- peft


def baseline_env() -> dict:
    """The baseline's environment: the image's own packages, /tmp/site (and its torchao) left out."""
    env = dict(os.environ)
    parts = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and not p.startswith("/tmp/site")]
    env["PYTHONPATH"] = os.pathsep.join(parts)
    return env


def grid(ranks: list[int]) -> list[tuple[int, float, int]]:
    """The sweep's configurations (rank, lr, batch size), ordered so that any first N of them
    mix ranks and batch sizes."""
    n_all = 4 * len(ranks)
    return [(ranks[k % len(ranks)], (1e-4, 3e-4)[k * 2 // n_all], (2, 4)[(k + k // len(ranks)) % 2])
            for k in range(n_all)]


def run_baseline(args, variant: str, data_dir: Path) -> dict:
    """The PEFT baseline, as users run it today: one job (a fresh interpreter that imports
    transformers and PEFT, loads the base model from disk, trains, evaluates and saves the
    adapter) per configuration, one after another. Each configuration's result is kept in
    ``baseline-<variant>/config-NN.json`` and a rerun trains only the missing ones, so the
    baseline can be spread over several calls of a machine with a per-call time limit."""
    from plora.spec.loading import load_spec

    spec = load_spec(args.out / f"{variant}.yaml")
    folder = args.out / f"baseline-{variant}"
    folder.mkdir(exist_ok=True)
    job = {"model": str(spec.model.resolved_path(weights=True)), "random_init": spec.model.random_init, "dtype": args.dtype,
           "device": args.device, "seq": args.seq, "train": str(data_dir / f"train-{variant}.jsonl"),
           "eval": str(data_dir / f"eval-{variant}.jsonl"), "eval_samples": args.eval_samples,
           "metrics": args.metrics, "max_new_tokens": args.max_new_tokens, "ranks": args.ranks,
           "base": str(args.out / "peft-base"), "adapters": str(folder / "adapters")}
    spec_path = folder / "job.json"
    spec_path.write_text(json.dumps(job))
    env = baseline_env() if not args.keep_site else dict(os.environ)
    worker = [sys.executable, str(Path(__file__).resolve()), "--peft-worker", str(spec_path)]
    if not (args.out / "peft-base" / "config.json").is_file():  # the base model on disk, before any timing
        subprocess.run(worker + ["--peft-save-base"], env=env, cwd=str(REPO), check=True)
    configs = grid(args.ranks)
    take = list(range(max(1, min(len(configs), int(args.baseline_configs or len(configs))))))
    runs: list[dict] = []
    for i in take:
        out = folder / f"config-{i:02d}.json"
        if not out.is_file():
            if args.baseline_budget_s and time.time() - args.started > args.baseline_budget_s:
                break  # the rest in a later call
            t0 = time.time()
            proc = subprocess.run(worker + ["--peft-config", str(i), "--peft-out", str(out)], env=env, cwd=str(REPO))
            wall = time.time() - t0
            if proc.returncode != 0 or not out.is_file():
                return {"variant": variant, "error": f"baseline configuration {i} exited {proc.returncode}"}
            out.write_text(json.dumps({**json.loads(out.read_text()), "process_s": wall}))
        runs.append(json.loads(out.read_text()))
        print(json.dumps(runs[-1]), flush=True)
    if not runs:
        return {"variant": variant, "error": "no baseline configuration ran"}
    meta = runs[-1]
    by_bs: dict[int, list[dict]] = {}
    for r in runs:
        by_bs.setdefault(r["batch_size"], []).append(r)

    def total(key: str) -> float:  # over all configurations: measured, or by batch size where not run
        if len(runs) == len(configs):
            return sum(r[key] for r in runs)
        mean = lambda rs: sum(r[key] for r in rs) / len(rs)  # noqa: E731
        return sum(mean(by_bs.get(bs, runs)) for _, _, bs in configs)

    real = total("real_tokens")
    makespan = total("process_s")
    return {"variant": variant, "configs_run": len(runs), "configs": len(configs),
            "extrapolated": len(runs) < len(configs), "makespan_s": makespan,
            "train_eval_s": total("seconds"), "train_s": total("train_s"), "load_s": total("load_s"),
            "real_tokens": real, "real_tokens_per_s": real / makespan,
            "real_tokens_per_train_s": real / total("train_s"),
            "padding_share": 1 - sum(r["real_tokens"] for r in runs) / max(1, sum(r["padded_tokens"] for r in runs)),
            "runs": runs, **{k: meta[k] for k in ("device", "torch", "peft", "transformers") if k in meta}}


def peft_worker(spec_path: Path, config: int | None, out: Path | None, save_base: bool) -> None:
    """One configuration with transformers + PEFT, as one job of today's practice; or, with
    ``save_base``, the base model written to disk once (random init where plora's is)."""
    sys.path[:] = [p for p in sys.path if "torchao" not in p]
    import torch
    from tokenizers import Tokenizer
    from transformers import AutoConfig, AutoModelForCausalLM

    job = json.loads(spec_path.read_text())
    device = torch.device("cuda" if job["device"] != "cpu" and torch.cuda.is_available() else "cpu")
    dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}[job["dtype"]]
    folder = Path(job["model"])
    if save_base:
        torch.manual_seed(0)
        if job["random_init"]:
            model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder), dtype=dtype)
        else:
            model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype)
        model.save_pretrained(job["base"])
        return
    cfg = json.loads((folder / "config.json").read_text())
    eos, pad = cfg.get("eos_token_id"), cfg.get("pad_token_id")
    pad = eos if pad is None else pad
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    seq = int(job["seq"])

    def encode(rows):  # as plora: the prompt as the tokenizer encodes it, answer + eos, loss on the answer and eos
        out_rows = []
        for r in rows:
            prompt = tok.encode(r["input"]).ids
            answer = tok.encode(r["output"], add_special_tokens=False).ids + [eos]
            ids = (prompt + answer)[:seq]
            labels = ([-100] * len(prompt) + answer)[:seq]
            out_rows.append((ids, labels, r))
        return out_rows

    read = lambda p: [json.loads(line) for line in Path(p).read_text().splitlines() if line.strip()]  # noqa: E731
    train = encode(read(job["train"]))
    evals = encode(read(job["eval"])[: int(job["eval_samples"])])

    t_load = time.time()
    base = AutoModelForCausalLM.from_pretrained(job["base"], dtype=dtype).to(device)
    if device.type == "cuda":
        torch.cuda.synchronize()
    load_s = time.time() - t_load
    from peft import LoraConfig, get_peft_model

    def batch(rows):
        width = max(len(r[0]) for r in rows)
        ids = torch.full((len(rows), width), pad, dtype=torch.long)
        labels = torch.full((len(rows), width), -100, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for i, (x, y, _) in enumerate(rows):
            ids[i, : len(x)] = torch.tensor(x)
            labels[i, : len(y)] = torch.tensor(y)
            mask[i, : len(x)] = 1
        return ids.to(device), labels.to(device), mask.to(device)

    if job.get("configs"):  # the caller's own list of [rank, alpha, learning rate, batch size]
        rank, alpha, lr, bs = job["configs"][config]
    else:
        rank, lr, bs = grid(list(job["ranks"]))[config]
        alpha = 2 * rank
    t0 = time.time()
    model = get_peft_model(base, LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=0.0, target_modules=TARGETS))
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    steps = math.ceil(len(train) / bs)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5 * (1.0 + math.cos(math.pi * min(1.0, s / max(1, steps)))))
    rng = random.Random(config)
    perm = list(range(len(train)))
    rng.shuffle(perm)
    model.train()
    real, padded = 0, 0
    for s in range(steps):
        rows = [train[perm[(s * bs + j) % len(train)]] for j in range(bs)]
        ids, labels, mask = batch(rows)
        real += int(mask.sum())
        padded += ids.numel()
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
    if device.type == "cuda":
        torch.cuda.synchronize()
    train_s = time.time() - t0
    model.eval()
    metrics = {}
    with torch.no_grad():
        sums = count = 0.0
        for e0 in range(0, len(evals), 32):
            ids, labels, mask = batch(evals[e0: e0 + 32])
            logits = model(input_ids=ids, attention_mask=mask).logits[:, :-1].float()
            tgt = labels[:, 1:]
            ce = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), tgt.reshape(-1),
                                                   ignore_index=-100, reduction="sum")
            sums += float(ce)
            count += int((tgt != -100).sum())
        metrics["eval_loss"] = sums / max(1, count)
        if "exact_match" in job["metrics"]:
            hits = 0
            for x, y, r in evals:
                prompt = x[: len(x) - sum(1 for v in y if v != -100)]
                gen = model.generate(input_ids=torch.tensor([prompt], device=device),
                                     max_new_tokens=int(job["max_new_tokens"]), do_sample=False,
                                     eos_token_id=eos, pad_token_id=pad)
                hits += int(tok.decode(gen[0, len(prompt):].tolist(), skip_special_tokens=True) == r["output"])
            metrics["eval_exact_match"] = hits / max(1, len(evals))
    model.save_pretrained(Path(job["adapters"]) / f"config-{config:02d}")
    if device.type == "cuda":
        torch.cuda.synchronize()
    total_s = time.time() - t0
    out.write_text(json.dumps({
        "config": config, "rank": rank, "lr": lr, "batch_size": bs, "steps": steps, "load_s": load_s,
        "train_s": train_s, "seconds": total_s, "real_tokens": real, "padded_tokens": padded, **metrics,
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "torch": torch.__version__,
        "peft": __import__("peft").__version__, "transformers": __import__("transformers").__version__}))


# ----------------------------------------------------------------------------- main


def smoke_model(out: Path) -> Path:
    """A tiny Qwen2 with weights, written by transformers, and a one-character tokenizer."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from plora.data.dataset import char_tokenizer

    folder = out / "tiny-qwen2"
    if (folder / "config.json").is_file():
        return folder
    cfg = Qwen2Config(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                      bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=True)
    torch.manual_seed(0)
    Qwen2ForCausalLM(cfg).save_pretrained(folder)
    char_tokenizer("".join(chr(b) for b in range(32, 127))).save(str(folder / "tokenizer.json"))
    return folder


def table(result: dict) -> list[str]:
    lines = ["| variant | plora predicted s | plora measured s | measured/predicted | OOM jobs | done | "
             "PEFT s (a job per config) | speed-up | PEFT steps+evals only s | speed-up | "
             "plora real tok/s | PEFT real tok/s |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]

    def f(v, fmt="{:.1f}"):
        return fmt.format(v) if isinstance(v, (int, float)) else "-"

    def ratio(a, b):
        return a / b if a and b else None

    for r in result["variants"]:
        p, b = r.get("plora", {}), r.get("baseline", {})
        span = p.get("makespan_s")
        peft = f(b.get("makespan_s")) + (f" (from {b['configs_run']} of {b['configs']})" if b.get("extrapolated") else "")
        lines.append(f"| {r['variant']} | {f(p.get('predicted_makespan_s'))} | {f(span)} | "
                     f"{f(p.get('measured_over_predicted'), '{:.2f}')} | {p.get('oom_jobs')} | "
                     f"{p.get('adapters', {}).get('done', 0)}/{4 * len(result['ranks'])} | {peft} | "
                     f"{f(ratio(b.get('makespan_s'), span), '{:.1f}x')} | {f(b.get('train_eval_s'))} | "
                     f"{f(ratio(b.get('train_eval_s'), span), '{:.1f}x')} | "
                     f"{f(p.get('real_tokens_per_s'), '{:,.0f}')} | {f(b.get('real_tokens_per_s'), '{:,.0f}')} |")
    fixed = next((r["plora"].get("makespan_s") for r in result["variants"] if r["variant"] == "fixed" and "plora" in r), None)
    varied = next((r["plora"].get("makespan_s") for r in result["variants"] if r["variant"] == "varied" and "plora" in r), None)
    if fixed and varied:
        lines.append("")
        lines.append(f"varied / fixed makespan: {varied / fixed:.2f}")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("bench-real-data"))
    ap.add_argument("--smoke", action="store_true", help="tiny model, few rows, CPU")
    ap.add_argument("--model", default="shape:qwen2.5-0.5b")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--seq", type=int, default=512, help="max_seq_len: holds the longest varied row")
    ap.add_argument("--rows", type=int, default=512)
    ap.add_argument("--row-chars", type=int, default=250, help="fixed rows: characters (~tokens) per row")
    ap.add_argument("--answer-chars", type=int, default=48)
    ap.add_argument("--eval-samples", type=int, default=32)
    ap.add_argument("--metrics", nargs="+", default=["loss"])
    ap.add_argument("--max-new-tokens", type=int, default=16)
    ap.add_argument("--variants", nargs="+", default=["fixed", "varied"], choices=["fixed", "varied"])
    ap.add_argument("--parts", nargs="+", default=["plora", "baseline"], choices=["plora", "baseline"],
                    help="what to run now; results merge into DIR's real_data_bench.json")
    ap.add_argument("--baseline-configs", type=int, default=16,
                    help="train the first N configurations with PEFT and extrapolate the rest (0: no baseline)")
    ap.add_argument("--baseline-variants", nargs="+", default=["fixed"], choices=["fixed", "varied"],
                    help="data variants the PEFT baseline runs on")
    ap.add_argument("--baseline-budget-s", type=float, default=0.0,
                    help="start no PEFT configuration after this many seconds of this run (0: no limit); "
                         "a rerun with the same DIR trains the rest")
    ap.add_argument("--no-profile", action="store_true",
                    help="plan with the analytic cost model (no profile; the predicted makespan is then the analytic one)")
    ap.add_argument("--keep-site", action="store_true", help="the baseline keeps PYTHONPATH as it is")
    ap.add_argument("--peft-worker", type=Path, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--peft-config", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--peft-out", type=Path, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--peft-save-base", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    args.started = time.time()
    if args.peft_worker is not None:
        peft_worker(args.peft_worker, args.peft_config, args.peft_out, args.peft_save_base)
        return
    args.ranks = [8, 16, 32, 64]
    args.out = args.out.resolve()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.smoke:
        os.environ.setdefault("PLORA_CACHE_DIR", str(args.out / "cache"))
        args.model = str(smoke_model(args.out))
        args.device, args.dtype, args.rows, args.seq = "cpu", "float32", min(args.rows, 32), min(args.seq, 160)
        args.row_chars, args.answer_chars, args.eval_samples = 96, 16, min(args.eval_samples, 4)
        args.max_new_tokens = min(args.max_new_tokens, 4)
        args.ranks = [8, 16]
        args.baseline_configs = min(args.baseline_configs, 2)
    data_dir = args.out / "data"
    data_dir.mkdir(exist_ok=True)
    in_max = 2 * (args.row_chars - args.answer_chars) - 16  # the varied rows' mean matches the fixed ones'
    for variant in args.variants:
        kw = dict(row_chars=args.row_chars, answer_chars=args.answer_chars, in_min=16,
                  in_max=min(in_max, args.seq - args.answer_chars - 4))
        write_jsonl(data_dir / f"train-{variant}.jsonl", make_rows(args.rows, variant, seed=1, **kw))
        write_jsonl(data_dir / f"eval-{variant}.jsonl", make_rows(args.eval_samples, variant, seed=2, **kw))
    device = "cpu"
    if args.device != "cpu":
        import torch

        device = torch.cuda.get_device_name()
    saved = args.out / "real_data_bench.json"
    result = {"model": args.model, "device": device, "dtype": args.dtype, "seq": args.seq, "rows": args.rows,
              "eval_samples": args.eval_samples, "metrics": args.metrics, "max_new_tokens": args.max_new_tokens,
              "ranks": args.ranks, "smoke": args.smoke, "variants": []}
    if saved.is_file():  # an earlier call's parts, kept
        result["variants"] = json.loads(saved.read_text()).get("variants", [])
    rows = {r["variant"]: r for r in result["variants"]}
    for variant in args.variants:
        if variant not in rows:
            rows[variant] = {"variant": variant}
            result["variants"].append(rows[variant])
    import yaml

    for variant in args.variants:  # the space files the baseline also reads its setting from
        (args.out / f"{variant}.yaml").write_text(yaml.safe_dump(space(args, variant, data_dir), sort_keys=False))
    if "plora" in args.parts:
        for variant in args.variants:
            rows[variant]["plora"] = run_plora(args, variant, data_dir)
            print(json.dumps(rows[variant]["plora"]), flush=True)
            saved.write_text(json.dumps(result, indent=2))
    if "baseline" in args.parts and args.baseline_configs > 0:
        for variant in args.variants:
            if variant not in args.baseline_variants:
                continue
            rows[variant]["baseline"] = run_baseline(args, variant, data_dir)
            print(json.dumps({k: v for k, v in rows[variant]["baseline"].items() if k != "runs"}), flush=True)
            saved.write_text(json.dumps(result, indent=2))
    lines = table(result)
    head = (f"{args.model} on {device}, {args.dtype}, {4 * len(args.ranks)} configurations, {args.rows} rows, "
            f"{args.eval_samples} eval samples per adapter (metrics: {', '.join(args.metrics)})")
    (args.out / "real_data_bench.md").write_text(head + "\n\n" + "\n".join(lines) + "\n")
    saved.write_text(json.dumps(result, indent=2))
    print("\n" + head)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
