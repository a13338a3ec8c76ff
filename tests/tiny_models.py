"""Tiny configs of every supported model family, built locally (no downloads)."""

from __future__ import annotations

from transformers import (
    Gemma2Config,
    Gemma3TextConfig,
    GraniteConfig,
    LlamaConfig,
    MistralConfig,
    Olmo2Config,
    Phi3Config,
    Qwen2Config,
    Qwen3Config,
)

COMMON = dict(
    vocab_size=97,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    initializer_range=0.3,
    tie_word_embeddings=False,
    eos_token_id=None,  # HF generate must run the full length, as the pipeline does
)


def tiny_config(family: str):
    if family == "llama":
        return LlamaConfig(**COMMON, head_dim=16)
    if family == "qwen2":
        return Qwen2Config(**COMMON)
    if family == "qwen3":
        return Qwen3Config(**COMMON, head_dim=16)
    if family == "mistral":
        return MistralConfig(**COMMON, head_dim=16, sliding_window=None)
    if family == "gemma3":
        # explicit layer types: a tiny Gemma 3 otherwise gets no full-attention layer
        return Gemma3TextConfig(
            **COMMON,
            head_dim=16,
            sliding_window=8,
            query_pre_attn_scalar=16,
            layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
        )
    if family == "gemma2":  # soft-capped logits: attention runs eager inside the hook
        return Gemma2Config(**COMMON, head_dim=16, sliding_window=8, query_pre_attn_scalar=16)
    if family == "granite":  # scaled embeddings, residuals and logits
        return GraniteConfig(
            **COMMON, embedding_multiplier=2.0, residual_multiplier=0.5, logits_scaling=2.0, attention_multiplier=0.25
        )
    if family == "olmo2":  # q/k RMSNorm over the whole projection, not per head
        return Olmo2Config(**COMMON)
    if family == "phi3":
        return Phi3Config(**{**COMMON, "num_key_value_heads": 2}, pad_token_id=0, sliding_window=None)
    raise ValueError(family)


FAMILIES = ("llama", "qwen2", "qwen3", "mistral", "gemma3", "phi3", "gemma2", "granite", "olmo2")


def hf_greedy(model, prompt, new_tokens: int):
    """transformers' own greedy generate of `new_tokens` after `prompt` [n]: (tokens, logits [vocab] per token)."""
    out = model.generate(
        prompt[None],
        max_new_tokens=new_tokens,
        do_sample=False,
        output_logits=True,
        return_dict_in_generate=True,
        pad_token_id=0,
    )
    return out.sequences[0, prompt.numel() :].tolist(), [logits[0] for logits in out.logits]


def save_tiny_model(folder, family: str = "llama", seed: int = 0):
    """A tiny model with a locally trained byte-level BPE tokenizer, saved like a real checkpoint."""
    from pathlib import Path

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from smartgen.runtime.models import model_from_config

    folder = Path(folder)
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=COMMON["vocab_size"], special_tokens=["<pad>", "<s>", "</s>"], show_progress=False
    )
    text = ["the quick brown fox jumps over the lazy dog", "the pass key is 12345. remember it.", "hello world"] * 20
    tokenizer.train_from_iterator(text, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    fast.chat_template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"
    config = tiny_config(family)
    config.vocab_size = len(fast)
    config.eos_token_id = fast.eos_token_id
    config.bos_token_id = fast.bos_token_id
    config.pad_token_id = fast.pad_token_id
    model = model_from_config(config, seed=seed)
    model.save_pretrained(folder)
    fast.save_pretrained(folder)
    return folder


class IdTokenizer:
    """A tokenizer stand-in for nodes built in-process: no EOS, token ids decode to their numbers."""

    eos_token_id = None

    def decode(self, ids, skip_special_tokens=True):
        return " ".join(map(str, ids))
