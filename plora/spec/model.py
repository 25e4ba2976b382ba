"""The ``model`` section and what it resolves: the model's folder (a built-in, a local
folder, a ``.gguf`` file, a Hub id from the local cache, or a shape preset for planning) and
the LoRA targets it has (``all-linear`` and each layer name, per family: the names
themselves live in `plora.models.families.targets`)."""

from __future__ import annotations

from pathlib import Path
from typing import Literal, Optional

from pydantic import Field, ValidationInfo, field_validator

from plora.models.families.targets import ALL_LINEAR, LLAMA_TARGETS
from plora.spec import defaults as D
from plora.spec.base import _Issue, _Model, _resolve, _where_relative, SpecError


#: Folder of the models shipped with plora (``model.path: builtin:<name>``).
#: A module attribute so that tests can point it elsewhere.
ASSETS_DIR: Path = Path(__file__).resolve().parents[1] / "assets"

#: Linear layers of a llama-style decoder that LoRA can adapt, and the keyword for all of them
#: (`plora.models.families.targets`, their one home).
KNOWN_TARGETS: tuple[str, ...] = LLAMA_TARGETS


def _gguf_builtins() -> tuple[str, ...]:
    from plora.models.gguf import BUILTIN_GGUF

    return tuple(BUILTIN_GGUF)


def available_models() -> list[str]:
    """Names usable as ``model.path: builtin:<name>``."""
    if not ASSETS_DIR.is_dir():
        return []
    return sorted(p.name for p in ASSETS_DIR.iterdir() if p.is_dir() and not p.name.startswith((".", "_")))


def _check_targets(targets: str | list[str], family: str | None = None) -> list[str]:
    """The layer names `targets` stands for. Without a family, any layer some family has is
    accepted and ``all-linear`` is the llama-style set; with one, ``all-linear`` is that
    family's set and a layer it lacks is refused by name."""
    from plora.models.families.targets import ALL_TARGET_NAMES, family_targets

    if isinstance(targets, str):
        targets = [targets]
    if not targets:
        raise _Issue("must name at least one layer")
    if family is not None:
        try:
            known = family_targets(family)
        except KeyError as e:
            raise _Issue(str(e.args[0])) from None
    else:
        known = ALL_TARGET_NAMES
    out: list[str] = []
    for t in targets:
        if t == ALL_LINEAR:
            names = list(KNOWN_TARGETS if family is None else known)
        elif t in known:
            names = [t]
        elif family is not None and t in ALL_TARGET_NAMES:
            raise _Issue(f"the {family} family has no {t!r} layer; its linear layers: {', '.join(known)} (or {ALL_LINEAR!r})")
        else:
            raise _Issue(f"unknown target {t!r}; expected {ALL_LINEAR!r} or some of: {', '.join(known)}")
        out += [n for n in names if n not in out]
    return out


def resolve_targets(targets: str | list[str], family: str | None = None) -> list[str]:
    """Hugging Face layer names to adapt; ``"all-linear"`` expands to every linear layer of
    a decoder block of `family` (llama-style when no family is given)."""
    try:
        return _check_targets(targets, family)
    except _Issue as e:
        raise SpecError("lora.targets", e.message) from None


# --------------------------------------------------------------------------- sections


class ModelConfig(_Model):
    path: str = "builtin:tiny-llama"
    family: Literal["auto", "llama", "qwen2", "mistral"] = "auto"
    dtype: Literal["float32", "bfloat16", "float16"] = D.DTYPE
    max_seq_len: int = Field(64, ge=8)
    #: the frozen block linears held 4-bit (QLoRA's NF4, `plora.quantize`); None: in ``dtype``
    quantize: Optional[str] = None

    @field_validator("quantize")
    @classmethod
    def _check_quantize(cls, v: Optional[str]) -> Optional[str]:
        from plora.quantize.cost import check_quantize

        try:
            return check_quantize(v)
        except ValueError as e:
            raise _Issue(str(e)) from None

    @field_validator("path")
    @classmethod
    def _check_path(cls, v: str, info: ValidationInfo) -> str:
        if v.startswith("builtin:"):
            name = v.removeprefix("builtin:")
            if name in _gguf_builtins():
                return v
            if name not in available_models():
                avail = ", ".join(available_models()) or "none installed"
                raise _Issue(f"unknown built-in model {name!r}; available: {avail}")
            return v
        if v.startswith("shape:"):
            from plora.models.shape import ModelShape

            name = v.removeprefix("shape:")
            if name not in ModelShape.presets():
                raise _Issue(f"unknown model shape {name!r}; known: {', '.join(ModelShape.presets())}")
            return v
        p = _resolve(v, info)
        if p.suffix.lower() == ".gguf":
            if not p.is_file():
                raise _Issue(f"GGUF file not found: {p}{_where_relative(v, info)}")
            return str(p)
        if not p.exists():
            from plora.models.hub_cache import HubCacheError, cached_model, looks_like_repo_id

            if looks_like_repo_id(v):  # a Hub id, where no folder of that name is beside the space file
                try:
                    return str(cached_model(v))
                except HubCacheError as e:
                    raise _Issue(f"no folder {p}, and {e}") from None
        if not p.is_dir():
            raise _Issue(f"directory not found: {p}{_where_relative(v, info)}")
        if not (p / "config.json").is_file():
            raise _Issue(f"no config.json in {p} (expected a Hugging Face model folder)")
        return str(p)

    def resolved_path(self, *, weights: bool = False) -> Path:
        """The model folder on disk (``builtin:<name>`` mapped into plora/assets;
        ``shape:<preset>`` to a config-only folder in plora's cache, see `random_init`). A
        GGUF file's is converted once (per dtype) into plora's cache: its config and
        tokenizer at once, its weights with ``weights`` or where they are first read."""
        if self.path.endswith(".gguf") or self.path.removeprefix("builtin:") in _gguf_builtins():
            from plora.models.folders import resolve_model_path

            return resolve_model_path(self.path, self.dtype, weights=weights)
        if self.path.startswith("builtin:"):
            return ASSETS_DIR / self.path.removeprefix("builtin:")
        if self.path.startswith("shape:"):
            from plora.models.shape import ModelShape
            from plora.models.folders import shape_folder

            return shape_folder(ModelShape.preset(self.path.removeprefix("shape:")))
        return Path(self.path)

    @property
    def random_init(self) -> bool:
        """``shape:<preset>``: a randomly initialised model of a known architecture. Planning
        and timing need the shape only; the weights are not on disk."""
        return self.path.startswith("shape:")
