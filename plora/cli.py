"""The `plora` command. Thin: parse, call the library, print what `plora.views` renders,
choose the exit code."""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Optional

if __name__ == "__main__":  # ``python -m plora.cli``: as `plora.command` does, before the imports below
    from plora.bytecode_ahead import set_up

    set_up()

import typer  # noqa: E402
from rich.markup import escape  # noqa: E402

from plora import views  # noqa: E402
from plora.views import PlainWidthConsole  # noqa: E402

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    help="Packed LoRA hyperparameter sweeps: many adapters per job on one shared base model.",
)
console = PlainWidthConsole()
err = PlainWidthConsole(stderr=True)

EXIT_USAGE = 2
_IMPORTED_AT = time.time()
#: moments of this command's start before its plan (`write_timings`)
_MOMENTS: dict[str, float] = {}
#: a model check still running (`_load` with ``check_later``)
_PENDING_CHECK: list = []
#: processes converting a GGUF file's weights while the sweep plans (`_load`)
_AHEAD: list = []


def _check_in_spare(folder: Path, family: str, random_init: bool, max_seq_len: int) -> Optional[str]:
    """The model check's slow part asked of the first job's process started ahead, which
    imports torchtune anyway (`plora.models.check.start_spec_model_check`)."""
    from plora.engine import spare

    answer = spare.check_model(spare.CheckOrder(check=str(folder), family=family, random_init=random_init,
                                                max_seq_len=max_seq_len))
    if answer is None or answer.failed:
        return None
    return "" if answer.ok else (answer.error or "the model check failed")


def _model_checked() -> None:
    """Wait for the model check `_load` left running; its problem is the usual one-line error.
    Called before anything measures on the GPU, is written or launched (again: a no-op)."""
    from plora.spec.base import SpecError

    while _PENDING_CHECK:
        wait = _PENDING_CHECK.pop()
        try:
            wait()
        except SpecError as e:
            _PENDING_CHECK.clear()
            fail(str(e))
        _MOMENTS["weights_checked_at"] = time.time()


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


def write_timings(run_dir: Path, **moments: float) -> None:
    """timings.json: where the wait of this command went (seconds since the process started:
    imported, space loaded, model checked, planning begun, configurations expanded, data
    checked, rows decided, cost model ready, jobs planned, planned (with the run's notes),
    engine started, engine ended with the results written). A file to look at, never needed
    to resume."""
    import json

    from plora.job.phases import process_started_at

    origin = process_started_at() or _IMPORTED_AT
    row = {"process_started_at": origin, **{k.removesuffix("_at") + "_s": round(v - origin, 3)
                                             for k, v in moments.items()}}
    try:
        (Path(run_dir) / "timings.json").write_text(json.dumps(row, indent=2) + "\n")
    except OSError:
        pass


def fail(message: str, code: int = EXIT_USAGE) -> None:
    """One line on stderr and an exit code; never a traceback for a user's mistake."""
    err.print(f"[bold red]error:[/] {escape(message)}", highlight=False, soft_wrap=True)
    raise typer.Exit(code)


#: the space file's values changed on the command line (`plora.spec.overrides`)
OVERRIDES_HELP = "Overrides of the space file's values, KEY=VALUE (a dotted field, a YAML value): training.epochs=2 space.rank=[8,16]."


def _overrides() -> Optional[list[str]]:
    return typer.Argument(None, metavar="KEY=VALUE", help=OVERRIDES_HELP, show_default=False)


def _load(space: Path, *, sampled: bool = False, warm: bool = False, overrides: Optional[list[str]] = None,
          check_later: bool = False, kernels_ahead: bool = False):
    """The space (with its command-line `overrides`), its model checked. With `warm`, the
    first job's process starts importing as soon as the space says where it runs
    (`plora.engine.spare`), before this process imports torch for the model check: on an
    H100 machine a job's imports take 12 s, which the sweep's validation and planning hide
    only if they start first. With `check_later`, the model check's slow part (the model
    built on meta) runs on while the caller plans; `_model_checked` waits for it. With
    `kernels_ahead` (and `warm`), a process starts importing that will compile the first
    job's kernels while the caller plans (`plora.engine.kernel_warmer`). The GPUs the plan
    needs are asked of the driver meanwhile (`plora.gpu_facts.look_ahead`)."""
    from plora.gpu_facts import look_ahead

    look_ahead()
    from plora.engine import spare
    from plora.spec.base import SpecError
    from plora.spec.loading import load_spec

    try:
        spec = load_spec(space, sampled=sampled, overrides=overrides or ())
        _MOMENTS["spec_loaded_at"] = time.time()
        if warm and spec.hardware.backend == "local":
            from plora.models.gguf import convert_weights_ahead

            # a GGUF file's weights dequantized in a process of their own while this one reads its
            # config and tokenizer and plans; the model check and the first job's model wait for
            # them (`ensure_weights`), so it starts first (nothing to start for any other model)
            _AHEAD.append(convert_weights_ahead(spec.model.path, spec.model.dtype, preexec_fn=spare.die_with_parent))
            for gpus in spare.first_wave(spec.hardware.device, spec.hardware.gpus):
                spare.prime(gpus, gpu_idle=True)
            if kernels_ahead:
                from plora.engine import kernel_warmer

                kernel_warmer.start(spec.hardware.device)  # told what to compile once the rows are decided
        from plora.models.check import check_spec_model, start_spec_model_check

        if check_later:  # config, tokenizer now; the weights in the first job's process, or meanwhile
            elsewhere = _check_in_spare if warm and spare.enabled() and spec.hardware.backend == "local" else None
            _PENDING_CHECK.append(start_spec_model_check(spec, elsewhere))
        else:
            check_spec_model(spec)  # config, tokenizer, weights: refused before anything runs
        _MOMENTS["model_checked_at"] = time.time()
        return spec
    except SpecError as e:
        spare.discard()
        from plora.engine import kernel_warmer

        kernel_warmer.discard()
        fail(str(e))


def _interrupted(what: str) -> None:
    """Ctrl-C: say what was kept, on a line of its own after everything printed so far."""
    console.file.flush()
    err.print(f"[yellow]interrupted: {what}[/]", highlight=False, soft_wrap=True)
    raise typer.Exit(130)


def _check_output(run_dir: Path) -> None:
    """The run directory must be writable before anything runs."""
    from plora.engine.preflight import OutputDirError, check_output_dir

    try:
        check_output_dir(run_dir)
    except OutputDirError as e:
        fail(str(e))


def _check_resumable(spec, output: Optional[Path]) -> None:
    """A run directory holds one space: another one's sweep is refused, before profiling or
    planning, with what differs and what to do."""
    from plora.engine.preflight import RunDirError, check_resumable

    try:
        check_resumable(spec.run_dir(output), spec, (c.id for c in spec.expand()))
    except RunDirError as e:
        fail(f"{e}; start over there with --restart, or choose another run directory with -o")


def _note_hardware(spec, hw) -> None:
    from plora.engine.preflight import hardware_note

    note = hardware_note(spec, hw)
    if note:
        err.print(f"[yellow]note:[/] {escape(note)}", highlight=False, soft_wrap=True)


def _prepare(space: Path, output: Optional[Path], *, probe: bool = False, warm: bool = False, fresh: bool = False,
             overrides: Optional[list[str]] = None):
    """Expand and plan; with `probe`, a GPU with nothing measured of the model may first
    measure two short packs (`plora.sweep.prepare`).
    With `warm`, the first job's process starts importing meanwhile (`plora.engine.spare`).
    Unless `fresh` (the run directory is started over), one that holds a sweep of another
    space is refused first."""
    from plora.engine import spare

    spec = _load(space, warm=warm, overrides=overrides, check_later=True,  # the first job's process imports meanwhile
                 kernels_ahead=warm)
    warm = warm and spec.hardware.backend == "local"
    from plora.engine import kernel_warmer

    try:
        _check_output(spec.run_dir(output))
        if not fresh:
            _check_resumable(spec, output)
        first_model = _FirstModel(spec, warm)
        first_model.send_early(output, probe=probe, fresh=fresh)  # on a thread, beside the data check
        prep = _plan(spec, output, probe=probe, fresh=fresh, on_cost_model=first_model.send)
        _model_checked()  # before anything is written or launched
    except BaseException:
        _PENDING_CHECK.clear()  # a check of this space never reaches another command of this process
        spare.discard()
        kernel_warmer.discard()
        raise
    if warm:  # (a profile's probe job may have taken the first one)
        wanted = [spare.first_gpus(spec.hardware.device)]
        if prep.hardware is not None and prep.hardware.gpu:  # the other one-GPU jobs that start at once
            wanted += [j.gpus for j in prep.plan.jobs if j.tp == 1 and j.start <= 0 and j.gpus]
        spare.keep_only(wanted)  # those started before planning for a GPU no job starts on go
        first_model.send()  # (where the cost model's moment did not: a plan that needed no cost model)
    return prep


class _FirstModel:
    """The sweep's base model, sent once to the first job's process to load ahead
    (`plora.engine.spare.preload`): at once where planning is sure to measure nothing on the
    GPU (`send_early`: a profile or calibration of the model is at hand), else as soon as the
    cost model is decided (`send`), so that a quick calibration's probes never share the GPU
    with it. On an H100 machine a warm sweep's first job waited 3.7 s for the load when it
    was sent after planning."""

    def __init__(self, spec, enabled: bool) -> None:
        import threading

        self.spec, self.enabled, self.sent = spec, enabled, False
        self._lock = threading.Lock()

    def send(self) -> None:
        from plora.engine import spare

        with self._lock:
            if not self.enabled or self.sent:
                return
            self.sent = True
            m = self.spec.model
            spare.preload(spare.PreloadOrder(path=str(m.resolved_path()), family=m.family, max_seq_len=m.max_seq_len,
                                             dtype=m.dtype, device=self.spec.hardware.device,
                                             random_init=m.random_init))

    def send_early(self, output: Optional[Path], *, probe: bool, fresh: bool) -> None:
        """`send` now, on a thread beside the data check (the GPU's name, `plora.gpu_facts`,
        finds what was measured of the model), where nothing can be measured before the plan
        (`plora.sweep.may_measure_before_planning`)."""
        import threading

        if not self.enabled:
            return

        def run() -> None:
            from plora.hardware import hardware_for
            from plora.sweep import may_measure_before_planning

            try:
                hw = hardware_for(self.spec)
                run_dir = None if fresh else self.spec.run_dir(output)
                if may_measure_before_planning(self.spec, run_dir, hw, probe=probe and hw.gpu):
                    return
            except Exception:  # noqa: BLE001 - planning says what is wrong; the model is sent after it
                return
            self.send()

        threading.Thread(target=run, name="plora-first-model", daemon=True).start()


def _warm_kernels(spec, configs, rows, hw) -> None:
    """The first job's likely kernels (its steps', its optimizer's and its evals'), compiled
    while this process plans (where a process was started for them: `plora.engine.kernel_warmer`)."""
    from plora.engine import kernel_warmer

    if not kernel_warmer.running():
        return
    if not hw.gpu or not hw.local:
        kernel_warmer.discard()
        return
    from plora.cost.sweep_model import graphed_steps
    from plora.cost.sweep_rows import eval_load_of

    data, evals = rows.data, None
    try:  # a guess: what it cannot say, the first job compiles itself
        if data is not None and data.num_eval and data.eval_row_tokens:
            evals = eval_load_of(spec, data.num_eval, data.eval_row_tokens, data.eval_prompt_tokens, gpu=True)
    except Exception:  # noqa: BLE001 - nothing here may stop a sweep
        evals = None
    if kernel_warmer.order_for_sweep(spec, configs, layout=rows.layout, lengths=rows.lengths,
                                     length_buckets=rows.length_buckets, graphed=graphed_steps(spec, hw),
                                     eval_load=evals):
        _spare_kernels(kernel_warmer.told())


def _spare_kernels(told) -> None:
    """The first job's process started ahead loads the kernels the warming process was told
    to compile, once they are compiled (`plora.engine.spare.KernelsOrder`): its first step
    then loads none of them in its capture (0.13-0.3 s of a warm 0.5B sweep on an H200)."""
    from plora.engine import spare

    if told is None:
        return
    order, log, offset = told
    spare.kernels_ahead(spare.KernelsOrder(order=order, warmer_log=str(log), warmer_offset=offset))


def _plan(spec, output: Optional[Path], *, probe: bool, fresh: bool = False, on_cost_model=None):
    from plora.data.dataset import DataError
    from plora.models.folders import ModelError
    from plora.planner import PlannerError
    from plora.sweep import prepare

    try:
        prep = prepare(spec, output, probe=probe, fresh=fresh,
                       check_model=_model_checked if _PENDING_CHECK else True, on_rows=_warm_kernels,
                       on_cost_model=on_cost_model,
                       log=lambda line: console.print(f"[dim]{escape(line)}[/]", highlight=False))
    except (DataError, ModelError, PlannerError, ValueError) as e:
        fail(str(e).splitlines()[0] if str(e) else type(e).__name__)
    if prep.hardware is not None:
        _note_hardware(spec, prep.hardware)
    for note in prep.data.notes if prep.data else []:
        console.print(f"[yellow]data:[/] {note}", highlight=False, soft_wrap=True)
    from plora.sweep import memory_notes

    for note in memory_notes(spec, prep):
        console.print(f"[yellow]memory:[/] {note}", highlight=False, soft_wrap=True)
    return prep


@app.command()
def sweep(
    space: Path = typer.Argument(..., help="The space file (YAML)."),
    overrides: Optional[list[str]] = _overrides(),
    output: Optional[Path] = typer.Option(None, "--output", "-o", help="Run directory (default: <output.dir>/<name>)."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Print the configurations and jobs; train nothing."),
    restart: bool = typer.Option(False, "--restart", help="Delete the run directory first and start over."),
    no_profile: bool = typer.Option(False, "--no-profile",
                                    help="Plan with a cached profile or calibration, or the analytic model with its "
                                         "safe memory margin; never measure before the first job."),
) -> None:
    """Train every configuration of SPACE as packed LoRA adapters and collect the results."""
    prep = _prepare(space, output, probe=not (dry_run or no_profile), warm=not dry_run, fresh=restart,
                    overrides=overrides)
    planned_at = time.time()
    if dry_run:
        console.print(views.configs_table(prep))
        console.print(views.jobs_table(prep))
        summary = views.plan_summary(prep)
        if summary is not None:
            console.print(summary)
        console.print(f"[dim]dry run: nothing trained, nothing written (run directory would be {prep.run_dir})[/]")
        return

    from plora.engine import spare
    from plora.engine.backends import BackendError
    from plora.results.collect import base_metrics
    from plora.sweep import run_prepared, write_run_files

    start = time.time()
    try:
        write_run_files(prep, restart=restart)
        console.print(f"[bold]plora[/] sweep [cyan]{prep.spec.name}[/]: {len(prep.configs)} adapters in "
                      f"{len(prep.plan.jobs)} jobs → {prep.run_dir}")
        console.print(f"[dim]{prep.plan.grouping}[/]")
        start = time.time()
        with views.progress(console, lambda snap: len(prep.configs)) as on_snapshot:
            frame = run_prepared(prep, on_snapshot=on_snapshot)
    except BackendError as e:  # Ray missing or unreachable, a node that cannot write the run directory
        fail(str(e))
    except KeyboardInterrupt:
        _interrupted("running jobs stopped; finished adapters are kept. Run the same command again to resume.")
    finally:
        spare.discard()  # a job process started ahead that no job took
    console.print()
    console.print(views.results_table(frame, prep.spec, base_metrics(prep.run_dir)))
    console.print(views.status_line(frame, time.time() - start, prep.run_dir / "results.parquet"))
    write_timings(prep.run_dir, imported_at=_IMPORTED_AT, **_MOMENTS, **prep.moments, planned_at=planned_at,
                  started_at=start, ended_at=time.time())
    failed = frame[frame["status"] == "failed"]
    if len(failed):
        for _, r in failed.iterrows():
            err.print(f"[red]failed[/] {r.adapter_id}: {escape(str(r.reason))}", highlight=False)
        raise typer.Exit(1)


@app.command()
def tune(
    space: Path = typer.Argument(..., help="The space file (YAML)."),
    overrides: Optional[list[str]] = _overrides(),
    sampler: str = typer.Option("tpe", "--sampler", help="Optuna sampler: tpe, random, grid, cmaes, gp, qmc, nsgaii, bruteforce."),
    trials: Optional[int] = typer.Option(None, "--trials", "-n", help="Trials to run (default: the space's number of configurations)."),
    batch: Optional[int] = typer.Option(None, "--batch", "-k", help="Trials trained packed together per batch (default: max_adapters_per_job × slots)."),
    pruner: Optional[str] = typer.Option(None, "--pruner", help="Optuna pruner: median, percentile, successive-halving, hyperband, wilcoxon; adapters are scored at fixed fractions of their budget (optuna.pruner in the space file)."),
    seed: Optional[int] = typer.Option(None, "--seed", help="Sampler seed (default: space.seed)."),
    output: Optional[Path] = typer.Option(None, "--output", "-o", help="Run directory (default: <output.dir>/<name>)."),
    asynchronous: bool = typer.Option(False, "--async", help="No batches: --batch trials train at once in one long-lived job per slot; each finished or pruned trial is told at once and the next one joins its slot."),
    budget_gpu: Optional[str] = typer.Option(None, "--budget-gpu-seconds", help="Ask no more trials once the tune's jobs have spent this much GPU time (GPUs × seconds each job ran): 1800, or 90s, 30m, 2h (default: optuna.budget_gpu_seconds)."),
    on_budget: Optional[str] = typer.Option(None, "--on-budget", help="Once the budget is spent: finish (running trials end) or stop (they are pruned) (default: optuna.on_budget, finish)."),
) -> None:
    """Search SPACE with an Optuna sampler: ask a batch of trials, train them packed, tell the results, repeat."""
    from plora.data.dataset import DataError
    from plora.models.folders import ModelError
    from plora.tuning.budget import Budget
    from plora.tuning.loop import check_tune_request, run_tune
    from plora.tuning.study import storage_url, study_name

    spec = _load(space, sampled=True, warm=True, overrides=overrides)  # the first job's process imports meanwhile
    run_dir = spec.run_dir(output)
    _check_output(run_dir)
    try:
        check_tune_request(spec, sampler=sampler, trials=trials, batch=batch, pruner=pruner)
        budget = Budget(budget_gpu if budget_gpu is not None else spec.optuna.budget_gpu_seconds,
                        on_budget if on_budget is not None else spec.optuna.on_budget)
    except ValueError as e:
        fail(str(e))
    from plora.hardware import hardware_for

    try:
        _note_hardware(spec, hardware_for(spec))
    except ValueError as e:
        fail(str(e))
    console.print(f"[bold]plora[/] tune [cyan]{spec.name}[/] with the {sampler} sampler → {run_dir}")
    start = time.time()
    failed: list[str] = []

    def spent() -> str:
        return f" · {budget.describe()}" if budget.gpu_seconds is not None else ""

    def on_batch(rep) -> None:
        console.print(views.batch_line(rep, spec) + spent())
        failed.extend(f"trial {t.number} ({t.user_attrs.get('adapter_id')}): {t.user_attrs.get('reason') or 'failed'}"
                      for t in rep.trials if t.user_attrs.get("status") == "failed")

    try:
        with views.progress(console, lambda snap: sum(snap.adapter_status.values()), transient=True) as on_snapshot:
            import optuna

            optuna.logging.set_verbosity(optuna.logging.WARNING)
            study = run_tune(spec, sampler=sampler, trials=trials, batch=batch, pruner=pruner, run_dir=output,
                             seed=seed, on_batch=on_batch, on_snapshot=on_snapshot, asynchronous=asynchronous,
                             on_trial=lambda t: console.print(views.trial_line(t, spec) + spent()), budget=budget)
    except (DataError, ModelError, ValueError) as e:
        fail(str(e))
    except KeyboardInterrupt:
        _interrupted("running jobs stopped; finished trials are kept in the study.")

    console.print(views.trials_table(study, spec, batches=not asynchronous))
    url = storage_url(spec, output)
    console.print(views.trials_line(study, time.time() - start, study_name(spec), url))
    console.print(views.budget_line(budget))
    console.print(f"[dim]dashboard: optuna-dashboard {url} · report: plora report {run_dir}[/]")
    if failed:
        for line in failed:
            err.print(f"[red]failed[/] {escape(line)}", highlight=False)
        raise typer.Exit(1)


@app.command()
def report(
    runs: list[Path] = typer.Argument(..., metavar="RUN [OTHER...]", help="A run directory (<output.dir>/<name>), or its space file; more runs of the same space are drawn beside it in the best-score-against-GPU-time plot (RUN may also be a folder of runs)."),
    output: Optional[Path] = typer.Option(None, "--output", "-o", help="HTML file (default: RUN/report.html)."),
) -> None:
    """Execute the report notebook on RUN and write report.html (tables and plots)."""
    from plora.results.notebook import ReportError, render_report

    runs = [_load(r, sampled=True).run_dir() if r.is_file() and r.suffix in (".yaml", ".yml") else r for r in runs]
    run, others = runs[0], runs[1:]
    with console.status("executing the report notebook"):
        try:
            path = render_report(run, output, compare=others)
        except ReportError as e:
            fail(str(e))
    console.print(f"report: {path}")


@app.command()
def plan(
    space: Path = typer.Argument(..., help="The space file (YAML)."),
    overrides: Optional[list[str]] = _overrides(),
    output: Optional[Path] = typer.Option(None, "--output", "-o", help="Run directory (default: <output.dir>/<name>)."),
    profile: Optional[Path] = typer.Option(None, "--profile", help="A profile.json to plan with (default: the run's, a cached one, or the analytic prior)."),
    here: bool = typer.Option(False, "--here", help="Plan for this machine's GPUs/cores instead of the space file's hardware."),
) -> None:
    """Plan SPACE: which adapters train together, at which TP degree, on which GPUs, when.

    Prints the job queue and the predicted makespan against the baselines; writes plan.json.
    """
    from plora.hardware import hardware_for
    from plora.sweep import prepare, write_plan

    spec = _load(space, overrides=overrides)
    _check_output(spec.run_dir(output))
    cm = None
    if profile is not None:
        from plora.cost.model import CostModel

        try:
            cm = CostModel.load(profile)
        except (OSError, ValueError, KeyError) as e:
            fail(f"--profile: cannot read {profile}: {e}")
        cm = cm.with_meta(plan_source=f"the profile {profile}")
    try:
        hw = hardware_for(spec, here=here)
        _note_hardware(spec, hw)
        prep = prepare(spec, output, hardware=hw, cost_model=cm)
    except Exception as e:  # noqa: BLE001 - planner, data and model errors are the user's to fix
        from plora.planner import PlannerError

        if isinstance(e, (PlannerError, ValueError)):
            fail(str(e).splitlines()[0])
        raise
    console.print(views.jobs_table(prep))
    summary = views.plan_summary(prep)
    if summary is not None:
        console.print(summary)
    path = write_plan(prep)
    console.print(f"[dim]wrote {path}[/]")


@app.command()
def export(
    run: Path = typer.Argument(..., help="A run directory (<output.dir>/<name>)."),
    adapter_id: Optional[str] = typer.Argument(None, help="The adapter to export (its id, a-...)."),
    best: bool = typer.Option(False, "--best", help="The best finished adapter by the sweep's objective."),
    every: bool = typer.Option(False, "--all", help="Every adapter that has saved weights, a folder each."),
    output: Optional[Path] = typer.Option(None, "--output", "-o",
                                          help="Folder to write (with --all: a folder per adapter in it); default RUN/exports/<id>."),
    merge: bool = typer.Option(False, "--merge", help="A whole Hugging Face model with the adapter merged into its weights."),
) -> None:
    """Export adapters of RUN: a PEFT folder with the base model's tokenizer, or with --merge a merged model."""
    from plora.results.export import ExportError, export_adapters, select_adapters

    try:
        ids = select_adapters(run, adapter_id, best=best, every=every)
        exported = export_adapters(run, ids, output, merge=merge, nested=every)
    except ExportError as e:
        fail(str(e))
    for item in exported:
        kind = "merged model" if item.merged else "PEFT adapter"
        console.print(f"{item.adapter_id}: {kind} → {escape(str(item.path))}", highlight=False, soft_wrap=True)


@app.command()
def status(run: Path = typer.Argument(..., help="A run directory (runs/<name>).")) -> None:
    """Where a sweep stands: adapters by state and every job, from the run's journal."""
    if not (run / "journal.sqlite").is_file():
        fail(f"{run}: not a run directory (no journal.sqlite)")
    for part in views.status_tables(run):
        console.print(part)


@app.command()
def profile(
    space: Path = typer.Argument(..., help="The space file (YAML)."),
    overrides: Optional[list[str]] = _overrides(),
    output: Optional[Path] = typer.Option(None, "--output", "-o", help="Run directory (default: <output.dir>/<name>)."),
    force: bool = typer.Option(False, "--force", help="Probe again even when a cached profile matches."),
) -> None:
    """Fit SPACE's memory and step-time model from short probe jobs on this machine; print it and its held-out error."""
    from plora.models.folders import ModelError
    from plora.cost.profiling.errors import ProfileError
    from plora.cost.profiling.profile import profile_sweep
    from plora.cost.profiling.record import load_profile

    spec = _load(space, overrides=overrides)
    run_dir = spec.run_dir(output)
    _check_output(run_dir)
    with console.status("profiling") as st:
        try:
            profile_sweep(spec, run_dir, force=force, log=lambda line: st.update(line.strip()))
        except (ModelError, ProfileError, ValueError) as e:
            fail(str(e))
    prof = load_profile(run_dir / "profile.json")
    console.print(views.cost_model_table(prof.cost_model))
    console.print(views.holdout_table(prof))
    console.print(views.holdout_line(prof))
    source = f"reused the cached profile {prof.cache_path}" if prof.reused else f"cached as {prof.cache_path}"
    console.print(f"[dim]{run_dir / 'profile.json'} — {source}[/]")


if __name__ == "__main__":  # pragma: no cover
    sys.exit(app())
