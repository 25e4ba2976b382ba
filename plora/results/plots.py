"""The report's sections: the summary, the results table and its plots, each a function of
a `RunData` (`plora.results.run_data`) that returns a figure, a table or Markdown, or raises
`Missing` (the run directory does not have its data: the notebook shows a note instead).

Results: score against each hyperparameter, best against worst and the base model,
learning curves. Runs: the jobs' Gantt chart (planned and actual), each adapter's span,
makespan against the baselines, the cost model's predicted against measured times, the
Optuna study's history and the best score against the GPU-seconds a tune spent."""

from __future__ import annotations

import contextlib
import math
from typing import TYPE_CHECKING

import pandas as pd

from plora.spec.adapter import HYPERPARAMETERS
from plora.results.run_data import Missing, RunData, _plan_jobs

if TYPE_CHECKING:
    from plora.cost.model import AdapterLoad
    from plora.planner.plan import Job


PALETTE = ["#4c78a8", "#f58518", "#54a24b", "#b279a2", "#e45756", "#72b7b2", "#eeca3b", "#9d755d"]


# --------------------------------------------------------------------------- sections


def _figure(w: float = 9, h: float = 4, **kw):
    from matplotlib.figure import Figure

    return Figure(figsize=(w, h), layout="constrained", **kw)


def _require_results(run: RunData) -> None:
    if run.results.empty:
        raise Missing("No results.parquet in this run directory.")


def _describe(row: pd.Series) -> str:
    return (f"rank {int(row['rank'])}, alpha {row['alpha']:g}, learning rate {row['learning_rate']:.3g}, "
            f"batch size {int(row['batch_size'])}")


def summary(run: RunData) -> str:
    """The answer in words: the best configuration, and its gain over the worst and the base."""
    _require_results(run)
    r = run.results
    counts = r["status"].value_counts().to_dict()
    status = ", ".join(f"{v} {k}" for k, v in sorted(counts.items()))
    lines = [f"**{run.name}** — {len(r)} adapters ({status}); ranked by **{run.score}** "
             f"({'lower' if run.minimize else 'higher'} is better). Run directory: `{run.run_dir}`.", ""]
    done = run.done()
    if done.empty:
        lines.append("No adapter finished with a score.")
        return "\n".join(lines)
    best, worst = done.iloc[0], done.iloc[-1]
    s = run.score
    lines.append(f"**Best configuration:** `{best['adapter_id']}` — {_describe(best)}: {s} = **{best[s]:.4g}**"
                 + (f", eval loss {best['eval_loss']:.4g}" if s != "eval_loss" and pd.notna(best.get("eval_loss")) else "")
                 + ".")
    lines.append("")
    gain = _gain(best[s], worst[s], run.minimize)
    lines.append(f"- over the worst finished configuration (`{worst['adapter_id']}`, {s} = {worst[s]:.4g}): {gain}")
    if s in run.base:
        lines.append(f"- over the base model ({s} = {run.base[s]:.4g}): {_gain(best[s], run.base[s], run.minimize)}")
    else:
        lines.append(f"- base model: no {s} in this run (no base_metrics.json, or no eval data)")
    if isinstance(best.get("checkpoint_path"), str):
        lines.append(f"- adapter (PEFT format): `{best['checkpoint_path']}`")
    return "\n".join(lines)


def _gain(best: float, other: float, minimize: bool) -> str:
    diff = (other - best) if minimize else (best - other)
    rel = f" ({diff / abs(other):+.1%})" if other else ""
    return f"{diff:+.4g}{rel} {'lower' if minimize else 'higher'}"


def results_table(run: RunData) -> pd.DataFrame:
    """Every adapter, finished ones best first, then diverged, pruned and failed ones."""
    _require_results(run)
    done = run.done()
    rest = run.results.drop(done.index)
    order = {"diverged": 0, "pruned": 1, "failed": 2}
    rest = rest.assign(_o=rest["status"].map(order).fillna(3)).sort_values(["_o", "adapter_id"]).drop(columns="_o")
    table = pd.concat([done, rest])
    cols = ["adapter_id", "rank", "alpha", "learning_rate", "batch_size", "seed", "status", "steps", "train_loss",
            "eval_loss", "eval_exact_match", "wall_time_s", "job_id"]
    # per-epoch scoring: the epoch kept, then each epoch's scores (`plora.results.collect.epoch_columns`)
    at = cols.index("wall_time_s")
    cols[at:at] = [c for c in table.columns if c == "epoch" or "_epoch" in c and c.startswith("eval_")]
    table = table[[c for c in cols if c in table.columns]].copy()
    table.insert(0, "#", range(1, len(table) + 1))
    return table


def _logx(values: pd.Series, name: str) -> bool:
    v = values[values > 0]
    return name == "learning_rate" or (len(v) > 0 and v.max() / v.min() >= 8)


def plot_score_vs_hyperparameters(run: RunData):
    """One panel per hyperparameter: the score of every finished adapter (log x for the
    learning rate and wide ranges), the best marked, the base model as a dashed line."""
    _require_results(run)
    done = run.done()
    if done.empty:
        raise Missing("No finished adapter with a score to plot.")
    fig = _figure(12, 3.4)
    axes = fig.subplots(1, len(HYPERPARAMETERS), sharey=True)
    best = done.iloc[0]
    for ax, name in zip(axes, HYPERPARAMETERS):
        ax.scatter(done[name], done[run.score], s=28, alpha=0.75, color="#3a6ea5", edgecolor="white", linewidth=0.5)
        ax.scatter([best[name]], [best[run.score]], s=160, marker="*", color="#e0a100", edgecolor="black",
                   linewidth=0.6, zorder=3, label="best")
        if run.score in run.base:
            ax.axhline(run.base[run.score], color="gray", linestyle="--", linewidth=1, label="base model")
        if _logx(done[name], name):
            ax.set_xscale("log", base=2 if name != "learning_rate" else 10)
        ax.set_xlabel(name)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel(run.score)
    axes[0].legend(fontsize=8, loc="best")
    others = len(run.results) - len(done)
    fig.suptitle(f"{run.score} against each hyperparameter ({len(done)} adapters"
                 + (f"; {others} without a score" if others else "") + ")", fontsize=11)
    return fig


def plot_best_worst_base(run: RunData):
    """The best configuration against the worst, the median and the base model."""
    _require_results(run)
    done = run.done()
    if done.empty:
        raise Missing("No finished adapter with a score to compare.")
    s = run.score
    labels = ["worst", "median", "best"]
    values = [float(done[s].iloc[-1]), float(done[s].median()), float(done[s].iloc[0])]
    colors = ["#c0504d", "#8fb3d9", "#2e7d32"]
    if s in run.base:
        labels, values, colors = ["base model", *labels], [float(run.base[s]), *values], ["#9a9a9a", *colors]
    fig = _figure(6.5, 3.6)
    ax = fig.subplots()
    bars = ax.bar(labels, values, color=colors)
    for b, v in zip(bars, values):
        ax.annotate(f"{v:.4g}", (b.get_x() + b.get_width() / 2, v), ha="center", va="bottom", fontsize=9)
    if run.minimize:  # losses differ in the second digit: a bar from zero would hide it
        lo, hi = min(values), max(values)
        pad = (hi - lo) * 0.4 or abs(hi) * 0.05 or 1.0
        ax.set_ylim(max(0.0, lo - pad), hi + pad)
    ax.set_ylabel(s)
    best = done.iloc[0]
    ax.set_title(f"best: {best['adapter_id']} ({_describe(best)})", fontsize=9)
    ax.grid(axis="y", alpha=0.3)
    return fig


def plot_learning_curves(run: RunData):
    """Training loss per adapter step (smoothed), and the intermediate eval losses when the
    run recorded them (``eval.every_steps``), coloured by learning rate."""
    if run.train_curves.empty:
        raise Missing("No per-step metrics (jobs/*/metrics.jsonl) in this run directory.")
    import matplotlib
    from matplotlib import cm, colors

    lr = run.results.set_index("adapter_id")["learning_rate"].to_dict() if not run.results.empty else {}
    lrs = [v for v in lr.values() if v and v > 0]
    norm = colors.LogNorm(min(lrs), max(lrs) if max(lrs) > min(lrs) else min(lrs) * 10) if lrs else None
    cmap = matplotlib.colormaps["viridis"]
    has_eval = not run.eval_curves.empty
    fig = _figure(12 if has_eval else 7, 3.6)
    axes = fig.subplots(1, 2 if has_eval else 1, squeeze=False)[0]

    def color(a):
        return cmap(norm(lr[a])) if norm is not None and a in lr else "#3a6ea5"

    for a, g in run.train_curves.groupby("adapter"):
        g = g.sort_values("adapter_step")
        y = g["loss"].rolling(5, min_periods=1).mean()
        axes[0].plot(g["adapter_step"], y, color=color(a), linewidth=1, alpha=0.8)
    axes[0].set_xlabel("adapter step")
    axes[0].set_ylabel("train loss (5-step mean)")
    axes[0].grid(alpha=0.3)
    if has_eval:
        for a, g in run.eval_curves.groupby("adapter"):
            g = g.sort_values("adapter_step")
            axes[1].plot(g["adapter_step"], g["eval_loss"], marker="o", markersize=3, color=color(a), linewidth=1)
            status = run.results.set_index("adapter_id")["status"].get(a) if not run.results.empty else None
            if status == "pruned":
                axes[1].plot(g["adapter_step"].iloc[-1:], g["eval_loss"].iloc[-1:], marker="x", color="red",
                             markersize=8, linestyle="none")
        axes[1].set_xlabel("adapter step")
        axes[1].set_ylabel("eval loss (x: pruned)")
        axes[1].grid(alpha=0.3)
    if norm is not None:
        sm = cm.ScalarMappable(norm=norm, cmap=cmap)
        fig.colorbar(sm, ax=list(axes), label="learning rate")
    return fig


def plot_gantt(run: RunData):
    """Jobs per slot (GPU or CPU core) over time: actual bars, and the plan's predicted bars
    (outlined) when the plan carries predicted start/end times."""
    jobs = run.jobs
    if jobs.empty:
        raise Missing("No job timings (journal.sqlite or jobs/*/summary.json) in this run directory.")
    from matplotlib.patches import Patch

    lanes = sorted({lane for ls in jobs["lanes"] for lane in ls}, key=_slot_key)
    y_of = {lane: i for i, lane in enumerate(lanes)}
    planned = jobs.dropna(subset=["planned_start", "planned_end"])
    fig = _figure(11, 0.7 * len(lanes) + 1.8)
    ax = fig.subplots()
    palette = PALETTE
    batches = sorted({b for b in jobs["batch"].dropna()})
    bad = {"crashed", "oom", "stopped", "abandoned", "split"}
    for _, r in jobs.iterrows():
        c = palette[batches.index(r["batch"]) % len(palette)] if r["batch"] in batches else palette[0]
        failed = r["status"] in bad or (pd.notna(r["returncode"]) and r["returncode"] != 0)
        label = f"{r['job_id']} ({int(r['adapters'] or 0)})" + (f" {r['status']}" if failed else "")
        for lane in r["lanes"]:
            y = y_of[lane]
            ax.barh(y, r["end"] - r["start"], left=r["start"], height=0.5, color="#d62728" if failed else c,
                    edgecolor="black", linewidth=0.4)
            ax.text(r["start"] + (r["end"] - r["start"]) / 2, y, label, ha="center", va="center", fontsize=7,
                    color="white", clip_on=True)
    for _, r in planned.iterrows():
        gpus = list(r["gpus"]) if isinstance(r["gpus"], (list, tuple)) and len(r["gpus"]) else None
        ys = [y_of[lane] for lane in r["lanes"]] if gpus is None else [
            y_of.get(_lane_for_gpu(g, lanes), y_of[r["lanes"][0]]) for g in gpus]
        for y in ys:
            ax.barh(y + 0.36, r["planned_end"] - r["planned_start"], left=r["planned_start"], height=0.18,
                    fill=False, edgecolor="black", linestyle="--", linewidth=0.8)
    ax.set_yticks(range(len(lanes)), lanes)
    ax.invert_yaxis()
    ax.set_xlabel("seconds since the first job started")
    if len(batches) > 1:
        handles = [Patch(color=palette[i % len(palette)], label=f"batch {int(b)}") for i, b in enumerate(batches)]
    else:
        handles = [Patch(color=palette[0], label="job (adapters)")]
    if not planned.empty:
        handles.append(Patch(fill=False, edgecolor="black", linestyle="--", label="planned"))
    ax.legend(handles=handles, fontsize=8, loc="lower right")
    title = "jobs per slot, planned vs actual" if not planned.empty else "jobs per slot (the plan has no predicted times)"
    if (jobs["source"] == "recipe").any():
        title += "; times exclude process start-up"
    if run.streamed:
        title += "; not run (adapters joined others): " + ", ".join(
            f"{j} → {into}" if into else j for j, into in sorted(run.streamed.items()))
    ax.set_title(title, fontsize=10)
    ax.grid(axis="x", alpha=0.3)
    return fig


def plot_adapter_gantt(run: RunData):
    """Each adapter's own span, grouped by slot (GPU or CPU core) and job: from its job's
    start, or from the step it joined the running job at, to when it finished. A job's
    span is the grey band behind its adapters; joined adapters are drawn in their own
    colour with a marker where they joined."""
    spans = run.adapter_spans
    if spans.empty:
        raise Missing("No adapter timings (journal.sqlite or jobs/*/summary.json) in this run directory.")
    from matplotlib.patches import Patch

    jobs = run.jobs.set_index("job_id")
    order = sorted(spans["job_id"].unique(), key=lambda j: (
        _slot_key(jobs.at[j, "lanes"][0]) if j in jobs.index and jobs.at[j, "lanes"] else ("",),
        jobs.at[j, "start"] if j in jobs.index else 0.0, j))
    rows: list[tuple[str, pd.Series]] = []
    groups: list[tuple[str, int, int]] = []  # job, first row, rows
    for j in order:
        g = spans[spans["job_id"] == j].sort_values(["start", "adapter"], kind="stable")
        groups.append((j, len(rows), len(g)))
        rows.extend((j, r) for _, r in g.iterrows())
    n = len(rows)
    fig = _figure(11, 0.22 * n + 0.3 * len(groups) + 1.6)
    ax = fig.subplots()
    colors = {"joined": PALETTE[1], "first": PALETTE[0]}
    bad = {"diverged", "pruned", "failed"}
    for j, first, count in groups:
        if j in jobs.index:
            r = jobs.loc[j]
            ax.barh(first + (count - 1) / 2, r["end"] - r["start"], left=r["start"], height=count - 0.1 + 0.4,
                    color="#e6e6e6", edgecolor="#999999", linewidth=0.5, zorder=0)
            lane = ",".join(r["lanes"]) if r["lanes"] else ""
            ax.text(r["start"], first - 0.55, f" {j} on {lane}" if lane else f" {j}", fontsize=7, va="bottom",
                    color="#555555")
    for y, (_, r) in enumerate(rows):
        c = colors["joined"] if r["joined"] else colors["first"]
        ax.barh(y, max(r["end"] - r["start"], 1e-3), left=r["start"], height=0.6, color=c,
                hatch="//" if r["status"] in bad else None, edgecolor="black", linewidth=0.3, zorder=2)
        if r["joined"]:
            ax.plot([r["start"]], [y], marker=">", color="black", markersize=4, zorder=3)
    labels = [f"{r['adapter']}" + (f" (joined at step {int(r['joined_step'])})" if r["joined"] and pd.notna(
        r["joined_step"]) else " (joined)" if r["joined"] else "") for _, r in rows]
    if n <= 150:
        ax.set_yticks(range(n), labels, fontsize=7)
    else:
        ax.set_yticks([])
    ax.set_ylim(n - 0.3, -1.2)
    ax.set_xlabel("seconds since the first job started")
    handles = [Patch(color=colors["first"], label="in the job from its start"),
               Patch(color=colors["joined"], label="joined the running job"),
               Patch(facecolor="white", edgecolor="black", hatch="//", label="diverged / pruned / failed"),
               Patch(color="#e6e6e6", label="the job")]
    ax.legend(handles=handles, fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))  # off the bars
    joined = int(spans["joined"].sum())
    title = f"adapters per job: {len(spans)} spans in {len(groups)} jobs, {joined} joined a running job"
    if run.streamed:
        title += f"; {len(run.streamed)} queued job{'s' if len(run.streamed) != 1 else ''} never ran (adapters streamed)"
    ax.set_title(title, fontsize=10)
    ax.grid(axis="x", alpha=0.3)
    return fig


def _slot_key(lane: str) -> tuple:
    head, _, tail = str(lane).partition(":")
    return (head, int(tail) if tail.isdigit() else 0, str(lane))


def _lane_for_gpu(gpu: int, lanes: list[str]) -> str:
    for lane in lanes:
        if lane.endswith(f":{gpu}") or lane == f"slot {gpu}":
            return lane
    return lanes[0]


def makespan_values(run: RunData) -> dict[str, float]:
    """Measured makespan, the measured sequential time (the same jobs one after another),
    and the plan's predicted makespan, baselines and lower bound where present."""
    out: dict[str, float] = {}
    if not run.jobs.empty:
        out["measured (this run)"] = float(run.jobs["end"].max() - run.jobs["start"].min())
        out["measured jobs, one after another"] = float((run.jobs["end"] - run.jobs["start"]).sum())
    plan = run.plan
    if plan is None:
        return out
    if plan.makespan > 0:
        out["planned (predicted)"] = plan.makespan
    if plan.streamed_makespan > 0:
        out["planned, streamed (predicted)"] = plan.streamed_makespan
    for name, v in plan.baselines.items():
        if math.isfinite(v):
            out[f"baseline: {name} (predicted)"] = v
    return out


def plot_makespan(run: RunData):
    """The sweep's makespan against the baselines and the lower bound."""
    vals = makespan_values(run)
    if not vals:
        raise Missing("No job timings and no planned makespan in this run directory.")
    fig = _figure(8, 0.45 * len(vals) + 1.6)
    ax = fig.subplots()
    names = list(vals)
    colors = ["#2e7d32" if n.startswith("measured (") else "#8fb3d9" if n.startswith("planned") else "#bbbbbb"
              for n in names]
    ax.barh(names, [vals[n] for n in names], color=colors)
    for i, n in enumerate(names):
        ax.annotate(f"{vals[n]:.1f} s", (vals[n], i), va="center", fontsize=8, xytext=(3, 0), textcoords="offset points")
    lb = run.plan.lower_bound if run.plan is not None else 0.0
    if lb > 0:
        ax.axvline(lb, color="black", linestyle=":", label=f"lower bound {lb:.1f} s")
        ax.legend(fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("seconds")
    if run.plan is None or not run.plan.baselines:
        ax.set_title("makespan (plan.json has no baselines; measured values only)", fontsize=10)
    else:
        ax.set_title("makespan against the baselines", fontsize=10)
    ax.grid(axis="x", alpha=0.3)
    return fig


def measured_step_times(run: RunData) -> dict[str, float]:
    """Median seconds of a full-pack step per job, from metrics.jsonl (the first step, which
    includes the base model's eval, and steps with fewer adapters are left out)."""
    out: dict[str, float] = {}
    for job, g in run.steps.groupby("job_id"):
        g = g.sort_values("step")
        full = g["adapters"].max()
        dt = g["time"].diff()
        sel = dt[(g["adapters"] == full) & (g["step"] > 0)].dropna()
        if len(sel):
            out[str(job)] = float(sel.median())
    return out


def cost_model_points(run: RunData) -> pd.DataFrame:
    """Per job: predicted and measured step time and job time (NaN where unknown)."""
    if run.jobs.empty:
        return pd.DataFrame()
    measured_step = measured_step_times(run)
    model = _cost_model(run)
    plan_jobs = _plan_jobs(run.plan)
    planned_loads = {a.id: a for a in run.plan.adapters} if run.plan is not None else {}
    cfg = run.results.set_index("adapter_id") if not run.results.empty else pd.DataFrame()
    rows = []
    for _, r in run.jobs.iterrows():
        pj = plan_jobs.get(r["job_id"])
        pred_step = r["predicted_step_time"] if isinstance(r["predicted_step_time"], (int, float)) else None
        pred_job = (r["planned_end"] - r["planned_start"]) if pd.notna(r["planned_end"]) and pd.notna(r["planned_start"]) else None
        if model is not None and pj is not None and (pred_step is None or pred_job is None):
            loads = _loads(pj, planned_loads, cfg)
            if loads:
                d = pj.tp
                with contextlib.suppress(Exception):
                    pred_step = pred_step if pred_step is not None else model.step_time(loads, d)
                    pred_job = pred_job if pred_job is not None else model.job_time(loads, d)
        rows.append({"job_id": r["job_id"], "predicted_step_s": pred_step, "measured_step_s": measured_step.get(r["job_id"]),
                     "predicted_job_s": pred_job, "measured_job_s": r["end"] - r["start"]})
    return pd.DataFrame(rows).astype({"predicted_step_s": float, "measured_step_s": float, "predicted_job_s": float})


def _cost_model(run: RunData):
    if not run.profile:
        return None
    try:
        from plora.cost.model import CostModel

        data = run.profile.get("cost_model", run.profile)
        return CostModel.from_dict(data)
    except Exception:  # noqa: BLE001 - a profile of another format: no predictions from it
        return None


def _loads(plan_job: Job, planned: dict[str, AdapterLoad], cfg: pd.DataFrame) -> list[AdapterLoad]:
    """The job's adapters as the plan priced them, else from the results table."""
    from plora.cost.model import AdapterLoad

    out = []
    for a in plan_job.adapters:
        if a in planned:
            out.append(planned[a])
        elif a in cfg.index:
            row = cfg.loc[a]
            out.append(AdapterLoad(a, int(row["rank"]), int(row["batch_size"]), int(row.get("steps") or 1)))
    return out


def plot_cost_model(run: RunData):
    """The cost model's predicted step and job times against the measured ones (y = x is a
    perfect model)."""
    pts = cost_model_points(run)
    if pts.empty:
        raise Missing("No job timings in this run directory.")
    pairs = [("predicted_step_s", "measured_step_s", "full-pack step time (s)"),
             ("predicted_job_s", "measured_job_s", "job time (s)")]
    pairs = [p for p in pairs if pts[[p[0], p[1]]].notna().all(axis=1).any()]
    if not pairs:
        raise Missing("No cost-model predictions: plan.json has no predicted times and there is no profile.json "
                      "(measured median step time per job: "
                      + ", ".join(f"{j} {t * 1000:.0f} ms" for j, t in measured_step_times(run).items()) + ").")
    fig = _figure(5 * len(pairs), 4)
    axes = fig.subplots(1, len(pairs), squeeze=False)[0]
    for ax, (px, my, label) in zip(axes, pairs):
        d = pts[[px, my, "job_id"]].dropna()
        ax.scatter(d[px], d[my], color="#3a6ea5")
        for _, r in d.iterrows():
            ax.annotate(r["job_id"], (r[px], r[my]), fontsize=7, xytext=(3, 3), textcoords="offset points")
        lo = min(d[px].min(), d[my].min()) * 0.9
        hi = max(d[px].max(), d[my].max()) * 1.1
        ax.plot([lo, hi], [lo, hi], color="gray", linestyle="--", linewidth=1)
        err = ((d[px] - d[my]).abs() / d[my]).median()
        ax.set_title(f"{label}: median error {err:.0%}", fontsize=10)
        ax.set_xlabel("predicted")
        ax.set_ylabel("measured")
        ax.grid(alpha=0.3)
    return fig


def _study_location(run: RunData) -> tuple[str, str] | None:
    opt = run.spec.get("optuna") or {}
    name = opt.get("study_name") or run.name
    if opt.get("storage"):
        return str(opt["storage"]), str(name)
    path = run.run_dir / "study.sqlite"
    return (f"sqlite:///{path}", str(name)) if path.is_file() else None


def plot_study(run: RunData):
    """The Optuna study's history: each trial's value in order, the best so far, and the
    trial states (a tune's batches in colour)."""
    loc = _study_location(run)
    if loc is None:
        raise Missing("No Optuna study for this run (study.sqlite).")
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    try:
        study = optuna.load_study(study_name=loc[1], storage=loc[0])
    except Exception as e:  # noqa: BLE001
        raise Missing(f"The Optuna study {loc[1]!r} could not be opened ({type(e).__name__}).") from None
    trials = study.get_trials(deepcopy=False)
    if not trials:
        raise Missing("The Optuna study has no trials yet.")
    fig = _figure(9, 3.6)
    ax = fig.subplots()
    done = [t for t in trials if t.state.name == "COMPLETE" and t.value is not None]
    batches = sorted({t.user_attrs.get("batch") for t in done if t.user_attrs.get("batch") is not None})
    if batches:
        for i, b in enumerate(batches):
            sel = [t for t in done if t.user_attrs.get("batch") == b]
            ax.scatter([t.number for t in sel], [t.value for t in sel], s=30, color=PALETTE[i % len(PALETTE)],
                       label=f"batch {b}")
    else:
        ax.scatter([t.number for t in done], [t.value for t in done], s=30, color="#3a6ea5", label="trial")
    best, xs, ys = None, [], []
    minimize = study.direction.name == "MINIMIZE"
    for t in done:
        if best is None or (t.value < best if minimize else t.value > best):
            best = t.value
        xs.append(t.number)
        ys.append(best)
    if xs:
        ax.step(xs, ys, where="post", color="#e0a100", label="best so far")
    counts: dict[str, int] = {}
    for t in trials:
        counts[t.state.name] = counts.get(t.state.name, 0) + 1
    ax.set_title(f"study {study.study_name!r}: " + ", ".join(f"{v} {k}" for k, v in sorted(counts.items())), fontsize=10)
    ax.set_xlabel("trial")
    ax.set_ylabel(str(study.user_attrs.get("objective", "objective")))
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    return fig


def plot_best_vs_gpu_seconds(run: RunData):
    """The best score each tune had found against the GPU-seconds it had spent then: one
    curve per strategy (sampler, pruner, loop or asynchronous) run on the space; a strategy
    run in several directories (seeds) is one curve per directory."""
    h = run.tune_history.dropna(subset=["gpu_seconds"])
    h = h[h["best"].notna()]
    if h.empty:
        raise Missing("No tune history (tune_history.csv): `plora tune` records one.")
    runs_of = h.groupby("strategy")["run"].nunique()
    fig = _figure(9, 4)
    ax = fig.subplots()
    for i, ((run_name, strategy), g) in enumerate(h.groupby(["run", "strategy"], sort=True)):
        g = g.sort_values("gpu_seconds", kind="stable")
        label = str(strategy) if runs_of[strategy] == 1 else f"{strategy} ({run_name})"
        ax.step(g["gpu_seconds"], g["best"], where="post", color=PALETTE[i % len(PALETTE)], label=label,
                linewidth=1.5, marker="o", markersize=3)
    if run.score in run.base:
        ax.axhline(run.base[run.score], color="gray", linestyle="--", linewidth=1, label="base model")
    ax.set_xlabel("GPU-seconds spent")
    ax.set_ylabel(f"best {run.score} so far")
    ax.set_title("Best score found against GPU time", fontsize=10)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    return fig
