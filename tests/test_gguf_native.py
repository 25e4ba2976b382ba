"""plora's own GGUF conversion: the same folder transformers makes, without its imports.

A made-up llama file (grouped-query attention, an untied head, Q8_0/F16/F32 tensors, a
byte-level vocabulary with merges, control and user-defined tokens, Llama 3's text split and a
bos the tokenizer adds) is converted both ways: the configs load into the same transformers
config, the tokenizers give the same ids, the tensors are the same bits. What the native
path does not cover is converted by transformers, and the head says why.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from plora.models import gguf
from plora.models.gguf_file import GGUFFormatError, read_gguf

pytestmark = pytest.mark.skipif(importlib.util.find_spec("gguf") is None, reason="needs the gguf package")

TEXTS = ["Hello world", "  two  spaces\n\nand lines", "<|begin_of_text|>the theme<|eot_id|>", "<think>hmm</think>",
         "ünïcödé 123456 日本", "", "it's what we'd've done"]


def _alphabet() -> list[str]:
    from plora.models.gguf_native import _byte_alphabet

    table = _byte_alphabet()
    return [table[b] for b in range(256)]


def write_tiny_llama(path: Path, *, pre: str = "llama-bpe", add_bos: bool = True, tied: bool = False,
                     arch: str = "llama", extra_tensors: dict | None = None, extra_kv: dict | None = None,
                     kv_per_layer: bool = False, kv_missing: bool = False, extra_tokens: tuple[str, ...] = (),
                     bos: str = "<|begin_of_text|>") -> Path:
    import gguf as g

    rng = np.random.default_rng(0)
    hidden, ff, heads, kv, layers = 64, 128, 4, 2, 2
    merges = ["Ġ t", "h e", "t h", "Ġt he", "i t"]
    merged = ["Ġt", "he", "th", "Ġthe", "it"]
    specials = [bos, "<|end_of_text|>", "<|eot_id|>"]
    tokens = _alphabet() + merged + specials + ["<think>", "</think>"] + list(extra_tokens)
    types = [1] * (256 + len(merged)) + [3] * len(specials) + [4, 4] + [1] * len(extra_tokens)
    w = g.GGUFWriter(str(path), arch)
    w.add_name("tiny llama")
    w.add_block_count(layers)
    w.add_context_length(256)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(ff)
    w.add_head_count(heads)
    if not kv_missing:
        w.add_head_count_kv([kv] * layers if kv_per_layer else kv)
    w.add_rope_dimension_count(hidden // heads)
    w.add_rope_freq_base(500000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(len(tokens))
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(tokens.index(bos))
    w.add_eos_token_id(tokens.index("<|eot_id|>"))
    w.add_pad_token_id(tokens.index("<|end_of_text|>"))
    w.add_add_bos_token(add_bos)
    w.add_chat_template("{% for m in messages %}<|begin_of_text|>{{ m['content'] }}<|eot_id|>{% endfor %}")
    for key, value in (extra_kv or {}).items():
        w.add_key_value(key, value, g.GGUFValueType.FLOAT32)

    def add(name, shape, qtype):
        data = rng.standard_normal(shape).astype(np.float32) * 0.1
        if qtype == g.GGMLQuantizationType.F32:
            w.add_tensor(name, data)
        elif qtype == g.GGMLQuantizationType.F16:
            w.add_tensor(name, data.astype(np.float16))
        else:
            w.add_tensor(name, g.quants.quantize(data, qtype), raw_dtype=qtype)

    q8, f16, f32 = g.GGMLQuantizationType.Q8_0, g.GGMLQuantizationType.F16, g.GGMLQuantizationType.F32
    add("token_embd.weight", (len(tokens), hidden), q8)
    if not tied:
        add("output.weight", (len(tokens), hidden), f16)
    add("output_norm.weight", (hidden,), f32)
    head_dim = hidden // heads
    for i in range(layers):
        add(f"blk.{i}.attn_norm.weight", (hidden,), f32)
        add(f"blk.{i}.ffn_norm.weight", (hidden,), f32)
        add(f"blk.{i}.attn_q.weight", (heads * head_dim, hidden), q8)
        add(f"blk.{i}.attn_k.weight", (kv * head_dim, hidden), q8)
        add(f"blk.{i}.attn_v.weight", (kv * head_dim, hidden), f16)
        add(f"blk.{i}.attn_output.weight", (hidden, heads * head_dim), q8)
        add(f"blk.{i}.ffn_gate.weight", (ff, hidden), q8)
        add(f"blk.{i}.ffn_up.weight", (ff, hidden), q8)
        add(f"blk.{i}.ffn_down.weight", (hidden, ff), q8)
    for name, shape in (extra_tensors or {}).items():
        add(name, shape, f32)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_the_header_reads_as_ggufs_own_reader_reads_it(tmp_path):
    import gguf as g

    file = write_tiny_llama(tmp_path / "m.gguf")
    ours = read_gguf(file)
    theirs = g.GGUFReader(str(file))
    for key, field in theirs.fields.items():
        if key.startswith("GGUF."):
            continue
        value = ours.metadata[key]
        assert (value.tolist() if isinstance(value, np.ndarray) else value) == pytest.approx(field.contents()), key
    assert {t.name: (tuple(int(d) for d in t.shape), int(t.tensor_type), int(t.data_offset)) for t in theirs.tensors} \
        == {n: (t.dims, t.ggml_type, t.offset) for n, t in ours.tensors.items()}


@pytest.mark.parametrize("damage", ["magic", "cut", "empty", "not utf-8", "big-endian"])
def test_a_damaged_header_is_one_error(tmp_path, damage):
    file = write_tiny_llama(tmp_path / "m.gguf")
    raw = file.read_bytes()
    at = raw.index(b"<|eot_id|>")
    file.write_bytes({"magic": b"GGUX" + raw[4:], "cut": raw[:2000], "empty": b"",
                      "not utf-8": raw[:at] + b"\xff" + raw[at + 1:],
                      "big-endian": raw[:4] + (3).to_bytes(4, "big") + raw[8:]}[damage])
    with pytest.raises(GGUFFormatError):
        read_gguf(file)


def test_a_head_plora_cannot_write_is_written_by_transformers(tmp_path, monkeypatch):
    pytest.importorskip("transformers")
    from plora.models import gguf_native

    def fail(*args, **kwargs):
        raise RuntimeError("token out of vocabulary")

    monkeypatch.setattr(gguf_native, "write_head", fail)
    folder = _convert(write_tiny_llama(tmp_path / "m.gguf"), tmp_path / "cache", "float32", "auto", monkeypatch)
    head = json.loads((folder / "plora-gguf-head.json").read_text())
    assert head["converter"] == "transformers" and "token out of vocabulary" in head["not_native"]
    assert (folder / "model.safetensors").is_file() and (folder / "tokenizer.json").is_file()


def _convert(file: Path, cache: Path, dtype: str, converter: str, monkeypatch) -> Path:
    monkeypatch.setenv("PLORA_CACHE_DIR", str(cache))
    monkeypatch.setenv("PLORA_GGUF_CONVERTER", converter)
    return gguf.converted_folder(file, dtype)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_native_folder_is_what_transformers_makes(tmp_path, monkeypatch, dtype):
    pytest.importorskip("transformers")
    from safetensors.numpy import load_file
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    file = write_tiny_llama(tmp_path / "tiny.gguf")
    ours = _convert(file, tmp_path / "ours", dtype, "auto", monkeypatch)
    theirs = _convert(file, tmp_path / "theirs", dtype, "transformers", monkeypatch)
    assert json.loads((ours / "plora-gguf-head.json").read_text())["converter"] == "plora"
    assert json.loads((ours / "plora-gguf.json").read_text())["converter"] == "plora"
    assert json.loads((theirs / "plora-gguf.json").read_text())["converter"] == "transformers"

    names = ("_name_or_path", "_model_name_or_path", "transformers_version")
    a, b = (AutoConfig.from_pretrained(f).to_dict() for f in (ours, theirs))
    assert {k: v for k, v in a.items() if k not in names} == {k: v for k, v in b.items() if k not in names}
    a, b = (GenerationConfig.from_pretrained(f).to_dict() for f in (ours, theirs))
    assert {k: v for k, v in a.items() if k not in names} == {k: v for k, v in b.items() if k not in names}

    ta, tb = AutoTokenizer.from_pretrained(ours), AutoTokenizer.from_pretrained(theirs)
    assert ta.special_tokens_map == tb.special_tokens_map
    for text in TEXTS:
        assert ta(text).input_ids == tb(text).input_ids, text
        assert ta(text).input_ids[:1] == [ta.bos_token_id]  # the file says the tokenizer adds bos
        assert ta.decode(ta(text).input_ids) == tb.decode(tb(text).input_ids)
    chat = [{"role": "user", "content": "the theme"}]
    assert ta.apply_chat_template(chat, tokenize=False) == tb.apply_chat_template(chat, tokenize=False)

    mine = {}
    for part in sorted(ours.glob("*.safetensors")):
        mine.update(load_file(part))
    other = {}
    for part in sorted(theirs.glob("*.safetensors")):
        other.update(load_file(part))
    assert sorted(mine) == sorted(other)
    for name in other:
        assert mine[name].dtype == other[name].dtype and mine[name].shape == other[name].shape, name
        assert mine[name].tobytes() == other[name].tobytes(), name  # q and k un-permuted alike
    assert (ours / "model.safetensors").stat().st_mode & 0o044  # readable like the rest of the folder


def test_the_native_folder_reads_into_plora_as_transformers_folder_does(tmp_path, monkeypatch):
    """plora's own readers (model info, the tokenizer and framing its data uses) agree too."""
    pytest.importorskip("transformers")
    from plora.data.special_tokens import framing
    from plora.models.folders import read_model_info
    from tokenizers import Tokenizer

    file = write_tiny_llama(tmp_path / "tiny.gguf", pre="smollm", add_bos=False, tied=True)
    ours = _convert(file, tmp_path / "ours", "float32", "auto", monkeypatch)
    theirs = _convert(file, tmp_path / "theirs", "float32", "transformers", monkeypatch)
    info_a, info_b = read_model_info(ours), read_model_info(theirs)
    assert {k: v for k, v in vars(info_a).items() if k != "path"} == {k: v for k, v in vars(info_b).items() if k != "path"}
    ta, tb = (Tokenizer.from_file(str(f / "tokenizer.json")) for f in (ours, theirs))
    assert framing(ta) == framing(tb) and framing(ta).prefix == ()
    for text in TEXTS:
        assert ta.encode(text).ids == tb.encode(text).ids, text
    assert json.loads((ours / "config.json").read_text())["tie_word_embeddings"] is True


@pytest.mark.parametrize("change, reason", [
    (dict(arch="qwen2"), "architecture 'qwen2'"),
    (dict(pre="qwen2"), "pre-tokenizer 'qwen2'"),
    (dict(extra_tensors={"blk.0.attn_q.bias": (64,)}), "tensor 'blk.0.attn_q.bias'"),
    (dict(extra_kv={"llama.rope.scaling.factor": 8.0}), "RoPE scaling"),
    (dict(kv_per_layer=True), "llama.attention.head_count_kv is not one number"),
    (dict(kv_missing=True), "llama.attention.head_count_kv missing"),
    (dict(extra_tokens=(" t",)), "two tokens spelled alike in the byte alphabet"),
    (dict(bos="<｜begin▁of▁sentence｜>"), "special token '<｜begin▁of▁sentence｜>' not in the byte alphabet"),
])
def test_what_the_native_path_does_not_know_is_left_to_transformers(tmp_path, change, reason):
    from plora.models.gguf_native import layout

    file = write_tiny_llama(tmp_path / "m.gguf", **change)
    assert layout(read_gguf(file), "float32") == reason


def test_a_file_the_native_path_refuses_is_converted_by_transformers_and_says_why(tmp_path, monkeypatch):
    pytest.importorskip("transformers")
    file = write_tiny_llama(tmp_path / "m.gguf", pre="qwen2")
    folder = _convert(file, tmp_path / "cache", "float32", "auto", monkeypatch)
    head = json.loads((folder / "plora-gguf-head.json").read_text())
    assert head["converter"] == "transformers" and head["not_native"] == "pre-tokenizer 'qwen2'"
    assert json.loads((folder / "plora-gguf.json").read_text())["converter"] == "transformers"


def test_a_native_conversion_imports_neither_torch_nor_transformers(tmp_path):
    """What made a first sweep of a GGUF model wait: a fresh interpreter converts the head
    and the weights with neither imported."""
    file = write_tiny_llama(tmp_path / "m.gguf")
    code = ("import sys; from plora.models.gguf import converted_folder; "
            f"f = converted_folder({str(file)!r}, 'bfloat16'); "
            "print(sorted(p.name for p in f.iterdir())); "
            "print([m for m in ('torch', 'transformers') if m in sys.modules])")
    env = {**__import__("os").environ, "PLORA_CACHE_DIR": str(tmp_path / "cache")}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True).stdout
    files, imported = out.strip().splitlines()
    assert "model.safetensors" in files and "tokenizer.json" in files and "plora-gguf.json" in files
    assert imported == "[]"


def test_weights_of_a_changed_file_are_refused_in_one_line(tmp_path, monkeypatch):
    """A head made natively whose file no longer fits the native path (replaced under the same
    name, size and time) is not finished with another converter's weights."""
    file = write_tiny_llama(tmp_path / "m.gguf")
    monkeypatch.setenv("PLORA_CACHE_DIR", str(tmp_path / "cache"))
    folder = gguf.converted_folder(file, "float32", weights=False)
    from plora.models import gguf_native

    monkeypatch.setattr(gguf_native, "layout", lambda header, dtype: "architecture 'other'")
    with pytest.raises(gguf.GGUFError, match="delete .* to convert again"):
        gguf.ensure_weights(folder)
    assert not (folder / "plora-gguf.json").exists() and not list(folder.glob("*.safetensors"))
