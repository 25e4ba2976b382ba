"""Bytecode kept in plora's cache where ``PYTHONDONTWRITEBYTECODE`` forbids it beside the
sources (`plora.bytecode_cache`): the sweep's processes stop compiling their imports afresh,
and read what an install compiled where it did."""

from __future__ import annotations

import os
import py_compile
import subprocess
import sys
import time
from pathlib import Path

from plora.bytecode_cache import DONT_WRITE, PREAMBLE, PREFIX, bytecode_dir

ROOT = Path(__file__).resolve().parents[1]


def test_only_where_bytecode_is_forbidden_and_no_prefix_is_set(tmp_path):
    base = {"PLORA_CACHE_DIR": str(tmp_path)}
    assert bytecode_dir(base) is None  # Python writes __pycache__ itself
    assert bytecode_dir({**base, DONT_WRITE: "1"}) == tmp_path / "bytecode"
    assert bytecode_dir({**base, DONT_WRITE: "1", PREFIX: "/elsewhere"}) is None  # the user's own prefix rules
    assert bytecode_dir({**base, DONT_WRITE: "1", "PLORA_BYTECODE_CACHE": "off"}) is None
    assert bytecode_dir({**base, DONT_WRITE: ""}) is None  # set but empty: Python writes, as it would


def test_every_process_the_sweep_starts_asks_for_it_first():
    from plora.engine import kernel_warmer, local, spare

    assert PREAMBLE in spare.CHILD and PREAMBLE in kernel_warmer.CHILD and PREAMBLE in local.TUNE
    assert spare.CHILD.index(PREAMBLE) < spare.CHILD.index("runpy.run_module")


def _mods(tmp_path: Path) -> Path:
    mods = tmp_path / "mods"
    mods.mkdir(exist_ok=True)
    for name in ("zz_parent", "zz_child", "zz_compiled", "zz_stale"):
        (mods / f"{name}.py").write_text(f"NAME = {name!r}\n")
    return mods


def _run(code: str, tmp_path: Path, **extra: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in (PREFIX, "PLORA_BYTECODE_CACHE")}
    env.update({DONT_WRITE: "1", "PLORA_CACHE_DIR": str(tmp_path / "cache"),
                "PYTHONPATH": os.pathsep.join([str(tmp_path / "mods"), str(ROOT)]), **extra})
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)


CHILD = PREAMBLE + ("import zz_parent, subprocess, sys; "
                    f"subprocess.run([sys.executable, '-c', {PREAMBLE + 'import zz_child'!r}], check=True)")


def _kept(tmp_path: Path) -> list[str]:
    return sorted(p.name.split(".")[0] for p in (tmp_path / "cache" / "bytecode").rglob("zz_*.pyc"))


def test_a_process_and_its_children_keep_bytecode_in_the_cache_only(tmp_path):
    mods = _mods(tmp_path)
    proc = _run(CHILD, tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert _kept(tmp_path) == ["zz_child", "zz_parent"]
    assert not (mods / "__pycache__").exists()  # nothing beside the sources
    again = _run(PREAMBLE + "import zz_parent; print(zz_parent.__cached__)", tmp_path)
    assert again.returncode == 0, again.stderr
    assert again.stdout.strip().startswith(str(tmp_path / "cache" / "bytecode"))  # read from there


def test_what_an_install_compiled_is_read_where_it_is(tmp_path):
    mods = _mods(tmp_path)
    compiled = Path(py_compile.compile(str(mods / "zz_compiled.py"), doraise=True))
    stale = Path(py_compile.compile(str(mods / "zz_stale.py"), doraise=True))
    later = time.time() + 10
    os.utime(mods / "zz_stale.py", (later, later))  # its source changed since
    before = stale.read_bytes()
    proc = _run(PREAMBLE + "import zz_compiled, zz_stale; print(zz_compiled.__cached__); print(zz_stale.__cached__)",
                tmp_path)
    assert proc.returncode == 0, proc.stderr
    cached = proc.stdout.split()
    assert cached[0] == str(compiled)  # fresh beside its source: read there, nothing copied
    assert cached[1].startswith(str(tmp_path / "cache" / "bytecode"))
    assert _kept(tmp_path) == ["zz_stale"] and stale.read_bytes() == before  # the stale one left alone


def test_switched_off_nothing_is_written(tmp_path):
    _mods(tmp_path)
    proc = _run(CHILD, tmp_path, PLORA_BYTECODE_CACHE="0")
    assert proc.returncode == 0, proc.stderr
    assert not (tmp_path / "cache" / "bytecode").exists()
    assert not list(tmp_path.rglob("*.pyc"))


def test_the_command_asks_for_it_before_its_imports(tmp_path):
    _mods(tmp_path)
    proc = _run("import plora.cli, zz_parent", tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert _kept(tmp_path) == ["zz_parent"]
