"""Built-in synthetic tasks: the demo fine-tuning task and the base model's pretraining mix.

The demo has to show, on a 2-core CPU and in minutes, that LoRA hyperparameters matter.
That needs a task the shipped tiny base model cannot do out of the box but is one small
step away from. So every task here shares one format and one alphabet:

    input  = <payload> <op>        e.g. "hello+"   (payload: 2-6 lowercase letters)
    output = <answer>              e.g. "ifmmp"

The single operator character at the end of the input says what to do with the payload.
The base model (``plora/assets/tiny-llama``) is pretrained on the operators in
``PRETRAIN_TASKS`` (copy, reverse, sort, count, alphabet range). The fine-tuning task
``shift`` ("+": replace every letter by the next one, z wraps to a) is never shown in
pretraining, so the base model scores ~0 exact match on it, while every piece it needs
(reading the payload position by position, the order of the alphabet) is already there.

Splits are disjoint by construction: an example belongs to the eval split exactly when a
hash of its *payload* falls in the eval bucket, whatever the task. So no eval payload of
any task was ever seen in training, by the base model or by an adapter.
"""

from __future__ import annotations

import hashlib
import random
import string
from dataclasses import dataclass
from typing import Callable

__all__ = [
    "ALPHABET",
    "BUILTIN_TASKS",
    "PRETRAIN_TASKS",
    "TaskInfo",
    "iter_examples",
    "load_builtin_task",
    "split_of",
]

ALPHABET = string.ascii_lowercase
MIN_LEN = 2
MAX_LEN = 6
EVAL_BUCKETS = 5  # one bucket in EVAL_BUCKETS of payloads is eval-only (20%)
SPLITS = ("train", "eval")


@dataclass(frozen=True)
class TaskInfo:
    """What a built-in task is; the defaults are the sizes the demo is calibrated for."""

    name: str
    description: str
    default_num_train: int
    default_num_eval: int
    op: str = ""
    min_len: int = MIN_LEN
    max_len: int = MAX_LEN


def _shift(s: str) -> str:
    return "".join(ALPHABET[(ALPHABET.index(c) + 1) % len(ALPHABET)] for c in s)


def _range(s: str) -> str:
    # payload is two letters a<=b: the answer spells the alphabet from a to b.
    a, b = ALPHABET.index(s[0]), ALPHABET.index(s[1])
    return ALPHABET[a : b + 1]


_ANSWER: dict[str, Callable[[str], str]] = {
    "shift": _shift,
    "copy": lambda s: s,
    "reverse": lambda s: s[::-1],
    "sort": lambda s: "".join(sorted(s)),
    "count": lambda s: str(len(s)),
    "range": _range,
}

BUILTIN_TASKS: dict[str, TaskInfo] = {
    "shift": TaskInfo(
        "shift",
        "shift every letter by one (z wraps to a): 'hello+' -> 'ifmmp'. The demo task: "
        "the tiny base model never saw '+', so it starts near 0 exact match.",
        1000,
        200,
        op="+",
    ),
    "copy": TaskInfo("copy", "copy the letters: 'hello=' -> 'hello'", 20000, 200, op="="),
    "reverse": TaskInfo("reverse", "reverse the letters: 'hello<' -> 'olleh'", 20000, 200, op="<"),
    "sort": TaskInfo("sort", "sort the letters: 'hello^' -> 'ehllo'", 20000, 200, op="^"),
    "count": TaskInfo("count", "count the letters: 'hello#' -> '5'", 20000, 200, op="#", min_len=1, max_len=9),
    "range": TaskInfo(
        "range", "spell the alphabet between two letters: 'dh>' -> 'defgh'", 80, 16, op=">", min_len=2, max_len=2
    ),
}

#: The operators the shipped base model is pretrained on (``shift`` is deliberately absent).
PRETRAIN_TASKS: tuple[str, ...] = ("copy", "reverse", "sort", "count", "range")


def split_of(payload: str) -> str:
    """The split a payload belongs to: a stable hash bucket, shared by all tasks."""
    digest = hashlib.sha256(payload.encode("utf-8")).digest()
    return "eval" if digest[0] % EVAL_BUCKETS == 0 else "train"


def _rng(*parts: object) -> random.Random:
    # Python's hash() is salted per process; derive the seed from a digest instead.
    key = "|".join(str(p) for p in parts).encode("utf-8")
    return random.Random(int.from_bytes(hashlib.sha256(key).digest()[:8], "big"))


def _payload(info: TaskInfo, rng: random.Random) -> str:
    if info.name == "range":
        a = rng.randrange(len(ALPHABET) - 1)
        b = rng.randrange(a + 1, min(a + MAX_LEN, len(ALPHABET)))
        return ALPHABET[a] + ALPHABET[b]
    n = rng.randint(info.min_len, info.max_len)
    return "".join(rng.choice(ALPHABET) for _ in range(n))


def load_builtin_task(name: str, split: str, n: int | None = None, seed: int = 0) -> list[dict]:
    """Generate ``n`` distinct examples ``{"input", "output"}`` of a built-in task.

    Deterministic in (name, split, n, seed); train and eval never share a payload.
    Examples are distinct within one call so that an epoch over them is a real epoch.
    """
    if name not in BUILTIN_TASKS:
        raise ValueError(f"unknown built-in task {name!r}; known: {', '.join(sorted(BUILTIN_TASKS))}")
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    info = BUILTIN_TASKS[name]
    if n is None:
        n = info.default_num_train if split == "train" else info.default_num_eval
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    rng = _rng("plora.tasks", name, split, seed)
    answer = _ANSWER[name]
    seen: set[str] = set()
    out: list[dict] = []
    attempts = 0
    max_attempts = 50 * n + 1000
    while len(out) < n:
        attempts += 1
        if attempts > max_attempts:
            raise ValueError(f"task {name!r} has fewer than {n} distinct {split} examples")
        payload = _payload(info, rng)
        if payload in seen or split_of(payload) != split:
            continue
        seen.add(payload)
        out.append({"input": payload + info.op, "output": answer(payload)})
    return out


def iter_examples(name: str, split: str, seed: int = 0):
    """An endless, seeded stream of examples of one task and split (repeats allowed).

    Pretraining draws from this rather than from a fixed list, so that small tasks (``range``
    has about a hundred distinct payloads) can be mixed in at any rate.
    """
    if name not in BUILTIN_TASKS:
        raise ValueError(f"unknown built-in task {name!r}")
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    info = BUILTIN_TASKS[name]
    rng = _rng("plora.tasks.stream", name, split, seed)
    answer = _ANSWER[name]
    while True:
        payload = _payload(info, rng)
        if split_of(payload) == split:
            yield {"input": payload + info.op, "output": answer(payload)}
