"""A small byte-level BPE for the suite's sample model: digits one per token, needle and task words whole."""

from __future__ import annotations

import random

from smartgen.apps.evalsuite.surface import (
    KEY_ADJECTIVES,
    KEY_NOUNS,
    TASK_KEYWORDS,
    TEMPLATES,
    VARIANTS,
    filler_sentences,
)

__all__ = ["train_tokenizer", "tokenizer_corpus"]

SPECIAL_TOKENS = ("<pad>", "<s>", "</s>")


# The sample model was never trained on chat turns: a conversation is its messages' contents, one per
# line, after <s>, so a chat request with one user message equals a completion of that message.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{{ message['content'] }}"
    "{% if not loop.last %}{{ '\\n' }}{% endif %}{% endfor %}"
)


def tokenizer_corpus(seed: int = 0) -> list[str]:
    """Text the BPE is trained on: every variant's surface text, the key words many times over."""
    rng = random.Random(seed)
    lines: list[str] = []
    for variant in VARIANTS:
        lines += list(filler_sentences(variant)) * (3 if variant == "train" else 40)
        for task in TEMPLATES[variant].values():
            for part, choices in task.items():
                for text in choices:
                    if part in ("intro", "sep"):  # plain text, not format templates
                        lines += [text] * 20
                        continue
                    for _ in range(20):
                        key = f"{rng.choice(KEY_ADJECTIVES)}-{rng.choice(KEY_NOUNS)}"
                        lines.append(
                            text.format(k=rng.randint(1, 50000), key=key, value=rng.randint(10**6, 10**7), count=5)
                        )
    # Frequency decides BPE merge order: repeating the words that carry the tasks makes each one token.
    lines += [f"for {a}-{n} is: 1." for a in KEY_ADJECTIVES for n in KEY_NOUNS] * 8
    lines += [" ".join(TASK_KEYWORDS)] * 400
    lines += ["VAR " + "".join(rng.choice("ABCDEFGHIJKLMNOPQRSTUVWXYZ") for _ in range(5)) for _ in range(2000)]
    rng.shuffle(lines)
    return lines


def train_tokenizer(vocab_size: int = 1024, seed: int = 0):
    """Train the BPE (well under a second) and wrap it as a PreTrainedTokenizerFast with <s>, </s>, <pad>."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        min_frequency=2,
        show_progress=False,
    )
    tok.train_from_iterator(tokenizer_corpus(seed), trainer=trainer)
    bos = tok.token_to_id("<s>")
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bos)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        model_max_length=16384,
        chat_template=CHAT_TEMPLATE,
    )
