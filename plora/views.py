"""Everything the `plora` command shows, as rich renderables: the configurations and the
plan before a sweep, the live view (or event log) while it runs, the results and
`plora status` after it, the best trials of a tune and a fitted cost model.

Library code that only builds rich renderables; the CLI decides where they go.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.console import Console, ConsoleDimensions, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

from plora import settings as settings_mod
from plora.engine.journal import FINAL_ADAPTER

if TYPE_CHECKING:
    import optuna
    import pandas as pd

    from plora.cost.profiling.record import Profile
    from plora.spec.schema import SweepSpec
    from plora.sweep import PreparedSweep

#: Width of output that is not a terminal (a log file, CI): wide enough that no table is
#: cut, so adapter ids stay whole and can be found on disk.
LOG_WIDTH = 4096


class PlainWidthConsole(Console):
    """A rich console that, when its output is not a terminal and COLUMNS is not set, does
    not wrap or cut at 80 columns: a log is read with a pager or grep, not a window."""

    @property
    def size(self) -> ConsoleDimensions:
        dims = super().size
        if self._width is None and not self.is_terminal:
            return ConsoleDimensions(LOG_WIDTH, dims.height)
        return dims

    @size.setter
    def size(self, new_size: tuple[int, int]) -> None:
        Console.size.fset(self, new_size)  # type: ignore[attr-defined]


def new_events(seen: list[str], events: list[str]) -> list[str]:
    """The events of `events` not yet in `seen`: the engine keeps a sliding window of its
    latest notes, so the new ones are what follows the longest overlap of the two."""
    for k in range(min(len(seen), len(events)), 0, -1):
        if seen[-k:] == events[:k]:
            return events[k:]
    return list(events)


#: seconds between two progress lines of a running job in a log (`EventLog`); the
#: environment variable of that name sets another interval
LOG_PROGRESS_ENV = settings_mod.LOG_PROGRESS_S
LOG_PROGRESS_S = settings_mod.DEFAULT_LOG_PROGRESS_S


def log_progress_interval() -> float:
    """`LOG_PROGRESS_S`, or what ``PLORA_LOG_PROGRESS_S`` says (a number of seconds)."""
    return settings_mod.settings().log_progress_s


def finished_counts(counts: dict[str, int]) -> str:
    """Finished adapters by state: "done 7, diverged 0, pruned 3, failed 0" (pruned only
    where some were: a sweep without a pruner has none)."""
    return ", ".join(f"{k} {counts.get(k, 0)}" for k in FINAL_ADAPTER if k != "pruned" or counts.get(k))


class EventLog:
    """Progress for output that is not a terminal: each engine event (a job started,
    finished, retried...) as its own line, a line whenever more adapters finish, and every
    ``every_s`` seconds a line per running job (`job_progress_line`), so that a log of a
    job that trains for minutes is not silent until it ends. A live view there would print
    only its last frame, without the events before it."""

    def __init__(self, console: Console, total_adapters: Callable[[Any], int], every_s: float | None = None) -> None:
        self.console = console
        self.total_adapters = total_adapters
        self.every_s = log_progress_interval() if every_s is None else every_s
        self.seen: list[str] = []
        self.finished = -1
        self.last_line: dict[str, float] = {}  # running job -> when its last progress line was printed

    def __call__(self, snapshot: Any) -> None:
        for event in new_events(self.seen, list(snapshot.events)):
            self.console.print(event, highlight=False, markup=False)
        self.seen = list(snapshot.events)
        now = time.monotonic()
        running = {rj.job.id: rj for rj in snapshot.running}
        self.last_line = {j: t for j, t in self.last_line.items() if j in running}
        for job_id, rj in running.items():
            if now - self.last_line.setdefault(job_id, now) >= self.every_s:
                self.last_line[job_id] = now
                self.console.print(f"{time.strftime('%H:%M:%S')} {job_progress_line(job_id, rj.proc.progress())}",
                                   highlight=False, markup=False)
        counts = snapshot.adapter_status
        finished = sum(counts.get(k, 0) for k in FINAL_ADAPTER)
        if finished != self.finished and (finished or self.finished >= 0):
            self.console.print(f"adapters {finished}/{self.total_adapters(snapshot)} finished "
                               f"({finished_counts(counts)})", highlight=False)
        self.finished = finished
        self.console.file.flush()


@contextlib.contextmanager
def progress(console: Console, total_adapters: Callable[[Any], int], *,
             transient: bool = False) -> Iterator[Callable[[Any], None]]:
    """A snapshot callback for the engine: a live view on a terminal, an event log
    otherwise. On exit (also on Ctrl-C) the output ends with a full line."""
    try:
        if console.is_terminal:
            with Live(console=console, refresh_per_second=4, transient=transient) as live:
                yield lambda snap: live.update(live_view(snap, total_adapters(snap)))
        else:
            yield EventLog(console, total_adapters)
    finally:
        console.file.flush()


def _fmt_s(seconds: float | None) -> str:
    if seconds is None or seconds != seconds:
        return "—"
    seconds = max(0.0, seconds)
    if seconds < 90:
        return f"{seconds:.0f}s"
    if seconds < 5400:
        return f"{seconds / 60:.1f}m"
    return f"{seconds / 3600:.1f}h"


def job_eta(progress: dict) -> float | None:
    """Seconds a running job has left, from its progress.json: its elapsed time per adapter
    step done so far, over the adapter steps left (None before its first step)."""
    done, total = progress.get("adapter_steps_done", 0), progress.get("adapter_steps_total") or 0
    elapsed = progress.get("elapsed_s")
    return elapsed * (total - done) / done if elapsed and done else None


def job_progress_line(job_id: str, progress: dict) -> str:
    """A running job in one line, from its progress.json: adapter steps done of its total,
    adapters finished, the range of its training adapters' recent losses, elapsed and ETA."""
    done, total = progress.get("adapter_steps_done", 0), progress.get("adapter_steps_total") or 0
    if not total:
        return f"{job_id}: starting"
    parts = [f"adapter steps {done}/{total} ({100 * done / total:.0f}%)",
             f"adapters {progress.get('adapters_finished', 0)}/{progress.get('adapters_total', 0)} finished"]
    losses = [v for v in (progress.get("train_loss") or {}).values() if isinstance(v, (int, float)) and v == v]
    if losses:
        low, high = f"{min(losses):.4g}", f"{max(losses):.4g}"
        parts.append(f"loss {low}" if low == high else f"loss {low}–{high}")
    parts.append(f"{_fmt_s(progress.get('elapsed_s'))} elapsed, ETA {_fmt_s(job_eta(progress))}")
    return f"{job_id}: " + ", ".join(parts)


def live_view(snapshot, total_adapters: int) -> Group:
    """Running jobs with their progress and ETA, adapters done, predicted vs actual makespan."""
    jobs = Table(title="running jobs", title_justify="left", expand=False)
    for col, just in (("job", "left"), ("GPUs / slots", "left"), ("adapters", "right"), ("adapter steps", "right"),
                      ("done", "right"), ("joins", "left"), ("elapsed", "right"), ("ETA", "right")):
        jobs.add_column(col, justify=just)
    for rj in snapshot.running:
        p = rj.proc.progress()
        done, total = p.get("adapter_steps_done", 0), p.get("adapter_steps_total") or 0
        jobs.add_row(rj.job.id, ",".join(rj.slots), str(len(rj.job.adapters)),
                     f"{done}/{total}" if total else "starting", f"{p.get('adapters_finished', 0)}",
                     joins_note(p, running=True), _fmt_s(p.get("elapsed_s")), _fmt_s(job_eta(p)))
    counts = snapshot.adapter_status
    finished = sum(counts.get(k, 0) for k in FINAL_ADAPTER)
    line = Text.assemble(
        ("adapters ", "bold"), f"{finished}/{total_adapters} finished", f" ({finished_counts(counts)})",
        "   ", ("jobs ", "bold"), f"{len(snapshot.running)} running, {len(snapshot.queued)} queued",
        "   ", ("makespan ", "bold"), f"{_fmt_s(snapshot.elapsed_s)} so far",
        f" / {_fmt_s(snapshot.predicted_makespan_s)} predicted" if snapshot.predicted_makespan_s else "",
    )
    parts = [line]
    if snapshot.running:
        parts.append(jobs)
    for note in snapshot.events[-3:]:
        parts.append(Text(note, style="dim"))
    return Group(*parts)


def joins_note(progress: dict, *, running: bool) -> str:
    """A job's joins from its progress.json: adapters that joined it, joins waiting in its
    control.json for room, and whether it waits for joins after its own adapters left
    (``streaming.linger_s``; only while it runs). "—" when there is none of these."""
    parts = []
    if progress.get("adapters_joined"):
        parts.append(f"{int(progress['adapters_joined'])} joined")
    if running and progress.get("joins_waiting"):
        parts.append(f"{int(progress['joins_waiting'])} waiting")
    if running and progress.get("lingering"):
        parts.append("lingering")
    return ", ".join(parts) or "—"


def _read_progress(job_dir: Path) -> dict:
    from plora.job.outputs import read_progress

    return dict(read_progress(job_dir))


def status_tables(run_dir: Path) -> list:
    """Where a sweep stands, from its journal (works while it runs, and after)."""
    import json

    from plora.engine.journal import Journal

    journal = Journal(run_dir / "journal.sqlite")
    try:
        jobs, adapters, events = journal.jobs(), journal.adapters(), journal.events()
    finally:
        journal.close()
    into: dict[str, str] = {}
    for _, kind, subject, detail in events:
        if kind == "streamed":
            with contextlib.suppress(ValueError, AttributeError):
                into[subject] = str(json.loads(detail).get("into") or "")
    counts: dict[str, int] = {}
    for a in adapters:
        counts[a["status"]] = counts.get(a["status"], 0) + 1
    summary = Text.assemble(("adapters: ", "bold"), ", ".join(f"{k} {v}" for k, v in sorted(counts.items())) or "none")
    t = Table(title=f"jobs of {run_dir.name}", title_justify="left")
    for col in ("job", "status", "adapters", "TP", "GPUs", "attempt", "resumed at", "joins", "wall time", "exit"):
        t.add_column(col)
    for j in jobs:
        wall = (j.ended or 0) - j.started if j.started and j.ended else None
        progress = _read_progress(run_dir / "jobs" / j.id) if j.started else {}
        if j.status == "streamed":  # never ran: its adapters joined a running job
            joins = f"adapters joined {into[j.id]}" if into.get(j.id) else "adapters joined running jobs"
        else:
            joins = joins_note(progress, running=j.status == "running")
        t.add_row(j.id, j.status, str(len(j.adapters)), str(j.tp), ",".join(map(str, j.gpus)) or "—",
                  str(j.attempt), _resumed_at(progress), joins, _fmt_s(wall),
                  "" if j.returncode is None else str(j.returncode))
    return [summary, t]


def _resumed_at(progress: dict) -> str:
    """The step a job's latest attempt resumed from its checkpoint ("—": from the start)."""
    step = progress.get("resumed_step")
    return f"step {step}" if step is not None else "—"


# --------------------------------------------------------------------------- before a sweep


def _fmt_time(seconds: float) -> str:
    """A predicted time (the plan's tables are finer in hours than the live view)."""
    if seconds < 120:
        return f"{seconds:.0f}s"
    if seconds < 7200:
        return f"{seconds / 60:.1f}m"
    return f"{seconds / 3600:.2f}h"


def configs_table(prep: PreparedSweep) -> Table:
    """Every configuration with its step budget and the job it is planned in."""
    t = Table(title=f"{len(prep.configs)} configurations", title_justify="left")
    dims = prep.spec.space.searched()
    for col in ("adapter", "rank", "alpha", "lr", "batch", "seed", *(_DIM_HEADS[n] for n in dims), "steps", "job"):
        t.add_column(col, justify="right" if col not in ("adapter", "job", "targets", "scheduler") else "left")
    job_of = prep.plan.job_of()
    for c in prep.configs:
        settings = prep.spec.settings(c)
        t.add_row(c.id, str(c.rank), f"{c.alpha:g}", f"{c.learning_rate:.3g}", str(c.batch_size), str(c.seed),
                  *(_dim_text(settings[n]) for n in dims), str(prep.steps[c.id]), job_of[c.id])
    return t


#: column heads of the dimensions a space searches per adapter (`plora.spec.adapter.TRAINING_DIMS`)
_DIM_HEADS = {"dropout": "dropout", "weight_decay": "wd", "warmup_ratio": "warm-up", "scheduler": "scheduler",
              "rslora": "rsLoRA", "targets": "targets", "epochs": "epochs"}


def _dim_text(value: Any) -> str:
    if value is None or value != value:
        return "—"
    if isinstance(value, bool):
        return "yes" if value else "no"
    return f"{value:g}" if isinstance(value, float) else str(value)


def jobs_table(prep: PreparedSweep) -> Table:
    """The job queue: adapters, TP degree, GPUs, predicted start and end."""
    t = Table(title=f"{len(prep.plan.jobs)} jobs — {prep.plan.grouping}", title_justify="left")
    for col in ("job", "adapters", "TP", "GPUs", "start", "end", "steps (max)", "ranks"):
        t.add_column(col, justify="left" if col in ("job", "ranks") else "right")
    rank_of = {c.id: c.rank for c in prep.configs}
    for j in prep.plan.jobs:
        gpus = ",".join(map(str, j.gpus)) if j.gpus else "—"
        start = "—" if j.start is None else _fmt_time(j.start)
        end = "—" if j.end is None else _fmt_time(j.end)
        ranks = ",".join(str(rank_of[a]) for a in j.adapters)
        t.add_row(j.id, str(len(j.adapters)), str(j.tp), gpus if (prep.hardware and prep.hardware.gpu) else "—",
                  start, end, str(max(prep.steps[a] for a in j.adapters)),
                  ranks if len(ranks) < 40 else ranks[:37] + "…")
    return t


#: How the plan summary names the planner's baselines.
BASELINE_NAMES = {"min_gpu": "Min GPU (one adapter per job, smallest TP)", "lp_columns": "packed (LP columns)",
                  "max_gpu": "Max GPU (one adapter per job, all GPUs)",
                  "sequential": "sequential (one adapter at a time)"}


def plan_summary(prep: PreparedSweep) -> Table | None:
    """The plan against the baselines and the lower bound (predicted makespans); None for
    a plan no planner made."""
    plan = prep.plan
    if plan.makespan <= 0:
        return None
    t = Table(title=f"predicted makespan on {prep.hardware.describe() if prep.hardware else '?'}", title_justify="left")
    for col in ("schedule", "makespan", "vs plan", "vs lower bound"):
        t.add_column(col, justify="left" if col == "schedule" else "right")
    rows = [(f"plan ({plan.strategy})", plan.makespan)]
    if plan.streamed_makespan > 0:  # what the engine is expected to take, joining queued adapters into running jobs
        rows.append(("plan, streamed", plan.streamed_makespan))
    if plan.strategy != "dtm":
        rows.append(("packed (dtm)", plan.packed_makespan))
    rows += [(BASELINE_NAMES.get(k, k), v) for k, v in plan.baselines.items()]
    rows.append(("lower bound", plan.lower_bound))
    for name, v in rows:
        t.add_row(name, _fmt_time(v), f"{v / plan.makespan:.2f}×", f"{v / plan.lower_bound:.2f}×" if plan.lower_bound else "—")
    t.caption = (f"solver: {plan.solver} · planning {plan.planning_seconds:.1f}s · objective {plan.objective}"
                 + (f" · {'; '.join(plan.notes)}" if plan.notes else ""))
    return t


# --------------------------------------------------------------------------- after a sweep or tune


def results_table(frame: pd.DataFrame, spec: SweepSpec, base: dict, top: int = 10) -> Table:
    """The best configurations by the objective, and the base model's scores below them."""
    from plora.results.collect import ranked

    objective = spec.eval.objective
    best = ranked(frame, objective, spec.eval.minimize).head(top)
    t = Table(title=f"best configurations by {objective}", title_justify="left")
    other = objective not in ("loss", "exact_match")  # another metric ranks: show it too
    dims = [n for n in spec.space.searched() if n in frame.columns]
    per_epoch = sorted((c for c in frame.columns if c.startswith(f"eval_{objective}_epoch")),
                       key=lambda c: int(c.rsplit("epoch", 1)[1]))
    epochs = ["epoch", f"{objective.replace('_', ' ')} by epoch"] if per_epoch and "epoch" in frame.columns else []
    for col in ("adapter", "rank", "alpha", "lr", "batch", *(_DIM_HEADS[n] for n in dims), "eval loss", "exact match",
                *([objective.replace("_", " ")] if other else []), *epochs, "train loss", "time (s)"):
        t.add_column(col, justify="left" if col == "adapter" else "right")

    def num(v, fmt):
        return "—" if v is None or v != v else format(v, fmt)

    def by_epoch(r) -> list[str]:
        """The epoch kept, and the objective of each epoch (the kept one marked)."""
        if not epochs:
            return []
        kept = r.get("epoch")
        kept = int(kept) if kept is not None and kept == kept else None
        shown = [num(r.get(c), ".4g") + ("*" if kept == i else "") for i, c in enumerate(per_epoch, 1)
                 if r.get(c) is not None and r.get(c) == r.get(c)]
        return ["—" if kept is None else str(kept), " · ".join(shown) or "—"]

    for _, r in best.iterrows():
        t.add_row(r.adapter_id, str(r["rank"]), f"{r.alpha:g}", f"{r.learning_rate:.3g}", str(r.batch_size),
                  *(_dim_text(r[n]) for n in dims), num(r.eval_loss, ".4f"), num(r.eval_exact_match, ".3f"),
                  *([num(r.get(f"eval_{objective}"), ".4g")] if other else []), *by_epoch(r),
                  num(r.train_loss, ".4f"), num(r.wall_time_s, ".1f"))
    if base:
        t.add_row("[dim]base model[/]", "", "", "", "", *([""] * len(dims)), num(base.get("eval_loss"), ".4f"),
                  num(base.get("eval_exact_match"), ".3f"),
                  *([num(base.get(f"eval_{objective}"), ".4g")] if other else []), *([""] * len(epochs)), "", "")
    return t


def status_line(frame: pd.DataFrame, seconds: float, results: Path) -> str:
    """Adapters by status, the sweep's wall time and where its results are."""
    counts = frame["status"].value_counts().to_dict()
    return ("status: " + ", ".join(f"{k} {v}" for k, v in sorted(counts.items()))
            + f" — {seconds:.0f} s — results: {results}")


def batch_line(rep: Any, spec: SweepSpec) -> str:
    """One line per tune batch (a `plora.tuning.loop.BatchReport`): trained, reused, pruned,
    the batch's best objective and the best so far, by the objective's name. An asynchronous
    run has no batches: its one report says what the whole run did."""
    objective = f"eval_{spec.eval.objective}"
    values = [t.value for t in rep.trials if t.value is not None and t.state.name == "COMPLETE"]
    line = (f"{len(rep.trials)} trials, {len(rep.trained)} adapters trained in "
            f"{len(rep.jobs)} job{'s' if len(rep.jobs) != 1 else ''}"
            + (f", {len(rep.reused)} reused" if rep.reused else "")
            + (f", {len(rep.pruned)} pruned" if rep.pruned else ""))
    line = f"asynchronous run: {line}" if rep.asynchronous else f"batch {rep.index}: {line}"
    if values and not rep.asynchronous:
        line += f"; batch best {objective} {max(values) if not spec.eval.minimize else min(values):.4g}"
    if rep.best is not None:
        line += f"; best so far {objective} {rep.best.value:.4g} (trial {rep.best.number})"
    return line + f" — {rep.wall_time_s:.0f} s"


#: how a tune's lines name a trial's state
TRIAL_STATES = {"COMPLETE": "complete", "PRUNED": "pruned", "FAIL": "failed", "RUNNING": "running"}


def trial_line(trial: optuna.trial.FrozenTrial, spec: SweepSpec) -> str:
    """One line per trial an asynchronous tune tells: its state, its objective by name (a
    pruned trial: the intermediate objective it was pruned on, scored on the intermediate
    eval rows) and its adapter."""
    from plora.tuning.study import intermediate_name

    a = trial.user_attrs
    state = TRIAL_STATES.get(trial.state.name, trial.state.name.lower())
    if trial.state.name == "PRUNED" and trial.last_step is not None:
        step = trial.last_step  # the per-mille of its budget seen (`plora.tuning.fidelity`)
        state += f", {intermediate_name(spec)} {trial.intermediate_values[step]:.4g} at {step / 10:g}% of its budget"
    elif trial.value is not None:
        state += f", eval_{spec.eval.objective} {trial.value:.4g}"
    return f"trial {trial.number}: {state} ({a.get('adapter_id')}, {a.get('steps')} steps in {a.get('job_id')})"


def trials_table(study: optuna.Study, spec: SweepSpec, top: int = 10, *, batches: bool = True) -> Table:
    """A tune's best finished trials by the objective (with the batch of each, unless the
    tune had none: ``batches`` off for an asynchronous one)."""
    objective = f"eval_{spec.eval.objective}"
    done = [t for t in study.get_trials(deepcopy=False) if t.state.name == "COMPLETE" and t.value is not None]
    done.sort(key=lambda t: t.value, reverse=not spec.eval.minimize)
    t = Table(title=f"best trials by {objective}", title_justify="left")
    dims = spec.space.searched()
    for col in ("trial", "adapter", "rank", "alpha", "lr", "batch", *(_DIM_HEADS[n] for n in dims), objective,
                *(["batch #"] if batches else [])):
        t.add_column(col, justify="left" if col == "adapter" else "right")
    for tr in done[:top]:
        a = tr.user_attrs
        t.add_row(str(tr.number), str(a.get("adapter_id")), str(tr.params.get("rank")), f"{a.get('alpha', 0):g}",
                  f"{tr.params.get('learning_rate', 0):.3g}", str(tr.params.get("batch_size")),
                  *(_dim_text(tr.params.get(n)) for n in dims), f"{tr.value:.4g}",
                  *([str(a.get("batch", ""))] if batches else []))
    return t


def budget_line(budget: Any) -> str:
    """What a tune spent in GPU-seconds (a `plora.tuning.budget.Budget`), against its budget."""
    line = f"GPU time: {budget.describe()}"
    if budget.spent_at is not None:
        line += "; budget spent: " + ("running trials pruned" if budget.on_budget == "stop" else "running trials finished")
    return line


def trials_line(study: optuna.Study, seconds: float, name: str, url: str) -> str:
    """Trials by state, the tune's wall time and where its study is."""
    counts: dict[str, int] = {}
    for tr in study.get_trials(deepcopy=False):
        state = TRIAL_STATES.get(tr.state.name, tr.state.name.lower())
        counts[state] = counts.get(state, 0) + 1
    states = [*TRIAL_STATES.values(), *sorted(set(counts) - set(TRIAL_STATES.values()))]
    return ("trials: " + ", ".join(f"{k} {counts[k]}" for k in states if k in counts)
            + f" — {seconds:.0f} s — study {name!r} in {url}")


# --------------------------------------------------------------------------- a fitted cost model


def cost_model_table(cm: Any) -> Table:
    """A fitted `plora.cost.model.CostModel`'s coefficients, one column per TP degree."""
    extra = set(cm.meta.get("extrapolated_degrees", []))
    t = Table(title=f"cost model of {cm.name} on {cm.meta.get('device', '?')} ({cm.meta.get('dtype', '')})",
              title_justify="left")
    t.add_column("coefficient")
    t.add_column("unit")
    for d in cm.degrees:
        t.add_column(f"TP {d}" + (" (extrap.)" if d in extra else ""), justify="right")
    coeffs = [
        ("step constant", "ms", lambda c, m: c.c0 * 1e3),
        ("per 1k tokens", "ms", lambda c, m: c.c_tok * 1e6),
        ("per rank·1k tokens", "µs", lambda c, m: c.c_rtok * 1e9),
        ("per adapter", "ms", lambda c, m: c.c_ad * 1e3),
        ("per rank bucket", "ms", lambda c, m: c.c_bkt * 1e3),
        ("memory base", "GiB", lambda c, m: m.base / 2**30),
        ("per adapter", "MiB", lambda c, m: m.adapter / 2**20),
        ("per rank", "MiB", lambda c, m: m.rank / 2**20),
        ("per token", "KiB", lambda c, m: m.tok / 2**10),
        ("per rank·token", "B", lambda c, m: m.rank_tok),
    ]
    for label, unit, f in coeffs:
        t.add_row(label, unit, *(f"{f(cm.time[d], cm.memory_coeffs[d]):.4g}" for d in cm.degrees))
    if cm.host_time:  # the step is the longer of the GPU piece above and the host's
        for label, unit, f in (("host: step constant", "ms", lambda c: c.c0 * 1e3),
                               ("host: per adapter", "ms", lambda c: c.c_ad * 1e3),
                               ("host: per rank bucket", "ms", lambda c: c.c_bkt * 1e3)):
            t.add_row(label, unit, *(f"{f(cm.host_time[d]):.4g}" if d in cm.host_time else "—" for d in cm.degrees))
    return t


def holdout_table(prof: Profile) -> Table:
    """The profile's held-out packs: measured against predicted step time and peak memory."""
    v = Table(title="held-out packs (not used in the fit)", title_justify="left")
    for col in ("pack", "K", "rows", "step ms", "pred.", "err", "peak GiB", "pred.", "err", "fits"):
        v.add_column(col, justify="left" if col == "pack" else "right")

    def pct(x):
        return "—" if x is None else f"{100 * x:+.1f}%"

    for r, m in zip(prof.errors(), prof.holdout):
        v.add_row(r["probe"], str(m.probe.adapters), str(m.probe.rows),
                  "OOM" if r["oom"] else ("—" if r["measured_s"] is None else f"{r['measured_s'] * 1e3:.1f}"),
                  f"{r['predicted_s'] * 1e3:.1f}", pct(r["time_err"]),
                  "—" if r["measured_bytes"] is None else f"{r['measured_bytes'] / 2**30:.2f}",
                  f"{r['predicted_bytes'] / 2**30:.2f}", pct(r["memory_err"]), "yes" if r["fits"] else "no")
    return v


def holdout_line(prof: Profile) -> str:
    """The profile's largest held-out errors and the packs predicted to fit that did not."""
    s = prof.summary()

    def mx(x):
        return "—" if x is None else f"{100 * x:.1f}%"

    return (f"held-out error: step time max {mx(s['time_max_abs_err'])}, peak memory max "
            f"{mx(s['memory_max_abs_err'])}; predicted fits that ran out of memory: {s['predicted_fit_oom']}")
