"""Shared fixtures: a tiny random Llama in Hugging Face format and a small text task.

The model is made at test time (a second), so the packed-training tests do not depend on
the shipped demo weights; the CLI tests use the shipped model and task.
"""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")


def _no_cuda() -> bool:
    import torch

    return not torch.cuda.is_available()


# Triton decides at import how it builds kernels, and any test may import it first: without
# a GPU, every kernel test runs on Triton's interpreter.
if _no_cuda():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(autouse=True)
def _own_profile_cache(tmp_path_factory, monkeypatch):
    """Profiles cached by one test (or by the user's own sweeps) never reach another."""
    monkeypatch.setenv("PLORA_CACHE_DIR", str(tmp_path_factory.mktemp("profile-cache")))


@pytest.fixture(autouse=True)
def _no_bytecode_pool(monkeypatch):
    """No command a test runs leaves a pool compiling a first sweep's modules behind it
    (`plora.bytecode_ahead`; its own tests turn it on)."""
    monkeypatch.setenv("PLORA_BYTECODE_AHEAD", "0")


@pytest.fixture(autouse=True)
def _no_spare_left():
    """A job process one test started ahead of its job (a sweep's, a calibration's) never
    takes another test's job: a sweep with spares off would otherwise be handed to it."""
    yield
    from plora.engine import spare

    spare.discard()


@pytest.fixture(autouse=True, scope="session")
def _one_thread():
    import torch

    torch.set_num_threads(1)  # tiny matmuls on several OpenMP threads are far slower here


def make_tiny_llama(out: Path, *, seed: int = 0, layers: int = 2) -> Path:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from plora.data.dataset import char_tokenizer

    tok = char_tokenizer("abcdefghijklmnopqrstuvwxyz0123456789+-=>< ")
    cfg = LlamaConfig(
        vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False, rope_theta=10000.0,
    )
    torch.manual_seed(seed)
    LlamaForCausalLM(cfg).save_pretrained(out)
    tok.save(str(out / "tokenizer.json"))
    return out


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def reverse_data(tmp_path_factory) -> dict[str, Path]:
    """String reversal: 'abc>' -> 'cba'. Train and eval as JSONL."""
    rng = random.Random(0)
    rows = []
    for _ in range(300):
        s = "".join(rng.choice("abcdef") for _ in range(rng.randint(2, 5)))
        rows.append({"input": s + ">", "output": s[::-1]})
    d = tmp_path_factory.mktemp("data")
    (d / "train.jsonl").write_text("\n".join(json.dumps(r) for r in rows[:250]))
    (d / "eval.jsonl").write_text("\n".join(json.dumps(r) for r in rows[250:]))
    return {"train": d / "train.jsonl", "eval": d / "eval.jsonl"}


def job_config(model: Path, data: dict, out: Path, adapters: list[dict], **over) -> dict:
    """A recipe config as `plora sweep` writes it (`plora.job.config.JobConfig`'s layout),
    for in-process runs; each adapter warms up for 2 of its steps unless it says otherwise."""
    cfg = {
        "job_id": "job-test",
        "output_dir": str(out),
        "device": "cpu",
        "num_threads": 1,
        "model": {"path": str(model), "max_seq_len": 64},
        "data": {"train": str(data["train"]), "eval": str(data["eval"])},
        "lora": {"targets": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "down_proj"], "dropout": 0.0},
        "adapters": [{"warmup_steps": 2, **a} for a in adapters],
        "training": {"scheduler": "cosine", "grad_clip": 1.0, "weight_decay": 0.01},
        "eval": {"metrics": ["loss"], "max_eval_samples": 8},
    }
    for k, v in over.items():
        cfg[k] = v
    return cfg


def adapter_weights(out: Path, adapter_id: str) -> dict:
    """An adapter's saved LoRA weights (its PEFT safetensors) under a job's output folder."""
    from safetensors.torch import load_file

    return load_file(str(out / "adapters" / adapter_id / "adapter_model.safetensors"))


def max_weight_diff(a: dict, b: dict) -> float:
    """The largest elementwise difference between two adapters' weights (same names)."""
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)


#: hooks that make a job process fail on purpose (`plora.train.hooks`, PLORA_TEST_HOOKS)
FAULT_HOOKS = Path(__file__).with_name("fault_hooks.py")


def inject_fault(monkeypatch, faults: str) -> None:
    """Make the jobs this test launches fail as ``faults`` says (`fault_hooks`: e.g.
    ``"crash@job-000@3@1"``: job-000 crashes after step 3 on its first attempt)."""
    monkeypatch.setenv("PLORA_TEST_HOOKS", str(FAULT_HOOKS))
    monkeypatch.setenv("PLORA_INJECT_FAULT", faults)
    monkeypatch.setenv("PLORA_INJECT_FAULT_PARENT", str(os.getpid()))


def cost_model_holding(admits: int, *, c0: float = 1.0, c_tok: float = 0.0, c_rtok: float = 0.0,
                       c_bkt: float = 0.0, overhead_s: float = 0.0, load_factor: float = 0.9):
    """A one-GPU cost model whose GPU holds ``admits`` adapters within ``load_factor`` (each
    adapter 1 byte, the base model none) and whose packed step costs ``c0`` plus the token
    terms (rows of 10 tokens)."""
    from plora.cost.model import CostModel, MemoryCoeffs, TimeCoeffs

    return CostModel((admits + 0.5) / load_factor, 10, {1: TimeCoeffs(c0, c_tok, c_rtok, 0.0, c_bkt)},
                     {1: MemoryCoeffs(0.0, 1.0, 0.0, 0.0, 0.0)}, job_overhead_s=overhead_s)


#: the streaming sweep's configurations (`run_streamed_sweep`): 3, 12 and 6 steps of 24 rows
STREAM_CONFIGS = [{"rank": 2, "alpha": 4, "learning_rate": 1e-2, "batch_size": 8},
                  {"rank": 4, "alpha": 8, "learning_rate": 3e-3, "batch_size": 2},
                  {"rank": 2, "alpha": 2, "learning_rate": 5e-3, "batch_size": 4}]


#: the model every small test space trains: the shipped tiny Llama
TINY_MODEL = "builtin:tiny-llama"


def tiny_space(root: Path | None = None, *, name: str = "t", model_path: str = TINY_MODEL, max_seq_len: int = 48,
               num_train: int = 24, num_eval: int = 4, **sections) -> dict:
    """A small space file's contents, the one the tests share: the tiny Llama (``model_path``,
    ``max_seq_len``) on the built-in shift task (``num_train``/``num_eval`` rows), LoRA on
    q_proj and v_proj, on the CPU, writing under ``root``/runs. Each section given in
    ``sections`` (``space``, ``training``, ``eval``, ``planner``..., or ``model``, ``data``,
    ``lora``, ``hardware``, ``output``) replaces that default whole; ``None`` leaves the
    section out."""
    data: dict = {
        "name": name,
        "model": {"path": model_path, "max_seq_len": max_seq_len},
        "data": {"task": "builtin:shift", "num_train": num_train, "num_eval": num_eval},
        "lora": {"targets": ["q_proj", "v_proj"]},
        "hardware": {"device": "cpu"},
        **({"output": {"dir": str(Path(root) / "runs")}} if root is not None else {}),
    }
    for key, value in sections.items():
        if value is None:
            data.pop(key, None)
        else:
            data[key] = value
    return data


def write_space(path: Path, data: dict) -> Path:
    """``data`` as a space file at ``path``."""
    import yaml

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(data))
    return path


def tiny_space_file(root: Path, filename: str = "space.yaml", **kw) -> Path:
    """`tiny_space` written as ``root``/``filename``."""
    return write_space(Path(root) / filename, tiny_space(root, **kw))


def run_streamed_sweep(root: Path, *, configs: list[dict] | None = None, groups=((0, 1), (2,)),
                       slots=("cpu:0",), max_adapters: int = 2, cost_model=None):
    """A sweep with planner.streaming on one CPU slot, planned as two jobs: job-000 (two
    adapters) and job-001 (one). Once an adapter of job-000 has left, job-001's adapter joins
    job-000 and job-001 never runs. The prepared sweep and its results frame.

    ``configs`` (`STREAM_CONFIGS`), ``groups`` (the configurations of job-000, job-001, ...,
    by index), ``slots``, ``max_adapters`` (``planner.max_adapters_per_job``) and
    ``cost_model`` (the sweep's, default: the analytic one) change that sweep."""
    from plora.planner.plan import Job, Plan
    from plora.spec.loading import load_spec
    from plora.sweep import prepare, run_prepared, write_run_files

    path = tiny_space_file(
        root, name="stream",
        space={"strategy": "list", "configs": configs or STREAM_CONFIGS},
        training={"epochs": 1, "scheduler": "cosine", "warmup_steps": 1},
        eval={"max_new_tokens": 2, "metrics": ["loss"]},
        planner={"max_adapters_per_job": max_adapters, "streaming": True})
    prep = prepare(load_spec(path), cost_model=cost_model)
    ids = [c.id for c in prep.configs]
    prep.plan = Plan([Job(f"job-{j:03d}", [ids[i] for i in g]) for j, g in enumerate(groups)],
                     grouping="fixed for the test")
    write_run_files(prep)
    return prep, run_prepared(prep, slots=list(slots))



#: a chat template for the swept run's model (the shipped tiny Llama has none)
CHAT_TEMPLATE = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
#: the swept run's command-line overrides (`plora.spec.overrides`): what its spec.yaml must show
SWEPT_OVERRIDES = ["training.steps=6", "training.epochs=null", "eval.every_steps=3", "planner.max_adapters_per_job=2"]


def _model_with_chat_template(out: Path) -> Path:
    """The shipped tiny Llama with `CHAT_TEMPLATE` in its tokenizer_config.json."""
    import shutil

    from plora.spec.model import ASSETS_DIR

    shutil.copytree(ASSETS_DIR / "tiny-llama", out)
    cfg = json.loads((out / "tokenizer_config.json").read_text())
    (out / "tokenizer_config.json").write_text(json.dumps({**cfg, "chat_template": CHAT_TEMPLATE}, indent=2))
    return out


@pytest.fixture(scope="session")
def swept_run(tmp_path_factory):
    """One small finished sweep, run through `plora sweep` with `SWEPT_OVERRIDES`, shared by
    the tests of what a finished run offers: the overrides in its spec.yaml; the perplexity,
    ROUGE-L and BLEU metrics, ranked by perplexity; TensorBoard and W&B (offline) tracking;
    `plora export`, whose tests need a base model with a chat template.

    A namespace: ``run`` (the run directory), ``model`` (the base model's folder), ``space``
    (the space file), ``output`` (what the command printed)."""
    import importlib.util
    from types import SimpleNamespace

    import yaml
    from typer.testing import CliRunner

    from plora.cli import app

    tmp = tmp_path_factory.mktemp("swept")
    model = _model_with_chat_template(tmp / "model")
    logging = {}  # each tracker whose extra is installed (its tests skip otherwise)
    if importlib.util.find_spec("tensorboard") is not None:
        logging["tensorboard"] = True
    if importlib.util.find_spec("wandb") is not None:
        logging["wandb"] = {"project": "plora-tests", "mode": "offline"}
    space = {
        "name": "swept",
        "model": {"path": str(model), "max_seq_len": 48},
        "data": {"task": "builtin:shift", "num_train": 32, "num_eval": 8},
        "lora": {"targets": ["q_proj", "k_proj", "v_proj", "o_proj", "up_proj"]},
        "space": {"strategy": "list", "configs": [
            {"rank": 2, "alpha": 4, "learning_rate": 1e-2, "batch_size": 4},
            {"rank": 4, "alpha": 4, "learning_rate": 3e-3, "batch_size": 8}]},
        "training": {"epochs": 1},
        "eval": {"max_new_tokens": 6, "metrics": ["loss", "exact_match", "perplexity", "rouge_l", "bleu"],
                 "objective": "perplexity"},
        "hardware": {"device": "cpu"},
        "logging": logging,
        "output": {"dir": str(tmp / "runs")},
    }
    path = tmp / "space.yaml"
    path.write_text(yaml.safe_dump(space))
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PLORA_CACHE_DIR", str(tmp / "cache"))  # profiles and job overheads stay here
        mp.setenv("WANDB_SILENT", "true")
        result = CliRunner().invoke(app, ["sweep", str(path), *SWEPT_OVERRIDES], terminal_width=200)
    assert result.exit_code == 0, result.output
    return SimpleNamespace(run=tmp / "runs" / "swept", model=model, space=path, output=result.output)


def assert_training_value_refused(tmp_path: Path, field: str, value) -> None:
    """`plora sweep` of a space whose ``training.<field>`` is ``value``: exit 2, one line
    naming the field, nothing written."""
    import yaml
    from typer.testing import CliRunner

    from plora.cli import app

    path = tmp_path / "space.yaml"
    path.write_text(yaml.safe_dump({"name": "x", "training": {field: value}, "output": {"dir": str(tmp_path / "runs")}}))
    out = CliRunner().invoke(app, ["sweep", str(path)])
    assert out.exit_code == 2, out.output
    text = out.output.strip()
    assert len(text.splitlines()) == 1 and text.startswith(f"error: training.{field}"), text
    assert not (tmp_path / "runs").exists()
