"""The report notebook run headless: ``plora report RUN`` executes
``notebooks/report.ipynb`` against a run directory and exports it to ``RUN/report.html``,
every plot embedded as a PNG. The notebook stays short: each section is one call into
`plora.results.report` (`show`), so that the same figures can be drawn (and tested) without
a notebook, and a section whose data is missing shows a one-line note instead of failing
the report."""

from __future__ import annotations

import io
import os
import subprocess
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pandas as pd

from plora.settings import REPORT_COMPARE_DIRS, REPORT_RUN_DIR
from plora.results.run_data import Missing, RunData, _history_files


#: The environment variable through which the notebook's parameter cell gets the run directory.
RUN_DIR_ENV = REPORT_RUN_DIR
#: more run directories whose tune histories the report draws beside the run's (os.pathsep-separated)
COMPARE_ENV = REPORT_COMPARE_DIRS


#: ``notebooks/report.ipynb``, installed with the package through the ``assets/report.ipynb`` link
PACKAGE_NOTEBOOK = Path(__file__).resolve().parents[1] / "assets" / "report.ipynb"


class ReportError(ValueError):
    """The report cannot be made (no such run, notebook failed); the message is one line."""


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
