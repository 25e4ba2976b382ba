"""A first sweep's modules compiled ahead, in parallel, into plora's bytecode cache
(`plora.bytecode_ahead`): what its processes then import is read back, not compiled."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from plora import bytecode_ahead
from plora.bytecode_ahead import LIST, listed_sources, pool_size
from plora.bytecode_cache import DONT_WRITE, PREAMBLE, PREFIX

ROOT = Path(__file__).resolve().parents[1]


def test_the_pool_leaves_the_sweep_its_cores():
    assert pool_size(16) == 6  # the most
    assert pool_size(8) == 3
    assert pool_size(4) == 1
    assert pool_size(2) == 0 and pool_size(1) == 0  # a worker could only slow the sweep down


def test_listed_modules_are_found_as_an_import_would(tmp_path):
    first, second = tmp_path / "first", tmp_path / "second"
    for entry in (first, second):
        (entry / "pkg").mkdir(parents=True)
        (entry / "pkg" / "a.py").write_text("")
    (second / "pkg" / "b.py").write_text("")
    listed = tmp_path / "list.txt"
    listed.write_text("# a comment\npkg/a.py\npkg/b.py\npkg/missing.py\n/etc/passwd\n../outside.py\n\n")
    assert listed_sources(listed, [str(first), str(second)]) == [str(first / "pkg" / "a.py"),
                                                                 str(second / "pkg" / "b.py")]
    assert listed_sources(tmp_path / "none.txt", [str(first)]) == []


def test_the_shipped_list_names_what_a_sweep_imports():
    names = [n for n in LIST.read_text().splitlines() if n and not n.startswith("#")]
    assert len(names) == len(set(names)) > 1000
    assert all(not os.path.isabs(n) and n.endswith(".py") for n in names)
    for wanted in ("torch/__init__.py", "plora/engine/spare.py", "torchtune/modules/transformer.py"):
        assert wanted in names
    found = listed_sources(LIST)
    assert any(f.endswith(os.path.join("torch", "__init__.py")) for f in found)  # resolved on this machine


def _site(tmp_path: Path) -> tuple[Path, Path]:
    site = tmp_path / "site"
    (site / "zzpkg").mkdir(parents=True)
    (site / "zzpkg" / "__init__.py").write_text("")
    for name in ("one", "two", "three"):
        (site / "zzpkg" / f"{name}.py").write_text(f"NAME = {name!r}\n")
    listed = tmp_path / "list.txt"
    listed.write_text("zzpkg/__init__.py\nzzpkg/one.py\nzzpkg/two.py\nzzpkg/three.py\nzzpkg/gone.py\n")
    return site, listed


def _env(tmp_path: Path, site: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in (PREFIX, "PLORA_BYTECODE_CACHE", "PLORA_BYTECODE_AHEAD")}
    env.update({DONT_WRITE: "1", "PLORA_CACHE_DIR": str(tmp_path / "cache"),
                "PYTHONPATH": os.pathsep.join([str(site), str(ROOT)])})
    return env


def _start(tmp_path: Path, listed: Path, env: dict[str, str], workers: int) -> subprocess.CompletedProcess:
    code = (PREAMBLE.replace("use_here(); ", "") + "from pathlib import Path; from plora.bytecode_ahead import start; "
            f"p = start(use_here(), Path({str(listed)!r}), {workers}); print('none' if p is None else p.wait())")
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)


def test_a_first_sweep_compiles_the_list_once_and_its_imports_read_it(tmp_path):
    site, listed = _site(tmp_path)
    env = _env(tmp_path, site)
    proc = _start(tmp_path, listed, env, workers=2)
    assert proc.returncode == 0 and proc.stdout.strip() == "0", proc.stderr
    cache = tmp_path / "cache" / "bytecode"
    kept = sorted(p.name.split(".")[0] for p in cache.rglob("*.pyc") if "zzpkg" in str(p))
    assert kept == ["__init__", "one", "three", "two"]  # every listed module there is, by two processes
    assert not (site / "zzpkg" / "__pycache__").exists()  # nothing beside the sources
    assert len(list(cache.glob("ahead-*.done"))) == 1
    stamps = {p: p.stat().st_mtime_ns for p in cache.rglob("*.pyc")}
    time.sleep(0.05)
    read = subprocess.run([sys.executable, "-c", PREAMBLE + "import zzpkg.one, zzpkg.two; print(zzpkg.two.__cached__)"],
                          env=env, capture_output=True, text=True, timeout=120)
    assert read.returncode == 0, read.stderr
    assert read.stdout.strip().startswith(str(cache))
    assert {p: p.stat().st_mtime_ns for p in cache.rglob("*.pyc")} == stamps  # read back, none compiled again
    again = _start(tmp_path, listed, env, workers=2)
    assert again.returncode == 0 and again.stdout.strip() == "none"  # done once: a warm sweep starts nothing


def test_nothing_starts_where_python_writes_its_own_bytecode_or_no_worker_is_wanted(tmp_path):
    site, listed = _site(tmp_path)
    assert bytecode_ahead.start(None, listed) is None
    assert bytecode_ahead.start(tmp_path / "cache" / "bytecode", listed, workers=0) is None
    assert bytecode_ahead.start(tmp_path / "cache" / "bytecode", tmp_path / "no-list.txt", workers=2) is None
    env = {k: v for k, v in _env(tmp_path, site).items() if k != DONT_WRITE}
    proc = _start(tmp_path, listed, env, workers=2)  # Python writes __pycache__ itself here
    assert proc.returncode == 0 and proc.stdout.strip() == "none", proc.stderr
    assert not (tmp_path / "cache").exists()
    off = _start(tmp_path, listed, {**_env(tmp_path, site), "PLORA_BYTECODE_AHEAD": "0"}, workers=2)
    assert off.returncode == 0 and off.stdout.strip() == "none", off.stderr  # turned off
    assert not list((tmp_path / "cache" / "bytecode").rglob("*.pyc"))


def test_no_mark_where_a_worker_could_not_compile_its_share(tmp_path):
    site, listed = _site(tmp_path)
    elsewhere = tmp_path / "not-the-cache"  # not the folder the workers' own cache answers
    code = f"from plora.bytecode_ahead import lead; lead({str(elsewhere)!r}, {str(listed)!r}, 2)"
    proc = subprocess.run([sys.executable, "-c", code], env=_env(tmp_path, site), capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert not elsewhere.exists() or not list(elsewhere.glob("ahead-*.done"))  # the next sweep tries again


def test_the_command_starts_the_pool_before_its_imports(tmp_path):
    site, _ = _site(tmp_path)
    code = ("import sys, plora.bytecode_ahead as a; started = []; a.start = lambda where: started.append(where); "
            "import plora.command as c; import plora.cli as cli; cli.app = lambda: None; c.main(); "
            "print(started[0])")
    proc = subprocess.run([sys.executable, "-c", code], env=_env(tmp_path, site), capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == str(tmp_path / "cache" / "bytecode")
