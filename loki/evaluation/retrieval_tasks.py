"""Seeded generators of RULER-style synthetic retrieval prompts (no downloads).

Every generator returns a :class:`RetrievalSample` whose prompt is **exactly** ``context_len`` tokens for the
given tokenizer (no padding is needed to batch samples of one length) and whose expected answer strings all
occur in the prompt.  A prompt is assembled from separately tokenised pieces,
``prefix + haystack[:p1] + needle_1 + haystack[p1:p2] + ... + question``, where the haystack is cut to the
exact token budget and the needles are inserted at unit boundaries (between noise sentences, or after a
sentence end of a book passage) at the requested depths.  The question closes the prompt, written as a plain
completion ("... The pass key is") so that the answer is the continuation.

Tasks (see ``docs/retrieval.md`` for why each size was chosen):

- ``passkey``: a 5-digit pass key in repeated noise sentences (RULER / landmark attention).
- ``single_needle``: "One of the special magic numbers for {key} is: {value}." in held-out book passages
  (RULER niah_single with an essay-like haystack); the question names the key.
- ``multikey_needle``: the same with ``NUM_KEYS`` needles of different keys, one of which is asked for
  (RULER niah_multikey_1); retrieving a wrong needle's number scores 0 (chance 1 / NUM_KEYS).
- ``variable_tracking``: a chain ``VAR A = 12345 ... VAR B = VAR A ...`` (``VT_HOPS`` hops) in noise sentences;
  the answer is every variable of the chain (RULER vt: all names must appear in the output).
"""

from __future__ import annotations

import random
import weakref
import zlib
from dataclasses import dataclass, field

__all__ = ["CHANCE", "NUM_KEYS", "TASKS", "VT_HOPS", "RetrievalSample", "make_sample", "make_samples"]

TASKS = ("single_needle", "multikey_needle", "passkey", "variable_tracking")
NUM_KEYS = 4  # needles in multikey_needle (one asked for, the others distractors)
VT_HOPS = 1  # assignments after the value in variable_tracking: VT_HOPS + 1 variables to name
NEEDLE_DIGITS = 6  # digits of the magic numbers of the needle tasks

#: Accuracy of a guess without retrieval, per task: a random number or name is (almost) never right; in
#: multikey_needle, copying one of the NUM_KEYS needle numbers at random is right 1 / NUM_KEYS of the time.
CHANCE = {"single_needle": 0.0, "multikey_needle": 1.0 / NUM_KEYS, "passkey": 0.0, "variable_tracking": 0.0}

NOISE = " The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
#: Keys of the needle tasks and variable names of variable_tracking (distinct words, common enough to be short).
WORDS = tuple("""apple badger candle dolphin engine falcon garden harbor island jacket kettle lantern meadow needle
orchard pepper quartz river saddle tulip umbrella violin walnut yacht zebra anchor basket cactus desert feather
glacier hammer igloo jungle ladder marble nectar otter pebble rocket sponge tiger velvet wagon whistle button
castle dragon forest guitar helmet jigsaw koala lemon magnet napkin oyster parrot puzzle rabbit salmon teapot
tractor turnip walrus beacon blanket bucket canyon carrot cherry cobra comet copper cotton crystal donkey
eagle emerald fossil goblet granite hazel kayak lobster mango mitten mustard nutmeg olive panda peacock
pillow pirate planet pumpkin raven ribbon scarf shovel spider statue thimble tomato trumpet tunnel vulture""".split())


@dataclass
class RetrievalSample:
    """One prompt: ``input_ids`` (exactly ``context_len`` ids), the expected ``answers`` (all must appear in the
    generated text), the needles' ``depths`` (fraction of the haystack before each needle) and token
    ``positions``."""

    task: str
    input_ids: list[int]
    answers: tuple[str, ...]
    depths: tuple[float, ...]
    positions: tuple[int, ...]
    seed: int
    meta: dict = field(default_factory=dict)


# ------------------------------------------------------------------------------------------ tokens
_MEMO: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # tokenizer -> {text: ids, (tok,): is end}
_BOOK: dict = {}


def _memo(tokenizer) -> dict:
    try:
        return _MEMO.setdefault(tokenizer, {})
    except TypeError:  # not weak-referenceable: no memo
        return {}


def _encode(tokenizer, text: str) -> list[int]:
    memo = _memo(tokenizer)
    ids = memo.get(text)
    if ids is None:
        ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
        if len(memo) < 200_000:
            memo[text] = ids
    return ids


def _is_sentence_end(tokenizer, tok: int) -> bool:
    memo = _memo(tokenizer)
    hit = memo.get((tok,))
    if hit is None:
        s = tokenizer.decode([tok]).rstrip(" ”\"'’)")
        hit = memo[(tok,)] = bool(s) and (s[-1] in ".!?" or "\n" in s)
    return hit


def _book_passages() -> list[str]:
    if "passages" not in _BOOK:
        from loki.evaluation.data import load_packaged_corpus

        _BOOK["passages"] = [p for p in load_packaged_corpus("book", part="eval").text.split("\n\n") if p.strip()]
    return _BOOK["passages"]


def _haystack(kind: str, tokenizer, n: int, rng: random.Random) -> tuple[list[int], list[int]]:
    """At least ``n`` haystack ids (the caller cuts them to ``n``) and the unit boundaries (offsets at which a
    needle may be inserted, in increasing order, starting with 0)."""
    ids: list[int] = []
    bounds: list[int] = [0]
    if kind == "noise":
        unit = _encode(tokenizer, NOISE)
        while len(ids) < n:
            ids.extend(unit)
            bounds.append(len(ids))
        return ids, bounds
    passages = _book_passages()
    i = rng.randrange(len(passages))
    while len(ids) < n:
        p = _encode(tokenizer, "\n\n" + passages[i % len(passages)])
        start = len(ids)
        ids.extend(p)
        bounds.extend(start + j + 1 for j in range(len(p) - 1) if _is_sentence_end(tokenizer, p[j]))
        bounds.append(len(ids))
        i += 1
    return ids, bounds


def _assemble(tokenizer, context_len: int, prefix: str, needles: list[str], depths: list[float], question: str,
              hay_kind: str, rng: random.Random) -> tuple[list[int], list[int]]:
    """prefix + haystack with the needles inserted at ``depths`` (non-decreasing, in [0, 1]) + question:
    exactly ``context_len`` ids.  Returns (ids, token positions of the needles)."""
    pre, q = _encode(tokenizer, prefix), _encode(tokenizer, question)
    nds = [_encode(tokenizer, s) for s in needles]
    budget = context_len - len(pre) - len(q) - sum(len(x) for x in nds)
    if budget < 16 * (len(nds) + 1):
        raise ValueError(f"context_len={context_len} is too short for this task ({context_len - budget} fixed tokens)")
    hay, bounds = _haystack(hay_kind, tokenizer, budget, rng)
    hay = hay[:budget]
    bounds = [b for b in bounds if b <= budget]
    ids, positions, last = list(pre), [], 0
    for needle, depth in zip(nds, depths):
        target = depth * budget
        b = min((x for x in bounds if x >= last), key=lambda x: abs(x - target))
        ids.extend(hay[last:b])
        positions.append(len(ids))
        ids.extend(needle)
        last = b
    ids.extend(hay[last:])
    ids.extend(q)
    assert len(ids) == context_len, (len(ids), context_len)
    return ids, positions


def _number(rng: random.Random, digits: int) -> str:
    return str(rng.randrange(10 ** (digits - 1), 10**digits))


def _words(rng: random.Random, n: int, exclude=()) -> list[str]:
    out: list[str] = []
    while len(out) < n:
        w = rng.choice(WORDS)
        if w not in out and w not in exclude:
            out.append(w)
    return out


# ------------------------------------------------------------------------------------------ tasks
def _passkey(tokenizer, context_len, rng, depth):
    key = _number(rng, 5)
    prefix = ("There is an important info hidden inside a lot of irrelevant text. Find it and memorize it. "
              "I will quiz you about the important information there.")
    needle = f" The pass key is {key}. Remember it. {key} is the pass key."
    question = "\n\nWhat is the pass key (a five-digit number)? The pass key is number"
    ids, pos = _assemble(tokenizer, context_len, prefix, [needle], [depth], question, "noise", rng)
    return ids, (key,), (depth,), pos, {}


def _needles(tokenizer, context_len, rng, depth, num_keys):
    keys = _words(rng, num_keys)
    values = []
    while len(values) < num_keys:
        v = _number(rng, NEEDLE_DIGITS)
        if v not in values:
            values.append(v)
    depths = [depth] + [rng.random() for _ in range(num_keys - 1)]
    order = sorted(range(num_keys), key=lambda i: depths[i])
    prefix = ("Some special magic numbers are hidden within the following text. Make sure to memorize them. "
              "I will quiz you about the numbers afterwards.")
    needles = [f" One of the special magic numbers for {keys[i]} is: {values[i]}." for i in order]
    question = (f"\n\nWhat is the special magic number for {keys[0]} mentioned in the provided text? "
                f"One of the special magic numbers for {keys[0]} is:")
    ids, pos = _assemble(tokenizer, context_len, prefix, needles, [depths[i] for i in order], question, "book",
                         rng)
    return ids, (values[0],), (depth,), (pos[order.index(0)],), {"keys": keys, "values": values}


def _vt_question(n: int, value: str) -> str:
    return (f"\n\nQuestion: Find all variables that are assigned the value {value} in the text above. "
            f"Answer: According to the chain(s) of variables assignment in the text above, {n} variables are "
            f"assigned the value {value}, they are:")


def _variable_tracking(tokenizer, context_len, rng, depth):
    names = [w.upper() for w in _words(rng, 2 * (VT_HOPS + 1))]
    names, shot = names[: VT_HOPS + 1], names[VT_HOPS + 1 :]  # the example's names differ from the task's
    value, shot_value = _number(rng, 5), _number(rng, 5)
    intro = "Memorize and track the chain(s) of variable assignment hidden in the following text."
    example = ("Example:\n" + intro + NOISE + f" VAR {shot[0]} = {shot_value}." + NOISE
               + "".join(f" VAR {shot[i]} = VAR {shot[i - 1]}." for i in range(1, VT_HOPS + 1)) + NOISE
               + _vt_question(VT_HOPS + 1, shot_value) + " " + " ".join(f"VAR {x}" for x in shot) + "\n\n")
    statements = [f" VAR {names[0]} = {value}."] + [f" VAR {names[i]} = VAR {names[i - 1]}."
                                                     for i in range(1, VT_HOPS + 1)]
    depths = [depth] + sorted(depth + (1.0 - depth) * rng.random() for _ in range(VT_HOPS))
    ids, pos = _assemble(tokenizer, context_len, example + intro, statements, depths,
                         _vt_question(VT_HOPS + 1, value), "noise", rng)
    return ids, tuple(names), (depth,), (pos[0],), {"value": value}


def make_sample(task: str, tokenizer, context_len: int, seed: int, depth: float | None = None) -> RetrievalSample:
    """One sample of ``task`` from ``random.Random(seed)``; ``depth`` (fraction of the haystack before the asked
    needle, default drawn from the seed) places the needle."""
    rng = random.Random(seed)
    if depth is None:
        depth = rng.random()
    depth = min(max(float(depth), 0.0), 1.0)
    if task == "passkey":
        out = _passkey(tokenizer, context_len, rng, depth)
    elif task == "single_needle":
        out = _needles(tokenizer, context_len, rng, depth, 1)
    elif task == "multikey_needle":
        out = _needles(tokenizer, context_len, rng, depth, NUM_KEYS)
    elif task == "variable_tracking":
        out = _variable_tracking(tokenizer, context_len, rng, depth)
    else:
        raise ValueError(f"task must be one of {TASKS}, got {task!r}")
    ids, answers, depths, pos, meta = out
    return RetrievalSample(task, ids, answers, depths, tuple(pos), seed, meta)


def sample_seed(seed: int, task: str, context_len: int, index: int) -> int:
    """The seed of sample ``index`` of (task, context_len) in a suite seeded with ``seed`` (stable across runs
    and Python versions: no ``hash()``)."""
    return zlib.crc32(f"{seed}/{task}/{context_len}/{index}".encode())


def make_samples(task: str, tokenizer, context_len: int, n: int, seed: int = 0) -> list[RetrievalSample]:
    """``n`` samples with depths spread evenly over the context ((i + 0.5) / n for sample i)."""
    return [make_sample(task, tokenizer, context_len, sample_seed(seed, task, context_len, i), (i + 0.5) / n)
            for i in range(n)]
