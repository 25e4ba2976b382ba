"""The results report: a sweep's answer, read in plots.

``plora report RUN`` executes ``notebooks/report.ipynb`` headless against a run directory
and exports it to ``RUN/report.html`` with every plot embedded as a PNG. The notebook
itself stays short: each section is one call into this module, so that the same figures
can be drawn (and tested) without a notebook, and a section whose data is missing (no
plan predictions, no cost-model profile, no intermediate evals) shows a one-line note
instead of failing the report.

What the run directory offers, and where each section reads it:

* ``results.parquet``, ``base_metrics.json``, ``spec.yaml``: the table, score against each
  hyperparameter, best against worst and base model.
* ``jobs/<id>/metrics.jsonl`` / ``evals.jsonl``: learning curves; measured step times.
* ``journal.sqlite`` (the engine's record of each job: slots, start, end, outcome), else the
  recipe's ``summary.json``: the actual timeline. A job the journal marks ``streamed`` (its
  adapters all joined running jobs) never ran and is not drawn. Each adapter's own span in
  its job (from the job's start, or from the step it joined at: ``joins.jsonl``,
  ``summary.json``'s ``joined``, ``metrics.jsonl``) comes from `plora.results.adapter_spans`. ``plan.json`` (read as a
  :class:`plora.planner.plan.Plan`): the planned one, when its jobs carry predicted times
  and GPUs; the makespan's baselines and lower bound when the planner wrote them.
* ``profile.json`` (a fitted cost model): predicted against measured step and job times.
* the Optuna study (``study.sqlite`` or ``optuna.storage``): the optimization history.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
import subprocess
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pandas as pd
import yaml

from plora.job.outputs import PROGRESS_FILE, SUMMARY_FILE
from plora.settings import REPORT_COMPARE_DIRS, REPORT_RUN_DIR
from plora.results.adapter_spans import SPAN_COLUMNS, JobRun, adapter_spans, planned_adapters, read_json, read_jsonl
from plora.job.control import read_joins
from plora.results.metrics import minimize as minimize_objective

if TYPE_CHECKING:
    from plora.cost.model import AdapterLoad
    from plora.planner.plan import Job, Plan

__all__ = [
    "Missing",
    "ReportError",
    "RunData",
    "load_run",
    "notebook_path",
    "plot_adapter_gantt",
    "plot_best_worst_base",
    "plot_cost_model",
    "plot_gantt",
    "plot_learning_curves",
    "plot_makespan",
    "plot_score_vs_hyperparameters",
    "plot_study",
    "render_report",
    "require_report_packages",
    "results_table",
    "show",
    "summary",
]

#: The environment variable through which the notebook's parameter cell gets the run directory.
RUN_DIR_ENV = REPORT_RUN_DIR
#: more run directories whose tune histories the report draws beside the run's (os.pathsep-separated)
COMPARE_ENV = REPORT_COMPARE_DIRS
#: what each tune records as trials are told (`plora.tuning.budget`; named here so that
#: the report imports no Optuna to find it)
TUNE_HISTORY_FILE = "tune_history.csv"
HYPERPARAMETERS = ("rank", "alpha", "learning_rate", "batch_size")
#: ``notebooks/report.ipynb``, installed with the package through the ``assets/report.ipynb`` link
PACKAGE_NOTEBOOK = Path(__file__).resolve().parents[1] / "assets" / "report.ipynb"


PALETTE = ["#4c78a8", "#f58518", "#54a24b", "#b279a2", "#e45756", "#72b7b2", "#eeca3b", "#9d755d"]


class ReportError(ValueError):
    """The report cannot be made (no such run, notebook failed); the message is one line."""


class Missing(Exception):
    """A section's data is not in the run directory; the message says what is missing."""


# --------------------------------------------------------------------------- rendering


def notebook_path() -> Path:
    """The report notebook (``notebooks/report.ipynb``, as installed with the package)."""
    if PACKAGE_NOTEBOOK.is_file():
        return PACKAGE_NOTEBOOK
    raise ReportError(f"report notebook not found at {PACKAGE_NOTEBOOK}")


#: What executing and exporting the notebook imports: the ``report`` extra of pyproject.toml.
REPORT_PACKAGES = ("nbformat", "nbclient", "nbconvert", "ipykernel", "matplotlib")
INSTALL_REPORT = 'pip install "plora[report]" (in a checkout: pip install -e ".[report]")'


def require_report_packages() -> None:
    """A missing extra is the user's set-up, not a bug: one line saying what to install,
    before anything is executed or written."""
    import importlib.util

    missing = []
    for name in REPORT_PACKAGES:
        try:
            found = importlib.util.find_spec(name) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            missing.append(name)
    if missing:
        raise ReportError(f"the report needs {', '.join(missing)}, from the report extra: {INSTALL_REPORT}")


def render_report(run_dir: Path | str, out: Path | str | None = None, *, timeout: int = 600,
                  compare: Sequence[Path | str] = ()) -> Path:
    """Execute the report notebook on ``run_dir`` (headless, kernel ``python3``) and write
    it as HTML with embedded images; returns the HTML path (default ``run_dir/report.html``).
    The executed notebook is saved next to it (``.ipynb``) for whoever wants to dig further.

    ``compare``: more run directories of the same space (other strategies, seeds), whose
    best score against GPU-seconds is drawn on the run's plot. ``run_dir`` may also be a
    folder that holds such runs, each a subfolder: then that plot is the report."""
    run_dir = Path(run_dir).expanduser().resolve()
    if not run_dir.is_dir():
        raise ReportError(f"{run_dir}: no such run directory")
    compare = [Path(c).expanduser().resolve() for c in compare]
    for c in compare:
        if not c.is_dir():
            raise ReportError(f"{c}: no such run directory")
    if not (run_dir / "results.parquet").is_file() and not _history_files(run_dir):
        raise ReportError(f"{run_dir}: no results.parquet (not a finished plora run)")
    require_report_packages()
    out = Path(out).expanduser().resolve() if out is not None else run_dir / "report.html"
    out.parent.mkdir(parents=True, exist_ok=True)

    import nbformat
    from nbclient import NotebookClient
    from nbclient.exceptions import CellExecutionError
    from nbconvert import HTMLExporter

    nb = nbformat.read(notebook_path(), as_version=4)
    env = dict(os.environ)
    env[RUN_DIR_ENV] = str(run_dir)
    env[COMPARE_ENV] = os.pathsep.join(map(str, compare))
    env["MPLBACKEND"] = "Agg"
    # The kernel must import this plora, installed or not.
    src = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (src, env.get("PYTHONPATH", "")) if p)
    client = NotebookClient(nb, kernel_name="python3", timeout=timeout,
                            resources={"metadata": {"path": str(run_dir)}})
    try:
        client.execute(env=env, stderr=subprocess.DEVNULL)  # the kernel's start-up chatter
    except CellExecutionError as e:
        lines = [ln for ln in str(e).strip().splitlines() if ln.strip()]
        raise ReportError(f"report notebook failed: {lines[-1] if lines else e}") from None
    except Exception as e:  # noqa: BLE001 - no kernel, timeout...: one line, not a traceback
        raise ReportError(f"report notebook could not run: {type(e).__name__}: {e}") from None
    exporter = HTMLExporter()
    exporter.exclude_input = True
    exporter.exclude_input_prompt = True
    exporter.exclude_output_prompt = True
    html, _ = exporter.from_notebook_node(nb)
    out.write_text(html, encoding="utf-8")
    nbformat.write(nb, str(out.with_suffix(".ipynb")))
    return out


def show(section: Callable[["RunData"], Any], run: "RunData") -> None:
    """Display one section in the notebook: a figure as a PNG, a table as HTML, text as
    Markdown; missing data, or a section that fails, as a short note (the report goes on)."""
    from IPython.display import HTML, Image, Markdown, display

    try:
        obj = section(run)
    except Missing as e:
        display(Markdown(f"*{e}*"))
        return
    except Exception as e:  # noqa: BLE001 - one broken section must not hide the others
        display(Markdown(f"*This section could not be drawn ({type(e).__name__}: {e}).*"))
        return
    if isinstance(obj, pd.DataFrame):
        display(HTML(obj.to_html(index=False, na_rep="—", float_format=_fmt_float, border=0)))
    elif isinstance(obj, str):
        display(Markdown(obj))
    else:
        display(Image(data=figure_png(obj), format="png"))


def figure_png(fig: Any) -> bytes:
    """A matplotlib figure as PNG bytes."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100, bbox_inches="tight")
    return buf.getvalue()


def _fmt_float(x: float) -> str:
    if x != x:
        return "—"
    if x != 0 and (abs(x) < 1e-3 or abs(x) >= 1e5):
        return f"{x:.3g}"
    return f"{x:.4g}"


# --------------------------------------------------------------------------- loading a run


@dataclass
class RunData:
    """Everything the report reads from a run directory (missing parts are empty/None)."""

    run_dir: Path
    name: str
    objective: str
    minimize: bool
    spec: dict[str, Any]
    results: pd.DataFrame
    base: dict[str, float]
    plan: Plan | None
    jobs: pd.DataFrame  # one row per job that ran: timeline and predictions
    adapter_spans: pd.DataFrame  # per job run and adapter: start, end (same clock as jobs), joined, status
    streamed: dict[str, str]  # jobs that never ran, their adapters having joined running jobs -> that job
    steps: pd.DataFrame  # per job and packed step: time, adapters in the pack
    train_curves: pd.DataFrame  # adapter, adapter_step, loss
    eval_curves: pd.DataFrame  # adapter, adapter_step, eval_loss
    profile: dict[str, Any] | None
    notes: list[str] = field(default_factory=list)
    #: every tune's (GPU-seconds, best so far) as its trials were told: this run's and the
    #: compared ones' (`load_tune_histories`)
    tune_history: pd.DataFrame = field(default_factory=lambda: pd.DataFrame(columns=HISTORY_COLUMNS))

    @property
    def score(self) -> str:
        """The results column that ranks adapters."""
        return f"eval_{self.objective}"

    def done(self) -> pd.DataFrame:
        """Finished adapters with a score, best first."""
        r = self.results
        if r.empty or self.score not in r:
            return r.iloc[0:0]
        d = r[(r["status"] == "done") & r[self.score].notna()]
        if self.score != "eval_loss" and "eval_loss" in d:  # ties (common with exact match): lower loss first
            return d.sort_values([self.score, "eval_loss"], ascending=[self.minimize, True])
        return d.sort_values(self.score, ascending=self.minimize)


def load_run(run_dir: Path | str, compare: Sequence[Path | str] | str = ()) -> RunData:
    """Read a run directory for the report; ``compare``: more run directories (or one
    os.pathsep-separated string of them) whose tune histories are drawn beside its own."""
    run_dir = Path(run_dir).expanduser().resolve()
    if isinstance(compare, str):
        compare = [c for c in compare.split(os.pathsep) if c]
    spec: dict[str, Any] = {}
    with contextlib.suppress(OSError, yaml.YAMLError):
        spec = yaml.safe_load((run_dir / "spec.yaml").read_text()) or {}
    ev = spec.get("eval") or {}
    objective = ev.get("objective") or ("exact_match" if "exact_match" in (ev.get("metrics") or ["exact_match"]) else "loss")
    results = pd.DataFrame()
    with contextlib.suppress(Exception):
        results = pd.read_parquet(run_dir / "results.parquet")
    base = read_json(run_dir / "base_metrics.json") or {}
    plan = _read_plan(run_dir)
    profile = read_json(run_dir / "profile.json")
    jobs_dir = run_dir / "jobs"
    job_dirs = sorted(p for p in jobs_dir.iterdir() if p.is_dir()) if jobs_dir.is_dir() else []

    train, evals, steps = [], [], []
    for jd in job_dirs:
        metrics = read_jsonl(jd / "metrics.jsonl")
        for m in metrics:
            if "adapter" in m and "loss" in m:
                train.append({"job_id": jd.name, "adapter": m["adapter"], "adapter_step": m.get("adapter_step"),
                              "loss": m["loss"], "time": m.get("time"), "attempt": int(m.get("attempt") or 1)})
        for e in read_jsonl(jd / "evals.jsonl"):
            if "adapter" in e:
                evals.append({"job_id": jd.name, **e, "attempt": int(e.get("attempt") or 1)})
        # a resumed job appends to its files: its step times are the last attempt's
        last = max((int(m.get("attempt") or 1) for m in metrics), default=1)
        by_step: dict[int, dict] = {}
        for m in metrics:
            if "step" in m and "time" in m and int(m.get("attempt") or 1) == last:
                s = by_step.setdefault(int(m["step"]), {"job_id": jd.name, "step": int(m["step"]), "time": 0.0, "adapters": 0})
                s["time"] = max(s["time"], float(m["time"]))
                s["adapters"] += 1
        steps.extend(by_step[k] for k in sorted(by_step))
    jobs, spans = _job_timeline(run_dir, job_dirs, plan, results)
    return RunData(
        run_dir=run_dir,
        name=str(spec.get("name") or run_dir.name),
        objective=str(objective),
        minimize=minimize_objective(str(objective), ev.get("greater_is_better")),
        spec=spec,
        results=results,
        base={k: v for k, v in base.items() if isinstance(v, (int, float))},
        plan=plan,
        jobs=jobs,
        adapter_spans=spans,
        streamed=_streamed_jobs(run_dir),
        steps=pd.DataFrame(steps, columns=["job_id", "step", "time", "adapters"]),
        train_curves=latest_attempts(pd.DataFrame(train, columns=["job_id", "adapter", "adapter_step", "loss", "time",
                                                                  "attempt"])),
        eval_curves=latest_attempts(pd.DataFrame(evals, columns=["job_id", "adapter", "adapter_step", "eval_loss", "time",
                                                                 "attempt"])),
        profile=profile,
        tune_history=load_tune_histories([run_dir, *map(Path, compare)]),
    )


HISTORY_COLUMNS = ["run", "strategy", "trial", "state", "value", "best", "gpu_seconds", "wall_seconds"]


def _history_files(folder: Path) -> list[Path]:
    """A run's tune history, else those of the runs in its subfolders (a folder of runs)."""
    own = folder / TUNE_HISTORY_FILE
    if own.is_file():
        return [own]
    return sorted(p for p in folder.glob(f"*/{TUNE_HISTORY_FILE}") if p.is_file())


def load_tune_histories(folders: Sequence[Path]) -> pd.DataFrame:
    """The tune histories of run directories (or folders of them), one frame, ``run`` naming
    each one's directory; unreadable files are left out."""
    frames, seen = [], set()
    for folder in folders:
        for path in _history_files(Path(folder).expanduser().resolve()):
            if path in seen:
                continue
            seen.add(path)
            with contextlib.suppress(Exception):
                f = pd.read_csv(path)
                f["run"] = path.parent.name
                frames.append(f)
    if not frames:
        return pd.DataFrame(columns=HISTORY_COLUMNS)
    out = pd.concat(frames, ignore_index=True)
    for c in ("value", "best", "gpu_seconds", "wall_seconds"):
        out[c] = pd.to_numeric(out.get(c), errors="coerce")
    return out.reindex(columns=HISTORY_COLUMNS)


def latest_attempts(curves: pd.DataFrame) -> pd.DataFrame:
    """Each adapter's curve as its latest attempt trained it.

    A job that was interrupted or crashed runs again and appends to its files, each row
    marked with its attempt (a split job's adapters train on in its child jobs). A row is kept
    unless a later attempt of the same adapter started at or before its step: a job that
    starts over keeps only its last attempt, one that resumed from a checkpoint keeps the
    steps before the checkpoint from the attempt that made them.
    """
    if curves.empty:
        return curves
    # the order runs happen in: a job's attempts in turn; a job split after running out of
    # memory continues as <job>.0 and <job>.1, which sort after it
    curves = curves.sort_values(["adapter", "job_id", "attempt", "adapter_step"], kind="stable")
    keep = pd.Series(True, index=curves.index)
    for _, g in curves.groupby("adapter", sort=False):
        runs = list(g.groupby(["job_id", "attempt"], sort=False)["adapter_step"].min().items())
        for i, ((job, attempt), _) in enumerate(runs):
            later = [first for _, first in runs[i + 1:]]
            if later:
                rows = g[(g["job_id"] == job) & (g["attempt"] == attempt)]
                keep[rows.index[rows["adapter_step"] >= min(later)]] = False
    return curves[keep].reset_index(drop=True)


def _read_plan(run_dir: Path) -> Plan | None:
    """The run's plan; None without one, or with one of another plora version (the
    sections that need it say so)."""
    from plora.planner.plan import Plan

    try:
        return Plan.of_run(run_dir)
    except (OSError, ValueError):
        return None


def _plan_jobs(plan: Plan | None) -> dict[str, Job]:
    return {j.id: j for j in plan.jobs} if plan is not None else {}


def _journal_jobs(run_dir: Path) -> list[dict] | None:
    """Job runs as the engine's journal recorded them (None when the run has no journal)."""
    path = run_dir / "journal.sqlite"
    if not path.is_file():
        return None
    from plora.engine.journal import Journal

    journal = Journal(path)
    try:
        jobs, events = journal.jobs(), journal.events()
    finally:
        journal.close()
    slots: dict[str, list[str]] = {}
    for _, kind, subject, detail in events:
        if kind == "launch":
            with contextlib.suppress(ValueError, AttributeError):
                slots[subject] = list(json.loads(detail).get("slots") or [])
    # a job whose adapters all joined running jobs (planner.streaming) never ran
    return [
        {"job_id": j.id, "slots": slots.get(j.id) or [], "start": j.started, "end": j.ended, "status": j.status,
         "returncode": j.returncode, "adapters": len(j.adapters), "adapter_ids": list(j.adapters), "tp": j.tp,
         "gpus": j.gpus, "predicted_start": j.predicted_start, "predicted_end": j.predicted_end}
        for j in jobs if j.started is not None and j.status != "streamed"
    ]


def _streamed_jobs(run_dir: Path) -> dict[str, str]:
    """Jobs that never ran because their adapters joined running ones: job -> the job that
    took them (the journal's ``streamed`` events)."""
    path = run_dir / "journal.sqlite"
    if not path.is_file():
        return {}
    from plora.engine.journal import Journal

    journal = Journal(path)
    try:
        events = journal.events()
    finally:
        journal.close()
    out = {}
    for _, kind, subject, detail in events:
        if kind == "streamed":
            with contextlib.suppress(ValueError, AttributeError):
                out[subject] = str(json.loads(detail).get("into") or "")
    return out


def _recipe_jobs(job_dirs: list[Path]) -> list[dict]:
    """Job runs from the recipe's own files, for runs without a journal: its clock starts
    after the model is loaded, so process start-up is not included."""
    rows = []
    for jd in job_dirs:
        summ = read_json(jd / SUMMARY_FILE) or {}
        prog = read_json(jd / PROGRESS_FILE) or {}
        for name, rec, key in ((SUMMARY_FILE, summ, "wall_time_s"), (PROGRESS_FILE, prog, "elapsed_s")):
            if rec.get(key) is not None and (jd / name).is_file():
                end = (jd / name).stat().st_mtime
                ids = list(summ.get("adapters") or {}) or [
                    *planned_adapters(jd), *(r.adapter.id for r in read_joins(jd) if r.refused is None)]
                rows.append({"job_id": jd.name, "slots": [], "start": end - float(rec[key]), "end": end,
                             "status": "finished" if summ else "running", "returncode": None,
                             "adapters": len(summ.get("adapters", {})) or None, "adapter_ids": ids})
                break
    return rows


def _job_timeline(run_dir: Path, job_dirs: list[Path], plan: Plan | None,
                  results: pd.DataFrame) -> tuple[pd.DataFrame, pd.DataFrame]:
    """One row per job run: actual start/end (seconds from the first start), its slots, and
    the plan's predictions where plan.json (or the journal) has them; and each adapter's
    span in those runs (`plora.results.adapter_spans`), on the same clock, with its job's lanes."""
    import time

    planned = _plan_jobs(plan)
    batch_of = plan.batch_of() if plan is not None else {}
    runs = _journal_jobs(run_dir)
    source = "journal"
    if not runs:
        runs, source = _recipe_jobs(job_dirs), "recipe"
    rows, job_runs = [], []
    now = time.time()
    for r in runs:
        p = planned.get(r["job_id"])
        job_runs.append(JobRun(r["job_id"], float(r["start"]), float(r["end"] if r["end"] is not None else now),
                               list(r.get("adapter_ids") or (p.adapters if p is not None else [])),
                               running=r["end"] is None, status=r.get("status")))
        pstart = p.start if p is not None and p.start is not None else r.get("predicted_start")
        pend = p.end if p is not None and p.end is not None else r.get("predicted_end")
        end = r["end"] if r["end"] is not None else now  # still running
        rows.append({
            "job_id": r["job_id"], "slots": r["slots"], "start": float(r["start"]), "end": float(end),
            "source": source, "status": r.get("status"), "returncode": r.get("returncode"),
            "adapters": r.get("adapters") or (len(p.adapters) if p is not None else 0),
            "tp": r.get("tp") or (p.tp if p is not None else 1),
            "batch": batch_of.get(r["job_id"]), "gpus": (p.gpus if p is not None else []) or r.get("gpus") or [],
            "planned_start": float(pstart) if isinstance(pstart, (int, float)) else None,
            "planned_end": float(pend) if isinstance(pend, (int, float)) else None,
            "predicted_step_time": p.step_time if p is not None else None,
        })
    cols = ["job_id", "slots", "start", "end", "source", "status", "returncode", "adapters", "tp", "batch", "gpus",
            "planned_start", "planned_end", "predicted_step_time"]
    frame = pd.DataFrame(rows, columns=cols)
    spans = pd.DataFrame([s.row() for s in adapter_spans(run_dir, job_runs)], columns=[*SPAN_COLUMNS, "lanes"])
    if frame.empty:
        return frame, spans
    t0 = frame["start"].min()
    frame["start"] -= t0
    frame["end"] -= t0
    frame = frame.sort_values(["start", "job_id"]).reset_index(drop=True)
    frame["lanes"] = _lanes(frame)
    if not spans.empty:
        spans["start"] -= t0
        spans["end"] -= t0
        lanes = dict(zip(frame["job_id"], frame["lanes"]))
        spans["lanes"] = [lanes.get(j, []) for j in spans["job_id"]]
    return frame, spans


def _lanes(frame: pd.DataFrame) -> list[list[str]]:
    """The slots each job ran on; when nothing recorded them, the first lane free at the
    job's start (what a first-come-first-served pool does)."""
    out: list[list[str]] = []
    free_at: dict[str, float] = {}
    for _, r in frame.iterrows():
        if r["slots"]:
            lanes = list(r["slots"])
        else:
            lanes = [next((k for k, t in sorted(free_at.items()) if t <= r["start"] + 1e-6), f"slot {len(free_at)}")]
        for lane in lanes:
            free_at[lane] = r["end"]
        out.append(lanes)
    return out


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
    # per-epoch scoring: the epoch kept, then each epoch's scores (`plora.sweep.epoch_columns`)
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
