"""A job process's imports without the torchtune package `__init__`s it never uses.

``import torchtune`` runs ``torchtune/__init__.py``, which imports every dataset builder
(Hugging Face ``datasets``, pandas, pyarrow), the generation utilities and every model
family's package, and each family's ``__init__`` imports its tokenizers and, through
``torchtune.data``, more of the same. A job uses none of it: plora tokenizes and batches its
own rows (`plora.data`), and builds models from the families' component builders and
`torchtune.modules` (`plora.models.families`). Measured in a fresh interpreter on an H100
machine, a job's imports took 21 s, 1.7 s of it ``datasets`` alone.

`skip_package_inits` registers those packages as bare packages (their folder on the module
path, their ``__init__`` not run) before anything imports them; any submodule still imports
as usual, with its own imports. torchtune 0.6.1 is its last release, so what its
``__init__``s hold cannot change under us.

``torchtune.modules`` imports torchao's NF4 module unconditionally (QLoRA's types), and that
package's ``__init__`` imports all of torchao (quantization, float8, sparsity kernels, and
through them ``torch._dynamo``, sympy and the inductor): 7.7 s of a 21 s job start on an
H100 machine, for jobs that quantize nothing. `defer_nf4` puts a stand-in under its name
whose names load the real module the first time they are used (a QLoRA job's
`plora.quantize.nf4` does, and then pays that import where it did before).
(What this saves is the rest of torchao: a quarter of a spare's imports and model build on
a 2-core CPU, 1.76 s against 1.33 s.)

``torch._dynamo`` came in twice more: ``torchtune.modules`` decorates
``TransformerDecoder.chunked_output`` with ``torch.compiler.disable``, which imports it at
once, and a model built on the meta device computed its RoPE caches through torch's Python
references, whose first call imports it: 5.9 s of a spare's 12.3 s of imports on an H100
machine, for a job that compiles nothing. `defer_compiler_disable` makes that decorator wait
for ``torch._dynamo`` to be loaded by something else (nothing can be compiling before), and
`plora.models.loading.build_on_meta` computes the RoPE caches on the CPU. A job on a GPU
imported it in its first forward pass, through torch's varlen attention; it now calls the
flash ops directly (`plora.train.packed.flash_varlen`). Where a torch's ops do not allow
that, a spare on a GPU imports it on a thread once it has said ready, while the sweep plans
(`import_late_modules`).

On a GPU, ``torchtune.modules`` also compiles flex attention with ``torch.compile`` as it
is imported, which imports ``torch._dynamo`` and the inductor: 6.3 s of an 11.5 s spare
start on an H200 machine. Flex attention only ever serves a ``BlockMask``, which torchtune's
packed datasets make and plora never passes (it attends within rows its own way,
`plora.train.packed.varlen_attention`); without it torchtune's attention is the same SDPA
call. `skip_flex_attention` tells torchtune flex attention is unavailable before its
modules import (``torchtune.utils``, imported on the way, has read the flag already and
imports flex attention's ``BlockMask`` type; that import compiles nothing).

Only processes plora starts ahead of their job (`plora.train.spare`) use this;
``PLORA_LEAN_IMPORTS=0`` turns it off (`plora.settings`).
"""

from __future__ import annotations

import functools
import importlib.util
import sys
import threading
import types

from plora.settings import settings

__all__ = ["JOB_MODULES", "LATE_GPU_MODULES", "LEAN_PACKAGES", "NF4_MODULE", "defer_compiler_disable", "defer_nf4",
           "import_job_modules", "import_late_modules", "lean_job_imports", "skip_flex_attention", "skip_package_inits"]

#: the packages whose ``__init__`` a job does not need (parents before children); the model
#: families are those `plora.models.families` builds from
LEAN_PACKAGES = (
    "torchtune",
    "torchtune.models",
    "torchtune.models.llama3",
    "torchtune.models.llama3_1",
    "torchtune.models.mistral",
    "torchtune.models.qwen2",
    "torchtune.models.gemma",
    "torchtune.models.gemma2",
)
#: what a job imports of torchtune, whatever its model's family: imported by a process started
#: ahead before it says ready, so that its job finds them loaded (with the ``__init__``s run,
#: `torchtune.modules` came in with ``import torchtune``)
JOB_MODULES = (
    "torchtune.config",
    "torchtune.config._errors",
    "torchtune.modules",
    "torchtune.models.llama3._component_builders",
    "torchtune.models.llama3_1._position_embeddings",
    "torchtune.models.mistral._component_builders",
    "torchtune.models.qwen2._component_builders",
    "torchtune.models.qwen2._positional_embeddings",
    "torchtune.models.gemma._component_builders",
    "torchtune.models.gemma.gemma_norm_embedding",
    "torchtune.models.gemma.rms_norm",
    "torchtune.models.gemma2._attention",
)


def skip_package_inits() -> bool:
    """Register `LEAN_PACKAGES` without running their ``__init__``. Whether it did: not
    where it is switched off, where torchtune is already imported, or where a package is
    missing (then nothing is registered and imports run as usual)."""
    if not settings().lean_imports:
        return False
    if any(name in sys.modules for name in LEAN_PACKAGES):
        return False
    added: list[str] = []
    try:
        for name in LEAN_PACKAGES:
            spec = importlib.util.find_spec(name)
            if spec is None or spec.submodule_search_locations is None:
                raise ImportError(name)
            module = importlib.util.module_from_spec(spec)  # not executed: its __init__ never runs
            sys.modules[name] = module
            added.append(name)
            parent, _, child = name.rpartition(".")
            if parent:
                setattr(sys.modules[parent], child, module)
    except (ImportError, ValueError):
        for name in added:
            sys.modules.pop(name, None)
        return False
    return True


def skip_flex_attention() -> bool:
    """Have torchtune's modules import without flex attention (and its compile at import);
    whether they will: not where lean imports are off or ``torchtune.modules`` is imported."""
    if not settings().lean_imports or "torchtune.modules.attention_utils" in sys.modules:
        return False
    try:
        guard = importlib.import_module("torchtune.utils._import_guard")
    except ImportError:
        return False
    guard._SUPPORTS_FLEX_ATTENTION = False
    return True


def lean_job_imports() -> bool:
    """Everything above, before anything imports torchtune or torchao: its package
    ``__init__``s skipped (`skip_package_inits`), torchao's NF4 deferred (`defer_nf4`), flex
    attention off (`skip_flex_attention`), ``torch.compiler.disable`` lazy
    (`defer_compiler_disable`); whether the package ``__init__``s are skipped."""
    lean = skip_package_inits()
    defer_nf4()
    skip_flex_attention()
    defer_compiler_disable()
    return lean


def defer_compiler_disable() -> bool:
    """Make ``torch.compiler.disable`` (as a decorator) import ``torch._dynamo`` only when the
    function it decorates is called with ``torch._dynamo`` loaded; until then nothing can be
    compiling, and the function runs as it is. Whether it did: not where lean imports are off
    or ``torch._dynamo`` is loaded already."""
    if not settings().lean_imports or "torch._dynamo" in sys.modules:
        return False
    import torch.compiler

    real = torch.compiler.disable
    if getattr(real, "_plora_deferred", False):
        return True

    def disable(fn=None, recursive=True, **kwargs):
        if fn is None:
            return lambda f: disable(f, recursive, **kwargs)
        if "torch._dynamo" in sys.modules:
            return real(fn, recursive, **kwargs)
        disabled = None

        @functools.wraps(fn)
        def run(*args, **kw):
            nonlocal disabled
            if "torch._dynamo" not in sys.modules:
                return fn(*args, **kw)
            if disabled is None:
                disabled = real(fn, recursive, **kwargs)
            return disabled(*args, **kw)

        return run

    disable._plora_deferred = True  # type: ignore[attr-defined]
    torch.compiler.disable = disable
    return True


def import_job_modules() -> None:
    """Import `JOB_MODULES` now (a spare, before it says ready)."""
    for name in JOB_MODULES:
        importlib.import_module(name)


#: what a job on a GPU imports once it runs where its torch's flash ops cannot be called
#: directly (`plora.train.packed.flash_varlen`): torch's varlen flash attention
#: (`plora.train.packed.varlen_attention`), whose import imports ``torch._dynamo`` (not
#: imported ahead, it took 2.3 s of a warm sweep's first job on an H100 machine, in the base
#: model's evaluation that opens the job, and 4.2 s of SmolLM2's)
LATE_GPU_MODULES = ("torch._dynamo", "torch.nn.attention.varlen")


def import_late_modules(moments: dict | None = None,
                        modules: tuple[str, ...] = LATE_GPU_MODULES) -> threading.Thread | None:
    """Import ``modules`` on a thread of their own, where a GPU is visible (a spare, once it
    has said ready: it waits for its job meanwhile, and before it said ready nothing of the
    job needs them); the thread, or None (nothing to import, or no GPU). A job that needs
    one before the thread is done waits for that import (Python's import lock) rather than
    starting it again. ``moments`` gets ``late_imports_at`` when they are done."""
    import torch

    if not modules or not torch.cuda.is_available():
        return None

    def run() -> None:
        import time

        for name in modules:
            try:
                importlib.import_module(name)
            except Exception:  # noqa: BLE001 - the job imports it (and says why) when it needs it
                pass
        if moments is not None:
            moments["late_imports_at"] = time.time()

    thread = threading.Thread(target=run, name="plora-late-imports", daemon=True)
    thread.start()
    return thread


#: torchao's NF4 module (`defer_nf4`)
NF4_MODULE = "torchao.dtypes.nf4tensor"
_NF4_LOCK = threading.RLock()


class _DeferredNF4(types.ModuleType):
    """Stands in for torchao's NF4 module until one of its names is used.

    The names torchtune imports from it at import time are stand-ins too: ``NF4Tensor`` (a
    class that no object is an instance of until the real module is loaded; from then on,
    the real class decides), ``implements`` (torchtune registers an op of NF4 tensors with
    it at import: kept, and registered with the real module when that loads), and functions
    that load the real module and call its own."""

    def __init__(self) -> None:
        super().__init__(NF4_MODULE)
        self._real: types.ModuleType | None = None
        self._ops: list[tuple] = []  # (aten ops, function) registered before the real module loaded
        self.NF4Tensor = _nf4_class(self)
        for name in ("to_nf4", "linear_nf4"):
            setattr(self, name, _nf4_function(self, name))
        self.implements = self._implements

    def _implements(self, aten_ops):
        def decorator(func):
            with _NF4_LOCK:
                if self._real is None:
                    self._ops.append((aten_ops, func))
                    return func
            return self._real.implements(aten_ops)(func)

        return decorator

    def load(self) -> types.ModuleType:
        """The real module, imported now if it is not yet (in this stand-in's place). Where
        torchao's package took the stand-in's names while it stood in (``torchao.dtypes``
        imports ``NF4Tensor`` and ``to_nf4`` from here), they are the real ones from now on."""
        with _NF4_LOCK:
            if self._real is None:
                if sys.modules.get(NF4_MODULE) is self:
                    del sys.modules[NF4_MODULE]
                try:
                    real = importlib.import_module(NF4_MODULE)
                except BaseException:
                    sys.modules.setdefault(NF4_MODULE, self)
                    raise
                for aten_ops, func in self._ops:
                    real.implements(aten_ops)(func)
                self._ops.clear()
                self._real = real
                package = sys.modules.get("torchao.dtypes")
                for name in ("NF4Tensor", "to_nf4", "linear_nf4", "implements"):
                    if package is not None and getattr(package, name, None) is getattr(self, name):
                        setattr(package, name, getattr(real, name))
            return self._real

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return getattr(self.load(), name)


def _nf4_class(stand_in: _DeferredNF4) -> type:
    """``NF4Tensor`` until the real module is loaded: no object is an instance of it before
    (none can exist), and any other use of it (a call, an attribute) loads the real class
    and is the real class's."""

    class _Meta(type):
        def __instancecheck__(cls, obj) -> bool:
            real = stand_in._real
            return real is not None and isinstance(obj, real.NF4Tensor)

        def __subclasscheck__(cls, sub) -> bool:
            real = stand_in._real
            return real is not None and issubclass(sub, real.NF4Tensor)

        def __getattr__(cls, name: str):
            if name.startswith("__"):
                raise AttributeError(name)
            return getattr(stand_in.load().NF4Tensor, name)

        def __call__(cls, *args, **kwargs):
            return stand_in.load().NF4Tensor(*args, **kwargs)

    return _Meta("NF4Tensor", (), {"__module__": NF4_MODULE})


def _nf4_function(stand_in: _DeferredNF4, name: str):
    def call(*args, **kwargs):
        return getattr(stand_in.load(), name)(*args, **kwargs)

    call.__name__ = call.__qualname__ = name
    return call


def defer_nf4() -> bool:
    """Register `_DeferredNF4` under `NF4_MODULE` where nothing imported torchao yet and lean
    imports are on; whether it did."""
    if not settings().lean_imports or NF4_MODULE in sys.modules or "torchao" in sys.modules:
        return False
    if importlib.util.find_spec("torchao") is None:
        return False
    sys.modules[NF4_MODULE] = _DeferredNF4()
    return True

