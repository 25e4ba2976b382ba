"""Each Triton kernel launcher loaded as a module of its own.

Triton versions that build a C launcher per kernel signature (3.6 among them) load each one as
an extension module named ``__triton_launcher`` from its own file in Triton's cache, and keep
its ``launch`` function. Such a module is initialised once per file (single-phase, ``m_size``
-1), and CPython serves a second load of a file it has loaded (a second variant of a kernel,
same signature) by copying that module's functions into the module object found under the
name in ``sys.modules`` (the last launcher loaded, of whatever kernel) and returning that
object. One thread reading ``launch`` from it while another thread loads a launcher then gets
the other's function: a job whose threads compile its kernels side by side
(`plora.kernels.compile_ahead`) launched ``sq_norm_tiles_kernel`` with the launcher of a
kernel of 34 arguments ("function takes exactly 34 arguments (20 given)"), and the job failed
and was started again, on an H200 in about one sweep in six.

`load_launchers_apart` gives every launcher load a name of its own
(``plora_triton_launcher_<n>.__triton_launcher``: CPython finds the same ``PyInit`` function
from the last part of the name), so no load ever shares a module object with another. It
changes nothing else: any other module, and a Triton whose launcher is not built per
signature, load as before.
"""

from __future__ import annotations

import importlib.util
import itertools
import threading

__all__ = ["LAUNCHER", "load_launchers_apart"]

#: the module name Triton loads every kernel launcher under
LAUNCHER = "__triton_launcher"
#: the package part of each launcher load's own name
PREFIX = "plora_triton_launcher_"

_COUNT = itertools.count()
_LOCK = threading.Lock()
_INSTALLED: list[bool] = []


def load_launchers_apart() -> None:
    """From now on each load of a Triton launcher in this process is a module of its own."""
    with _LOCK:
        if _INSTALLED:
            return
        original = importlib.util.spec_from_file_location

        def spec_from_file_location(name, location=None, *args, **kwargs):
            if name == LAUNCHER:
                name = f"{PREFIX}{next(_COUNT)}.{LAUNCHER}"
            return original(name, location, *args, **kwargs)

        spec_from_file_location.__wrapped__ = original
        importlib.util.spec_from_file_location = spec_from_file_location
        _INSTALLED.append(True)
