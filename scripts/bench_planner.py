"""Plan a sweep's space for several model shapes and compare with the baselines and the bound.

For each model (a `ModelShape` preset with the analytic cost model, or a fitted profile)
and each planner objective, runs `plora.planner.plan_sweep` on the space file's
adapters and prints one row: the plan's predicted makespan, the packed schedule's, the
baselines' (Min GPU, Max GPU, sequential), the lower bound, plan / bound, planning
seconds and the solver that ran. Needs no GPU and no weights -- only shapes.

    python scripts/bench_planner.py                                  # the paper space, 0.5B/3B/7B
    python scripts/bench_planner.py --space sweeps/demo.yaml --models qwen2.5-0.5b --gpus 2
    python scripts/bench_planner.py --profile runs/x/profile.json    # a fitted cost model
    python scripts/bench_planner.py --check                          # exit 1 past 1.10x / 60 s
    python scripts/bench_planner.py --exact 216                      # small sweeps against the optimum

``--exact N`` instead plans N seeded random small sweeps (6-9 adapters; 2 and 4 GPUs;
the fitted profiles in scripts/profiles/ and the analytic model; memory binding in most:
`plora.planner.instances`) without the exact solver, solves each exactly
(`plora.planner.exact`) and prints plan / optimum per GPU count and cost model.

Adapters come from the space file through `plora.spec.schema` (the same configurations a sweep
trains; model.path need not exist); steps = ceil(epochs * num_train / batch size), with
num_train from ``--num-train``, else data.num_train, else 10,000.
"""

from __future__ import annotations

import argparse
import copy
import itertools
import json
import sys
import time
from pathlib import Path

import numpy as np
import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from plora.cost.model import AdapterLoad, CostModel  # noqa: E402
from plora.data.accumulation import steps_for  # noqa: E402
from plora.models.shape import ModelShape  # noqa: E402
from plora.planner import PLANNING_BUDGET_S, PlannerError, plan_sweep, simulate  # noqa: E402

DEFAULT_SPACE = REPO / "sweeps" / "paper-qwen2.5-7b.yaml"
DEFAULT_MODELS = "qwen2.5-0.5b,qwen2.5-3b,qwen2.5-7b"
DEFAULT_NUM_TRAIN = 10_000
#: --check limits (the planner's targets on the paper space)
MAX_BOUND_RATIO = 1.10
MAX_PLANNING_S = 60.0


def loads_from_space(raw: dict, num_train: int) -> tuple[list[AdapterLoad], str]:
    """The space's adapters as planning loads, and how they were obtained."""
    try:
        from plora.spec.loading import parse_spec
    except ImportError:
        return _loads_fallback(raw, num_train), "pyyaml fallback sampler"
    data = copy.deepcopy(raw)
    # Planning needs the shape only: stand in a shipped model so that validation does not
    # require the weights at model.path.
    data.setdefault("model", {})["path"] = "builtin:tiny-llama"
    spec = parse_spec(data)
    loads = [
        AdapterLoad(c.id, c.rank, c.batch_size, spec.steps_for(c, num_train)) for c in spec.expand()
    ]
    return loads, "plora.spec.schema expansion"


def _loads_fallback(raw: dict, num_train: int) -> list[AdapterLoad]:
    """Rank and batch size from plain lists (grid or random); enough for planning."""
    space = raw.get("space", {})
    ranks, sizes = space.get("rank", [8]), space.get("batch_size", [4])
    if not isinstance(ranks, list) or not isinstance(sizes, list):
        raise SystemExit("fallback sampler: space.rank and space.batch_size must be lists")
    epochs = float(raw.get("training", {}).get("epochs") or 1.0)
    fixed = raw.get("training", {}).get("steps")
    if space.get("strategy", "grid") == "random":
        rng = np.random.default_rng(space.get("seed", 0))
        pairs = [(int(rng.choice(ranks)), int(rng.choice(sizes))) for _ in range(int(space["num_samples"]))]
    else:
        pairs = list(itertools.product(ranks, sizes))
    return [
        AdapterLoad(f"a{i:04d}", r, b, int(fixed) if fixed else steps_for(num_train, b, epochs))
        for i, (r, b) in enumerate(pairs)
    ]


def against_the_optimum(count: int, seed: int) -> int:
    """Plan / optimum on `count` random small sweeps; exit 1 if a plan fails its replay or
    beats the optimum, or a bound is above it (the exact solver or the planner is wrong)."""
    from plora.planner import Workload
    from plora.planner.exact import solve_exact
    from plora.planner.instances import random_instances

    rows: dict[tuple[str, int], list[tuple[float, float, float]]] = {}
    failed = False
    for inst in random_instances(count, seed=seed):
        plan = plan_sweep(inst.loads, inst.cost_model, inst.gpus, load_factor=inst.load_factor, exact=False)
        wl = Workload(inst.loads, inst.cost_model, inst.gpus, load_factor=inst.load_factor)
        t = time.perf_counter()
        best = solve_exact(wl)
        exact_s = time.perf_counter() - t
        sim = simulate(plan, inst.cost_model)
        if (best is None or not best.proven or not sim.ok or abs(sim.makespan - plan.makespan) > 1e-9 * plan.makespan
                or plan.makespan < best.makespan * (1 - 1e-9) or plan.lower_bound > best.makespan * (1 + 1e-9)):
            print(f"{inst.name}: check failed")
            failed = True
            continue
        rows.setdefault((inst.source, inst.gpus), []).append((plan.makespan / best.makespan, plan.planning_seconds, exact_s))
    header = ["", "instances", "mean plan/optimum", "worst", "above 1.02x", "above 1.10x", "optimum found",
              "planning (s, mean)", "exact (s, mean / max)"]
    print("| " + " | ".join(header) + " |")
    print("|" + "|".join(" --- " for _ in header) + "|")
    everything = []
    for (source, gpus), vals in sorted(rows.items()):
        everything += vals
        print(_optimum_row(f"{source} model, {gpus} GPUs", vals))
    print(_optimum_row("all", everything))
    return 1 if failed else 0


def _optimum_row(name: str, vals: list[tuple[float, float, float]]) -> str:
    r = np.array([v[0] for v in vals])
    cells = [name, str(len(r)), f"{r.mean():.4f}", f"{r.max():.3f}", f"{int((r > 1.02).sum())}",
             f"{int((r > 1.10).sum())}", f"{int((r < 1 + 1e-9).sum())}/{len(r)}",
             f"{np.mean([v[1] for v in vals]):.2f}", f"{np.mean([v[2] for v in vals]):.2f} / {max(v[2] for v in vals):.2f}"]
    return "| " + " | ".join(cells) + " |"


def fmt_s(x: float) -> str:
    return f"{x:,.0f}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--space", type=Path, default=DEFAULT_SPACE, help="space file (YAML)")
    ap.add_argument("--models", default=DEFAULT_MODELS, help="comma-separated ModelShape presets (analytic cost model)")
    ap.add_argument("--profile", type=Path, action="append", default=[],
                    help="a fitted cost model (profile.json); repeatable; replaces --models")
    ap.add_argument("--objectives", default="makespan,paper", help="comma-separated: makespan, paper")
    ap.add_argument("--gpus", type=int, help="default: hardware.gpus of the space file")
    ap.add_argument("--gpu-memory-gb", type=float, help="default: hardware.gpu_memory_gb (GiB)")
    ap.add_argument("--seq-len", type=int, help="default: model.max_seq_len")
    ap.add_argument("--num-train", type=int, help=f"samples per epoch (default: data.num_train, else {DEFAULT_NUM_TRAIN})")
    ap.add_argument("--max-adapters", type=int, help="default: planner.max_adapters_per_job")
    ap.add_argument("--load-factor", type=float, help="default: planner.memory_load_factor")
    ap.add_argument("--solver", help="auto | gurobi | highs (default: planner.solver)")
    ap.add_argument("--time-limit", type=float, default=PLANNING_BUDGET_S,
                    help="soft planning budget per plan (seconds; default: what plora plan/sweep give it)")
    ap.add_argument("--out", type=Path, help="write each plan as <out>/<model>-<objective>.plan.json and a summary.json")
    ap.add_argument("--exact", type=int, metavar="N",
                    help="plan N random small sweeps and compare with the exact optimum (ignores the space)")
    ap.add_argument("--seed", type=int, default=0, help="first seed of --exact's instances")
    ap.add_argument("--check", action="store_true",
                    help=f"exit 1 if a makespan-objective plan is over {MAX_BOUND_RATIO}x its bound or took over {MAX_PLANNING_S:.0f} s")
    args = ap.parse_args(argv)
    if args.exact:
        return against_the_optimum(args.exact, args.seed)

    raw = yaml.safe_load(args.space.read_text()) or {}
    hw, planner, model_cfg = raw.get("hardware", {}), raw.get("planner", {}), raw.get("model", {})
    gpus = args.gpus or int(hw.get("gpus", 1))
    gpu_mem = (args.gpu_memory_gb or float(hw.get("gpu_memory_gb", 80))) * 2**30
    seq = args.seq_len or int(model_cfg.get("max_seq_len", 64))
    num_train = args.num_train or raw.get("data", {}).get("num_train") or DEFAULT_NUM_TRAIN
    cap = args.max_adapters or planner.get("max_adapters_per_job", 8)
    load_factor = args.load_factor or float(planner.get("memory_load_factor", 0.9))
    solver = args.solver or planner.get("solver", "auto")
    targets = raw.get("lora", {}).get("targets")
    objectives = [o.strip() for o in args.objectives.split(",") if o.strip()]

    loads, source = loads_from_space(raw, int(num_train))
    if args.profile:
        models = [CostModel.load(p) for p in args.profile]
    else:
        models = [CostModel.analytic(ModelShape.preset(m.strip()), seq, gpu_mem, targets)
                  for m in args.models.split(",") if m.strip()]
    steps = sorted({a.steps for a in loads})
    mem_note = "GPU memory of each profile" if args.profile else f"{gpu_mem / 2**30:.0f} GiB"
    print(f"space {args.space.name}: {len(loads)} adapters ({source}), {gpus} GPUs x {mem_note}, "
          f"seq {seq}, num_train {num_train}, steps {steps[0]}..{steps[-1]}, cap {cap}, load factor {load_factor}, "
          f"solver {solver}")

    rows, summary, failed = [], [], False
    for cm in models:
        for objective in objectives:
            try:
                plan = plan_sweep(loads, cm, gpus, solver=solver, load_factor=load_factor,
                                  max_adapters_per_job=cap, objective=objective, time_limit_s=args.time_limit)
            except PlannerError as e:
                print(f"{cm.name} {objective}: {e}")
                failed = True
                continue
            sim = simulate(plan, cm)
            if not sim.ok:
                print(f"{cm.name} {objective}: plan check failed: {sim.violations[0]}")
                failed = True
            b = plan.baselines
            tps = sorted({j.tp for j in plan.jobs})
            rows.append([
                cm.name, objective, fmt_s(plan.makespan), fmt_s(plan.packed_makespan), fmt_s(b["min_gpu"]),
                fmt_s(b["max_gpu"]), fmt_s(b["sequential"]), fmt_s(plan.lower_bound), f"{plan.bound_ratio:.3f}",
                f"{b['min_gpu'] / plan.makespan:.2f}x", f"{plan.planning_seconds:.1f}", plan.solver,
                f"{len(plan.jobs)} ({','.join(map(str, tps))})", plan.strategy,
            ])
            summary.append({
                "model": cm.name, "objective": objective, "makespan_s": plan.makespan,
                "packed_makespan_s": plan.packed_makespan, "baselines_s": b, "lower_bound_s": plan.lower_bound,
                "bound_ratio": plan.bound_ratio, "planning_s": plan.planning_seconds, "solver": plan.solver,
                "solver_calls": plan.solver_calls, "jobs": len(plan.jobs), "tp_degrees": tps,
                "strategy": plan.strategy, "notes": plan.notes,
            })
            if args.out:
                args.out.mkdir(parents=True, exist_ok=True)
                plan.save(args.out / f"{cm.name.replace('@', '-seq')}-{objective}.plan.json")
            if args.check and objective == "makespan" and (
                plan.bound_ratio > MAX_BOUND_RATIO or plan.planning_seconds > MAX_PLANNING_S
            ):
                failed = True

    header = ["model", "objective", "plan (s)", "packed (s)", "Min GPU (s)", "Max GPU (s)", "sequential (s)",
              "lower bound (s)", "plan/bound", "vs Min GPU", "planning (s)", "solver", "jobs (TP)", "kept"]
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(header)]
    line = lambda cells: "| " + " | ".join(c.ljust(w) for c, w in zip(cells, widths)) + " |"  # noqa: E731
    print(line(header))
    print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for r in rows:
        print(line(r))
    if args.out:
        (args.out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return 1 if failed else 0


if __name__ == "__main__":
    t0 = time.perf_counter()
    code = main()
    print(f"total {time.perf_counter() - t0:.1f} s")
    sys.exit(code)
