"""Exporting a sweep's adapters into folders that Hugging Face tools load as they are.

An adapter in a run directory is already in the PEFT format, but it is one folder among
many and its base model is wherever the space file said (a shipped model, a GGUF file
dequantized into plora's cache). An export is self-contained: the PEFT adapter with the base
model's tokenizer and chat template beside it (``PeftModel.from_pretrained`` +
``AutoTokenizer.from_pretrained(folder)``), or with ``merge`` a whole model with the adapter
merged into its weights (``AutoModelForCausalLM.from_pretrained(folder)``, no PEFT needed).

Each folder is written aside and renamed into place, so a failed export leaves nothing
half-written; a folder that exists and is not empty is never overwritten.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd
import yaml

__all__ = ["ExportError", "ExportedAdapter", "base_model_folder", "export_adapters", "select_adapters"]

#: the PEFT adapter's own files
ADAPTER_FILES: tuple[str, ...] = ("adapter_model.safetensors", "adapter_config.json")
#: a model folder's tokenizer and chat template files (whichever it has)
TOKENIZER_FILES: tuple[str, ...] = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json", "tokenizer.model",
    "vocab.json", "vocab.txt", "merges.txt", "chat_template.jinja", "chat_template.json",
)


class ExportError(ValueError):
    """An export that cannot be made; the message is one line naming what is wrong."""


@dataclass(frozen=True)
class ExportedAdapter:
    adapter_id: str
    path: Path
    merged: bool


def _run_spec(run_dir: Path) -> dict[str, Any]:
    path = run_dir / "spec.yaml"
    if not path.is_file():
        raise ExportError(f"{run_dir}: not a run directory (no spec.yaml)")
    try:
        data = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as e:
        raise ExportError(f"{path}: cannot read: {str(e).splitlines()[0]}") from None
    if not isinstance(data, dict):
        raise ExportError(f"{path}: not a resolved space file")
    return data


def _results(run_dir: Path) -> pd.DataFrame:
    """The run's adapters with their status and scores: results.parquet, or (a sweep
    stopped before it wrote one) every adapter's metrics.json."""
    path = run_dir / "results.parquet"
    if path.is_file():
        return pd.read_parquet(path)
    rows = []
    for m in sorted((run_dir / "adapters").glob("*/metrics.json")):
        try:
            row = json.loads(m.read_text())
        except (OSError, ValueError):
            continue
        rows.append({k: v for k, v in row.items() if not isinstance(v, (dict, list))})
    return pd.DataFrame(rows, columns=None if rows else ["adapter_id", "status"])


def _has_weights(run_dir: Path, adapter_id: str) -> bool:
    return all((run_dir / "adapters" / adapter_id / name).is_file() for name in ADAPTER_FILES)


def select_adapters(run_dir: Path, adapter_id: str | None = None, *, best: bool = False,
                    every: bool = False) -> list[str]:
    """The adapters to export: ``adapter_id``; with ``best``, the best finished one by the
    sweep's objective in its direction (``eval.greater_is_better``, else the metric's own:
    `plora.results.metrics.minimize`), ties to the lower eval loss as `plora.results.collect.ranked` breaks
    them; with ``every``, each one that has weights. Exactly one of the three."""
    from plora.results.metrics import minimize
    from plora.results.collect import ranked

    run_dir = Path(run_dir)
    if sum([adapter_id is not None, best, every]) != 1:
        raise ExportError("ADAPTER_ID, --best, --all: give exactly one")
    spec = _run_spec(run_dir)
    frame = _results(run_dir)
    if adapter_id is not None:
        if not (run_dir / "adapters" / adapter_id).is_dir() and adapter_id not in set(frame["adapter_id"]):
            raise ExportError(f"ADAPTER_ID: no adapter {adapter_id!r} in {run_dir}")
        if not _has_weights(run_dir, adapter_id):
            status = frame.loc[frame["adapter_id"] == adapter_id, "status"]
            why = f" (status {status.iloc[0]})" if len(status) else ""
            raise ExportError(f"ADAPTER_ID: {adapter_id} has no saved weights to export{why}")
        return [adapter_id]
    if every:
        ids = [a for a in frame["adapter_id"] if _has_weights(run_dir, a)]
        if not ids:
            raise ExportError(f"--all: no adapter of {run_dir} has saved weights")
        return ids
    ev = spec.get("eval") or {}
    objective = str(ev.get("objective") or "loss")
    order = ranked(frame, objective, minimize(objective, ev.get("greater_is_better")))
    column = f"eval_{objective}"
    order = order[order[column].notna()] if column in order.columns else order.iloc[0:0]
    ids = [a for a in order["adapter_id"] if _has_weights(run_dir, a)]
    if not ids:
        raise ExportError(f"--best: no finished adapter of {run_dir} has a score for the objective {objective}")
    return ids[:1]


def base_model_folder(run_dir: Path, *, merge: bool = False) -> Path:
    """The base model's folder of a run, as its spec.yaml names it (`ModelConfig.resolved_path`:
    a shipped model, a Hugging Face folder, a GGUF file's dequantized copy in plora's cache).
    A ``shape:`` model was drawn at random and never saved: nothing to merge into."""
    from plora.spec.base import SpecError
    from plora.spec.loading import parse_model_section

    try:
        cfg = parse_model_section(_run_spec(Path(run_dir)).get("model"), Path(run_dir))
    except SpecError as e:
        raise ExportError(f"{Path(run_dir) / 'spec.yaml'}: {e}") from None
    if merge and cfg.random_init:
        raise ExportError(f"--merge: the base model {cfg.path} is random-init (its weights were never saved), "
                          "so there is nothing to merge into; export the adapter without --merge")
    try:
        return cfg.resolved_path()
    except (SpecError, OSError, ValueError) as e:
        raise ExportError(f"model.path: {str(e).splitlines()[0]}") from None


def _targets(run_dir: Path, adapter_ids: list[str], output: Path | None, merge: bool, nested: bool) -> list[Path]:
    """Where each export goes: ``output`` itself for one adapter, ``output/<id>`` for several
    (or with ``nested``), by default ``<run>/exports/<id>`` (``<id>-merged`` merged). Each
    must be free."""
    suffix = "-merged" if merge else ""
    if output is not None and len(adapter_ids) == 1 and not nested:
        targets = [Path(output)]
    else:
        root = Path(output) if output is not None else run_dir / "exports"
        targets = [root / f"{a}{suffix if output is None else ''}" for a in adapter_ids]
    for t in targets:
        if t.exists() and (not t.is_dir() or any(t.iterdir())):
            raise ExportError(f"--output: {t} exists and is not an empty folder; choose another or remove it")
    return targets


def _tokenizer_config(model_dir: Path) -> dict[str, Any] | None:
    """A tokenizer_config.json for a model folder that has tokenizer.json but none: without it
    `AutoTokenizer` cannot tell the class, nor the special tokens, from the adapter's folder."""
    if (model_dir / "tokenizer_config.json").is_file() or not (model_dir / "tokenizer.json").is_file():
        return None
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    try:
        config = json.loads((model_dir / "config.json").read_text())
    except (OSError, ValueError):
        config = {}
    out: dict[str, Any] = {"tokenizer_class": "PreTrainedTokenizerFast"}
    for name in ("bos", "eos", "pad"):
        token_id = config.get(f"{name}_token_id")
        if isinstance(token_id, list):
            token_id = token_id[0] if token_id else None
        token = tok.id_to_token(token_id) if isinstance(token_id, int) else None
        if token is not None:
            out[f"{name}_token"] = token
    return out


def _copy_tokenizer(model_dir: Path, out: Path) -> None:
    for name in TOKENIZER_FILES:
        if (model_dir / name).is_file():
            shutil.copy2(model_dir / name, out / name)
    extra = _tokenizer_config(model_dir)
    if extra is not None:
        (out / "tokenizer_config.json").write_text(json.dumps(extra, indent=2) + "\n")


def _generation_config(model_dir: Path, out: Path) -> None:
    """generation_config.json as transformers derives it from config.json, where the base has none."""
    if (out / "generation_config.json").is_file():
        return
    try:
        config = json.loads((model_dir / "config.json").read_text())
    except (OSError, ValueError):
        return
    gen = {"_from_model_config": True,
           **{k: config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if config.get(k) is not None}}
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")


def _write_one(run_dir: Path, adapter_id: str, model_dir: Path, target: Path, merge: bool) -> None:
    from plora.train.packed.peft_format import merge_adapter

    adapter_dir = run_dir / "adapters" / adapter_id
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.parent / f".{target.name}.partial"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        if merge:
            merge_adapter(model_dir, adapter_dir, tmp)
            _generation_config(model_dir, tmp)
        else:
            for name in ADAPTER_FILES:
                shutil.copy2(adapter_dir / name, tmp / name)
            from plora.quantize.export import NOTE_FILE  # trained on a quantized base: its note

            if (adapter_dir / NOTE_FILE).is_file():
                shutil.copy2(adapter_dir / NOTE_FILE, tmp / NOTE_FILE)
        _copy_tokenizer(model_dir, tmp)
        if target.is_dir():
            target.rmdir()  # empty, checked before
        tmp.rename(target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def export_adapters(run_dir: Path, adapter_ids: list[str], output: Path | None = None, *,
                    merge: bool = False, nested: bool = False) -> list[ExportedAdapter]:
    """Write each adapter's export (see the module's docstring) and say where: into
    ``output`` (``nested``, or several adapters: a folder per adapter in it). Every target is
    checked before the first is written."""
    run_dir = Path(run_dir)
    model_dir = base_model_folder(run_dir, merge=merge)
    targets = _targets(run_dir, adapter_ids, output, merge, nested)
    out = []
    for adapter_id, target in zip(adapter_ids, targets):
        try:
            _write_one(run_dir, adapter_id, model_dir, target, merge)
        except OSError as e:
            raise ExportError(f"--output: cannot write {target}: {e.strerror or e}") from None
        except ValueError as e:  # merge_adapter: the adapter does not fit the base model's weights
            raise ExportError(f"{adapter_id}: {str(e).splitlines()[0]}") from None
        out.append(ExportedAdapter(adapter_id, target, merge))
    return out
