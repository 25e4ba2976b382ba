"""Triton's per-signature kernel launchers loaded as modules of their own
(`plora.kernels.launcher_modules`): a launcher loaded a second time never hands its functions
to the module object another launcher was loaded as."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

SOURCE = """
#include <Python.h>
static PyObject* launch(PyObject* self, PyObject* args) {{ return PyUnicode_FromString("{who}"); }}
static PyMethodDef Methods[] = {{{{"launch", launch, METH_VARARGS, ""}}, {{NULL, NULL, 0, NULL}}}};
static struct PyModuleDef Def = {{PyModuleDef_HEAD_INIT, "__triton_launcher", NULL, -1, Methods}};
PyMODINIT_FUNC PyInit___triton_launcher(void) {{ return PyModule_Create(&Def); }}
"""


def _launchers(tmp_path: Path) -> dict[str, Path]:
    """Two launcher modules as Triton builds them: one name, single-phase, each in its own file."""
    cc = shutil.which("gcc") or shutil.which("cc") or shutil.which("clang")
    include = sysconfig.get_paths()["include"]
    if cc is None or not (Path(include) / "Python.h").is_file():
        pytest.skip("no C compiler or Python headers here")
    suffix = sysconfig.get_config_var("EXT_SUFFIX")
    out = {}
    for who in ("first", "second"):
        folder = tmp_path / who
        folder.mkdir()
        (folder / "main.c").write_text(SOURCE.format(who=who))
        so = folder / f"__triton_launcher{suffix}"
        subprocess.run([cc, str(folder / "main.c"), "-O1", "-shared", "-fPIC", "-o", str(so), f"-I{include}"],
                       check=True, capture_output=True)
        out[who] = so
    return out


LOADS = """
import importlib.util, sys
def load(path):  # as Triton loads a launcher
    spec = importlib.util.spec_from_file_location("__triton_launcher", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod
first, second = load({first!r}), load({second!r})
held = second.launch  # what the second kernel's launcher keeps
again = load({first!r})  # a second variant of the first kernel: its launcher's file again
print(again is second, second.launch(), again.launch(), held())
"""


def _run(code: str) -> list[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.split()


def test_loaded_apart_each_launcher_keeps_its_own_functions(tmp_path):
    so = _launchers(tmp_path)
    loads = textwrap.dedent(LOADS).format(first=str(so["first"]), second=str(so["second"]))
    shared, second_now, again_now, held = _run(loads)
    if shared == "True":  # as CPython 3.11-3.13 do it: the second load of a file returns the module
        # object last loaded under the name, its functions replaced; a thread between a load
        # and its read gets the other kernel's
        assert (second_now, again_now, held) == ("first", "first", "second")
    apart = "from plora.kernels.launcher_modules import load_launchers_apart; load_launchers_apart()\n" + loads
    assert _run(apart) == ["False", "second", "first", "second"]  # every load a module of its own


def test_other_modules_load_as_before(tmp_path):
    (tmp_path / "plain.py").write_text("X = 1\n")
    code = textwrap.dedent(f"""
        import importlib.util
        from plora.kernels.launcher_modules import LAUNCHER, load_launchers_apart
        load_launchers_apart()
        load_launchers_apart()  # once is enough
        plain = importlib.util.spec_from_file_location("plain", {str(tmp_path / "plain.py")!r})
        launcher = importlib.util.spec_from_file_location(LAUNCHER, {str(tmp_path / "plain.py")!r})
        other = importlib.util.spec_from_file_location(LAUNCHER, {str(tmp_path / "plain.py")!r})
        print(plain.name, launcher.name.endswith("." + LAUNCHER), launcher.name != other.name)
    """)
    assert _run(code) == ["plain", "True", "True"]
