"""The import graph of plora: no circles, and planning never walks through training.

Every ``import`` in plora's modules counts, at module level, inside a function (a lazy
import is still a dependency) or under ``if TYPE_CHECKING:`` (a circle closed through a type
is still a circle: the shared type belongs below both).

The planner, the cost model and the profiler sit below the recipe (`plora.train`): they
describe and measure training jobs, and a change to how a job trains must not reach them
except through what they measure. One module is the exception, by necessity:
`plora.cost.profiling.measure` builds a probe's packed job with the recipe and steps it in this
process, because a probe's times and peaks are only a job's when it runs as a job does. It
is imported by one module, `plora.cost.profiling.profile`, which runs the probes (and which
the sweep's choice of its cost model, `plora.cost.sweep_model`, may call); the probes,
the fit, the validation, the profile record and the cache never reach the recipe, so that
what the planner reads of a profile loads no training code. What the recipe and the
profiler must agree on (CUDA graphs, the CUDA allocator) is in `plora.job.step_settings`, below
both.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "plora"


def _module_name(path: Path) -> str:
    rel = path.relative_to(ROOT.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    out = {}
    for path in ROOT.rglob("*.py"):
        if "kernels" in path.relative_to(ROOT).parts[:1]:
            continue  # plora.kernels: a link to the kernels/ package, which imports only plora.settings
        out[_module_name(path)] = path
    return out


def _imports(name: str, path: Path, known: set[str]) -> set[str]:
    tree = ast.parse(path.read_text())
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(tree):
        targets = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
            targets = [base] + [f"{base}.{a.name}" for a in node.names]
        for t in targets:
            while t and t not in known:
                t = t.rpartition(".")[0]
            if t and t != name:
                found.add(t)
    return found


def _graph() -> dict[str, set[str]]:
    mods = _modules()
    return {name: _imports(name, path, set(mods)) for name, path in mods.items()}


def test_no_import_circles():
    graph = _graph()
    seen: dict[str, int] = {}  # 1: on the current path, 2: done
    cycles = []

    def visit(node: str, path: list[str]) -> None:
        seen[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if seen.get(nxt) == 1:
                cycles.append(path[path.index(nxt):] + [nxt] if nxt in path else [node, nxt])
            elif nxt not in seen:
                visit(nxt, path + [nxt])
        seen[node] = 2

    for mod in sorted(graph):
        if mod not in seen:
            visit(mod, [mod])
    assert not cycles, "import circles: " + "; ".join(" -> ".join(c) for c in cycles)


def _reach(graph: dict[str, set[str]], start: str, avoid: frozenset[str] = frozenset()) -> set[str]:
    """What ``start`` imports, directly or not, without walking through ``avoid``."""
    out, todo = set(), [start]
    while todo:
        for nxt in graph.get(todo.pop(), ()):
            if nxt not in out and nxt not in avoid:
                out.add(nxt)
                todo.append(nxt)
    return out


def _recipes(modules: set[str]) -> list[str]:
    return sorted(m for m in modules if m == "plora.train" or m.startswith("plora.train."))


#: the one module of the profiler that imports the recipe: it runs a probe's job in-process
MEASURES_IN_PROCESS = "plora.cost.profiling.measure"
#: the one module that imports it: the profiler proper, which runs the probes
RUNS_PROBES = "plora.cost.profiling.profile"
#: the sweep's choice of its cost model, which may profile (through `RUNS_PROBES`)
CHOOSES_BY_PROBING = "plora.cost.sweep_model"


def test_planning_never_imports_the_training_loop():
    graph = _graph()
    planning = [m for m in graph if m.startswith(("plora.cost", "plora.planner"))
                and m not in (MEASURES_IN_PROCESS, RUNS_PROBES, CHOOSES_BY_PROBING)]
    assert "plora.cost.model" in planning and "plora.cost.job" in planning
    assert planning
    bad = {m: _recipes(_reach(graph, m)) for m in planning}
    assert not {m: r for m, r in bad.items() if r}, bad


def test_the_profiler_reaches_the_recipe_only_through_its_in_process_measurement():
    graph = _graph()
    profiler = {m for m in graph if m == "plora.cost.profiling" or m.startswith("plora.cost.profiling.")}
    profiler |= {"plora.cost.job", "plora.cost.profiling.job_probe"}  # the job terms: a real job, run as the engine runs it
    shared = {"plora.job.step_settings", "plora.train.heap", "plora.job.phases"}  # what the recipe imports from below
    assert {MEASURES_IN_PROCESS, RUNS_PROBES} <= profiler and shared <= set(graph)

    below = sorted((profiler | shared) - {MEASURES_IN_PROCESS, RUNS_PROBES})
    bad = {m: _recipes(_reach(graph, m)) for m in below}
    assert not {m: r for m, r in bad.items() if r}, bad
    importers = sorted(m for m in graph if MEASURES_IN_PROCESS in graph[m])
    assert importers == [RUNS_PROBES], f"only {RUNS_PROBES} may import {MEASURES_IN_PROCESS}, not {importers}"
    for runs in (RUNS_PROBES, CHOOSES_BY_PROBING):
        around = _recipes(_reach(graph, runs, avoid=frozenset({MEASURES_IN_PROCESS})))
        assert not around, f"{runs} reaches {around} other than through {MEASURES_IN_PROCESS}"


def test_type_checking_imports_count(tmp_path):
    """An import under ``if TYPE_CHECKING:`` is an edge of the graph like any other."""
    mod = tmp_path / "m.py"
    mod.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from plora.sweep import PreparedSweep\n")
    assert _imports("plora.x", mod, {"plora.sweep", "plora.x"}) == {"plora.sweep"}


def test_every_package_is_installed():
    """A package missing from pyproject's list imports from a checkout and is absent from an
    installed wheel: every folder of plora with an ``__init__.py`` is listed."""
    import tomllib

    listed = set(tomllib.loads((ROOT.parent / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {_module_name(p) for p in ROOT.rglob("__init__.py")}
    assert found <= listed, f"not in pyproject.toml's packages: {sorted(found - listed)}"


def test_reading_a_plan_or_the_planners_errors_imports_no_solver():
    """cvxpy (seconds to import on a GPU machine) comes with making a plan, not with what
    only reads one (`plora.planner.plan`, the report) or catches the planner's errors: a sweep
    checks its data and decides its rows before it."""
    import subprocess
    import sys

    code = ("import sys\n"
            "from plora.planner import Plan, PlannerError\n"
            "import plora.planner.plan, plora.results.run_data, plora.sweep\n"
            "assert 'cvxpy' not in sys.modules, 'cvxpy imported'\n"
            "from plora.planner import plan_sweep\n"
            "assert 'cvxpy' in sys.modules and callable(plan_sweep)\n"
            "import plora.planner as p\n"
            "assert set(p.__all__) <= set(dir(p))\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT.parent)
    assert done.returncode == 0, done.stderr
