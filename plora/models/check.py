"""Model folders checked at validation, before anything is planned, written or launched.

A model that plora cannot build used to be found inside the first job, after planning,
and retried as a crash. Everything a job will read is cheap to check up front: config.json
(parsed, its family supported and buildable), tokenizer.json, the safetensors files and
their index, and the weight names and shapes against the family's builder (safetensors
headers only, never tensor data; the builder runs on the meta device). Every problem is
one `ModelError` line that names the file or the field.

A folder that passed is remembered in plora's cache (``model-checks/``), keyed by its
files' names, sizes and times, the check's settings, the checking code and torchtune's
version: building the
model on meta needs torchtune, whose import alone took 8 s of a sweep's start on an H100
machine, so a sweep of a folder checked before skips it. A changed file is checked again.
A sweep asks that part of its first job's process started ahead, which imports torchtune
anyway (`start_spec_model_check`).
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
from collections.abc import Callable
from functools import lru_cache
from pathlib import Path
from typing import Any

from plora.settings import settings
from plora.models.families import ModelError
from plora.data.json_errors import json_error_text
from plora.models.info import ModelInfo
from plora.models.folders import ensure_weights, read_model_info, resolve_model_path

__all__ = ["check_model", "check_spec_model", "expected_weights", "start_spec_model_check"]

INDEX_FILE = "model.safetensors.index.json"
#: at most this many names are listed in one error line
_SHOWN = 3


def check_model(path: str | Path, family: str = "auto", *, random_init: bool = False,
                max_seq_len: int = 8) -> ModelInfo:
    """Check a model folder (or `.gguf` file / built-in name) and return its ModelInfo.

    `random_init` models (``shape:`` presets, profiling) need no weights on disk;
    `max_seq_len` is checked against what the family allows (e.g. a sliding window).
    """
    folder = resolve_model_path(path)
    if not random_init:
        ensure_weights(folder)  # a GGUF file's folder converted head first
    return _check_folder(folder, family, random_init, max_seq_len, _stamp(folder))


def _stamp(folder: Path) -> tuple:
    # Re-check a folder whose files changed; one stat per file, no reads.
    return tuple(sorted((p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in folder.iterdir() if p.is_file()))


@lru_cache(maxsize=1)
def _checker_version() -> str:
    """What a remembered pass depends on besides the folder: the checking and building code
    (this module, `plora.models.loading`, the families) and torchtune's version."""
    from importlib.metadata import PackageNotFoundError, version
    from importlib.util import find_spec

    # found, not imported: `plora.models.loading` imports torch, which a warm sweep's model
    # check (a marker read) does not otherwise need (3 s of a 2-core machine's planning)
    loading = find_spec("plora.models.loading").origin
    families = find_spec("plora.models.families").origin
    digest = hashlib.sha1()
    sources = [Path(__file__), Path(loading), *sorted(Path(families).parent.glob("*.py"))]
    for path in sources:
        digest.update(path.read_bytes())
    try:
        digest.update(version("torchtune").encode())
    except PackageNotFoundError:
        pass
    return digest.hexdigest()[:16]


def _passed_marker(folder: Path, family: str, random_init: bool, max_seq_len: int, stamp: tuple) -> Path:
    ident = json.dumps([str(folder.resolve()), family, random_init, max_seq_len, stamp, _checker_version()],
                       default=str)
    return settings().cache_dir / "model-checks" / hashlib.sha1(ident.encode()).hexdigest()[:16]


def _quick_checks(folder: Path, family: str) -> ModelInfo:
    """What needs no model built: config.json read and supported, tokenizer.json there."""
    _read_json(folder / "config.json", "config.json")
    info = read_model_info(folder, family)  # names the missing or unsupported setting
    if not (folder / "tokenizer.json").is_file():
        raise ModelError(f"{folder}: no tokenizer.json (plora needs the model's fast tokenizer)")
    return info


@lru_cache(maxsize=32)
def _check_folder(folder: Path, family: str, random_init: bool, max_seq_len: int, _stamp: tuple) -> ModelInfo:
    info = _quick_checks(folder, family)
    marker = _passed_marker(folder, family, random_init, max_seq_len, _stamp)
    if marker.is_file():  # these very files passed before: no model to build again
        return info
    _read_json(folder / "tokenizer.json", "tokenizer.json")
    expected = expected_weights(info, max_seq_len)  # builds the model on meta: an unbuildable one fails here
    if not random_init:
        found = _weight_headers(folder)
        _compare(folder, info, expected, found)
    try:  # written aside and renamed: a check cut short never leaves a pass behind
        marker.parent.mkdir(parents=True, exist_ok=True)
        scratch = marker.with_name(f".{marker.name}.{os.getpid()}.{threading.get_ident()}")
        scratch.write_text(json.dumps({"folder": str(folder), "family": info.family}))
        os.replace(scratch, marker)
    except OSError:  # a read-only cache: the next sweep checks again
        pass
    return info


def _read_json(path: Path, what: str) -> Any:
    if not path.is_file():
        raise ModelError(f"{path.parent}: no {what}")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ModelError(f"{path}: not valid JSON ({json_error_text(e)})") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ModelError(f"{path}: cannot read ({e})") from None
    if not isinstance(data, dict):
        raise ModelError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def expected_weights(info: ModelInfo, max_seq_len: int = 8) -> dict[str, tuple[int, ...]]:
    """torchtune weight name -> shape of the empty model the family's builder makes (on meta)."""
    from plora.models.loading import build_on_meta  # torch: where a model is built

    model = build_on_meta(info, max_seq_len)
    return {name: tuple(t.shape) for name, t in model.state_dict().items()}


def _weight_headers(folder: Path) -> dict[str, tuple[int, ...]]:
    """Every tensor name and shape in the folder's safetensors files (headers only)."""
    from safetensors import safe_open

    files = sorted(folder.glob("*.safetensors"))
    index_path = folder / INDEX_FILE
    if index_path.is_file():
        index = _read_json(index_path, INDEX_FILE)
        weight_map = index.get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ModelError(f"{index_path}: no weight_map")
        missing = sorted({f for f in weight_map.values() if not (folder / str(f)).is_file()})
        if missing:
            raise ModelError(f"{index_path}: names shard files that are not there: {', '.join(missing[:_SHOWN])}")
    elif not files:
        raise ModelError(f"{folder}: no *.safetensors weights (convert .bin/.pt checkpoints to safetensors first)")
    found: dict[str, tuple[int, ...]] = {}
    for f in files:
        try:
            with safe_open(str(f), framework="pt") as st:
                for name in st.keys():
                    found[name] = tuple(st.get_slice(name).get_shape())
        except Exception as e:  # noqa: BLE001 - a truncated or foreign file
            raise ModelError(f"{f}: not a readable safetensors file ({str(e).splitlines()[0] if str(e) else type(e).__name__})") from None
    if index_path.is_file():
        indexed = set(index["weight_map"])
        absent = sorted(indexed - set(found))
        if absent:
            raise ModelError(f"{index_path}: lists tensors no shard holds: {', '.join(absent[:_SHOWN])}")
    return found


def _compare(folder: Path, info: ModelInfo, expected: dict[str, tuple[int, ...]],
             found: dict[str, tuple[int, ...]]) -> None:
    """The family's own Hugging Face -> torchtune conversion, run on meta tensors of the
    header shapes: the same renames, permutes and splits the load will do, without data."""
    import torch

    from plora.models.families.table import get_family

    meta = {name: torch.empty(shape, device="meta") for name, shape in found.items()}
    converted = get_family(info.family).hf_to_tune(meta, info)  # unknown names: ModelError
    missing = [n for n in expected if n not in converted]
    if missing:
        more = f" (and {len(missing) - _SHOWN} more)" if len(missing) > _SHOWN else ""
        raise ModelError(f"{folder}: the weights lack {len(missing)} tensor(s) the {info.family} model needs: "
                         f"{', '.join(missing[:_SHOWN])}{more}")
    unexpected = sorted(set(converted) - set(expected))
    if unexpected:
        raise ModelError(f"{folder}: weights the {info.family} model does not have: {', '.join(unexpected[:_SHOWN])}")
    for name, shape in expected.items():
        got = tuple(converted[name].shape)
        if got != shape:
            raise ModelError(f"{folder}: weight {name} has shape {list(got)}, config.json implies {list(shape)}")


#: checks a folder in another process: (folder, family, random_init, max_seq_len) -> None where
#: it could not, "" where the folder passed, else the problem's line (`start_spec_model_check`)
CheckElsewhere = Callable[[Path, str, bool, int], "str | None"]


def start_spec_model_check(spec: Any, elsewhere: CheckElsewhere | None = None) -> Callable[[], ModelInfo]:
    """`check_spec_model`, its slow part done while the caller goes on.

    The quick checks run now and raise their `SpecError` here: the model path (a GGUF file
    converted), config.json, tokenizer.json. Building the model on meta and comparing the
    weights' names and shapes needs torchtune, whose import took 9 s of a first sweep's start
    on an H100 machine, in series with its data check and planning. With ``elsewhere`` (a
    sweep's job process started ahead, which imports torchtune anyway: `plora.engine.spare`)
    that part is asked of it when the returned callable is called, and done here only where it
    gave no answer; without, it runs on a thread (which shares this process's interpreter lock
    with the planning: on an H100 machine the two took as long together as one after the
    other). The returned callable raises the `SpecError`: a sweep calls it after planning and
    before it writes or launches anything. A folder that passed before (`_passed_marker`) has
    nothing left to run.
    """
    from plora.spec.base import SpecError

    m = spec.model
    try:
        folder = resolve_model_path(m.resolved_path())
        stamp = _stamp(folder)
        info = _quick_checks(folder, m.family)
    except ModelError as e:
        raise SpecError("model.path", str(e)) from None
    if _passed_marker(folder, m.family, m.random_init, m.max_seq_len, stamp).is_file():
        return lambda: info
    if elsewhere is not None:
        def ask() -> ModelInfo:
            if not m.random_init:  # a GGUF's weights, converted meanwhile (`plora.models.gguf.convert_weights_ahead`)
                try:
                    ensure_weights(folder)
                except ModelError as e:
                    raise SpecError("model.path", str(e)) from None
            problem = elsewhere(folder, m.family, m.random_init, m.max_seq_len)
            if problem:
                raise SpecError("model.path", problem)
            if problem is None:  # not answered there: here, then
                return check_spec_model(spec)
            return info

        return ask
    outcome: dict[str, Any] = {}

    def run() -> None:
        try:
            outcome["info"] = check_spec_model(spec)
        except BaseException as e:  # noqa: BLE001 - handed to the waiting caller
            outcome["error"] = e

    thread = threading.Thread(target=run, name="plora-model-check", daemon=True)
    thread.start()

    def wait() -> ModelInfo:
        thread.join()
        if "error" in outcome:
            raise outcome["error"]
        return outcome["info"]

    return wait


def check_spec_model(spec: Any) -> ModelInfo:
    """Check a validated SweepSpec's model; a problem is a SpecError at ``model.path``.

    Called by `plora.sweep.prepare` and by the CLI's commands right after the space is
    loaded, so `sweep`, `plan`, `profile` and `tune` refuse a broken model before they
    measure or write anything (`plan`, `profile` and `tune` before they plan too; `sweep`
    plans meanwhile: `start_spec_model_check`).
    """
    from plora.spec.base import SpecError

    try:
        return check_model(spec.model.resolved_path(), spec.model.family, random_init=spec.model.random_init,
                           max_seq_len=spec.model.max_seq_len)
    except ModelError as e:
        raise SpecError("model.path", str(e)) from None
