"""Surface text per variant: filler sentences and phrasing templates; eval, calibration and train share none.

What the variants do share is each task's core syntax, which defines the task: "for {key} is: {value}",
"The pass key is {k}", '"{key}": "{value}"', "VAR {a} = {v}". Every template around it (instructions,
needle sentences, questions) and every filler sentence belongs to one variant only, so a calibration
profile or a trained model never sees an evaluation prompt (tests/test_evalsuite.py checks both).

Every question ends in its task's answer prefix ("... for {key} is:"), the way RULER ends prompts with
"The special magic number for {key} ... is"; eval keeps RULER's and Quest's wording everywhere else.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

__all__ = [
    "VARIANTS",
    "KEY_ADJECTIVES",
    "KEY_NOUNS",
    "TASK_KEYWORDS",
    "TEMPLATES",
    "filler_sentences",
    "train_filler_sentences",
]

VARIANTS = ("eval", "calibration", "train")

# Needle keys are "adjective-noun" pairs as in RULER; both lists stay clear of every filler word.
KEY_ADJECTIVES = (
    "red",
    "gold",
    "quiet",
    "brave",
    "calm",
    "dark",
    "bright",
    "happy",
    "lucky",
    "swift",
    "gentle",
    "wild",
    "proud",
    "cold",
    "sweet",
    "bitter",
    "tiny",
    "giant",
    "ancient",
    "modern",
    "hidden",
    "frozen",
    "rapid",
    "silent",
    "clever",
    "noble",
    "fancy",
    "purple",
    "humble",
    "eager",
    "polite",
    "rusty",
)
KEY_NOUNS = (
    "tiger",
    "castle",
    "garden",
    "rocket",
    "violin",
    "pencil",
    "mirror",
    "island",
    "forest",
    "dragon",
    "window",
    "engine",
    "planet",
    "candle",
    "anchor",
    "basket",
    "bridge",
    "camera",
    "desert",
    "falcon",
    "hammer",
    "jacket",
    "lantern",
    "meadow",
    "orchid",
    "pepper",
    "rabbit",
    "saddle",
    "tunnel",
    "wallet",
    "zebra",
    "helmet",
)
TASK_KEYWORDS = (
    " pass",
    " key",
    " special",
    " magic",
    " number",
    " numbers",
    " value",
    " VAR",
    "VAR",
    " variables",
    " text",
    " remember",
    " JSON",
    " mentioned",
    " provided",
    " assigned",
)

# RULER's noise haystack (scripts/data/synthetic/niah.py) and Quest's passkey garbage.
_EVAL_FILLER = ("The grass is green.", "The sky is blue.", "The sun is yellow.", "Here we go.", "There and back again.")
_CALIBRATION_FILLER = (
    "The river flows down to the sea.",
    "A small bird sings in the tree.",
    "The road is long and quiet.",
    "Snow falls softly on the hills.",
    "The old clock ticks on the wall.",
    "Night comes and the stars shine.",
)

TEMPLATES: dict[str, dict[str, dict[str, tuple[str, ...]]]] = {
    "eval": {
        "passkey": {
            "intro": (
                "There is an important info hidden inside a lot of irrelevant text. Find it and memorize them. "
                "I will quiz you about the important information there.",
            ),
            "needle": ("The pass key is {k}. Remember it. {k} is the pass key.",),
            "question": ("What is the pass key? The pass key is",),
        },
        "niah": {
            "intro": (
                "Some special magic numbers are hidden within the following text. Make sure to memorize it. "
                "I will quiz you about the numbers afterwards.",
            ),
            "needle": ("One of the special magic numbers for {key} is: {value}.",),
            "question": (
                "What is the special magic number for {key} mentioned in the provided text? "
                "The special magic number for {key} is:",
            ),
        },
        "kv": {
            "intro": (
                "Extract the value corresponding to the specified key in the JSON object below.\n\nJSON data:\n{",
            ),
            "question": ('}}\n\nKey: "{key}"\nThe value associated with the specified key is: "{key}": "',),
            "sep": (", ",),
        },
        "vt": {
            "intro": ("Memorize and track the chain(s) of variable assignment hidden in the following text.",),
            "question": (
                "Question: Find all variables that are assigned the value {value} in the text above. "
                "Answer: According to the chain(s) of variables assignment in the text above, "
                "{count} variables are assigned the value {value}, they are:",
            ),
        },
    },
    "calibration": {
        "passkey": {
            "intro": (
                "A secret number is buried somewhere in the long text that follows. Read it carefully and keep "
                "the number in mind; you will be asked for it at the end.",
            ),
            "needle": ("Attention: the pass key is {k}. Keep it safe, {k} is the pass key.",),
            "question": ("Which pass key was mentioned in the text? The pass key is",),
        },
        "niah": {
            "intro": (
                "Several special magic numbers are scattered through the passage below. Please remember them; "
                "one of them will be asked about at the end.",
            ),
            "needle": ("Remember that the special magic number for {key} is: {value}.",),
            "question": (
                "Tell me the special magic number that was given for {key}. So the special magic number for {key} is:",
            ),
        },
        "kv": {
            "intro": (
                "Below is a list of records, one key and one value per line. Find the value stored under the "
                "key asked at the end.\n",
            ),
            "question": ('\n\nLook up the key "{key}" in the records. Record found: "{key}": "',),
            "sep": ("\n",),
        },
        "vt": {
            "intro": (
                "Follow the variable assignments hidden in the text below and keep track of which variables "
                "share a value.",
            ),
            "question": (
                "Question: Which variables end up holding the value {value}? "
                "Answer: The {count} variables holding the value {value} are:",
            ),
        },
    },
    "train": {
        "passkey": {
            "intro": (
                "Somewhere in the text below there is a pass key. Find it and remember it.",
                "Read the following text. A pass key is hidden in it and you must recall it later.",
                "This is a memory test. Keep the pass key that appears in the text.",
                "Below is a long text with one important number in it.",
            ),
            "needle": (
                "The pass key is {k}. Do not forget it.",
                "Important: the pass key is {k}.",
                "Here is the number to keep. The pass key is {k}. Again, {k} is the pass key.",
                "Listen well, the pass key is {k}. The pass key is {k}.",
                "The pass key is {k}.",
            ),
            "question": (
                "What number is the pass key? The pass key is",
                "Recall the pass key now. The pass key is",
                "Question: what was the pass key? Answer: the pass key is",
                "Now answer. The pass key is",
            ),
        },
        "niah": {
            "intro": (
                "Some special magic numbers are written in the text below. Keep them in mind.",
                "Read the text and remember every special magic number in it.",
                "The following text hides special magic numbers. You will be asked about one.",
                "Memorize the special magic numbers given in this text.",
            ),
            "needle": (
                "The special magic number for {key} is: {value}.",
                "Note that the special magic number for {key} is: {value}.",
                "Keep in mind: a special magic number for {key} is: {value}.",
                "Here is one of them. The special magic number for {key} is: {value}.",
                "Write this down, the special magic number for {key} is: {value}.",
            ),
            "question": (
                "What is the special magic number for {key}? The special magic number for {key} is:",
                "Find the special magic number for {key} in the text above. Answer: the special magic number for {key} is:",
                "Give the special magic number that belongs to {key}. The special magic number for {key} is:",
                "Which special magic number is mentioned for {key}? The special magic number for {key} is:",
                "Recall the special magic number for {key}. The special magic number for {key} is:",
            ),
        },
        "kv": {
            "intro": (
                "Here is a JSON object. Read it and answer with the value of one key.\n{",
                "Data:\n{",
                "Below are key and value pairs. Find the value of the key asked for.\n",
                "A table of keys and values follows.\n",
            ),
            "question": (
                '}}\nWhat is the value of the key "{key}"? Answer: "{key}": "',
                '}}\n\nThe value of "{key}" in the data above is given by "{key}": "',
                '\n\nKey to look up: "{key}". Its entry: "{key}": "',
                '\nFind "{key}". The matching pair is "{key}": "',
            ),
            "sep": (", ", "\n", ",\n"),
        },
        "vt": {
            "intro": (
                "Keep track of the variable assignments in the text below.",
                "The text hides a chain of variables that pass one value along.",
                "Read the text and follow the variables.",
            ),
            "question": (
                "Question: List all variables that hold the value {value}. Answer: {count} variables hold the value {value}, they are:",
                "Which variables are assigned the value {value}? The {count} variables are:",
                "Find every variable equal to {value}. Answer: there are {count}, they are:",
            ),
        },
    },
}

# A small grammar for the train filler: its words cover the other variants' filler words (so a model
# trained on it has seen every word it meets at evaluation) but never one of their sentences.
_SUBJECTS = (
    "The grass",
    "The sky",
    "The sun",
    "The moon",
    "The sea",
    "The river",
    "The road",
    "The tree",
    "The wind",
    "The rain",
    "The snow",
    "The hill",
    "The wall",
    "The clock",
    "The star",
    "The cloud",
    "The lake",
    "The stone",
    "A bird",
    "A small dog",
    "The old man",
    "The child",
    "The farmer",
    "A boat",
    "The city",
    "The night",
    "The field",
    "The door",
    "A cat",
    "The fire",
)
_PREDICATES = (
    "is green",
    "is blue",
    "is yellow",
    "is quiet",
    "is long",
    "is old",
    "is warm",
    "is small",
    "is white",
    "is very still",
    "looks grey today",
    "flows to the sea",
    "sings in the tree",
    "falls on the hills",
    "moves slowly",
    "shines at night",
    "rests by the wall",
    "goes back again",
    "comes and goes",
    "runs far away",
    "stays here",
    "waits by the road",
    "turns softly",
    "ticks all day",
    "grows in the field",
    "sleeps in the sun",
    "sits on the stone",
    "looks at the sky",
    "is far from home",
    "comes back in spring",
)
_OTHERS = (
    "Here we go again.",
    "Here we are.",
    "There we go.",
    "Back and forth again.",
    "We go there and back.",
    "Then we go home.",
    "And so it goes.",
    "Here it comes.",
    "There it goes again.",
    "Now we rest.",
    "The day is over.",
    "Soon it is morning.",
    "It is time to go.",
    "We walk and talk.",
    "All is well here.",
)


def filler_sentences(variant: str) -> tuple[str, ...]:
    """The filler sentences a variant may use (train: all its grammar's sentences)."""
    if variant == "eval":
        return _EVAL_FILLER
    if variant == "calibration":
        return _CALIBRATION_FILLER
    if variant == "train":
        return train_filler_sentences()
    raise ValueError(f"unknown variant {variant!r}; expected one of {VARIANTS}")


_TRAIN_FILLER: tuple[str, ...] | None = None


def train_filler_sentences() -> tuple[str, ...]:
    global _TRAIN_FILLER
    if _TRAIN_FILLER is None:
        taken = set(_EVAL_FILLER) | set(_CALIBRATION_FILLER)
        made = [f"{s} {p}." for s in _SUBJECTS for p in _PREDICATES] + list(_OTHERS)
        _TRAIN_FILLER = tuple(s for s in made if s not in taken)
    return _TRAIN_FILLER


def filler_stream(variant: str, rng: random.Random):
    """An endless filler sentence stream: eval and calibration cycle their block like RULER's noise;
    train either cycles a random small block or draws sentences freely."""
    block: Sequence[str]
    if variant in ("eval", "calibration"):
        block = filler_sentences(variant)
        while True:
            yield from block
    pool = train_filler_sentences()
    if rng.random() < 0.5:
        block = rng.sample(pool, rng.randint(3, 8))
        while True:
            yield from block
    while True:
        yield rng.choice(pool)
