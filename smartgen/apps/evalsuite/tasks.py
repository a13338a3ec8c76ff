"""Long-context retrieval prompts (passkey, RULER NIAH, key-value, variable tracking), deterministic in a seed.

A task draws its answer first (keys, values, names; from the seed alone), then fills a haystack up to the
target length in tokens of the given tokenizer, with the needles at the requested depth: the fraction of
haystack items before the needle. `generate_suite` spreads depths as i/(n-1) over a cell's n samples.
"""

from __future__ import annotations

import random
import string
from dataclasses import dataclass, field

from smartgen.apps.evalsuite.haystack import Insert, assemble
from smartgen.apps.evalsuite.surface import KEY_ADJECTIVES, KEY_NOUNS, TEMPLATES, VARIANTS, filler_stream

__all__ = ["TASKS", "MAX_NEW_TOKENS", "Sample", "generate_task", "generate_suite", "task_depths"]

# Tokens a model needs to write the answer; the prompt is sized to length - this, as RULER does.
MAX_NEW_TOKENS = {"passkey": 8, "niah_single": 10, "niah_multikey": 10, "kv_retrieval": 10, "vt": 40}
TASKS = tuple(MAX_NEW_TOKENS)
NUM_MULTIKEY_NEEDLES = 4  # RULER multikey_1: 4 keys, 1 queried
NUM_VT_HOPS = 4  # RULER vt: 1 chain, 4 hops, 5 variables


@dataclass(frozen=True, slots=True)
class Sample:
    """One prompt, its references (RULER: every one must appear in the output) and where its needles sit."""

    prompt: str
    references: list[str]
    task: str
    length: int  # target length in tokens (prompt + answer budget)
    depth: float  # fraction of the haystack before the (first) answer needle
    seed: int
    variant: str = "eval"
    answer: str = ""  # the ideal continuation of the prompt (training target)
    num_tokens: int = 0  # prompt tokens under the tokenizer used to build it
    needle_spans: list[tuple[int, int]] = field(default_factory=list)  # char spans of the answer needles

    def __post_init__(self) -> None:
        if self.task not in MAX_NEW_TOKENS:
            raise ValueError(f"unknown task {self.task!r}; expected one of {TASKS}")
        if not self.references:
            raise ValueError("a sample needs at least one reference")
        if not 0.0 <= self.depth <= 1.0:
            raise ValueError(f"depth must be in [0, 1], got {self.depth}")

    @property
    def max_new_tokens(self) -> int:
        return MAX_NEW_TOKENS[self.task]

    def to_json(self) -> dict:
        return {
            "prompt": self.prompt,
            "task": self.task,
            "length": self.length,
            "references": self.references,
            "depth": round(self.depth, 4),
            "seed": self.seed,
            "variant": self.variant,
        }


def task_depths(num: int) -> list[float]:
    """Needle depths spread evenly over [0, 1]: i/(n-1)."""
    return [0.5] if num == 1 else [i / (num - 1) for i in range(num)]


def generate_task(
    task: str, length_tokens: int, seed: int, tokenizer, variant: str = "eval", depth: float | None = None
) -> Sample:
    """One prompt of `task` about `length_tokens` tokens long (±2%); `depth` defaults to a draw from the seed."""
    if task not in MAX_NEW_TOKENS:
        raise ValueError(f"unknown task {task!r}; expected one of {TASKS}")
    if variant not in VARIANTS:
        raise ValueError(f"unknown variant {variant!r}; expected one of {VARIANTS}")
    # String seeds are hashed with SHA-512 by random.Random: stable across runs and processes, and a
    # different stream per variant, so eval, calibration and train never draw the same prompt.
    rng = random.Random(f"smartgen-evalsuite:{variant}:{task}:{length_tokens}:{seed}")
    if depth is None:
        depth = rng.randrange(40) / 39  # RULER: 40 evenly spaced depths
    templates = TEMPLATES[variant]
    target = length_tokens - MAX_NEW_TOKENS[task]
    build = _BUILDERS[task]
    head, inserts, tail, sep, items, references, answer = build(rng, templates, depth, variant)
    built = assemble(head, items, inserts, tail, sep, target, tokenizer)
    return Sample(
        prompt=built.prompt,
        references=references,
        task=task,
        length=length_tokens,
        depth=depth,
        seed=seed,
        variant=variant,
        answer=answer,
        num_tokens=built.num_tokens,
        needle_spans=built.answer_spans,
    )


def generate_suite(tasks, lengths, num_per_cell: int, seed: int, tokenizer, variant: str = "eval") -> list[Sample]:
    """num_per_cell prompts per (task, length), needles at depths i/(n-1); sample i of a cell gets seed + i."""
    return [
        generate_task(task, length, seed + i, tokenizer, variant, depth=depth)
        for task in tasks
        for length in lengths
        for i, depth in enumerate(task_depths(num_per_cell))
    ]


def _pick(rng: random.Random, choices: tuple[str, ...]) -> str:
    return choices[0] if len(choices) == 1 else rng.choice(choices)


def _word_key(rng: random.Random) -> str:
    return f"{rng.choice(KEY_ADJECTIVES)}-{rng.choice(KEY_NOUNS)}"


def _number(rng: random.Random, digits: int) -> str:
    return str(rng.randrange(10 ** (digits - 1), 10**digits))


def _filler(rng: random.Random, variant: str):
    hay_rng = random.Random(rng.random())  # its own stream: the haystack length never shifts the answer draws
    return filler_stream(variant, hay_rng), (" " if variant != "train" else rng.choice((" ", "\n")))


def _passkey(rng, templates, depth, variant):
    t = templates["passkey"]
    k = str(rng.randint(1, 50000))  # Quest: randint(1, 50000)
    needle = _pick(rng, t["needle"]).format(k=k)
    items, sep = _filler(rng, variant)
    head = _pick(rng, t["intro"]) + "\n"
    tail = "\n" + _pick(rng, t["question"])
    return head, [Insert(depth, "\n" + needle + "\n", True)], tail, sep, items, [k], " " + k


def _niah(num_needles: int):
    def build(rng, templates, depth, variant):
        t = templates["niah"]
        keys: list[str] = []
        while len(keys) < num_needles:
            key = _word_key(rng)
            if key not in keys:
                keys.append(key)
        values = [_number(rng, 7) for _ in keys]  # RULER: 7-digit values
        needle_template = _pick(rng, t["needle"])
        inserts = [Insert(depth, "\n" + needle_template.format(key=keys[0], value=values[0]) + "\n", True)]
        inserts += [
            Insert(rng.random(), "\n" + needle_template.format(key=k, value=v) + "\n", False)
            for k, v in zip(keys[1:], values[1:])
        ]
        items, sep = _filler(rng, variant)
        head = _pick(rng, t["intro"]) + "\n"
        tail = "\n" + _pick(rng, t["question"]).format(key=keys[0])
        return head, inserts, tail, sep, items, [values[0]], " " + values[0]

    return build


def _random_key(rng: random.Random) -> str:
    return "".join(rng.choice(string.ascii_lowercase + string.digits) for _ in range(8))


def _kv(rng, templates, depth, variant):
    t = templates["kv"]
    key, value = _random_key(rng), _number(rng, 7)
    sep = _pick(rng, t["sep"])
    pair_rng = random.Random(rng.random())

    def pairs():
        while True:
            other = _random_key(pair_rng)
            if other != key:
                yield f'"{other}": "{_number(pair_rng, 7)}"'

    head = _pick(rng, t["intro"])
    # a JSON intro ("...{") needs a question that closes the object ("}...")
    questions = tuple(q for q in t["question"] if q.startswith("}}") == head.endswith("{"))
    tail = _pick(rng, questions).format(key=key)
    return head, [Insert(depth, f'"{key}": "{value}"', True, joins_as_item=True)], tail, sep, pairs(), [value], value


def _var_name(rng: random.Random) -> str:
    return "".join(rng.choice(string.ascii_uppercase) for _ in range(5))  # RULER: 5 uppercase letters


def _vt(rng, templates, depth, variant):
    t = templates["vt"]
    names: list[str] = []
    while len(names) < NUM_VT_HOPS + 1:
        name = _var_name(rng)
        if name not in names:
            names.append(name)
    value = str(rng.randint(10000, 99999))  # RULER: randint(10000, 99999)
    lines = [f"VAR {names[0]} = {value}"] + [f"VAR {b} = VAR {a}" for a, b in zip(names, names[1:])]
    later = sorted(depth + (1.0 - depth) * rng.random() for _ in lines[1:])
    inserts = [Insert(d, "\n" + line + "\n", True) for d, line in zip([depth, *later], lines)]
    items, sep = _filler(rng, variant)
    head = _pick(rng, t["intro"]) + "\n"
    tail = "\n" + _pick(rng, t["question"]).format(value=value, count=len(names))
    return head, inserts, tail, sep, items, names, " " + " ".join(names)


_BUILDERS = {
    "passkey": _passkey,
    "niah_single": _niah(1),
    "niah_multikey": _niah(NUM_MULTIKEY_NEEDLES),
    "kv_retrieval": _kv,
    "vt": _vt,
}
