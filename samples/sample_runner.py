"""Loads the sample model and answers evalsuite samples greedily, densely or under a Restriction."""

from __future__ import annotations

import os
from pathlib import Path

import sample_attention
import torch
from sample_attention import Restriction

MODEL_DIR = Path(__file__).resolve().parent / "sample-model"


def load(model_dir: Path = MODEL_DIR, attn: str = "sdpa"):
    """(model, tokenizer) from the folder, offline."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation=attn, dtype=torch.float32)
    model.eval()
    return model, tokenizer


@torch.no_grad()
def answer(model, tokenizer, sample, restriction: Restriction | None = None, decode_tail: int = 32) -> str:
    """Greedy continuation of sample.prompt. With a restriction, the last `decode_tail` prompt tokens and
    every generated token run restricted (they stand for the decode steps)."""
    ids = tokenizer(sample.prompt, return_tensors="pt").input_ids
    if restriction is not None:
        restriction.start = max(0, ids.shape[1] - decode_tail)
        sample_attention.STATE = restriction
        model.config._attn_implementation = sample_attention.NAME
    try:
        out = model.generate(
            ids,
            max_new_tokens=sample.max_new_tokens,
            do_sample=False,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )
    finally:
        if restriction is not None:
            model.config._attn_implementation = "sdpa"
            sample_attention.STATE = Restriction()
    return tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)


def needle_token_mask(tokenizer, sample) -> torch.Tensor:
    """Bool [n] over the prompt tokens (bos included) that overlap an answer needle's characters."""
    enc = tokenizer(sample.prompt, return_offsets_mapping=True)
    mask = torch.zeros(len(enc.input_ids), dtype=torch.bool)
    for i, (a, b) in enumerate(enc.offset_mapping):
        if b > a and any(a < end and b > start for start, end in sample.needle_spans):
            mask[i] = True
    return mask


@torch.no_grad()
def needle_mass(model, tokenizer, sample) -> torch.Tensor:
    """[L, H]: attention weight of the last prompt row on the answer needle tokens, per layer and head."""
    ids = tokenizer(sample.prompt, return_tensors="pt").input_ids
    probe = Restriction(mode="full", probe=True)
    sample_attention.STATE = probe
    model.config._attn_implementation = sample_attention.NAME
    try:
        model(input_ids=ids)
    finally:
        model.config._attn_implementation = "sdpa"
        sample_attention.STATE = Restriction()
    mask = needle_token_mask(tokenizer, sample)
    return torch.stack([probe.probed[layer][:, mask].sum(-1) for layer in sorted(probe.probed)])
