"""The `plora` command. Thin: parse, call the library, render with rich."""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    help="Packed LoRA hyperparameter sweeps: many adapters per job on one shared base model.",
)
console = Console()
err = Console(stderr=True)

EXIT_USAGE = 2


@app.callback()
def _root(
    version: bool = typer.Option(False, "--version", help="Print the version and exit.", is_eager=True),
) -> None:
    """plora: packed LoRA hyperparameter sweeps."""
    if version:
        from plora import __version__

        console.print(f"plora {__version__}")
        raise typer.Exit(0)


def fail(message: str, code: int = EXIT_USAGE) -> None:
    """One line on stderr and an exit code; never a traceback for a user's mistake."""
    err.print(f"[bold red]error:[/] {message}", highlight=False, soft_wrap=True)
    raise typer.Exit(code)


def _load(space: Path):
    from plora.spec import SpecError, load_spec

    try:
        return load_spec(space)
    except SpecError as e:
        fail(str(e))


def _prepare(space: Path, output: Optional[Path]):
    from plora.data import DataError
    from plora.models import ModelError
    from plora.sweep import prepare

    spec = _load(space)
    try:
        return prepare(spec, output)
    except (DataError, ModelError, ValueError) as e:
        fail(str(e))


def _configs_table(prep) -> Table:
    t = Table(title=f"{len(prep.configs)} configurations", title_justify="left")
    for col in ("adapter", "rank", "alpha", "lr", "batch", "seed", "steps", "job"):
        t.add_column(col, justify="right" if col not in ("adapter", "job") else "left")
    job_of = {a.id: j.job_id for j in prep.plan.jobs for a in j.adapters}
    for c in prep.configs:
        t.add_row(c.id, str(c.rank), f"{c.alpha:g}", f"{c.learning_rate:.3g}", str(c.batch_size), str(c.seed),
                  str(prep.steps[c.id]), job_of[c.id])
    return t


def _jobs_table(prep) -> Table:
    t = Table(title=f"{len(prep.plan.jobs)} jobs — {prep.plan.grouping}", title_justify="left")
    for col in ("job", "adapters", "TP", "steps (max)", "ranks"):
        t.add_column(col)
    for j in prep.plan.jobs:
        t.add_row(j.job_id, str(len(j.adapters)), str(j.tp), str(max(j.steps.values())),
                  ",".join(str(a.rank) for a in j.adapters))
    return t


def _results_table(frame, spec, base: dict, top: int = 10) -> Table:
    from plora.sweep import ranked

    objective = spec.eval.objective
    best = ranked(frame, objective, spec.eval.minimize).head(top)
    t = Table(title=f"best configurations by {objective}", title_justify="left")
    for col in ("adapter", "rank", "alpha", "lr", "batch", "eval loss", "exact match", "train loss", "time (s)"):
        t.add_column(col, justify="left" if col == "adapter" else "right")

    def num(v, fmt):
        return "—" if v is None or v != v else format(v, fmt)

    for _, r in best.iterrows():
        t.add_row(r.adapter_id, str(r["rank"]), f"{r.alpha:g}", f"{r.learning_rate:.3g}", str(r.batch_size),
                  num(r.eval_loss, ".4f"), num(r.eval_exact_match, ".3f"), num(r.train_loss, ".4f"),
                  num(r.wall_time_s, ".1f"))
    if base:
        t.add_row("[dim]base model[/]", "", "", "", "", num(base.get("eval_loss"), ".4f"),
                  num(base.get("eval_exact_match"), ".3f"), "", "")
    return t


@app.command()
def sweep(
    space: Path = typer.Argument(..., help="The space file (YAML)."),
    output: Optional[Path] = typer.Option(None, "--output", "-o", help="Run directory (default: <output.dir>/<name>)."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Print the configurations and jobs; train nothing."),
    restart: bool = typer.Option(False, "--restart", help="Delete the run directory first and start over."),
) -> None:
    """Train every configuration of SPACE as packed LoRA adapters and collect the results."""
    prep = _prepare(space, output)
    if dry_run:
        console.print(_configs_table(prep))
        console.print(_jobs_table(prep))
        console.print(f"[dim]dry run: nothing trained, nothing written (run directory would be {prep.run_dir})[/]")
        return

    from plora.sweep import base_metrics, run_prepared, write_run_files

    write_run_files(prep, restart=restart)
    console.print(f"[bold]plora[/] sweep [cyan]{prep.spec.name}[/]: {len(prep.configs)} adapters in "
                  f"{len(prep.plan.jobs)} jobs → {prep.run_dir}")
    console.print(f"[dim]{prep.plan.grouping}[/]")
    total_steps = sum(prep.steps.values())
    start = time.time()
    with Progress(
        TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
        console=console, transient=False,
    ) as progress:
        overall = progress.add_task("adapter steps", total=total_steps)
        per_job: dict[str, int] = {}

        def on_tick(running, finished):
            done = 0
            for jp in list(running) + list(finished):
                p = jp.progress()
                if jp.job_id not in per_job:
                    per_job[jp.job_id] = progress.add_task(f"  {jp.job_id}", total=p.get("adapter_steps_total") or 1)
                progress.update(per_job[jp.job_id], completed=p.get("adapter_steps_done", 0),
                                total=p.get("adapter_steps_total") or 1)
                done += p.get("adapter_steps_done", 0)
            progress.update(overall, completed=done)

        try:
            frame = run_prepared(prep, on_tick=on_tick)
        except KeyboardInterrupt:
            err.print("[yellow]interrupted: running jobs stopped; finished adapters are kept[/]")
            raise typer.Exit(130)

    console.print(_results_table(frame, prep.spec, base_metrics(prep.run_dir)))
    counts = frame["status"].value_counts().to_dict()
    console.print("status: " + ", ".join(f"{k} {v}" for k, v in sorted(counts.items()))
                  + f" — {time.time() - start:.0f} s — results: {prep.run_dir / 'results.parquet'}")
    failed = frame[frame["status"] == "failed"]
    if len(failed):
        for _, r in failed.iterrows():
            err.print(f"[red]failed[/] {r.adapter_id}: {r.reason}")
        raise typer.Exit(1)


def main() -> None:  # pragma: no cover - console entry point alias
    app()


if __name__ == "__main__":  # pragma: no cover
    sys.exit(app())
