"""HATA: top-k prompt tokens by the Hamming distance between learned binary hash codes of the query and the keys.

Following gpzlx1/HATA (REFERENCE.md §3):

1. Weights: per sparse layer a matrix W [H, d, rbit] per KV head, shared by its queries and keys,
   trained offline on calibration prompts (`smartgen.selectors.hata_train`); random normal
   weights (`random_weights`) are plain sign random projections (SimHash), the untrained baseline.
2. Prefill (`build_metadata`, layers >= 2): each post-RoPE key's code, bit = (k·W > 0), packed
   8 bits a byte ([H, n, rbit/8] uint8), and its norm ‖k‖ ([H, n], the keys' dtype).
3. Decode (`select`): the G query heads of a KV head are encoded the same way; per token
   ΣHam = the sum over those G heads of popcount(code_q XOR code_k), and
   score = (G - 2·ΣHam/rbit)·‖k‖ (HATA's `use_norm`: ≈ Σ cos(q_j, k)·‖k‖); the top
   budget_tokens(budget, n) by score form the row. The selection is shared by the GQA group,
   as in HATA, but by default (`gqa="max"`, ours) each query head's estimated logits are softmaxed and
   the max over the group is taken, the exact top-k's rule: on the sample model HATA's ΣHam
   (`gqa="sum"`) let three diffuse heads outvote the retrieval head's needle token, and max took
   HATA from 86% to 100% of the full cache's accuracy at 10% (docs/selectors.md).

`hamming_reference` is the plain-torch reference of the packed XOR/popcount path: with codes
as ±1 vectors, Ham = (rbit - c_q·c_k) / 2. HATA's optional forced sink and recent tokens are
0 in its own scripts and left out. The decode node needs the codes, norms and W locally:
rbit/8 + 2 bytes per token and KV head (18 B at rbit 128, against 4·d bytes of fp16 K and V).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

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
    group_max_probability,
    pad_rows,
)
from smartgen.selectors.budget_split import BudgetSplit

__all__ = [
    "HashWeights",
    "HATASelector",
    "hash_bits",
    "pack_bits",
    "packed_hamming",
    "hamming_reference",
    "random_weights",
    "weights_to_bytes",
    "weights_from_bytes",
    "save_weights",
    "load_weights",
]

DEFAULT_RBIT = 128
GQA_RULES = ("sum", "max")

HashWeights = dict[int, torch.Tensor]  # layer -> W [H, d, rbit] float32

_BIT_VALUES = 2 ** torch.arange(8, dtype=torch.int32)  # bit i of a byte has value 2^i
_POPCOUNT = torch.tensor([bin(i).count("1") for i in range(256)], dtype=torch.int32)


def hash_bits(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Sign bits of x·W per KV head: x [H, ..., d], weight [H, d, rbit] -> bool [H, ..., rbit]."""
    heads, dim = x.shape[0], x.shape[-1]
    flat = x.float().reshape(heads, -1, dim) @ weight.float().to(x.device)  # [H, m, rbit]
    return (flat > 0).view(*x.shape[:-1], weight.shape[-1])


def pack_bits(bits: torch.Tensor) -> torch.Tensor:
    """bool [..., rbit] (rbit a multiple of 8) -> uint8 [..., rbit/8], bit i of byte j = bits[8j + i]."""
    if bits.shape[-1] % 8:
        raise ValueError(f"rbit must be a multiple of 8, got {bits.shape[-1]}")
    grouped = bits.view(*bits.shape[:-1], -1, 8).to(torch.int32)
    return (grouped * _BIT_VALUES.to(bits.device)).sum(dim=-1).to(torch.uint8)


def packed_hamming(query_codes: torch.Tensor, key_codes: torch.Tensor) -> torch.Tensor:
    """Hamming distances: query_codes [H, G, B], key_codes [H, n, B] uint8 -> [H, G, n] int32 (XOR + popcount)."""
    xor = torch.bitwise_xor(query_codes[:, :, None, :], key_codes[:, None, :, :])  # [H, G, n, B]
    return _POPCOUNT.to(xor.device)[xor.long()].sum(dim=-1, dtype=torch.int32)


def hamming_reference(query_bits: torch.Tensor, key_bits: torch.Tensor) -> torch.Tensor:
    """The torch reference of `packed_hamming` on unpacked bits [H, G, rbit], [H, n, rbit]: (rbit - c_q·c_k)/2."""
    rbit = query_bits.shape[-1]
    cq, ck = query_bits.float() * 2 - 1, key_bits.float() * 2 - 1
    return ((rbit - torch.einsum("hgr,hnr->hgn", cq, ck)) / 2).round().to(torch.int32)


def random_weights(info: ModelInfo, rbit: int = DEFAULT_RBIT, seed: int = 0) -> HashWeights:
    """Untrained weights (HATA's randn initialisation) for every layer >= 2: sign random projections."""
    g = torch.Generator().manual_seed(seed)
    return {
        layer: torch.randn(info.num_kv_heads, info.head_dim, rbit, generator=g)
        for layer in range(FIRST_SPARSE_LAYER, info.num_layers)
    }


def weights_to_bytes(weights: Mapping[int, torch.Tensor]) -> bytes:
    """Serialises weights as safetensors bytes (tensors "layer.<l>"), for a file or a profile store row."""
    from safetensors.torch import save

    return save({f"layer.{layer}": w.float().contiguous().cpu() for layer, w in weights.items()})


def weights_from_bytes(data: bytes) -> HashWeights:
    from safetensors.torch import load

    return {int(name.split(".")[1]): w for name, w in load(data).items()}


def save_weights(weights: Mapping[int, torch.Tensor], path: str | Path) -> None:
    Path(path).write_bytes(weights_to_bytes(weights))


def load_weights(path: str | Path) -> HashWeights:
    return weights_from_bytes(Path(path).read_bytes())


class HATASelector(Selector):
    """HATA's hash-based top-k: learned codes, Hamming distance summed over the GQA group, scaled by ‖k‖."""

    name = "hata"
    learned_param = "weights"
    needs_training = True

    def __init__(
        self,
        info: ModelInfo,
        budget: float = 0.1,
        weights: Mapping[int, torch.Tensor] | bytes | None = None,
        rbit: int = DEFAULT_RBIT,
        use_norm: bool = True,
        seed: int = 0,
        gqa: str = "max",
        head_split: str = "even",
        layer_split: str = "even",
        slope: float = 0.5,
        floor: float = 0.2,
    ) -> None:
        """`weights` from `hata_train.train_hash_weights` (or its bytes); None = random ones of `rbit` bits.

        `gqa`: how the G query heads of a KV head combine: "max" (each head's estimated logits
        ‖q‖·‖k‖·(1 - 2·Ham/rbit)·scale softmaxed, then the max over the group, as the exact top-k does;
        without ‖k‖ when `use_norm` is False), or "sum" (HATA's own ΣHam). `head_split`, `layer_split`,
        `slope`, `floor`: how the budget spreads over KV heads and layers (budget_split; adaptive needs "max")."""
        super().__init__(info)
        self.gqa = check_gqa("hata", gqa, GQA_RULES)
        self.split = BudgetSplit.checked("hata", head_split, layer_split, slope, floor, gqa)
        budget_tokens(budget, 1)  # rejects a non-positive budget at construction
        if isinstance(weights, bytes | bytearray):
            weights = weights_from_bytes(bytes(weights))
        self.weights = dict(weights) if weights is not None else random_weights(info, rbit, seed)
        for layer, w in self.weights.items():
            expect = (info.num_kv_heads, info.head_dim)
            if tuple(w.shape[:2]) != expect or w.shape[2] % 8:
                raise ValueError(
                    f"HATA weights of layer {layer} have shape {tuple(w.shape)}, need [{expect}, rbit % 8 == 0]"
                )
        self.budget = budget
        self.use_norm = use_norm

    def _weight(self, layer: int) -> torch.Tensor:
        if layer not in self.weights:
            raise ValueError(f"no HATA hash weights for layer {layer} (have {sorted(self.weights)})")
        return self.weights[layer]

    def build_metadata(self, prefill: PrefillLayer) -> LayerMetadata:
        if prefill.layer < FIRST_SPARSE_LAYER:
            return {}  # dense layers never reach a selector
        codes = pack_bits(hash_bits(prefill.key, self._weight(prefill.layer)))  # [H, n, rbit/8]
        norms = prefill.key.float().norm(dim=-1).to(prefill.key.dtype)  # [H, n]
        return {"codes": codes, "norms": norms}

    def scores(self, query: torch.Tensor, metadata: LayerMetadata, layer: int, n: int) -> torch.Tensor:
        """HATA's score per KV head and prompt token: query [Hq, d] -> [H, n] float32 (larger = selected first)."""
        heads, group = self.info.num_kv_heads, self.info.group_size
        weight = self._weight(layer)
        q = query.reshape(heads, group, -1)  # [H, G, d]
        q_codes = pack_bits(hash_bits(q, weight))  # [H, G, rbit/8]
        per_head = packed_hamming(q_codes, metadata["codes"][:, :n])  # [H, G, n]
        rbit = weight.shape[-1]
        if self.gqa == "max":  # cos(q, k) ≈ 1 - 2·Ham/rbit, so q·k ≈ ‖q‖·‖k‖·cos
            cosine = 1 - 2 * per_head.float() / rbit
            norms = q.float().norm(dim=-1, keepdim=True)  # [H, G, 1]
            if self.use_norm:
                norms = norms * metadata["norms"][:, None, :n].float()
            return group_max_probability(cosine * norms * self.info.head_dim**-0.5)
        distance = per_head.sum(dim=1)  # [H, n] ΣHam over the group
        if not self.use_norm:
            return -distance.float()  # the smallest Hamming sum first
        return (group - 2 * distance.float() / rbit) * metadata["norms"][:, :n].float()

    def select(self, step: StepQuery, metadata: list[LayerMetadata]) -> torch.Tensor:
        if step.query is None:
            raise ValueError("HATASelector needs this layer's query (StepQuery.query)")
        rows = []
        for b, n in enumerate(step.prompt_lengths):
            scores = self.scores(step.query[b], metadata[b], step.layer, n)
            budget = self.split.budget(self.budget, step.layer, self.info.num_layers)
            rows.append(self.split.rows(scores, budget_tokens(budget, n)))  # ascending positions, as the others
        return pad_rows(rows)  # [B·H, max k]
