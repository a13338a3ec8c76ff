"""GPU checks of the runtime: SmartGen's decode (prefill and decode engines, pool and kernels on the device) against
Hugging Face's own generate on the same weights, for the 16-layer sample and the random:32 shape.

Greedy, dense selector, so every scheme must give HF's tokens: full (all KV pushed), partial (most KV fetched on
demand while decoding: the split and gather kernels with remote entries) and smartgen (proactive, prefetched and
speculative paths). A step whose top two logits are closer than the tolerance may pick either: a divergence
there is a tie, noted, not a failure.
"""

from __future__ import annotations

import copy
import time

import torch
from transformers import PreTrainedModel

from smartgen.apps.gpu_check_base import Context, Row
from smartgen.engine.policy import get_policy
from smartgen.runtime.pipeline import GenerationResult, InprocPipeline

__all__ = ["check_sample16", "check_random32"]

SCHEMES = ("full", "partial", "smartgen")
TOLERANCE = {True: 2e-3, False: 1e-4}  # max |logit difference|, on CUDA (SDPA's kernels sum in their own order)


def check_sample16(ctx: Context) -> None:
    from smartgen.apps.bench.models import SAMPLE_MODEL_16
    from smartgen.runtime.models import load_model

    _check_model(ctx, "decode.sample16", load_model(SAMPLE_MODEL_16, torch.float32, ctx.device_name))


def check_random32(ctx: Context) -> None:
    """`smartgen bench --model random:32`'s model (the sample's shape, 32 layers, seeded random weights), built in
    memory rather than in the bench's cache folder."""
    from transformers import AutoConfig

    from smartgen.apps.bench.models import SAMPLE_MODEL
    from smartgen.runtime.models import model_from_config

    config = AutoConfig.from_pretrained(SAMPLE_MODEL, local_files_only=True)
    config.num_hidden_layers = 32
    model = model_from_config(config, seed=0)
    # transformers wraps PreTrainedModel.to so that mypy binds the device to `self` (as in runtime.models)
    _check_model(ctx, "decode.random32", model.to(ctx.device))  # type: ignore[arg-type]


def _reference(model: PreTrainedModel) -> PreTrainedModel:
    """The same weights under transformers' own SDPA attention, with no EOS (both sides generate every token)."""
    from transformers import AutoModelForCausalLM

    reference = AutoModelForCausalLM.from_config(copy.deepcopy(model.config), attn_implementation="sdpa")
    reference.load_state_dict(model.state_dict())
    reference.generation_config.eos_token_id = None
    return reference.to(model.device).eval()


def _sync(cuda: bool) -> None:
    if cuda:
        torch.cuda.synchronize()


def _check_model(ctx: Context, name: str, model: PreTrainedModel) -> None:
    cuda = ctx.cuda
    prompt_tokens, new_tokens, blocks = (2048, 16, 64) if cuda else (48, 4, 16)
    vocab = model.config.vocab_size
    prompt = torch.randint(3, vocab, (prompt_tokens,), generator=torch.Generator().manual_seed(1))
    shape = f"L{model.config.num_hidden_layers} prompt {prompt_tokens} + {new_tokens} new, batch 1"
    reference = _reference(model)
    ids = prompt[None].to(model.device)
    with torch.no_grad():
        generate = dict(do_sample=False, output_logits=True, return_dict_in_generate=True, pad_token_id=0)
        # a warm-up first (CUDA's libraries load on first use); mypy sees nn.Module's __getattr__ in `generate`
        reference.generate(ids, max_new_tokens=2, **generate)  # type: ignore[operator]
        _sync(cuda)
        began = time.perf_counter()
        out = reference.generate(ids, max_new_tokens=new_tokens, **generate)  # type: ignore[operator]
        _sync(cuda)
        hf_ms = (time.perf_counter() - began) * 1e3 / new_tokens
    hf_tokens = out.sequences[0, prompt_tokens:].tolist()
    hf_logits = [logits[0].float().cpu() for logits in out.logits]
    del reference
    limit = prompt_tokens + new_tokens + 16
    for scheme in SCHEMES:
        if ctx.over_time(name, f"{shape}, {scheme}", "fp32", reserve_s=5):
            continue
        policy = get_policy(scheme, strategy="streaming") if scheme == "smartgen" else get_policy(scheme)
        with InprocPipeline(model, policy, "dense", num_blocks=blocks, max_batch=1, max_tokens=limit) as pipeline:
            if scheme == SCHEMES[0]:
                pipeline.generate([prompt], 2)  # warm-up: the kernels compile on their first launch
            began = time.perf_counter()
            [result] = pipeline.generate([prompt], new_tokens, keep_logits=True)
            _sync(cuda)
            ours_ms = (time.perf_counter() - began) * 1e3 / new_tokens
        ctx.add(_compare(ctx, name, f"{shape}, {scheme}", result, hf_tokens, hf_logits, hf_ms, ours_ms))


def _compare(
    ctx: Context,
    name: str,
    shape: str,
    result: GenerationResult,
    hf_tokens: list[int],
    hf_logits: list[torch.Tensor],
    hf_ms: float,
    ours_ms: float,
) -> Row:
    """Tokens equal to HF's (a divergence only at a near tie), decode-step logits within the tolerance up to the
    first divergence (past it the two runs see different tokens)."""
    tokens, logits = result.tokens, result.logits  # logits of the decode steps: HF's from its 2nd token on
    tolerance = TOLERANCE[ctx.cuda]
    diverged = next((i for i, (a, b) in enumerate(zip(tokens, hf_tokens)) if a != b), None)
    compared = [(ours.float().cpu(), theirs) for ours, theirs in zip(logits, hf_logits[1:])]
    if diverged is not None:
        compared = compared[:diverged]  # decode step j makes token j + 1: those up to the divergent token
    error = max((float((a - b).abs().max()) for a, b in compared), default=0.0)
    problems = []
    if len(tokens) != len(hf_tokens):
        problems.append(f"{len(tokens)} tokens, HF made {len(hf_tokens)}")
    if error > tolerance:
        problems.append(f"logits off by more than {tolerance:g}")
    note = f"{len(tokens)}/{len(hf_tokens)} tokens equal"
    if diverged is not None:
        top = hf_logits[diverged].topk(2).values
        gap = float(top[0] - top[1])
        note = f"tokens equal up to #{diverged}, where HF's top two logits are {gap:.1e} apart"
        if gap > tolerance:
            problems.append(f"token #{diverged} differs from HF's ({tokens[diverged]} vs {hf_tokens[diverged]})")
        else:
            note += " (a tie)"
    note += f"; {result.metrics.remote_entries} remote entries read"
    if problems:
        note = "; ".join(problems) + "; " + note
    result_word = "fail" if problems else "pass"
    return Row(name, ctx.device_name, shape, "fp32", result_word, error, hf_ms, ours_ms, note)
