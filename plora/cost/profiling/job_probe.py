"""One short real job, run the way the engine runs jobs, to measure what probes cannot see.

The profiler's probes time steps inside its own process. A job of a sweep is a process of
its own that starts an interpreter, imports torchtune, loads the model, captures graphs
each time its pack changes, and evaluates and saves every adapter that leaves. This runs
one such job (`tune run`, as `plora.engine.local.launch` does) on text rows written here,
with adapters that leave at different steps in groups of different sizes and intermediate
evals, so that every term of `plora.cost.job.JobOverheads` is measured; the recipe reports
its phases in summary.json (`plora.job.phases`).
"""

from __future__ import annotations

import json
import random
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any, Sequence

from plora.job.outputs import read_summary
from plora.job.config import JobAdapter, JobConfig, JobData, JobEval, JobLora, JobModel, JobTraining

__all__ = ["job_probe_config", "run_job_probe", "text_rows"]

_WORDS = ("the model reads a short note about rivers, markets and weather before it answers with a plain "
          "summary of what changed since last week in the town and why people noticed it at all").split()


def text_rows(n: int, prompt_tokens: int, answer_tokens: int, count_tokens, seed: int = 0) -> list[dict]:
    """``n`` rows of plain words, prompts of about ``prompt_tokens`` and answers of about
    ``answer_tokens`` tokens as ``count_tokens`` counts them."""
    rng = random.Random(seed)

    def text(target: int) -> str:
        words: list[str] = []
        while True:
            words.append(rng.choice(_WORDS))
            if count_tokens(" ".join(words)) >= target:
                return " ".join(words)

    return [{"input": text(max(1, prompt_tokens)), "output": text(max(1, answer_tokens))} for _ in range(n)]


def job_probe_config(model_dir: str | Path, work: Path, *, seq_len: int, dtype: str, device: str,
                     targets: Sequence[str], family: str, dropout: float, random_init: bool,
                     activation_checkpointing: bool, cuda_graphs: Any, samples: int, max_new_tokens: int,
                     steps: Sequence[int], ranks: Sequence[int], batch_size: int, every_steps: int,
                     quantize: str | None = None) -> JobConfig:
    """The job config of the probe job (laid out as `plora.job.from_spec.job_config`'s)."""
    return JobConfig(
        job_id="job-probe",
        output_dir=work,
        job_dir=work / "jobs" / "job-probe",
        seed=0,
        device=device,
        num_threads=1 if device == "cpu" else None,
        model=JobModel(path=str(model_dir), family=family, dtype=dtype, max_seq_len=int(seq_len),
                       random_init=bool(random_init), quantize=quantize),
        data=JobData(train=str(work / "train.jsonl"), eval=str(work / "eval.jsonl"), on_bad_rows="drop",
                     input_column="input", output_column="output"),
        lora=JobLora(targets=list(targets), dropout=float(dropout)),
        adapters=[JobAdapter(id=f"probe-{k}", rank=int(r), alpha=2.0 * r, learning_rate=1e-4,
                             batch_size=int(batch_size), seed=k, steps=int(s))
                  for k, (r, s) in enumerate(zip(ranks, steps))],
        training=JobTraining(scheduler="constant", grad_clip=1.0, weight_decay=0.0, divergence_loss=None,
                             activation_checkpointing=bool(activation_checkpointing), cuda_graphs=cuda_graphs,
                             cover_vacant_slots=False),
        eval=JobEval(metrics=["loss", "exact_match"], max_new_tokens=int(max_new_tokens),
                     max_eval_samples=int(samples), every_steps=int(every_steps)),
        eval_base=False,
    )


def run_job_probe(model_dir: str | Path, *, seq_len: int, dtype: str, device: str, targets: Sequence[str],
                  family: str = "auto", dropout: float = 0.0, random_init: bool = True,
                  activation_checkpointing: bool = False, cuda_graphs: Any = "auto", samples: int | None = None,
                  max_new_tokens: int | None = None, timeout_s: float = 900.0,
                  quantize: str | None = None) -> dict[str, Any] | None:
    """Run the probe job; its summary's ``phases`` with ``exited_at`` (when the process was
    seen to end), or None when it did not finish (the cost model then has no job terms)."""
    from plora.data.dataset import TextTokenizer
    from plora.engine.local import launch
    from plora.models.loading import read_model_info

    cuda = str(device).startswith("cuda")
    # small evals: the probe measures the eval's cost per token, not its memory limit (an eval of
    # 4 adapters x 8 rows of half the sequence stays far below a GPU's memory on 152k-vocabulary models)
    samples = samples or (8 if cuda else 4)
    max_new_tokens = max_new_tokens or (8 if cuda else 4)
    info = read_model_info(model_dir, family)
    tok = TextTokenizer(info.path, info.eos_token_id, info.pad_token_id)
    answer = max(2, min(16, seq_len // 8))
    prompt = max(2, seq_len - answer - 4)
    with tempfile.TemporaryDirectory(prefix="plora-jobprobe-") as tmp:
        work = Path(tmp)
        count = lambda text: len(tok.encode(text))  # noqa: E731
        rows = text_rows(16, prompt, answer, count, seed=0)
        (work / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        evals = text_rows(samples, max(2, seq_len // 2 - answer), answer, count, seed=1)
        (work / "eval.jsonl").write_text("".join(json.dumps(r) + "\n" for r in evals))
        # adapters leave alone, in a pair, alone: three pack compositions, evals of 1 and 2
        # adapters with generation; intermediate (loss) evals of 4, 3 and 1 adapters
        cfg = job_probe_config(model_dir, work, seq_len=seq_len, dtype=dtype, device=device, targets=targets,
                               family=family, dropout=dropout, random_init=random_init,
                               activation_checkpointing=activation_checkpointing, cuda_graphs=cuda_graphs,
                               samples=samples, max_new_tokens=max_new_tokens, steps=(4, 8, 8, 12),
                               ranks=(16, 16, 32, 64), batch_size=2, every_steps=3, quantize=quantize)
        job_dir = cfg.job_dir
        job_dir.mkdir(parents=True)
        cfg.write(job_dir / "job.yaml")
        proc = launch("job-probe", job_dir, device, gpus=[0] if cuda else [])
        try:
            rc = proc.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.proc.kill()
            proc.proc.wait()
            rc = None
        exited = time.time()
        if proc.log:
            proc.log.close()
        summary = read_summary(job_dir) if rc == 0 else None
        phases = (summary or {}).get("phases")
        if not phases:
            return None
        return {**phases, "exited_at": exited, "launched_at": proc.started}
