"""The committed sample model (samples/sample-model) loads offline and answers retrieval prompts end to end."""

import json
import os
from pathlib import Path

import pytest

MODEL_DIR = Path(__file__).resolve().parents[1] / "samples" / "sample-model"

pytestmark = pytest.mark.skipif(
    not (MODEL_DIR / "model.safetensors").exists(),
    reason=f"{MODEL_DIR} is missing: train it with `python samples/train_sample_model.py` (about 50 min on 2 cores)",
)


@pytest.fixture(scope="module")
def model_and_tokenizer():
    os.environ["HF_HUB_OFFLINE"] = "1"
    torch = pytest.importorskip("torch")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(MODEL_DIR)
    model = AutoModelForCausalLM.from_pretrained(MODEL_DIR, dtype=torch.float32)
    model.eval()
    return model, tokenizer


def _greedy(model, tokenizer, sample):
    import torch

    ids = tokenizer(sample.prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(
            ids,
            max_new_tokens=sample.max_new_tokens,
            do_sample=False,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )
    return tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)


def test_folder_is_small_and_complete():
    names = {p.name for p in MODEL_DIR.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "MODEL_CARD.md"} <= names
    assert sum(p.stat().st_size for p in MODEL_DIR.iterdir()) < 25 * 2**20
    config = json.loads((MODEL_DIR / "config.json").read_text())
    assert config["num_hidden_layers"] >= 6 and config["num_key_value_heads"] < config["num_attention_heads"]


def test_tokenizer_is_the_suites(model_and_tokenizer):
    _, tokenizer = model_and_tokenizer
    assert tokenizer.bos_token and tokenizer.eos_token and tokenizer.pad_token
    assert tokenizer.convert_ids_to_tokens(tokenizer.encode("key 907", add_special_tokens=False))[-3:] == [
        "9",
        "0",
        "7",
    ]


@pytest.mark.parametrize("task", ["passkey", "niah_single"])
def test_answers_retrieval_prompts_at_1k(model_and_tokenizer, task):
    from smartgen.apps.evalsuite import generate_task, score_sample

    model, tokenizer = model_and_tokenizer
    scores = [
        score_sample(s, _greedy(model, tokenizer, s))
        for s in (generate_task(task, 1024, seed, tokenizer, depth=d) for seed, d in ((0, 0.2), (1, 0.7)))
    ]
    assert scores == [1.0, 1.0], f"{task}: {scores}"
