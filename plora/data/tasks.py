"""Built-in synthetic tasks: the demo fine-tuning task and the base model's pretraining mix.

The demo has to show, on a 2-core CPU and in minutes, that LoRA hyperparameters matter.
That needs a task the shipped tiny base model cannot do out of the box but is one small
step away from. So every task here shares one format and one alphabet:

    input  = <payload><op>        e.g. "hello+"   (payload: 2-5 lowercase letters)
    output = <answer>             e.g. "elloh"

The single operator character at the end of the input says what to do with the payload.
The base model (``plora/assets/tiny-llama``) is pretrained on the operators in
``PRETRAIN_TASKS``: copy "=", reverse "<", sort "^", count "#" and alphabet range ">".
The fine-tuning task ``shift`` ("+": shift the string one place to the left, the first
letter moving to the end) is never shown in pretraining, so the base model scores ~0 exact
match on it. Yet every piece it needs (reading the payload letter after letter, finding
its first letter, stopping after the last one) is what copy and reverse already do, so a
LoRA adapter on the attention projections learns it in about a hundred steps with a good
learning rate, stays near 0 with a small one and diverges with a large one.

(Shifting every *letter* to the next one in the alphabet, the other reading of "shift",
was tried and rejected for the demo: the model must learn a 26-entry lookup table that
no pretraining task exercises, which needs the MLP targets and 3-4x more steps.)

Splits are disjoint by construction: an example belongs to the eval split exactly when a
hash of its *payload* falls in the eval bucket, whatever the task. So no eval payload of
any task was ever seen in training, by the base model or by an adapter.
"""

from __future__ import annotations

import hashlib
import random
import string
from collections.abc import Callable, Iterator
from dataclasses import dataclass

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
MAX_LEN = 5
EVAL_BUCKETS = 5  # one payload bucket in EVAL_BUCKETS is eval-only (20% of payloads)
SPLITS = ("train", "eval")


@dataclass(frozen=True)
class TaskInfo:
    """What a built-in task is; the default sizes are the ones the demo is calibrated for."""

    name: str
    description: str
    default_num_train: int
    default_num_eval: int
    op: str = ""
    min_len: int = MIN_LEN
    max_len: int = MAX_LEN


def _range(s: str) -> str:
    # The payload is two letters a < b; the answer spells the alphabet from a to b.
    a, b = ALPHABET.index(s[0]), ALPHABET.index(s[1])
    return ALPHABET[a : b + 1]


_ANSWER: dict[str, Callable[[str], str]] = {
    "shift": lambda s: s[1:] + s[:1],
    "copy": lambda s: s,
    "reverse": lambda s: s[::-1],
    "sort": lambda s: "".join(sorted(s)),
    "count": lambda s: str(len(s)),
    "range": _range,
}

BUILTIN_TASKS: dict[str, TaskInfo] = {
    "shift": TaskInfo(
        "shift",
        "shift the letters one place left, the first one moving to the end: 'hello+' -> 'elloh'. "
        "The demo task: the tiny base model never saw '+' and starts near 0 exact match.",
        2000,
        200,
        op="+",
    ),
    "copy": TaskInfo("copy", "copy the letters: 'hello=' -> 'hello'", 2000, 200, op="="),
    "reverse": TaskInfo("reverse", "reverse the letters: 'hello<' -> 'olleh'", 2000, 200, op="<"),
    "sort": TaskInfo("sort", "sort the letters: 'hello^' -> 'ehllo'", 2000, 200, op="^"),
    "count": TaskInfo("count", "count the letters: 'hello#' -> '5'", 2000, 200, op="#", min_len=1, max_len=9),
    # Few distinct payloads (about 95 pairs), hence the small defaults.
    "range": TaskInfo("range", "spell the alphabet between two letters: 'dh>' -> 'defgh'", 60, 12, op=">"),
}

#: Tasks for a real instruct model (SmolLM2-135M-Instruct starts weak on them): short natural
#: language prompts ending in a newline, short exact answers. See `_WORD_TASKS` below.
BUILTIN_TASKS.update({
    "arithmetic": TaskInfo(
        "arithmetic",
        "multi-step arithmetic word problems: 'Tom has 12 apples. He buys 7 more and then gives away 5. "
        "How many apples does Tom have now?' -> '14'",
        2000,
        200,
    ),
    "sentiment": TaskInfo(
        "sentiment",
        "label a short generated review with one word: positive, negative or mixed "
        "('The soup was delicious but the waiter was rude.' -> 'mixed')",
        2000,
        200,
    ),
    "verdict": TaskInfo(
        "verdict",
        "label a three-point review by how many points are good, negations included: positive (3), "
        "mostly positive (2), mostly negative (1) or negative (0) ('The room was not clean, the staff was "
        "friendly and the view was superb.' -> 'mostly positive')",
        2000,
        200,
    ),
})

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
        b = rng.randrange(a + 1, min(a + info.max_len, len(ALPHABET)))
        return ALPHABET[a] + ALPHABET[b]
    n = rng.randint(info.min_len, info.max_len)
    return "".join(rng.choice(ALPHABET) for _ in range(n))


def _check(name: str, split: str) -> TaskInfo:
    if name not in BUILTIN_TASKS:
        raise ValueError(f"unknown built-in task {name!r}; known: {', '.join(sorted(BUILTIN_TASKS))}")
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    return BUILTIN_TASKS[name]


def load_builtin_task(name: str, split: str, n: int | None = None, seed: int = 0) -> list[dict]:
    """Generate ``n`` distinct examples ``{"input", "output"}`` of a built-in task.

    Deterministic in (name, split, n, seed): the first k of n examples are the k examples
    of a smaller call. Train and eval never share a payload. Examples are distinct within
    one call so that an epoch over them is a real epoch.
    """
    info = _check(name, split)
    if n is None:
        n = info.default_num_train if split == "train" else info.default_num_eval
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    rng = _rng("plora.tasks", name, split, seed)  # the seed key: fixed, whatever this module is called
    seen: set[str] = set()
    out: list[dict] = []
    attempts, max_attempts = 0, 50 * n + 1000
    while len(out) < n:
        attempts += 1
        if attempts > max_attempts:
            raise ValueError(f"task {name!r} has fewer than {n} distinct {split} examples")
        payload, example = _example(info, rng)
        if payload in seen or split_of(payload) != split:
            continue
        seen.add(payload)
        out.append(example)
    return out


def _example(info: TaskInfo, rng: random.Random) -> tuple[str, dict]:
    """One example and the payload that decides its split (the whole prompt for word tasks)."""
    if info.name in _WORD_TASKS:
        example = _WORD_TASKS[info.name](rng)
        return example["input"], example
    payload = _payload(info, rng)
    return payload, {"input": payload + info.op, "output": _ANSWER[info.name](payload)}


def iter_examples(name: str, split: str, seed: int = 0) -> Iterator[dict]:
    """An endless, seeded stream of examples of one task and split (repeats allowed).

    Pretraining draws from this rather than from a fixed list, so that a small task
    (``range``) can be mixed in at any rate.
    """
    info = _check(name, split)
    rng = _rng("plora.tasks.stream", name, split, seed)  # likewise
    while True:
        payload, example = _example(info, rng)
        if split_of(payload) == split:
            yield example


# --------------------------------------------------------------------------- word tasks
# Each prompt ends with an instruction and a newline; the answer is one short line, so
# exact match is meaningful and a model that rambles (or never stops) scores 0.

_NAMES = ("Tom", "Anna", "Ravi", "Mia", "Lucas", "Sofia", "Omar", "Emma", "Kenji", "Lena", "Ben", "Zoe",
          "Ali", "Nora", "Pablo", "Ivy", "Sam", "Chloe", "Yuki", "Leo")
_ITEMS = ("apples", "marbles", "stickers", "books", "coins", "pencils", "cookies", "cards", "shells", "stamps",
          "balloons", "candies")
#: how an amount changes the count; {n} is the amount
_GAINS = ("buys {n} more", "finds {n} more", "gets {n} more from a friend", "wins {n} more", "is given {n} more")
_LOSSES = ("gives away {n}", "loses {n}", "uses {n}", "sells {n}", "gives {n} to a friend")


def _arithmetic(rng: random.Random) -> dict:
    """2 or 3 additions/subtractions on a count that never goes below zero."""
    name, item = rng.choice(_NAMES), rng.choice(_ITEMS)
    count = rng.randint(5, 40)
    start = count
    steps = []
    for _ in range(rng.choice((2, 2, 3))):
        if count > 3 and rng.random() < 0.5:
            n = rng.randint(1, min(count - 1, 20))
            steps.append(rng.choice(_LOSSES).format(n=n))
            count -= n
        else:
            n = rng.randint(1, 20)
            steps.append(rng.choice(_GAINS).format(n=n))
            count += n
    done = ", then ".join(steps[:-1]) + f" and then {steps[-1]}" if len(steps) > 1 else steps[0]
    text = (f"{name} has {start} {item}, {done}. How many {item} does {name} have now? "
            "Answer with the number only.\n")
    return {"input": text, "output": str(count)}


_ASPECTS = ("food", "service", "music", "room", "price", "staff", "view", "coffee", "seats", "screen", "battery",
            "delivery", "plot", "acting", "soup", "bed")
_GOOD = ("excellent", "delicious", "friendly", "wonderful", "great", "perfect", "lovely", "superb", "fantastic",
         "comfortable")
_BAD = ("terrible", "awful", "rude", "cold", "disappointing", "noisy", "overpriced", "broken", "dirty", "boring")
_PLACES = ("restaurant", "hotel", "cafe", "cinema", "shop", "phone", "movie", "train", "museum", "bakery")
SENTIMENT_LABELS = ("positive", "negative", "mixed")


def _sentiment(rng: random.Random) -> dict:
    """One or two clauses about aspects of a place: all good, all bad, or one of each."""
    label = rng.choice(SENTIMENT_LABELS)
    a, b = rng.sample(_ASPECTS, 2)
    place = rng.choice(_PLACES)
    if label == "mixed":
        first, second = (rng.choice(_GOOD), rng.choice(_BAD)) if rng.random() < 0.5 else (rng.choice(_BAD), rng.choice(_GOOD))
        review = f"At the {place} the {a} was {first} but the {b} was {second}."
    else:
        words = _GOOD if label == "positive" else _BAD
        if rng.random() < 0.5:
            review = f"At the {place} the {a} was {rng.choice(words)}."
        else:
            review = f"At the {place} the {a} was {rng.choice(words)} and the {b} was {rng.choice(words)}."
    text = ("Label the review as positive, negative or mixed. Answer with one word.\n"
            f"Review: {review}\n")
    return {"input": text, "output": label}


#: the verdict for each number of good points (0..3)
VERDICT_LABELS = ("negative", "mostly negative", "mostly positive", "positive")


def _verdict(rng: random.Random) -> dict:
    """Three points about a place, each good or bad and a third of them negated ("was not
    friendly" is a bad point, "was not noisy" a good one); the label counts the good points.

    The harder classification task: the sentiment task's label follows from its words (a
    135M model learns it with almost any learning rate), while here the label needs every
    clause read with its negation and the good ones counted, which separates configurations.
    """
    place = rng.choice(_PLACES)
    aspects = rng.sample(_ASPECTS, 3)
    good = 0
    clauses = []
    for aspect in aspects:
        positive_word = rng.random() < 0.5
        negated = rng.random() < 1 / 3
        word = rng.choice(_GOOD if positive_word else _BAD)
        good += positive_word != negated
        clauses.append(f"the {aspect} was {'not ' if negated else ''}{word}")
    review = f"At the {place} {clauses[0]}, {clauses[1]} and {clauses[2]}."
    text = ("Count the good points of the review and answer with its verdict: positive (all three good), "
            "mostly positive (two), mostly negative (one) or negative (none).\n"
            f"Review: {review}\n")
    return {"input": text, "output": VERDICT_LABELS[good]}


_WORD_TASKS: dict[str, Callable[[random.Random], dict]] = {"arithmetic": _arithmetic, "sentiment": _sentiment,
                                                           "verdict": _verdict}
