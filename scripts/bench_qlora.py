"""QLoRA's memory and speed: the largest pack that fits with a bfloat16 base and with an NF4
base (``model.quantize: nf4``), and the step time per adapter-row at a common pack size.

A random-init model of a known shape (default Qwen2.5-7B: built from its config, no weights
on disk, as the other benchmarks do), every adapter of rank ``--rank`` on every linear
(``all-linear``) with the same rows (``--rows`` rows of ``--seq`` tokens each). For each base
(``--variants bf16,nf4``) the pack grows, doubling from ``--start`` adapters, until a step
runs out of memory (caught: the job is dropped, its memory freed, the size recorded), then
is bisected between the last size that ran and the first that did not. Each try is a real
packed job (`PackedLoRARecipe`: load, quantize, inject, set up, ``--warmup`` + ``--steps``
steps). At the common size (``--common``, default the smaller of the two largest packs),
each base's median step is timed again (``--time-steps``) and divided by the pack's rows.

``--memory-gb`` caps what the process may allocate (``torch.cuda.set_per_process_memory_fraction``),
to see the same search on a smaller card; the caps listed run one after another (default
``full,24``: the whole card, then a 24 GiB card's worth). What NF4 saves is the base's
weights (Qwen2.5-7B: 14.2 GiB in bfloat16, 5.2 GiB in NF4, plus 0.9 GiB of dequantize
workspace), a fixed amount: on an 80 GB card, where the adapters' state and activations take
most of the memory, the pack grows by that much (the analytic model: 66 -> 75 adapters with
activation checkpointing); twice the adapters needs a budget where the bfloat16 base is most
of it (24 GiB: 7 -> 16 predicted). The cost model's own prediction of each largest pack (the analytic prior,
`plora.quantize.cost` for the NF4 base) is reported beside the measured one.

    python scripts/bench_qlora.py --out DIR                     # one GPU: Qwen2.5-7B, rank 16, 1 row of 512
    python scripts/bench_qlora.py --memory-gb full --out DIR    # the whole card only (half the time)
    python scripts/bench_qlora.py --smoke --out DIR             # CPU, the shipped tiny model: the path, < 1 min

Writes DIR/qlora.json and DIR/qlora.md (a short table), and prints the table.

Steps run eagerly by default (``--graphs`` replays them from CUDA graphs, as sweeps do on a
GPU): an out-of-memory inside a graph capture leaves the capture to be torn down, which the
eager search avoids. ``--smoke`` has no out-of-memory to find on a CPU: a pack larger than
``--smoke-oom-above`` adapters raises one on purpose, so the search and its clean-up run
(its dense base is the tiny model's float32; "bf16" names the dense variant).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable

import torch

from plora.cost.model import AdapterLoad, CostModel
from plora.models.shape import ModelShape
from plora.train.heap import frozen_heap
from plora.job.config import JobAdapter, JobConfig, JobData, JobEval, JobLora, JobModel, JobTraining, SyntheticRows
from plora.models.loading import write_shape_folder
from plora.cost.profiling.cache import shape_from_model
from plora.train.packed_lora import PackedLoRARecipe
from plora.job.step_settings import CUDA_GRAPHS_ENV

ALL_LINEAR = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
VARIANTS = {"bf16": None, "nf4": "nf4"}  # name -> model.quantize


def cuda() -> bool:
    return torch.cuda.is_available()


def free_memory() -> None:
    gc.collect()
    if cuda():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def make_recipe(model_dir: Path, out: Path, k: int, args, quantize: str | None) -> PackedLoRARecipe:
    """A packed job of ``k`` adapters (rank ``--rank``, ``--rows`` rows each) that never ends,
    set up and ready for `train_step`."""
    cfg = JobConfig(
        job_id="bench-qlora",
        output_dir=out,
        device="cuda" if cuda() else "cpu",
        num_threads=None if cuda() else 1,
        model=JobModel(path=str(model_dir), max_seq_len=args.seq, dtype=args.dtype, random_init=True,
                       quantize=quantize),
        data=JobData(synthetic=SyntheticRows(seq_len=args.seq, num_samples=max(64, 4 * args.rows))),
        lora=JobLora(targets=ALL_LINEAR, dropout=0.0),
        adapters=[JobAdapter(id=f"a{i}", rank=args.rank, alpha=2.0 * args.rank, learning_rate=1e-4,
                             batch_size=args.rows, seed=i, steps=10**6) for i in range(k)],
        training=JobTraining(scheduler="constant", grad_clip=1.0, activation_checkpointing=args.ac,
                             cuda_graphs=bool(args.graphs)),
        eval=JobEval(metrics=[]),
    )
    recipe = PackedLoRARecipe(cfg)
    recipe.setup()
    return recipe


def run_steps(recipe: PackedLoRARecipe, warmup: int, steps: int) -> list[float]:
    """Seconds of each timed packed step (forward, backward, AdamW), after ``warmup``."""
    active = list(recipe.runs)
    times = []
    with frozen_heap():  # as the recipe's own loop runs its steps
        for i in range(warmup + steps):
            if cuda():
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            recipe.train_step(active, i)
            if cuda():
                torch.cuda.synchronize()
            if i >= warmup:
                times.append(time.perf_counter() - t0)
    return times


def trial(model_dir: Path, tmp: Path, k: int, args, quantize: str | None, steps: int) -> dict[str, Any]:
    """One pack of ``k`` adapters: whether it ran, its median step and its peak memory. An
    out-of-memory is a result: the job is dropped and its memory given back."""
    row: dict[str, Any] = {"adapters": k, "ok": False}
    recipe = None
    free_memory()
    t0 = time.perf_counter()
    try:
        recipe = make_recipe(model_dir, tmp / f"k{k}", k, args, quantize)
        if args.smoke and args.smoke_oom_above and k > args.smoke_oom_above:
            raise torch.OutOfMemoryError(f"smoke: a pack of more than {args.smoke_oom_above} adapters")
        times = run_steps(recipe, args.warmup, steps)
        med = statistics.median(times)
        row.update(ok=True, step_s=med, per_row_ms=1e3 * med / (k * args.rows),
                   tokens_per_s=k * args.rows * args.seq / med)
        if cuda():
            row["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
    except torch.OutOfMemoryError as e:
        row["oom"] = str(e).splitlines()[0][:200] if str(e) else "out of memory"
    finally:
        if recipe is not None:
            recipe.cleanup()
        del recipe
        free_memory()
    row["wall_s"] = time.perf_counter() - t0
    print(json.dumps({"quantize": quantize or "none", **row}), flush=True)
    return row


def largest_pack(run: Callable[[int], dict[str, Any]], start: int, max_k: int) -> tuple[int, list[dict[str, Any]]]:
    """The largest pack size that runs (0: none), growing by doubling from ``start`` up to
    ``max_k`` and bisecting once a size fails; every try in order."""
    tries: list[dict[str, Any]] = []
    ok, bad = 0, None
    k = max(1, min(start, max_k))
    while True:  # grow (or shrink, when the start fails) until both ends are known
        r = run(k)
        tries.append(r)
        if r["ok"]:
            ok = k
            if k >= max_k:
                break
            k = min(2 * k, max_k)
            if bad is not None and k >= bad:
                break
        else:
            bad = k
            if ok or k == 1:
                break
            k //= 2
    while bad is not None and bad - ok > max(1, ok // 16):  # bisect to about 6 %
        k = (ok + bad) // 2
        r = run(k)
        tries.append(r)
        if r["ok"]:
            ok = k
        else:
            bad = k
    return ok, tries


def predicted_largest(shape: ModelShape, args, memory_bytes: float, max_k: int) -> int:
    """The largest pack the cost model's analytic prior fits in ``memory_bytes``."""
    cm = CostModel.analytic(shape, args.seq, memory_bytes, ALL_LINEAR, activation_checkpointing=args.ac,
                            tp_degrees=[1])
    a = AdapterLoad("a", args.rank, args.rows, 1)
    best = 0
    for k in range(1, max_k + 1):
        if not cm.fits([a] * k, 1, load_factor=1.0):
            break
        best = k
    return best


def markdown(result: dict[str, Any]) -> str:
    lines = [f"QLoRA on {result['device']}: {result['shape']}, rank {result['rank']} on all linears, "
             f"{result['rows']} row(s) of {result['seq']} tokens per adapter, "
             f"activation checkpointing {'on' if result['activation_checkpointing'] else 'off'}", "",
             "| memory | base | largest pack | predicted | peak GiB | common pack | step s | ms / adapter-row |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for cap in result["caps"]:
        for name, v in cap["variants"].items():
            t = cap["common"].get(name) or {}
            peak = max((r.get("peak_gib") or 0.0 for r in v["tries"] if r["ok"]), default=0.0)
            lines.append(f"| {cap['memory']} | {name} | {v['largest']} | {v['predicted']} | "
                         f"{peak:.1f} | {cap['common'].get('adapters', '-')} | "
                         f"{t.get('step_s', float('nan')):.3f} | {t.get('per_row_ms', float('nan')):.2f} |")
        if cap.get("largest_ratio") is not None:
            lines.append(f"| {cap['memory']} | nf4 / bf16 | {cap['largest_ratio']:.2f}x | | | | | "
                         f"{cap.get('per_row_ratio', float('nan')):.2f}x |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="qwen2.5-7b", help="a ModelShape preset (random-init)")
    ap.add_argument("--seq", type=int, default=512, help="tokens per row")
    ap.add_argument("--rows", type=int, default=1, help="rows per adapter per step")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--variants", default="bf16,nf4")
    ap.add_argument("--memory-gb", default="full,24", help="comma-separated caps: full, or GiB (e.g. full,24)")
    ap.add_argument("--start", type=int, default=8, help="the first pack size tried")
    ap.add_argument("--max", type=int, default=1024, help="the largest pack size tried")
    ap.add_argument("--common", type=int, default=None, help="the pack size timed (default: the smaller largest)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=2, help="timed steps of each search try")
    ap.add_argument("--time-steps", type=int, default=8, help="timed steps at the common pack size")
    ap.add_argument("--no-ac", dest="ac", action="store_false", help="no activation checkpointing")
    ap.add_argument("--graphs", action="store_true", help="replay steps from CUDA graphs")
    ap.add_argument("--smoke", action="store_true", help="CPU, the shipped tiny model, tiny packs")
    ap.add_argument("--smoke-oom-above", type=int, default=3, help="--smoke: packs above this many adapters 'OOM'")
    ap.add_argument("--out", type=Path, default=Path("bench-out"))
    args = ap.parse_args()
    if args.smoke:
        args.seq, args.rank, args.start, args.max = min(args.seq, 32), min(args.rank, 4), 1, min(args.max, 8)
        args.dtype, args.warmup, args.steps, args.time_steps, args.memory_gb = "float32", 1, 1, 2, "full"
    elif not cuda():
        raise SystemExit("bench_qlora: no CUDA device (use --smoke for the CPU path)")
    os.environ[CUDA_GRAPHS_ENV] = "on" if args.graphs else "off"
    args.out.mkdir(parents=True, exist_ok=True)
    device = torch.cuda.get_device_name() if cuda() else "cpu"
    total = float(torch.cuda.get_device_properties(0).total_memory) if cuda() else 8.0 * 2**30

    with tempfile.TemporaryDirectory(prefix="bench-qlora-") as tmp_s:
        tmp = Path(tmp_s)
        if args.smoke:
            from plora.spec.model import ASSETS_DIR

            model_dir = ASSETS_DIR / "tiny-llama"
            dtype_name = "float32"
        else:
            model_dir = write_shape_folder(ModelShape.preset(args.shape), tmp / "model")
            dtype_name = args.dtype
        shape = shape_from_model(model_dir, "auto", dtype_name)
        caps = []
        for cap_s in args.memory_gb.split(","):
            cap_s = cap_s.strip()
            memory = total if cap_s == "full" else float(cap_s) * 2**30
            if cuda():
                torch.cuda.set_per_process_memory_fraction(min(1.0, memory / total))
            cap: dict[str, Any] = {"memory": "full" if cap_s == "full" else f"{cap_s} GiB",
                                   "memory_bytes": memory, "variants": {}, "common": {}}
            for name in args.variants.split(","):
                quantize = VARIANTS[name.strip()]
                largest, tries = largest_pack(
                    lambda k, q=quantize: trial(model_dir, tmp, k, args, q, args.steps), args.start, args.max)
                cap["variants"][name] = {
                    "largest": largest, "tries": tries,
                    "predicted": predicted_largest(replace(shape, quantize=quantize), args, memory, args.max)}
            sizes = [v["largest"] for v in cap["variants"].values() if v["largest"] > 0]
            common = args.common or (min(sizes) if sizes else 0)
            if common:
                cap["common"]["adapters"] = common
                for name in cap["variants"]:
                    r = trial(model_dir, tmp, common, args, VARIANTS[name], args.time_steps)
                    cap["common"][name] = r if r["ok"] else {"oom": r.get("oom")}
            v = cap["variants"]
            if "bf16" in v and "nf4" in v and v["bf16"]["largest"]:
                cap["largest_ratio"] = v["nf4"]["largest"] / v["bf16"]["largest"]
                c = cap["common"]
                if c.get("bf16", {}).get("per_row_ms") and c.get("nf4", {}).get("per_row_ms"):
                    cap["per_row_ratio"] = c["nf4"]["per_row_ms"] / c["bf16"]["per_row_ms"]
            caps.append(cap)
        if cuda():
            torch.cuda.set_per_process_memory_fraction(1.0)

    result = {"shape": "tiny-llama (smoke)" if args.smoke else args.shape, "device": device, "torch": torch.__version__,
              "seq": args.seq, "rows": args.rows, "rank": args.rank, "dtype": args.dtype,
              "activation_checkpointing": bool(args.ac), "graphs": bool(args.graphs), "caps": caps}
    (args.out / "qlora.json").write_text(json.dumps(result, indent=2) + "\n")
    table = markdown(result)
    (args.out / "qlora.md").write_text(table)
    print("\n" + table)


if __name__ == "__main__":
    main()
