"""Datasets, tokenization and the per-adapter batch streams of a packed job.

Each adapter draws its micro-batches from its own seeded order of the training set, which
depends on nothing but its seed: that is what makes a packed adapter see exactly the data it
would see trained alone.

Rows are read and shaped by `plora.data.formats` (plain, instruction, chat); `tokenize_split` is
the one place they become tokens, and `prepare_data` the one path from a job config's data
and eval sections to samples, taken both by a job and by the check before a sweep runs.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from plora.data.formats import DataError, RowFormat, read_rows, rows_to_examples
from plora.data.row_layout import bucket_bounds

if TYPE_CHECKING:
    import torch

    from plora.job.config import JobData, JobEval

IGNORE_INDEX = -100

# DataError and SUPPORTED_SUFFIXES live in plora.data.formats (which reads the files) and are
# imported from here by the rest of plora.


def read_examples(path: str | Path, input_column: str = "input", output_column: str = "output") -> list[dict]:
    """Plain rows of a JSON/JSONL/CSV/parquet file as `{"input", "output"}` dicts."""
    fmt = RowFormat(format="plain", input_column=input_column, output_column=output_column)
    rows, columns = read_rows(path)
    examples, _ = rows_to_examples(rows, columns, fmt, f"data: {path}")
    return [{"input": ex["input"], "output": ex["output"]} for ex in examples]


def synthetic_samples(count: int, seq_len: int, vocab_size: int, seed: int = 0) -> list[Sample]:
    """Random token rows of exactly `seq_len`, loss on every token: what profiling and
    throughput benchmarks train on, where only shapes matter."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    rows = torch.randint(4, vocab_size, (count, seq_len), generator=gen).tolist()
    return [Sample(r, r) for r in rows]


def load_split(data: JobData, split: str, *, choices_column: str | None = None,
               dropped: list[str] | None = None) -> list[dict]:
    """The train or eval examples a data config names (a built-in task or files), each row
    checked and shaped by its format (`plora.data.formats`). Rows without an answer raise, or
    land in ``dropped`` with ``data.on_bad_rows: drop``."""
    from plora.data.formats import Row

    task = data.task
    fmt = RowFormat.from_config(data, choices_column if split == "eval" else None)
    on_bad = data.on_bad_rows
    if task:
        from plora.data.tasks import load_builtin_task

        name = str(task).removeprefix("builtin:")
        n = data.num_train if split == "train" else data.num_eval
        raw = load_builtin_task(name, split, n, seed=0)
        rows = [Row(f"example {i}", ex) for i, ex in enumerate(raw, start=1)]
        fmt = RowFormat(format="plain", prompt_template=fmt.prompt_template, choices_column=fmt.choices_column)
        examples, bad = rows_to_examples(rows, ["input", "output"], fmt, f"data.task {task} ({split})", on_bad)
    else:
        path = data.train if split == "train" else data.eval
        if not path:
            if split == "eval":
                return []
            raise DataError(f"data.{split}: no file given")
        part = data.train_split if split == "train" else data.eval_split
        rows, columns = read_rows(path, f"data.{split}", part)
        examples, bad = rows_to_examples(rows, columns, fmt, _split_label(data, split), on_bad)
    if dropped is not None:
        dropped.extend(bad)
    return examples


def char_tokenizer(chars: str):
    """A one-token-per-character `tokenizers.Tokenizer` with ids pad 0, bos 1, eos 2, unk 3:
    the tokenizer of config-only shape folders and of test models."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3}
    for ch in chars:
        vocab.setdefault(ch, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")
    tok.decoder = decoders.Fuse()
    return tok


class TextTokenizer:
    """A `tokenizer.json` tokenizer with the model's eos/pad ids (from config.json), the
    special tokens its own tokenizer puts around a text (`plora.data.special_tokens`) and its chat
    template, when the folder has one."""

    def __init__(self, model_dir: str | Path, eos_id: int | None, pad_id: int | None):
        from tokenizers import Tokenizer

        from plora.data.special_tokens import framing, stop_ids

        self.model_dir = Path(model_dir)
        path = self.model_dir / "tokenizer.json"
        if not path.is_file():
            raise DataError(f"{model_dir}: no tokenizer.json")
        self._tok = Tokenizer.from_file(str(path))
        if eos_id is None:
            raise DataError(f"{model_dir}: config.json gives no eos_token_id")
        self.eos_id = eos_id
        self.pad_id = pad_id if pad_id is not None else eos_id
        self.framing = framing(self._tok)
        #: the ids that end a generated answer (generation_config.json's end tokens)
        self.stop_ids = stop_ids(self.model_dir, eos_id)
        self._chat_template: Any = False  # not looked up yet
        self._primed: dict[str, list[int]] = {}  # texts encoded ahead in one batch (`primed`)

    @property
    def chat_template(self):
        """The model's `plora.data.chat_template.ChatTemplate`, or None when it has none."""
        if self._chat_template is False:
            from plora.data.chat_template import ChatTemplateError, load_chat_template

            try:
                self._chat_template = load_chat_template(self.model_dir)
            except ChatTemplateError as e:
                raise DataError(f"model {self.model_dir}: {e}") from None
        return self._chat_template

    def encode(self, text: str) -> list[int]:
        ids = self._primed.get(text)
        return list(ids) if ids is not None else self._tok.encode(text, add_special_tokens=False).ids

    @contextlib.contextmanager
    def primed(self, texts: Sequence[str]) -> Iterator[None]:
        """``encode`` answers these texts from one batch encoding while the block runs: the
        tokenizer's batch call runs in parallel outside the interpreter lock (a job's 1,000
        rows: 0.17 s one by one on an H200's host), and gives each text the ids ``encode`` would."""
        unique = list(dict.fromkeys(texts))
        self._primed = dict(zip(unique, self.encode_many(unique))) if len(unique) > 1 else {}
        try:
            yield
        finally:
            self._primed = {}

    def encode_many(self, texts: Sequence[str]) -> list[list[int]]:
        return [e.ids for e in self._tok.encode_batch(list(texts), add_special_tokens=False)]

    def encode_with_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        """Token ids and each token's character span in ``text``."""
        enc = self._tok.encode(text, add_special_tokens=False)
        return enc.ids, enc.offsets

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=True)

    def prompt_ids(self, text: str) -> list[int]:
        """A plain row's prompt as ``tokenizer(text)`` gives it, less any special tokens the
        tokenizer puts after a text: the answer follows there."""
        return list(self.framing.prefix) + self.encode(text)

    @property
    def answer_end(self) -> list[int]:
        """What closes a plain row after its answer: the tokenizer's own closing tokens, and
        eos, so that the model learns to stop."""
        suffix = list(self.framing.suffix)
        return suffix if self.eos_id in suffix else suffix + [self.eos_id]


@dataclass(frozen=True)
class Sample:
    """One row as a job trains on it: tokens, and labels (IGNORE_INDEX off the answer).

    Eval rows also carry what the generated and scored metrics need: the prompt a generated
    answer follows, the reference answer, and, for choice accuracy, each choice as a row of
    its own (labels on the choice's tokens) with the index of the right one.
    """

    tokens: list[int]
    labels: list[int]
    prompt: list[int] | None = None
    reference: str | None = None
    choices: tuple["Sample", ...] | None = None
    gold: int | None = None


@dataclass
class SplitReport:
    """What tokenization did to one split: rows kept, cut by max_seq_len, dropped."""

    label: str
    rows: int = 0
    truncated: int = 0
    dropped: list[str] = field(default_factory=list)
    kept: list[int] = field(default_factory=list)  # indices of the examples that became samples

    def notes(self, max_seq_len: int) -> list[str]:
        out = []
        if self.truncated:
            out.append(f"{self.label}: {self.truncated} of {self.rows} rows are longer than model.max_seq_len "
                       f"{max_seq_len} and are cut (their answers partly trained)")
        if self.dropped:
            out.append(f"{self.label}: {len(self.dropped)} rows dropped (data.on_bad_rows: drop); "
                       f"first: {self.dropped[0]}")
        return out


def _chat_tokens(ex: dict, tok: TextTokenizer) -> tuple[list[int], list[int], list[tuple[int, int]]]:
    """A chat example through the model's template: tokens, labels on every assistant turn,
    and each assistant turn's token range."""
    template = tok.chat_template
    if template is None:
        raise DataError(f"{ex.get('where', 'data')}: chat rows need a chat template, and model "
                        f"{tok.model_dir} has none (no chat_template in tokenizer_config.json, no chat_template.jinja)")
    from plora.data.chat_template import ChatTemplateError

    try:
        rendered = template.render_with_spans(ex["messages"])
    except ChatTemplateError as e:
        raise DataError(f"{ex.get('where', 'data')}: {e}") from None
    ids, offsets = tok.encode_with_offsets(rendered.text)
    labels = [IGNORE_INDEX] * len(ids)
    turns = []
    for start, end in rendered.spans:
        inside = [j for j, (a, _) in enumerate(offsets) if start <= a < end]
        for j in inside:
            labels[j] = ids[j]
        if inside:
            turns.append((inside[0], inside[-1] + 1))
    return ids, labels, turns


def _last_turn(ex: dict) -> int:
    return max(i for i, m in enumerate(ex["messages"]) if m["role"] == "assistant")


def _full_row(ex: dict, tok: TextTokenizer) -> tuple[list[int], list[int], int, int]:
    """Untruncated tokens and labels of one example, the length of its eval prompt, and
    where its first label is (len(tokens) when it has none)."""
    if "messages" in ex:
        tokens, labels, turns = _chat_tokens(ex, tok)
        return tokens, labels, turns[-1][0] if turns else len(tokens), turns[0][0] if turns else len(tokens)
    prompt = tok.prompt_ids(ex["input"])
    answer = tok.encode(ex["output"]) + tok.answer_end
    return prompt + answer, [IGNORE_INDEX] * len(prompt) + answer, len(prompt), len(prompt)


def _eval_parts(ex: dict, tok: TextTokenizer, choices: Sequence[str] | None, where: str) -> dict:
    """The eval prompt (rendered with the generation prompt for chat), the reference answer,
    and each choice as a scored row."""
    if "messages" in ex:
        last = _last_turn(ex)
        head = ex["messages"][:last]
        reference = ex["messages"][last]["content"]
        prompt = tok.encode(tok.chat_template.render(head, add_generation_prompt=True))

        def choice_row(text: str) -> Sample:
            tokens, labels, turns = _chat_tokens({**ex, "messages": head + [{"role": "assistant", "content": text}]}, tok)
            a, b = turns[-1]
            return Sample(tokens, [IGNORE_INDEX] * a + labels[a:b] + [IGNORE_INDEX] * (len(tokens) - b))
    else:
        reference = ex["output"]
        prompt = tok.prompt_ids(ex["input"])

        def choice_row(text: str) -> Sample:
            answer = tok.encode(text) + tok.answer_end
            return Sample(prompt + answer, [IGNORE_INDEX] * len(prompt) + answer)

    parts: dict = {"prompt": prompt, "reference": reference}
    row_choices = ex.get("choices") or choices
    if row_choices:
        if reference not in row_choices:
            shown = ", ".join(map(repr, row_choices))
            raise DataError(f"{where}: the answer {reference!r} is not one of the choices ({shown})")
        parts["choices"] = tuple(choice_row(c) for c in row_choices)
        parts["gold"] = list(row_choices).index(reference)
    return parts


def tokenize_split(examples: Sequence[dict], tok: TextTokenizer, max_seq_len: int, *, label: str = "data",
                   eval: bool = False, choices: Sequence[str] | None = None,
                   on_bad_rows: str = "error") -> tuple[list[Sample], SplitReport]:
    """The one place rows become tokens: prompt + answer + eos (plain), framed by the special
    tokens the model's tokenizer puts around a text (`plora.data.special_tokens`), or the chat
    template's rendering (chat); the loss is on the answers only.

    Rows longer than ``max_seq_len`` are cut and counted. A row whose answer is cut away
    entirely (or, for eval, whose prompt leaves no room to answer) would train as zero loss:
    it raises `DataError` naming it, or is dropped and counted with ``on_bad_rows="drop"``.
    """
    report = SplitReport(label)
    out: list[Sample] = []
    bad: list[tuple[str, int]] = []
    plain = [t for ex in examples if "messages" not in ex for t in (ex.get("input"), ex.get("output"))]
    with tok.primed([t for t in plain if isinstance(t, str)]):
        for index, ex in enumerate(examples):
            where = ex.get("where", label)
            tokens, labels, prompt_len, first_label = _full_row(ex, tok)
            kept = labels[:max_seq_len]
            if first_label >= max_seq_len or (eval and prompt_len >= max_seq_len):
                bad.append((where, prompt_len))
                continue
            report.rows += 1
            report.kept.append(index)
            if len(tokens) > max_seq_len:
                report.truncated += 1
            extra = _eval_parts(ex, tok, choices, where) if eval else {}
            out.append(Sample(tokens[:max_seq_len], kept, **extra))
    if bad:
        where, prompt_len = bad[0]
        message = (f"{where}: the answer is cut away entirely by model.max_seq_len {max_seq_len} (the prompt alone "
                   f"is {prompt_len} tokens); {len(bad)} of {len(examples)} rows are like this")
        if not out:
            raise DataError(f"{message}: every row is; raise model.max_seq_len or shorten the prompts")
        if on_bad_rows != "drop":
            raise DataError(f"{message}: raise model.max_seq_len, or set data.on_bad_rows: drop to skip them")
        report.dropped += [f"{w}: the answer is cut away by max_seq_len" for w, _ in bad]
    return out, report


def tokenize_examples(examples: Sequence[dict], tok: TextTokenizer, max_seq_len: int, **kw: Any) -> list[Sample]:
    """`tokenize_split` without the report."""
    return tokenize_split(examples, tok, max_seq_len, **kw)[0]


@dataclass
class PreparedData:
    """A job's rows as samples, and what reading and tokenizing them found."""

    train: list[Sample]
    eval: list[Sample]
    reports: list[SplitReport]
    eval_examples: list[dict] = field(default_factory=list)  # the eval rows behind `eval`

    def notes(self, max_seq_len: int) -> list[str]:
        return [n for r in self.reports for n in r.notes(max_seq_len)]


def prepare_data(data: JobData, evals: JobEval, tok: TextTokenizer, max_seq_len: int) -> PreparedData:
    """Train and eval samples of a job config's ``data`` and ``eval`` sections: what a job
    trains on, and what validation checks before anything runs (the same code for both)."""
    on_bad = data.on_bad_rows
    reports = []
    dropped: list[str] = []
    train_ex = load_split(data, "train", dropped=dropped)
    train, rep = tokenize_split(train_ex, tok, max_seq_len, label=_split_label(data, "train"), on_bad_rows=on_bad)
    rep.dropped[:0] = dropped
    reports.append(rep)
    dropped = []
    eval_ex = load_split(data, "eval", choices_column=evals.choices_column, dropped=dropped)
    samples: list[Sample] = []
    kept: list[dict] = []
    if eval_ex:
        samples, rep = tokenize_split(eval_ex, tok, max_seq_len, label=_split_label(data, "eval"), eval=True,
                                      choices=evals.choices, on_bad_rows=on_bad)
        rep.dropped[:0] = dropped
        reports.append(rep)
        kept = [eval_ex[i] for i in rep.kept]
    limit = evals.max_eval_samples
    return PreparedData(train, samples[:limit], reports, kept[:limit])


def _split_label(data: JobData, split: str) -> str:
    if data.task:
        return f"data.task ({split})"
    part = data.train_split if split == "train" else data.eval_split
    label = f"data.{split}: {data.train if split == 'train' else data.eval}"
    return f"{label} (split {part})" if part else label


class AdapterStream:
    """An endless, seeded sequence of sample indices: one fresh permutation per epoch.

    With ``buckets`` > 1 (padded rows, `plora.data.row_layout.length_buckets_for`), the rows are
    split by ``lengths`` into that many equal buckets, each shuffled per epoch, and the
    n-th call takes its rows from bucket n mod ``buckets`` (or the next one not used up).
    Every bucket then gives up its rows at the same pace, whatever the batch size, so all
    adapters of a pack draw from the same bucket at the same step and the step pads to
    the longest row of one bucket instead of the longest of all. The order depends only
    on the adapter's own seed, batch size and data, so packed still equals alone.

    An adapter that joins a running job starts at bucket 0 like any other, so while the
    pack is on another bucket its steps pad to the longer of the two (its results do not
    change). It cannot start on the pack's bucket instead: the bucket of a call is a
    function of the adapter's own call count, and entering the cycle at bucket j makes its
    first step train on bucket j's rows where alone it trains on bucket 0's, another order
    (and one that would depend on when it joined). Holding a join back until the pack is
    at bucket 0 would keep the order but leave the freed slot empty for up to
    ``buckets`` - 1 steps.
    """

    def __init__(self, num_samples: int, seed: int, *, lengths: Sequence[int] | None = None, buckets: int = 1):
        if num_samples <= 0:
            raise DataError("the training set is empty")
        self.num_samples = num_samples
        self.seed = seed
        self._epoch = 0
        self._pos = 0
        self._step = 0
        self._buckets: list[list[int]] | None = None
        if buckets > 1 and lengths is not None and num_samples > 1:
            self._buckets = [b for b in bucket_bounds(list(lengths)[:num_samples], buckets) if b]
        # the plain shuffle's order (bucketed streams keep one order per bucket instead)
        self._order: np.ndarray | None = self._permutation(0) if self._buckets is None else None
        self._orders = self._bucket_orders(0)
        self._bucket_pos = [0] * len(self._orders)

    @property
    def buckets(self) -> int:
        return len(self._buckets) if self._buckets is not None else 1

    def _permutation(self, epoch: int) -> np.ndarray:
        return np.random.default_rng([self.seed, epoch]).permutation(self.num_samples)

    def _bucket_orders(self, epoch: int) -> list[np.ndarray]:
        if self._buckets is None:
            return []
        rng = np.random.default_rng([self.seed, epoch])
        return [rng.permutation(np.asarray(b, dtype=np.int64)) for b in self._buckets]

    def next(self, count: int) -> list[int]:
        if self._buckets is not None:
            return self._next_bucketed(count)
        taken: list[int] = []
        while len(taken) < count:
            if self._pos == self.num_samples:
                self._epoch += 1
                self._order, self._pos = self._permutation(self._epoch), 0
            take = min(count - len(taken), self.num_samples - self._pos)
            taken.extend(int(i) for i in self._order[self._pos : self._pos + take])
            self._pos += take
        return taken

    def _next_bucketed(self, count: int) -> list[int]:
        first = self._step % len(self._orders)
        self._step += 1
        taken: list[int] = []
        while len(taken) < count:
            for j in range(len(self._orders)):  # this call's bucket, or the next one not used up
                k = (first + j) % len(self._orders)
                if self._bucket_pos[k] < len(self._orders[k]):
                    break
            else:  # every bucket used up: the next epoch
                self._epoch += 1
                self._orders, self._bucket_pos = self._bucket_orders(self._epoch), [0] * len(self._orders)
                continue
            pos = self._bucket_pos[k]
            take = min(count - len(taken), len(self._orders[k]) - pos)
            taken.extend(int(i) for i in self._orders[k][pos:pos + take])
            self._bucket_pos[k] += take
        self._pos = sum(self._bucket_pos)
        return taken

    def rows_left_in_epoch(self) -> int:
        """Rows the plain shuffle gives before its epoch ends (a bucketed stream: its buckets')."""
        return self.num_samples - self._pos

    def state_dict(self) -> dict[str, Any]:
        """Where the stream is (a resumed job goes on from here, not from the start)."""
        state: dict[str, Any] = {"epoch": self._epoch, "pos": self._pos}
        if self._buckets is not None:
            state.update(step=self._step, bucket_pos=list(self._bucket_pos), buckets=len(self._orders))
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if "epoch" not in state or "pos" not in state:
            raise DataError("the checkpoint's data position was saved with another row order")
        if (self._buckets is not None) != ("bucket_pos" in state) or (
                self._buckets is not None and int(state["buckets"]) != len(self._orders)):
            raise DataError("the checkpoint's data position was saved with other length buckets")
        self._epoch, self._pos = int(state["epoch"]), int(state["pos"])
        if self._buckets is None:
            self._order = self._permutation(self._epoch)
        else:
            self._step = int(state["step"])
            self._orders = self._bucket_orders(self._epoch)
            self._bucket_pos = [int(p) for p in state["bucket_pos"]]


def collate(samples: Sequence[Sample], pad_id: int, width: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded tokens and labels, ``width`` wide (default: the longest row). Right
    padding keeps every real position's causal context identical whatever the batch's
    width, so padding cannot change an adapter."""
    import torch

    longest = max(len(s.tokens) for s in samples)
    if width is None:
        width = longest
    elif width < longest:
        raise ValueError(f"collate: width {width} is shorter than the longest row ({longest})")
    tokens = torch.full((len(samples), width), pad_id, dtype=torch.long)
    labels = torch.full((len(samples), width), IGNORE_INDEX, dtype=torch.long)
    for i, s in enumerate(samples):
        tokens[i, : len(s.tokens)] = torch.tensor(s.tokens)
        labels[i, : len(s.labels)] = torch.tensor(s.labels)
    return tokens, labels

