"""The report's vocabulary: what ``notebooks/report.ipynb`` calls, one name each.

``plora report RUN`` runs that notebook headless into ``RUN/report.html``
(`plora.results.notebook`); each of its sections is one call here: `load_run` reads the run
directory (`plora.results.run_data`), a section function draws from it (`plora.results.plots`),
and `show` displays what it returns, or a one-line note when the run has no data for it.
Open the notebook in Jupyter to change the plots. Nothing is defined here: each name has
its home in one of those three modules.
"""

from __future__ import annotations

from plora.results.notebook import (
    COMPARE_ENV,
    RUN_DIR_ENV,
    ReportError,
    figure_png,
    notebook_path,
    render_report,
    require_report_packages,
    show,
)
from plora.results.plots import (
    cost_model_points,
    makespan_values,
    measured_step_times,
    plot_adapter_gantt,
    plot_best_vs_gpu_seconds,
    plot_best_worst_base,
    plot_cost_model,
    plot_gantt,
    plot_learning_curves,
    plot_makespan,
    plot_score_vs_hyperparameters,
    plot_study,
    results_table,
    summary,
)
from plora.results.run_data import Missing, RunData, latest_attempts, load_run, load_tune_histories

__all__ = [
    "COMPARE_ENV",
    "Missing",
    "RUN_DIR_ENV",
    "ReportError",
    "RunData",
    "cost_model_points",
    "figure_png",
    "latest_attempts",
    "load_run",
    "load_tune_histories",
    "makespan_values",
    "measured_step_times",
    "notebook_path",
    "plot_adapter_gantt",
    "plot_best_vs_gpu_seconds",
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
