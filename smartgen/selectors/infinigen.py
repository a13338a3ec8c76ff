"""InfiniGen: speculates layer l's KV selection from layer l-1's attention input with partial, skewed q/k.

Following snu-comparch/InfiniGen (REFERENCE.md §1), for RoPE models:

1. Offline (`compute_skewing`, one warm-up prompt): per layer and KV head, A = the right
   singular vectors of the post-RoPE queries, columns ordered by σ_q·σ_k (largest first).
   A is orthogonal, so (qA)·(kA) = q·k; it concentrates the query's energy in few columns.
   RoPE makes A impossible to fold into W_q/W_k, so it is applied at runtime to post-RoPE
   q and k, as InfiniGen's Llama code does.
2. Prefill (`build_metadata`, layers >= 2): per KV head, the d' = max(1, int(d·partial_ratio))
   columns with the largest Σ|QA| over this prompt's tokens; ships those columns of the
   skewed keys (the partial K, [H, n, d']), the column index and A.
3. Decode (`select` for layer l, lookahead): layer l's query is speculated from layer l-1's
   attention input: layer l's q projection (+ bias, + q_norm where the model has one), RoPE
   at the current position, skew, keep the d' columns. Partial scores q'·K'ᵀ·scale
   (the attention's own scale, d^-0.5 for Llama) are thresholded as InfiniGen does: per
   query head count the tokens above (row max - alpha); k = int(mean count) over the query
   heads of the request (InfiniGen averages over the whole batch; per request, a request's
   selection does not depend on its batch-mates), capped by budget_tokens(budget, n).

Choices of ours:
- GQA (InfiniGen handles only MHA), as the HATA port does: one A per KV head from its G
  query heads' queries stacked; columns by Σ|QA| over the G heads; the G heads' softmaxed
  partial scores summed per KV head before top-k (`gqa="max"`: maxed), so the row is shared by the group.
- A is computed from the eigenvectors of QᵀQ in float64 rather than an SVD of Q: the same
  right singular vectors, always a square d×d matrix even when the warm-up prompt has fewer
  than d rows, and cheap for long prompts. The column order of A does not affect
  selection (columns are then picked by Σ|QA|); the σ_q·σ_k order is kept for fidelity.
- Columns are chosen from the queries only (the speedup code), not the simulation's union
  with the keys' top columns, so d' is fixed per head.
- skew=None (or skewing=False) means no skewing (A = I), InfiniGen's ablation; pass `compute_skewing`'s result.
- If a step has no hidden state but carries this layer's query, that query is used instead
  (selection without lookahead, for tests and comparisons).
- Prompt tokens only: generated tokens are local on the decode node, so the partial K is
  never appended to.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from typing import cast

import torch

from smartgen.selectors.base import (
    FIRST_SPARSE_LAYER,
    LayerMetadata,
    ModelInfo,
    PrefillLayer,
    Selector,
    StepQuery,
    budget_tokens,
    check_gqa,
    pad_rows,
)

__all__ = ["InfiniGenSelector", "QuerySpeculator", "compute_skewing", "rope_from_model", "decoder_layers"]


def decoder_layers(model: torch.nn.Module) -> torch.nn.ModuleList:
    """The decoder layer list of a HF causal LM (text-only or a multimodal wrapper's language model)."""
    for path in ("model.layers", "model.language_model.layers", "language_model.layers", "layers"):
        module: object = model
        for part in path.split("."):
            module = getattr(module, part, None)
            if module is None:
                break
        if isinstance(module, torch.nn.ModuleList):
            return module
    raise ValueError(f"cannot find the decoder layers of {type(model).__name__}")


def rope_from_model(model: torch.nn.Module) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """rope(x [B, heads, T, d], positions [B, T]) -> x rotated as the model's full-attention layers do.

    Handles partial rotary (Phi-3: only the first cos.shape[-1] dims rotate) and rotary
    modules keyed by layer type (Gemma 3: the "full_attention" one, the only kind selected).
    """
    inner = getattr(model, "model", model)
    rotary = getattr(inner, "rotary_emb", None) or getattr(getattr(inner, "language_model", None), "rotary_emb", None)
    if rotary is None:
        raise ValueError(f"{type(model).__name__} has no rotary embedding module")
    # the signature, not __code__: HF wraps Llama's forward in a decorator that itself takes layer_type
    by_layer_type = "layer_type" in inspect.signature(rotary.forward).parameters

    def rope(x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        cos, sin = rotary(x, positions, "full_attention") if by_layer_type else rotary(x, positions)
        cos, sin = cos.unsqueeze(1).to(x.dtype), sin.unsqueeze(1).to(x.dtype)  # [B, 1, T, rot]
        rot = cos.shape[-1]
        x_rot, x_pass = x[..., :rot], x[..., rot:]
        half = x_rot.shape[-1] // 2
        rotated = torch.cat((-x_rot[..., half:], x_rot[..., :half]), dim=-1)
        return torch.cat((x_rot * cos + rotated * sin, x_pass), dim=-1)

    return rope


def compute_skewing(
    model_info: ModelInfo, layer_queries: Mapping[int, torch.Tensor], layer_keys: Mapping[int, torch.Tensor]
) -> dict[int, torch.Tensor]:
    """Skewing matrices from one warm-up prompt: {layer: A [H, d, d] float32}, A orthogonal.

    layer_queries[l] [Hq, n, d] and layer_keys[l] [H, n, d] are layer l's post-RoPE q and k.
    """
    heads, group = model_info.num_kv_heads, model_info.group_size
    skew = {}
    for layer, queries in layer_queries.items():
        keys = layer_keys[layer].double()  # [H, n, d]
        dim = queries.shape[-1]
        q = queries.double().reshape(heads, group * queries.shape[1], dim)  # [H, G·n, d]
        # eigh of the Gram matrix: eigenvalues = σ², eigenvectors = right singular vectors;
        # eigh returns ascending order, flipped so index i pairs the i-th largest σ_q and σ_k
        q_eig, q_vec = torch.linalg.eigh(q.transpose(1, 2) @ q)  # [H, d], [H, d, d]
        k_eig = torch.linalg.eigvalsh(keys.transpose(1, 2) @ keys)  # [H, d]
        sigma_q = q_eig.flip(-1).clamp(min=0).sqrt()
        sigma_k = k_eig.flip(-1).clamp(min=0).sqrt()
        order = (sigma_q * sigma_k).argsort(dim=-1, descending=True)  # [H, d]
        vectors = q_vec.flip(-1)  # [H, d, d] columns by descending σ_q
        skew[layer] = vectors.gather(2, order[:, None, :].expand(-1, dim, -1)).float()
    return skew


class InfiniGenSelector(Selector):
    """InfiniGen's speculative selection: layer l's index from layer l-1's attention input."""

    name = "infinigen"
    learned_param = "skew"
    needs_warmup = True
    reads_prefill_queries = True
    lookahead = True

    def __init__(
        self,
        info: ModelInfo,
        budget: float = 0.2,
        partial_ratio: float = 0.2,
        alpha: float = 4.0,
        skew: Mapping[int, torch.Tensor] | None = None,
        speculate: bool = True,
        skewing: bool = True,
        gqa: str = "sum",
    ) -> None:
        """`speculate=False` selects with the layer's own query instead of layer l-1's input (no prefetch overlap);
        `skewing=False` ignores `skew` (A = I: the columns are the raw q/k dimensions, InfiniGen's ablation);
        `gqa`: the G heads' softmaxed partial scores are summed ("sum", the HATA port's rule) or maxed ("max")."""
        super().__init__(info)
        self.gqa = check_gqa("infinigen", gqa, ("sum", "max"))
        self.lookahead = speculate
        budget_tokens(budget, 1)  # rejects a non-positive budget at construction
        if not 0 < partial_ratio <= 1:
            raise ValueError(f"partial_ratio must be in (0, 1], got {partial_ratio}")
        self.budget = budget
        self.alpha = alpha
        self.num_columns = max(1, int(info.head_dim * partial_ratio))
        self.skew = dict(skew) if skew is not None and skewing else {}
        self._speculator = QuerySpeculator(info)

    def skew_matrix(self, layer: int) -> torch.Tensor:
        """A [H, d, d] for `layer`; the identity when no skewing was computed for it."""
        if layer in self.skew:
            return self.skew[layer]
        eye = torch.eye(self.info.head_dim)
        return eye.expand(self.info.num_kv_heads, -1, -1).contiguous()

    def build_metadata(self, prefill: PrefillLayer) -> LayerMetadata:
        if prefill.layer < FIRST_SPARSE_LAYER:
            return {}  # dense layers never reach a selector
        heads, group = self.info.num_kv_heads, self.info.group_size
        _, n, dim = prefill.query.shape
        skew = self.skew_matrix(prefill.layer).to(prefill.key.device, torch.float32)  # [H, d, d]
        q = prefill.query.float().reshape(heads, group * n, dim) @ skew  # [H, G·n, d] skewed
        columns = q.abs().sum(dim=1).topk(self.num_columns, dim=-1).indices.sort(dim=-1).values  # [H, d']
        keys = prefill.key.float() @ skew  # [H, n, d] skewed
        partial = keys.gather(2, columns[:, None, :].expand(-1, n, -1))  # [H, n, d']
        return {"columns": columns, "partial_keys": partial.to(prefill.key.dtype), "skew": skew}

    def query_from_hidden(self, layer: int, hidden: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Layer `layer`'s post-RoPE query from an attention input: hidden [B, D], positions [B] -> [B, Hq, d]."""
        return self._speculator.query(layer, hidden, positions)

    def _attention(self, layer: int) -> torch.nn.Module:
        return self._speculator.attention(layer)

    def _scale(self, layer: int) -> float:
        # the model's own softmax scale, so alpha thresholds the same logits attention uses
        model = self.info.model
        attn = self._attention(layer) if model is not None else None
        return float(getattr(attn, "scaling", self.info.head_dim**-0.5))

    def select(self, step: StepQuery, metadata: list[LayerMetadata]) -> torch.Tensor:
        if self.lookahead and step.hidden is not None:
            query = self.query_from_hidden(step.layer, step.hidden, step.positions)  # [B, Hq, d]
        elif step.query is not None:
            query = step.query
        else:
            raise ValueError("InfiniGenSelector needs StepQuery.hidden (layer l-1's attention input) or a query")
        heads, group = self.info.num_kv_heads, self.info.group_size
        scale = self._scale(step.layer)
        scores, counts = [], []
        for b, n in enumerate(step.prompt_lengths):
            meta = metadata[b]
            skew, columns = meta["skew"], meta["columns"]
            q = query[b].float().reshape(heads, group, -1) @ skew.float()  # [H, G, d] skewed
            q = q.gather(2, columns[:, None, :].expand(-1, group, -1))  # [H, G, d']
            logits = torch.einsum("hgc,hnc->hgn", q, meta["partial_keys"][:, :n].float()) * scale  # [H, G, n]
            counts.append((logits > logits.amax(dim=-1, keepdim=True) - self.alpha).sum(dim=-1).flatten())
            scores.append(logits)
        rows = []
        for b, n in enumerate(step.prompt_lengths):
            # InfiniGen's k: the mean above-threshold count over the query heads — per request,
            # so a request's selection never depends on what else is in its batch
            k = max(1, int(counts[b].float().mean().item()))
            probs = scores[b].softmax(dim=-1)  # [H, G, n]
            summed = probs.amax(dim=1) if self.gqa == "max" else probs.sum(dim=1)  # [H, n]
            top = summed.topk(min(k, budget_tokens(self.budget, n)), dim=-1).indices
            rows.append(top.sort(dim=-1).values)  # ascending positions, as the other selectors
        return pad_rows(rows)  # [B·H, k]


class QuerySpeculator:
    """InfiniGen's query speculation, for any selector: layer l's post-RoPE query computed from an earlier layer's
    attention input with layer l's own q projection (+ bias, + q_norm) and RoPE at the current position. Across a
    layer the residual stream changes little, so this query picks most of what the real one will (the runtime's
    prefetch, SmartGen's `prefetch` policy)."""

    def __init__(self, info: ModelInfo) -> None:
        self.info = info
        self._rope = info.rope
        if self._rope is None and info.model is not None:
            self._rope = rope_from_model(info.model)

    def attention(self, layer: int) -> torch.nn.Module:
        if self.info.model is None:
            raise ValueError("speculating queries from hidden states needs ModelInfo.model")
        return decoder_layers(self.info.model)[layer].get_submodule("self_attn")

    @torch.no_grad()  # selection never needs gradients through the model's weights
    def query(self, layer: int, hidden: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Layer `layer`'s post-RoPE query from an attention input: hidden [B, D], positions [B] -> [B, Hq, d]."""
        attn = self.attention(layer)
        hq, dim = self.info.num_q_heads, self.info.head_dim
        proj = getattr(attn, "q_proj", None)
        if proj is not None:
            weight, bias = proj.weight, proj.bias
        else:  # Phi-3's fused projection: the first Hq·d output rows are q
            qkv_proj = cast(torch.nn.Linear, attn.qkv_proj)
            weight, bias = qkv_proj.weight[: hq * dim], None
            if qkv_proj.bias is not None:
                bias = qkv_proj.bias[: hq * dim]
        q = torch.nn.functional.linear(hidden.to(weight.dtype), weight, bias).view(-1, hq, 1, dim)  # [B, Hq, 1, d]
        norm = getattr(attn, "q_norm", None)
        if norm is not None and norm.weight.numel() == hq * dim:  # OLMo 2 normalises the whole projection
            q = norm(q.reshape(-1, hq * dim)).view(-1, hq, 1, dim)
        elif norm is not None:  # Qwen3 / Gemma 3 normalise q per head before RoPE
            q = norm(q)
        if self._rope is None:
            raise ValueError("speculating queries needs ModelInfo.rope (or a model with a rotary module)")
        return self._rope(q, positions[:, None]).squeeze(2)
