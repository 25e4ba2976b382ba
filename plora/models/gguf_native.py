"""A GGUF model converted into a Hugging Face folder without transformers or torch.

transformers converts a GGUF file through its model classes: its head (config, tokenizer)
imports torch and transformers (11–13 s of a first SmolLM2 sweep on an H200 host, before
planning could start), and its weights load the whole model (another 17–19 s in a process of
their own, which the first job then waits for). Both halves are simple for the files most
users bring: llama.cpp's llama architecture (Llama, SmolLM2, and models converted as llama)
with a byte-level BPE vocabulary. For those the header is read directly
(`plora.models.gguf_file`), the config and tokenizer are written from it with ``tokenizers``,
and each tensor is dequantized with ``gguf``'s own numpy routines (the ones transformers
calls) on a few threads and written with ``safetensors``: the same numbers, bit for bit, as
transformers' conversion, in about a second.

Anything else (another architecture, a sentencepiece vocabulary, RoPE scaling, biases, a
quantization ``gguf`` cannot dequantize) is left to transformers: `layout` says why not,
and the caller converts the old way. The rules follow what transformers does with these
files, so that either way gives a folder that loads into the same model and tokenizes alike
(`tests/test_gguf_native.py` compares the two on SmolLM2 and on made-up files).
"""

from __future__ import annotations

import json
import math
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

from plora.models.gguf_file import GGUFFile

__all__ = ["NativeLayout", "layout", "write_head", "write_weights"]

#: GGUF tensors of one llama block -> the Hugging Face names (``model.layers.{i}.`` + these)
_BLOCK_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_TOP_NAMES = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
              "output.weight": "lm_head.weight"}

#: llama.cpp's pre-tokenizer names whose text splitting transformers leaves to the byte-level
#: pre-tokenizer's own GPT-2 pattern
_GPT2_SPLIT_PRE = frozenset({"default", "gpt2", "smollm", "starcoder", "refact", "olmo", "gpt-2"})
#: the Llama 3 pattern, and llama.cpp's pre-tokenizer names that use it
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_LLAMA3_SPLIT_PRE = frozenset({"llama3", "llama-v3", "llama-bpe", "smaug-bpe"})

#: llama.cpp's token types: a control token is special (``<|im_end|>``), a user-defined one is
#: matched whole but is not special (``<think>``)
_CONTROL, _USER_DEFINED = 3, 4

#: the config's special token ids -> llama.cpp's keys (``tokenizer.ggml.<key>``); without
#: ``_id``, the tokenizer config's names of the same tokens
_GGUF_ID_KEYS = {"bos_token_id": "bos_token_id", "eos_token_id": "eos_token_id",
                 "pad_token_id": "padding_token_id", "unk_token_id": "unknown_token_id"}

#: tensors are written in files of about this size (a larger model gets an index), and
#: dequantized a file at a time, which bounds the memory a conversion holds
SHARD_BYTES = 5 << 30

WEIGHT_DTYPES = ("float32", "float16", "bfloat16")


@dataclass(frozen=True)
class NativeLayout:
    """What `layout` found in a file it can convert."""

    blocks: int
    heads: int
    kv_heads: int
    #: GGUF tensor name -> Hugging Face name
    names: dict[str, str]
    #: token -> id, respelled in the byte alphabet (`_byte_level_vocab`): what the tokenizer holds
    vocab: dict[str, int]


def layout(g: GGUFFile, dtype: str) -> NativeLayout | str:
    """The file's layout where this module converts it, else why not (one line)."""
    md = g.metadata
    arch = md.get("general.architecture")
    if arch != "llama":
        return f"architecture {arch!r}"
    if "mistral" in str(md.get("general.name", "")).lower():
        return "a Mistral model (transformers makes it a MistralConfig)"
    if any(k.startswith("llama.rope.scaling.") for k in md) or "rope_freqs.weight" in g.tensors:
        return "RoPE scaling"
    if md.get("llama.expert_count"):
        return "experts"
    if md.get("tokenizer.ggml.model") != "gpt2":
        return f"tokenizer model {md.get('tokenizer.ggml.model')!r}"
    pre = md.get("tokenizer.ggml.pre", "default")
    if pre not in _GPT2_SPLIT_PRE | _LLAMA3_SPLIT_PRE:
        return f"pre-tokenizer {pre!r}"
    if md.get("tokenizer.ggml.add_eos_token"):
        return "a tokenizer that adds eos"
    merges = md.get("tokenizer.ggml.merges")
    if not isinstance(merges, list) or any(m.count(" ") != 1 for m in merges):
        return "merges missing or not pairs"
    tokens = md.get("tokenizer.ggml.tokens")
    if not isinstance(tokens, list) or not tokens:
        return "no vocabulary"
    vocab = _byte_level_vocab(tokens)
    if problem := _vocabulary_problem(md, tokens, vocab):
        return problem
    for key in ("llama.block_count", "llama.embedding_length", "llama.feed_forward_length",
                "llama.attention.head_count", "llama.context_length", "llama.attention.layer_norm_rms_epsilon"):
        if not isinstance(md.get(key), (int, float)):
            return f"{key} missing"
    for key in ("llama.attention.head_count_kv", "llama.rope.dimension_count", "llama.attention.key_length",
                "llama.rope.freq_base", "llama.vocab_size"):
        if key in md and not isinstance(md[key], (int, float)):  # a per-layer array, say
            return f"{key} is not one number"
    if "llama.attention.head_count_kv" not in md:  # transformers then leaves q and k as llama.cpp stored them
        return "llama.attention.head_count_kv missing"
    blocks, heads = int(md["llama.block_count"]), int(md["llama.attention.head_count"])
    kv_heads = int(md["llama.attention.head_count_kv"])
    head_dim = _head_dim(md)
    if "llama.attention.key_length" in md and int(md["llama.attention.key_length"]) != head_dim:
        return "attention.key_length differs from the RoPE dimension"
    if heads <= 0 or kv_heads <= 0 or heads % kv_heads or head_dim % 2:
        return f"{heads} heads, {kv_heads} key/value heads of {head_dim}"
    if dtype == "bfloat16" and not _imports("ml_dtypes"):
        return "bfloat16 needs ml_dtypes"
    if not _imports("gguf"):
        return "no gguf package"
    names = {}
    for name in g.tensors:
        if name in _TOP_NAMES:
            names[name] = _TOP_NAMES[name]
            continue
        parts = name.split(".", 2)
        if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in _BLOCK_NAMES \
                and int(parts[1]) < blocks:
            names[name] = f"model.layers.{parts[1]}.{_BLOCK_NAMES[parts[2]]}"
        else:
            return f"tensor {name!r}"
    expected = {f"blk.{i}.{n}" for i in range(blocks) for n in _BLOCK_NAMES} | {"token_embd.weight", "output_norm.weight"}
    if missing := sorted(expected - set(names)):
        return f"tensor {missing[0]!r} missing"
    hidden = int(md["llama.embedding_length"])
    for i in range(blocks):  # what un-permuting q and k reshapes by
        for part, rows in (("attn_q", heads * head_dim), ("attn_k", kv_heads * head_dim)):
            shape = g.tensors[f"blk.{i}.{part}.weight"].shape
            if shape != (rows, hidden):
                return f"tensor 'blk.{i}.{part}.weight' of shape {shape}, not {(rows, hidden)}"
    try:
        from gguf import GGMLQuantizationType
        from gguf.quants import _type_traits  # what gguf dequantizes in numpy (F32 and F16 besides)
    except ImportError:
        return "this gguf package's dequantizers not found"

    for name, info in g.tensors.items():
        try:
            qtype = GGMLQuantizationType(info.ggml_type)
        except ValueError:
            return f"tensor {name!r} of unknown type {info.ggml_type}"
        if qtype not in (GGMLQuantizationType.F32, GGMLQuantizationType.F16) and qtype not in _type_traits:
            return f"tensor {name!r} of type {qtype.name}"
    return NativeLayout(blocks, heads, kv_heads, names, vocab)


def _vocabulary_problem(md: dict[str, Any], tokens: list[str], vocab: dict[str, int]) -> str | None:
    """Why transformers would build another tokenizer of this vocabulary, if it would: two
    tokens spelled alike in the byte alphabet (transformers keeps the last), or a special
    token not spelled in it (DeepSeek's ``<｜begin▁of▁sentence｜>``, which transformers names
    but the vocabulary it builds does not hold). ``vocab``: the tokens respelled
    (`_byte_level_vocab`)."""
    spelled = set(_byte_alphabet().values())
    if len(vocab) != len(tokens):
        return "two tokens spelled alike in the byte alphabet"
    for gguf_key in _GGUF_ID_KEYS.values():
        token_id = md.get(f"tokenizer.ggml.{gguf_key}")
        if token_id is None:
            continue
        if not isinstance(token_id, int) or not 0 <= token_id < len(tokens):
            return f"tokenizer.ggml.{gguf_key} {token_id} outside the vocabulary"
        if not set(tokens[token_id]) <= spelled:
            return f"special token {tokens[token_id]!r} not in the byte alphabet"
    types = md.get("tokenizer.ggml.token_type")
    if types is not None and len(types) != len(tokens):
        return "token types and tokens differ in number"
    return None


def _imports(name: str) -> bool:
    """Whether ``name`` imports (a wheel built against another numpy fails only there)."""
    import importlib

    try:
        importlib.import_module(name)
    except Exception:  # noqa: BLE001 - any failure: the other converter
        return False
    return True


def _head_dim(md: dict[str, Any]) -> int:
    if "llama.rope.dimension_count" in md:
        return int(md["llama.rope.dimension_count"])
    return int(md["llama.embedding_length"]) // int(md["llama.attention.head_count"])


# ----------------------------------------------------------------------------- the head


def write_head(g: GGUFFile, lay: NativeLayout, out: Path, dtype: str) -> None:
    """config.json, generation_config.json, tokenizer.json, tokenizer_config.json and the chat
    template, as transformers would make them of this file (same model, same ids)."""
    md = g.metadata
    out.mkdir(parents=True, exist_ok=True)
    _write_json(out / "config.json", _config(g, lay, dtype))
    generation: dict[str, Any] = {"_from_model_config": True}
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        value = md.get(f"tokenizer.ggml.{_GGUF_ID_KEYS[key]}")
        if value is not None:
            generation[key] = int(value)
    generation.update(output_attentions=False, output_hidden_states=False, use_cache=True)
    _write_json(out / "generation_config.json", dict(sorted(generation.items())))
    _tokenizer(md, lay.vocab).save(str(out / "tokenizer.json"))
    _write_json(out / "tokenizer_config.json", _tokenizer_config(md))
    template = md.get("tokenizer.chat_template")
    if isinstance(template, str) and template:
        (out / "chat_template.jinja").write_text(template)


def _config(g: GGUFFile, lay: NativeLayout, dtype: str) -> dict[str, Any]:
    md = g.metadata
    theta = float(md.get("llama.rope.freq_base", 10000.0))
    vocab = md.get("llama.vocab_size")
    if vocab is None:  # older files: the embedding's rows
        vocab = g.tensors["token_embd.weight"].shape[0]
    config: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "attention_bias": False,
        "hidden_act": "silu",
        "head_dim": _head_dim(md),
        "hidden_size": int(md["llama.embedding_length"]),
        "intermediate_size": int(md["llama.feed_forward_length"]),
        "max_position_embeddings": int(md["llama.context_length"]),
        "mlp_bias": False,
        "num_attention_heads": lay.heads,
        "num_hidden_layers": lay.blocks,
        "num_key_value_heads": lay.kv_heads,
        "rms_norm_eps": float(md["llama.attention.layer_norm_rms_epsilon"]),
        "rope_parameters": {"rope_theta": theta, "rope_type": "default"},
        "rope_theta": theta,  # the transformers 4 spelling (`plora.models.gguf._add_legacy_rope_theta`)
        # llama.cpp writes the output projection only where it is not the embedding
        "tie_word_embeddings": "output.weight" not in g.tensors,
        "vocab_size": int(vocab),
        "dtype": dtype,
        "use_cache": True,
    }
    for key, gguf_key in _GGUF_ID_KEYS.items():
        value = md.get(f"tokenizer.ggml.{gguf_key}")
        if value is not None:
            config[key] = int(value)
    return dict(sorted(config.items()))


@lru_cache(maxsize=1)
def _byte_alphabet() -> dict[int, str]:
    """GPT-2's byte -> printable character map, the alphabet byte-level vocabularies are spelled in."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    chars = printable[:]
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {b: chr(c) for b, c in zip(printable, chars)}


def _byte_level_vocab(tokens: list[str]) -> dict[str, int]:
    """Token -> id, a token written outside the byte alphabet spelled in it byte by byte, as
    transformers does (where two come out alike the last wins there too; `layout` refuses them)."""
    alphabet = _byte_alphabet()
    spelled = set(alphabet.values())
    return {token if set(token) <= spelled else "".join(alphabet[b] for b in token.encode("utf-8")): i
            for i, token in enumerate(tokens)}


def _tokenizer(md: dict[str, Any], vocab: dict[str, int]):
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

    spelled = set(_byte_alphabet().values())
    tokens: list[str] = md["tokenizer.ggml.tokens"]
    merges = [tuple(m.split(" ")) for m in md["tokenizer.ggml.merges"]]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, dropout=None, continuing_subword_prefix="",
                               end_of_word_suffix="", fuse_unk=False, byte_fallback=False))
    if md.get("tokenizer.ggml.pre", "default") in _LLAMA3_SPLIT_PRE:
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(_LLAMA3_SPLIT), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    else:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    types = md.get("tokenizer.ggml.token_type")
    types = [] if types is None else [int(t) for t in types]
    control = [AddedToken(t, normalized=False, special=True)
               for t, kind in zip(tokens, types) if kind == _CONTROL and set(t) <= spelled]
    if control:
        tok.add_special_tokens(control)
    user = [AddedToken(t, normalized=False, special=False)
            for t, kind in zip(tokens, types) if kind == _USER_DEFINED and t in vocab]
    if user:
        tok.add_tokens(user)
    bos_id = md.get("tokenizer.ggml.bos_token_id")
    if md.get("tokenizer.ggml.add_bos_token") and bos_id is not None:
        bos = tokens[int(bos_id)]
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos}:0 $A:0", pair=f"{bos}:0 $A:0 {bos}:1 $B:1", special_tokens=[(bos, int(bos_id))])
    else:
        tok.post_processor = processors.TemplateProcessing(single="$A:0", pair="$A:0 $B:1", special_tokens=[])
    return tok


def _tokenizer_config(md: dict[str, Any]) -> dict[str, Any]:
    tokens = md["tokenizer.ggml.tokens"]
    config: dict[str, Any] = {}
    for flag in ("add_bos_token", "add_eos_token"):
        if f"tokenizer.ggml.{flag}" in md:
            config[flag] = bool(md[f"tokenizer.ggml.{flag}"])
    for id_key, gguf_key in _GGUF_ID_KEYS.items():
        token_id = md.get(f"tokenizer.ggml.{gguf_key}")
        if token_id is not None and 0 <= int(token_id) < len(tokens):
            config[id_key.removesuffix("_id")] = tokens[int(token_id)]
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    return config


def _write_json(path: Path, value: dict[str, Any]) -> None:
    path.write_text(json.dumps(value, indent=2, ensure_ascii=False) + "\n")


# ----------------------------------------------------------------------------- the weights


def write_weights(g: GGUFFile, lay: NativeLayout, out: Path, dtype: str, *, threads: int | None = None) -> None:
    """The dequantized tensors in ``dtype``, as safetensors in ``out`` (with an index where
    they take more than one file). llama.cpp stores q and k with their rotary halves
    interleaved per head; they are put back as transformers does."""
    import numpy as np
    from safetensors.numpy import save_file

    if dtype not in WEIGHT_DTYPES:
        raise ValueError(f"cannot write weights as {dtype!r}")
    itemsize = 4 if dtype == "float32" else 2
    order = sorted(lay.names, key=lambda n: lay.names[n])
    shards: list[list[str]] = [[]]
    size = 0
    for name in order:
        nbytes = math.prod(g.tensors[name].dims) * itemsize
        if shards[-1] and size + nbytes > SHARD_BYTES:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    data = np.memmap(g.path, dtype=np.uint8, mode="r")
    threads = threads or min(8, os.cpu_count() or 1)
    weight_map: dict[str, str] = {}
    total = 0
    mode = 0o666 & ~_umask()  # (read before the pool's threads start: reading it sets it for a moment)
    with ThreadPoolExecutor(threads, thread_name_prefix="plora-gguf") as pool:
        for k, names in enumerate(shards, 1):
            file = "model.safetensors" if len(shards) == 1 else f"model-{k:05d}-of-{len(shards):05d}.safetensors"
            arrays = dict(zip((lay.names[n] for n in names),
                              pool.map(lambda n: _tensor(g, lay, data, n, dtype), names)))
            save_file(arrays, str(out / file), metadata={"format": "pt"})
            (out / file).chmod(mode)  # safetensors creates it readable by its owner only
            total += sum(a.nbytes for a in arrays.values())
            weight_map.update((n, file) for n in arrays)
            del arrays
    if len(shards) > 1:
        _write_json(out / "model.safetensors.index.json",
                    {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))})


def _tensor(g: GGUFFile, lay: NativeLayout, data, name: str, dtype: str):
    import numpy as np
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
    from gguf.quants import dequantize

    info = g.tensors[name]
    qtype = GGMLQuantizationType(info.ggml_type)
    block, type_size = GGML_QUANT_SIZES[qtype]
    row_bytes = info.dims[0] // block * type_size
    rows = math.prod(info.dims[1:])
    raw = data[info.offset: info.offset + rows * row_bytes].reshape(rows, row_bytes)
    w = np.asarray(dequantize(raw, qtype), dtype=np.float32).reshape(info.shape)
    if name.endswith(".attn_q.weight"):
        w = _unpermute(w, lay.heads)
    elif name.endswith(".attn_k.weight"):
        w = _unpermute(w, lay.kv_heads)
    if dtype == "bfloat16":
        import ml_dtypes

        return np.ascontiguousarray(w).astype(ml_dtypes.bfloat16)
    return np.ascontiguousarray(w, dtype=np.dtype(dtype))


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _unpermute(w, heads: int):
    """llama.cpp's q/k row order (each head's two rotary halves interleaved) back to Hugging Face's."""
    half = w.shape[0] // heads // 2
    return w.reshape(heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
