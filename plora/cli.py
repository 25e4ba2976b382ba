"""The `plora` command. Thin: parse, call the library, render with rich."""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Optional

import typer
from rich.markup import escape
from rich.table import Table

from plora.live import PlainWidthConsole

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    help="Packed LoRA hyperparameter sweeps: many adapters per job on one shared base model.",
)
console = PlainWidthConsole()
err = PlainWidthConsole(stderr=True)

EXIT_USAGE = 2


def _print_version(value: bool) -> None:
    """Runs while the options are parsed, so `plora --version` needs no command."""
    if value:
        from plora import __version__

        console.print(f"plora {__version__}", highlight=False)
        raise typer.Exit(0)


@app.callback()
def _root(
    version: bool = typer.Option(False, "--version", help="Print the version and exit.", is_eager=True,
                                 callback=_print_version, expose_value=False),
) -> None:
    """plora: packed LoRA hyperparameter sweeps."""


def fail(message: str, code: int = EXIT_USAGE) -> None:
    """One line on stderr and an exit code; never a traceback for a user's mistake."""
    err.print(f"[bold red]error:[/] {escape(message)}", highlight=False, soft_wrap=True)
    raise typer.Exit(code)


def _load(space: Path, *, sampled: bool = False):
    from plora.model_check import check_spec_model
    from plora.spec import SpecError, load_spec

    try:
        spec = load_spec(space, sampled=sampled)
        check_spec_model(spec)  # config, tokenizer, weights: refused before anything runs
        return spec
    except SpecError as e:
        fail(str(e))


def _interrupted(what: str) -> None:
    """Ctrl-C: say what was kept, on a line of its own after everything printed so far."""
    console.file.flush()
    err.print(f"[yellow]interrupted: {what}[/]", highlight=False, soft_wrap=True)
    raise typer.Exit(130)


def _check_output(run_dir: Path) -> None:
    """The run directory must be writable before anything runs."""
    from plora.preflight import OutputDirError, check_output_dir

    try:
        check_output_dir(run_dir)
    except OutputDirError as e:
        fail(str(e))


def _note_hardware(spec, hw) -> None:
    from plora.preflight import hardware_note

    note = hardware_note(spec, hw)
    if note:
        err.print(f"[yellow]note:[/] {escape(note)}", highlight=False, soft_wrap=True)


def _prepare(space: Path, output: Optional[Path], *, probe: bool = False):
    """Expand and plan; with `probe`, profile the model first on a GPU that has no profile."""
    from plora.data import DataError
    from plora.models import ModelError
    from plora.planner import PlannerError
    from plora.sweep import hardware_for, prepare

    spec = _load(space)
    _check_output(spec.run_dir(output))
    try:
        hw = hardware_for(spec)
        _note_hardware(spec, hw)
        if probe and hw.gpu:
            console.print("[dim]planning needs a cost model: profiling the model if this machine has no profile "
                          "of it yet (a few real training steps; cached)…[/]")
        prep = prepare(spec, output, probe=probe and hw.gpu, hardware=hw)
    except (DataError, ModelError, PlannerError, ValueError) as e:
        fail(str(e).splitlines()[0] if str(e) else type(e).__name__)
    for note in prep.data.notes if prep.data else []:
        console.print(f"[yellow]data:[/] {note}", highlight=False, soft_wrap=True)
    return prep


def _configs_table(prep) -> Table:
    t = Table(title=f"{len(prep.configs)} configurations", title_justify="left")
    for col in ("adapter", "rank", "alpha", "lr", "batch", "seed", "steps", "job"):
        t.add_column(col, justify="right" if col not in ("adapter", "job") else "left")
    job_of = {a.id: j.job_id for j in prep.plan.jobs for a in j.adapters}
    for c in prep.configs:
        t.add_row(c.id, str(c.rank), f"{c.alpha:g}", f"{c.learning_rate:.3g}", str(c.batch_size), str(c.seed),
                  str(prep.steps[c.id]), job_of[c.id])
    return t


def _fmt_time(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f}s"
    if seconds < 7200:
        return f"{seconds / 60:.1f}m"
    return f"{seconds / 3600:.2f}h"


def _jobs_table(prep) -> Table:
    """The job queue: adapters, TP degree, GPUs, predicted start and end."""
    t = Table(title=f"{len(prep.plan.jobs)} jobs — {prep.plan.grouping}", title_justify="left")
    for col in ("job", "adapters", "TP", "GPUs", "start", "end", "steps (max)", "ranks"):
        t.add_column(col, justify="left" if col in ("job", "ranks") else "right")
    for j in prep.plan.jobs:
        gpus = ",".join(map(str, j.gpus)) if j.gpus else "—"
        start = "—" if j.predicted_start is None else _fmt_time(j.predicted_start)
        end = "—" if j.predicted_end is None else _fmt_time(j.predicted_end)
        ranks = ",".join(str(a.rank) for a in j.adapters)
        t.add_row(j.job_id, str(len(j.adapters)), str(j.tp), gpus if (prep.hardware and prep.hardware.gpu) else "—",
                  start, end, str(max(j.steps.values())), ranks if len(ranks) < 40 else ranks[:37] + "…")
    return t


def _plan_summary(prep) -> Optional[Table]:
    """The plan against the baselines and the lower bound (predicted makespans)."""
    plan = prep.plan.planned
    if plan is None:
        return None
    t = Table(title=f"predicted makespan on {prep.hardware.describe() if prep.hardware else '?'}", title_justify="left")
    for col in ("schedule", "makespan", "vs plan", "vs lower bound"):
        t.add_column(col, justify="left" if col == "schedule" else "right")
    rows = [(f"plan ({plan.strategy})", plan.makespan)]
    if plan.strategy != "dtm":
        rows.append(("packed (dtm)", plan.packed_makespan))
    names = {"min_gpu": "Min GPU (one adapter per job, smallest TP)", "lp_columns": "packed (LP columns)", "max_gpu": "Max GPU (one adapter per job, all GPUs)",
             "sequential": "sequential (one adapter at a time)"}
    rows += [(names.get(k, k), v) for k, v in plan.baselines.items()]
    rows.append(("lower bound", plan.lower_bound))
    for name, v in rows:
        t.add_row(name, _fmt_time(v), f"{v / plan.makespan:.2f}×", f"{v / plan.lower_bound:.2f}×" if plan.lower_bound else "—")
    t.caption = (f"solver: {plan.solver} · planning {plan.planning_seconds:.1f}s · objective {plan.objective}"
                 + (f" · {'; '.join(plan.notes)}" if plan.notes else ""))
    return t


def _results_table(frame, spec, base: dict, top: int = 10) -> Table:
    from plora.sweep import ranked

    objective = spec.eval.objective
    best = ranked(frame, objective, spec.eval.minimize).head(top)
    t = Table(title=f"best configurations by {objective}", title_justify="left")
    other = objective not in ("loss", "exact_match")  # another metric ranks: show it too
    for col in ("adapter", "rank", "alpha", "lr", "batch", "eval loss", "exact match",
                *([objective.replace("_", " ")] if other else []), "train loss", "time (s)"):
        t.add_column(col, justify="left" if col == "adapter" else "right")

    def num(v, fmt):
        return "—" if v is None or v != v else format(v, fmt)

    for _, r in best.iterrows():
        t.add_row(r.adapter_id, str(r["rank"]), f"{r.alpha:g}", f"{r.learning_rate:.3g}", str(r.batch_size),
                  num(r.eval_loss, ".4f"), num(r.eval_exact_match, ".3f"),
                  *([num(r.get(f"eval_{objective}"), ".4g")] if other else []), num(r.train_loss, ".4f"),
                  num(r.wall_time_s, ".1f"))
    if base:
        t.add_row("[dim]base model[/]", "", "", "", "", num(base.get("eval_loss"), ".4f"),
                  num(base.get("eval_exact_match"), ".3f"),
                  *([num(base.get(f"eval_{objective}"), ".4g")] if other else []), "", "")
    return t


@app.command()
def sweep(
    space: Path = typer.Argument(..., help="The space file (YAML)."),
    output: Optional[Path] = typer.Option(None, "--output", "-o", help="Run directory (default: <output.dir>/<name>)."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Print the configurations and jobs; train nothing."),
    restart: bool = typer.Option(False, "--restart", help="Delete the run directory first and start over."),
    no_profile: bool = typer.Option(False, "--no-profile",
                                    help="Plan with a cached profile or the analytic model; never profile first."),
) -> None:
    """Train every configuration of SPACE as packed LoRA adapters and collect the results."""
    prep = _prepare(space, output, probe=not (dry_run or no_profile))
    if dry_run:
        console.print(_configs_table(prep))
        console.print(_jobs_table(prep))
        summary = _plan_summary(prep)
        if summary is not None:
            console.print(summary)
        console.print(f"[dim]dry run: nothing trained, nothing written (run directory would be {prep.run_dir})[/]")
        return

    from plora.engine.backends import BackendError
    from plora.sweep import base_metrics, run_prepared, write_run_files

    write_run_files(prep, restart=restart)
    console.print(f"[bold]plora[/] sweep [cyan]{prep.spec.name}[/]: {len(prep.configs)} adapters in "
                  f"{len(prep.plan.jobs)} jobs → {prep.run_dir}")
    console.print(f"[dim]{prep.plan.grouping}[/]")
    from plora.live import progress

    start = time.time()
    try:
        with progress(console, lambda snap: len(prep.configs)) as on_snapshot:
            frame = run_prepared(prep, on_snapshot=on_snapshot)
    except BackendError as e:  # Ray missing or unreachable, a node that cannot write the run directory
        fail(str(e))
    except KeyboardInterrupt:
        _interrupted("running jobs stopped; finished adapters are kept. Run the same command again to resume.")
    console.print()
    console.print(_results_table(frame, prep.spec, base_metrics(prep.run_dir)))
    counts = frame["status"].value_counts().to_dict()
    console.print("status: " + ", ".join(f"{k} {v}" for k, v in sorted(counts.items()))
                  + f" — {time.time() - start:.0f} s — results: {prep.run_dir / 'results.parquet'}")
    failed = frame[frame["status"] == "failed"]
    if len(failed):
        for _, r in failed.iterrows():
            err.print(f"[red]failed[/] {r.adapter_id}: {escape(str(r.reason))}", highlight=False)
        raise typer.Exit(1)


@app.command()
def tune(
    space: Path = typer.Argument(..., help="The space file (YAML)."),
    sampler: str = typer.Option("tpe", "--sampler", help="Optuna sampler: tpe, random, grid, cmaes, gp, qmc, nsgaii, bruteforce."),
    trials: Optional[int] = typer.Option(None, "--trials", "-n", help="Trials to run (default: the space's number of configurations)."),
    batch: Optional[int] = typer.Option(None, "--batch", "-k", help="Trials trained packed together per batch (default: max_adapters_per_job × slots)."),
    pruner: Optional[str] = typer.Option(None, "--pruner", help="Optuna pruner: median, percentile, successive-halving, hyperband, wilcoxon (needs eval.every_steps)."),
    seed: Optional[int] = typer.Option(None, "--seed", help="Sampler seed (default: space.seed)."),
    output: Optional[Path] = typer.Option(None, "--output", "-o", help="Run directory (default: <output.dir>/<name>)."),
) -> None:
    """Search SPACE with an Optuna sampler: ask a batch of trials, train them packed, tell the results, repeat."""
    from plora.data import DataError
    from plora.models import ModelError
    from plora.tuning.loop import check_tune_request, run_tune
    from plora.tuning.study import storage_url, study_name

    spec = _load(space, sampled=True)
    run_dir = spec.run_dir(output)
    _check_output(run_dir)
    try:
        check_tune_request(spec, sampler=sampler, trials=trials, batch=batch, pruner=pruner)
    except ValueError as e:
        fail(str(e))
    from plora.sweep import hardware_for

    try:
        _note_hardware(spec, hardware_for(spec))
    except ValueError as e:
        fail(str(e))
    console.print(f"[bold]plora[/] tune [cyan]{spec.name}[/] with the {sampler} sampler → {run_dir}")
    start = time.time()
    failed: list[str] = []

    def on_batch(rep) -> None:
        values = [t.value for t in rep.trials if t.value is not None and t.state.name == "COMPLETE"]
        line = (f"batch {rep.index}: {len(rep.trials)} trials, {len(rep.trained)} adapters trained in "
                f"{len(rep.jobs)} job{'s' if len(rep.jobs) != 1 else ''}"
                + (f", {len(rep.reused)} reused" if rep.reused else "")
                + (f", {len(rep.pruned)} pruned" if rep.pruned else ""))
        if values:
            line += f"; batch best {max(values) if not spec.eval.minimize else min(values):.4g}"
        if rep.best is not None:
            line += f"; best so far {rep.best.value:.4g} (trial {rep.best.number})"
        console.print(line + f" — {rep.wall_time_s:.0f} s")
        failed.extend(f"trial {t.number} ({t.user_attrs.get('adapter_id')}): {t.user_attrs.get('reason') or 'failed'}"
                      for t in rep.trials if t.user_attrs.get("status") == "failed")

    from plora.live import progress

    try:
        with progress(console, lambda snap: sum(snap.adapter_status.values()), transient=True) as on_snapshot:
            import optuna

            optuna.logging.set_verbosity(optuna.logging.WARNING)
            study = run_tune(spec, sampler=sampler, trials=trials, batch=batch, pruner=pruner, run_dir=output,
                             seed=seed, on_batch=on_batch, on_snapshot=on_snapshot)
    except (DataError, ModelError, ValueError) as e:
        fail(str(e))
    except KeyboardInterrupt:
        _interrupted("running jobs stopped; finished trials are kept in the study.")

    done = [t for t in study.get_trials(deepcopy=False) if t.state.name == "COMPLETE" and t.value is not None]
    done.sort(key=lambda t: t.value, reverse=not spec.eval.minimize)
    t = Table(title=f"best trials by eval_{spec.eval.objective}", title_justify="left")
    for col in ("trial", "adapter", "rank", "alpha", "lr", "batch", "value", "batch #"):
        t.add_column(col, justify="left" if col == "adapter" else "right")
    for tr in done[:10]:
        a = tr.user_attrs
        t.add_row(str(tr.number), str(a.get("adapter_id")), str(tr.params.get("rank")), f"{a.get('alpha', 0):g}",
                  f"{tr.params.get('learning_rate', 0):.3g}", str(tr.params.get("batch_size")), f"{tr.value:.4g}",
                  str(a.get("batch", "")))
    console.print(t)
    counts: dict[str, int] = {}
    for tr in study.get_trials(deepcopy=False):
        counts[tr.state.name] = counts.get(tr.state.name, 0) + 1
    url = storage_url(spec, output)
    console.print("trials: " + ", ".join(f"{k} {v}" for k, v in sorted(counts.items()))
                  + f" — {time.time() - start:.0f} s — study {study_name(spec)!r} in {url}")
    console.print(f"[dim]dashboard: optuna-dashboard {url} · report: plora report {run_dir}[/]")
    if failed:
        for line in failed:
            err.print(f"[red]failed[/] {escape(line)}", highlight=False)
        raise typer.Exit(1)


@app.command()
def report(
    run: Path = typer.Argument(..., help="A run directory (<output.dir>/<name>), or its space file."),
    output: Optional[Path] = typer.Option(None, "--output", "-o", help="HTML file (default: RUN/report.html)."),
) -> None:
    """Execute the report notebook on RUN and write report.html (tables and plots)."""
    from plora.report import ReportError, render_report

    if run.is_file() and run.suffix in (".yaml", ".yml"):
        run = _load(run, sampled=True).run_dir()
    with console.status("executing the report notebook"):
        try:
            path = render_report(run, output)
        except ReportError as e:
            fail(str(e))
    console.print(f"report: {path}")


@app.command()
def plan(
    space: Path = typer.Argument(..., help="The space file (YAML)."),
    output: Optional[Path] = typer.Option(None, "--output", "-o", help="Run directory (default: <output.dir>/<name>)."),
    profile: Optional[Path] = typer.Option(None, "--profile", help="A profile.json to plan with (default: the run's, a cached one, or the analytic prior)."),
    here: bool = typer.Option(False, "--here", help="Plan for this machine's GPUs/cores instead of the space file's hardware."),
) -> None:
    """Plan SPACE: which adapters train together, at which TP degree, on which GPUs, when.

    Prints the job queue and the predicted makespan against the baselines; writes plan.json.
    """
    from plora.sweep import hardware_for, prepare, write_plan

    spec = _load(space)
    _check_output(spec.run_dir(output))
    cm = None
    if profile is not None:
        from plora.costmodel import CostModel

        try:
            cm = CostModel.load(profile)
        except (OSError, ValueError, KeyError) as e:
            fail(f"--profile: cannot read {profile}: {e}")
        cm.meta["plan_source"] = f"the profile {profile}"
    try:
        hw = hardware_for(spec, here=here)
        _note_hardware(spec, hw)
        prep = prepare(spec, output, hardware=hw, cost_model=cm)
    except Exception as e:  # noqa: BLE001 - planner, data and model errors are the user's to fix
        from plora.planner import PlannerError

        if isinstance(e, (PlannerError, ValueError)):
            fail(str(e).splitlines()[0])
        raise
    console.print(_jobs_table(prep))
    summary = _plan_summary(prep)
    if summary is not None:
        console.print(summary)
    path = write_plan(prep)
    console.print(f"[dim]wrote {path}[/]")


@app.command()
def status(run: Path = typer.Argument(..., help="A run directory (runs/<name>).")) -> None:
    """Where a sweep stands: adapters by state and every job, from the run's journal."""
    from plora.live import status_tables

    if not (run / "journal.sqlite").is_file():
        fail(f"{run}: not a run directory (no journal.sqlite)")
    for part in status_tables(run):
        console.print(part)


@app.command()
def profile(
    space: Path = typer.Argument(..., help="The space file (YAML)."),
    output: Optional[Path] = typer.Option(None, "--output", "-o", help="Run directory (default: <output.dir>/<name>)."),
    force: bool = typer.Option(False, "--force", help="Probe again even when a cached profile matches."),
) -> None:
    """Fit SPACE's memory and step-time model from short probe jobs on this machine; print it and its held-out error."""
    from plora.models import ModelError
    from plora.profiling.errors import ProfileError
    from plora.profiling.profile import profile_sweep
    from plora.profiling.record import load_profile

    spec = _load(space)
    run_dir = spec.run_dir(output)
    _check_output(run_dir)
    with console.status("profiling") as st:
        try:
            profile_sweep(spec, run_dir, force=force, log=lambda line: st.update(line.strip()))
        except (ModelError, ProfileError, ValueError) as e:
            fail(str(e))
    prof = load_profile(run_dir / "profile.json")
    cm = prof.cost_model
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
    console.print(t)
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
    console.print(v)
    s = prof.summary()
    source = f"reused the cached profile {prof.cache_path}" if prof.reused else f"cached as {prof.cache_path}"
    def mx(x):
        return "—" if x is None else f"{100 * x:.1f}%"

    console.print(f"held-out error: step time max {mx(s['time_max_abs_err'])}, peak memory max "
                  f"{mx(s['memory_max_abs_err'])}; predicted fits that ran out of memory: {s['predicted_fit_oom']}")
    console.print(f"[dim]{run_dir / 'profile.json'} — {source}[/]")


if __name__ == "__main__":  # pragma: no cover
    sys.exit(app())
