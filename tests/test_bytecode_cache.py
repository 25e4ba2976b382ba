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
    relative = bytecode_dir({"PLORA_CACHE_DIR": "rel-cache", DONT_WRITE: "1"})
    assert relative == Path.cwd() / "rel-cache" / "bytecode"  # fixed now: a job's chdir does not move it


def test_every_process_the_sweep_starts_asks_for_it_first():
    from plora.engine import kernel_warmer, local, spare

    assert PREAMBLE in spare.CHILD and PREAMBLE in kernel_warmer.CHILD and PREAMBLE in local.TUNE
    assert spare.CHILD.index(PREAMBLE) < spare.CHILD.index("runpy.run_module")


def _mods(tmp_path: Path) -> Path:
    mods = tmp_path / "mods"
    mods.mkdir(exist_ok=True)
    for name in ("zz_parent", "zz_child", "zz_compiled", "zz_stale", "zz_swapped", "zz_broken"):
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
    left = {}
    for name in ("zz_stale", "zz_swapped", "zz_broken"):
        left[name] = Path(py_compile.compile(str(mods / f"{name}.py"), doraise=True))
    later = time.time() + 10
    os.utime(mods / "zz_stale.py", (later, later))  # its source changed since
    st = (mods / "zz_swapped.py").stat()  # another source put in place with an older time (cp -p, tar)
    (mods / "zz_swapped.py").write_text("NAME = 'another source, longer'\n")
    os.utime(mods / "zz_swapped.py", ns=(st.st_atime_ns, st.st_mtime_ns - 10**9))
    left["zz_broken"].write_bytes(left["zz_broken"].read_bytes()[:10])  # cut short, newer than its source
    before = {name: p.read_bytes() for name, p in left.items()}
    names = ["zz_compiled", *left]
    proc = _run(PREAMBLE + f"import {', '.join(names)}; " + "; ".join(f"print({n}.__cached__, {n}.NAME)" for n in names),
                tmp_path)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0].split()[0] == str(compiled)  # fresh beside its source: read there, nothing copied
    assert all(line.startswith(str(tmp_path / "cache" / "bytecode")) for line in lines[1:])
    assert "another source" in lines[2]  # the swapped source's own code, not the old bytecode's
    assert _kept(tmp_path) == sorted(left)
    assert {name: p.read_bytes() for name, p in left.items()} == before  # nothing beside rewritten


def test_a_prefix_of_the_users_own_rules(tmp_path):
    _mods(tmp_path)
    env = {k: v for k, v in os.environ.items() if k != PREFIX}
    env.update({DONT_WRITE: "1", "PLORA_CACHE_DIR": str(tmp_path / "cache"), "PYTHONPATH": str(ROOT)})
    proc = subprocess.run([sys.executable, "-X", f"pycache_prefix={tmp_path / 'mine'}", "-c",
                           "from plora.bytecode_cache import use_here; print(use_here())"],
                          env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "None" and not (tmp_path / "cache").exists()


def test_switched_off_nothing_is_written(tmp_path):
    _mods(tmp_path)
    proc = _run(CHILD, tmp_path, PLORA_BYTECODE_CACHE="0")
    assert proc.returncode == 0, proc.stderr
    assert not (tmp_path / "cache" / "bytecode").exists()
    assert not list(tmp_path.rglob("*.pyc"))


def test_the_program_asks_for_it_before_its_imports_and_an_import_does_not(tmp_path):
    _mods(tmp_path)
    program = ("import sys; sys.argv = ['plora', '--help']\nfrom plora.command import main\n"
               "try:\n    main()\nexcept SystemExit:\n    pass\nimport zz_parent")
    proc = _run(program, tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert _kept(tmp_path) == ["zz_parent"]
    imported = _run("import sys, plora.cli; print(sys.dont_write_bytecode)", tmp_path)  # a test's import
    assert imported.returncode == 0 and imported.stdout.strip() == "True", imported.stderr
    module = _run("import runpy, sys; sys.argv = ['plora', '--help']\n"
                  "try:\n    runpy.run_module('plora.cli', run_name='__main__')\nexcept SystemExit:\n    pass\n"
                  "print(sys.dont_write_bytecode)", tmp_path)  # python -m plora.cli
    assert module.returncode == 0 and module.stdout.strip().endswith("False"), module.stderr
