"""Quest: page-level selection by an upper bound of q·k from each page's element-wise key min/max.

Following mit-han-lab/Quest (see REFERENCE.md §2):

1. Prefill: the prompt's post-RoPE keys are cut into P = ceil(n / page_size) pages (the last
   may be partial); each page keeps its element-wise max and min, [H, P, d] each.
2. Decode: a page's score is the bound sum_d max(q_d·max_d, q_d·min_d) >= max over the page
   of q·k. page_budget pages include the last page always (Quest's "real page budget
   including the last page"), so the top page_budget - 1 of the other pages are picked.
   If P <= page_budget every token goes.

Choices of ours:
- GQA: Quest's simulation repeats KV so each query head selects on its own; our index has
  one row per KV head, so a page's score for a KV head is the max over its G query heads: a page
  that any head may need is kept. By default (`gqa="max"`) each head's bounds (scaled by d^-0.5)
  are softmaxed over the pages first, so heads with larger queries do not outrank the others by
  scale alone (on the sample model: 75% -> 89% of the full cache's accuracy at 10%);
  `gqa="bound"` maxes the raw bounds.
- Min/max are exact element picks, so they are computed in float32 and stored in the
  keys' dtype without loss: half the bytes to ship for fp16/bf16 caches.
- The bound is scored unscaled (no d^-0.5): a positive scale does not change the order.
- page_budget = max(1, 1 + (budget_tokens(budget, n) - last) // page_size), `last` being
  the tokens of the last page: Quest's budget // page_size when that page is full, but a
  partial last page is charged its real size, so rows never exceed the token budget and
  budget 1.0 selects every token (plain // would drop a page whenever n % page_size != 0).
- A budget smaller than the last page still yields the last page, so such a row may hold
  more than budget_tokens(budget, n) — as in Quest.
- `head_split` / `layer_split` (budget_split.py): Ada-KV's adaptive split of a layer's pages over its
  KV heads (ranked over all heads at once; needs gqa="max", whose scores are probabilities) and
  PyramidKV's falling budget over layers; both off ("even") by default.
- `bound_bits=8` ships the bounds in 8 bits, half the bytes of a 16-bit cache's (they cross the
  link before the first decode step, so they cost TTST): per (KV head, channel) an affine grid
  over the prompt's range, page maxima rounded up and minima down (`quantize_bounds`), so each
  page's interval still contains its keys and the score stays an upper bound, only looser by
  at most one grid step per channel.
"""

from __future__ import annotations

import torch

from smartgen.selectors.base import (
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
from smartgen.selectors.budget_split import BudgetSplit, adaptive_order, rows_from_flat

__all__ = [
    "QuestSelector",
    "page_bounds",
    "page_upper_bounds",
    "upper_bounds",
    "quantize_bounds",
    "dequantize_bounds",
]

BOUND_BITS = (8, 16)  # 16: the keys' own dtype
BOUND_MARGIN = 4e-6  # relative outward margin of 8-bit bounds: about 32 float32 ulps, under 0.1% of a grid step


def page_bounds(keys: torch.Tensor, page_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Element-wise max and min of each page of keys [H, n, d] -> ([H, P, d], [H, P, d]) float32."""
    heads, n, dim = keys.shape
    pages = -(-n // page_size)
    # pad the partial last page with ∓inf so it never wins a max/min it does not contain
    padded = keys.float().new_full((heads, pages * page_size, dim), float("-inf"))
    padded[:, :n] = keys.float()
    page_max = padded.view(heads, pages, page_size, dim).amax(dim=2)
    padded[:, n:] = float("inf")
    page_min = padded.view(heads, pages, page_size, dim).amin(dim=2)
    return page_max, page_min


def page_upper_bounds(query: torch.Tensor, page_max: torch.Tensor, page_min: torch.Tensor) -> torch.Tensor:
    """Quest's bound per query head and page: query [Hq, d], page_max/min [H, P, d] -> [Hq, P] float32.

    Query head j belongs to KV head j // G (the grouping of HF's repeat_kv).
    """
    heads, pages, dim = page_max.shape
    q = query.float().reshape(heads, -1, dim)  # [H, G, d]
    # sum_d max(q_d·max_d, q_d·min_d) is q⁺·max + q⁻·min (max >= min): two batched products; picking max or min
    # per element first built a [H, G, P, d] tensor, most of a small model's selection time
    bounds = torch.bmm(q.clamp_min(0), page_max.float().transpose(1, 2))
    return bounds.baddbmm_(q.clamp_max(0), page_min.float().transpose(1, 2)).view(-1, pages)


def upper_bounds(query: torch.Tensor, metadata: LayerMetadata) -> torch.Tensor:
    """`page_upper_bounds` from one layer's metadata in either form: query [Hq, d] -> [Hq, P] float32. From 8-bit
    codes without making the bounds: q⁺·(low + code·step + margin) is q⁺·(low + margin) + (q⁺·step)·code, and
    likewise for q⁻ and the minima, so only the codes are read per page."""
    if "max_code" not in metadata:
        return page_upper_bounds(query, metadata["page_max"], metadata["page_min"])
    max_code, min_code = metadata["max_code"], metadata["min_code"]
    heads, pages, dim = max_code.shape
    low, step = metadata["low"][:, None], metadata["step"][:, None]  # [H, 1, d]
    margin = _margin(low, step)
    q = query.float().reshape(heads, -1, dim)  # [H, G, d]
    positive, negative = q.clamp_min(0), q.clamp_max(0)
    base = (positive * (low + margin)).sum(-1, keepdim=True) + (negative * (low - margin)).sum(-1, keepdim=True)
    bounds = torch.baddbmm(base, positive * step, max_code.float().transpose(1, 2))  # [H, G, P]
    return bounds.baddbmm_(negative * step, min_code.float().transpose(1, 2)).view(-1, pages)


def quantize_bounds(page_max: torch.Tensor, page_min: torch.Tensor) -> dict[str, torch.Tensor]:
    """[H, P, d] page maxima and minima -> 8-bit codes on a per-(head, channel) grid over [low, low + 255 * step],
    maxima rounded up and minima down: the dequantized interval of a page contains the original one."""
    high, low = page_max.float().amax(dim=1), page_min.float().amin(dim=1)  # [H, d]
    step = ((high - low) / 255).clamp_min(torch.finfo(torch.float32).tiny)
    up = torch.ceil((page_max.float() - low[:, None]) / step[:, None])
    down = torch.floor((page_min.float() - low[:, None]) / step[:, None])
    return {
        "max_code": up.clamp(0, 255).to(torch.uint8),
        "min_code": down.clamp(0, 255).to(torch.uint8),
        "low": low,
        "step": step,
    }


def dequantize_bounds(metadata: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Page maxima and minima [H, P, d] float32 from `quantize_bounds`'s codes, or as stored when unquantized."""
    if "max_code" not in metadata:
        return metadata["page_max"], metadata["page_min"]
    low, step = metadata["low"][:, None], metadata["step"][:, None]
    margin = _margin(low, step)
    page_max = low + metadata["max_code"].float() * step + margin
    page_min = low + metadata["min_code"].float() * step - margin
    return page_max, page_min


def _margin(low: torch.Tensor, step: torch.Tensor) -> torch.Tensor:
    """The outward margin of dequantized 8-bit bounds: float32 rounding (here and in quantize_bounds) may land a
    code's value a few ulps inside the original bound; a margin far below one grid step, relative to the channel's
    magnitude, keeps it outside."""
    return BOUND_MARGIN * (low.abs() + (low + 255 * step).abs()) + torch.finfo(torch.float32).tiny


class QuestSelector(Selector):
    """Quest page selection over the prompt; the last prompt page is always included."""

    name = "quest"

    def __init__(
        self,
        info: ModelInfo,
        budget: float = 0.1,
        page_size: int = 16,
        gqa: str = "max",
        bound_bits: int = 8,
        head_split: str = "even",
        layer_split: str = "even",
        slope: float = 0.5,
        floor: float = 0.2,
    ) -> None:
        """`gqa`: a page's score for a KV head is the max over its G query heads of their softmax over the pages
        of bound·d^-0.5 ("max", the exact top-k's rule), or of their raw bounds ("bound"). `bound_bits`: 16
        keeps the page bounds in the keys' dtype, 8 ships them as outward-rounded 8-bit codes (module docstring).
        `head_split`, `layer_split`, `slope`, `floor`: how the budget spreads over heads and layers (budget_split)."""
        super().__init__(info)
        self.split = BudgetSplit.checked("quest", head_split, layer_split, slope, floor, gqa)
        if bound_bits not in BOUND_BITS:
            raise ValueError(f"quest: bound_bits must be one of {', '.join(map(str, BOUND_BITS))}, got {bound_bits}")
        self.bound_bits = bound_bits
        self.gqa = check_gqa("quest", gqa, ("bound", "max"))
        budget_tokens(budget, 1)  # rejects a non-positive budget at construction
        if page_size < 1:
            raise ValueError(f"page_size must be at least 1, got {page_size}")
        self.budget = budget
        self.page_size = page_size

    def build_metadata(self, prefill: PrefillLayer) -> LayerMetadata:
        page_max, page_min = page_bounds(prefill.key, self.page_size)
        if self.bound_bits == 8:
            return quantize_bounds(page_max, page_min)
        dtype = prefill.key.dtype
        return {"page_max": page_max.to(dtype), "page_min": page_min.to(dtype)}  # [H, P, d] each

    def page_budget(self, length: int, layer: int | None = None) -> int:
        """Pages a prompt of `length` tokens may select per KV head, the last page included (at `layer`, under
        the layer split; with an adaptive head split, the mean over the layer's heads).

        Quest's token_budget // page_size when the last page is full; a partial last page
        counts for its real tokens, so budget 1.0 is every token and no budget is exceeded.
        """
        budget = self.budget if layer is None else self.split.budget(self.budget, layer, self.info.num_layers)
        last = length - (-(-length // self.page_size) - 1) * self.page_size  # tokens in the last page
        return max(1, 1 + (budget_tokens(budget, length) - last) // self.page_size)

    def select(self, step: StepQuery, metadata: list[LayerMetadata]) -> torch.Tensor:
        return self._select(step, metadata, None)[0]

    def select_with_next(
        self, step: StepQuery, metadata: list[LayerMetadata], wide: Selector
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One ranking of the pages, cut at this budget and at `wide`'s: a page's bound does not depend on the
        budget, so the wider pick is the narrower one plus the next pages in rank. Under the even split the second
        output is those next pages' tokens, in rank order (the likeliest next pick first: where SmartGen's hints
        outrun the link, what crosses first is what the coming steps most likely select); where the wider pick is
        every token (a short prompt), or under the adaptive split, it is the wider pick whole, ascending."""
        ranking = (self.page_size, self.gqa, self.split)
        if not isinstance(wide, QuestSelector) or (wide.page_size, wide.gqa, wide.split) != ranking:
            return super().select_with_next(step, metadata, wide)
        picked, following = self._select(step, metadata, wide)
        assert following is not None
        return picked, following

    def _select(
        self, step: StepQuery, metadata: list[LayerMetadata], wide: QuestSelector | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        if step.query is None:
            raise ValueError("QuestSelector needs this layer's query (StepQuery.query)")
        if self.split.head_split == "adaptive":
            return self._select_each(step, metadata, wide)
        return self._select_batch(step, metadata, wide)

    def _select_batch(
        self, step: StepQuery, metadata: list[LayerMetadata], wide: QuestSelector | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The even split's selection for the whole batch in one pass: every request's pages scored, grouped and
        ranked together (padded to the longest prompt's pages), the tokens made per group of equal prompt length.
        One request at a time cost ~15 tensor operations per request and pass, which on a small model is most of
        a batch step's selection (py-spy, random:32 at batch 8: a third of the decode node's busy time)."""
        assert step.query is not None  # _select checked
        heads = self.info.num_kv_heads
        count = len(step.prompt_lengths)
        rows: list[torch.Tensor | None] = [None] * count
        wide_rows: list[torch.Tensor | None] = [None] * count
        scored: list[int] = []  # requests whose own pick is not every token: their pages are ranked
        pages: list[int] = []
        budgets: list[tuple[int, int]] = []  # (this selector's, the wide one's) pages, per request
        for b, n in enumerate(step.prompt_lengths):
            num_pages = page_count(metadata[b])
            budget = self.page_budget(n, step.layer)
            wide_budget = budget if wide is None else max(budget, wide.page_budget(n, step.layer))
            pages.append(num_pages)
            budgets.append((budget, wide_budget))
            if num_pages <= wide_budget:
                device = step.query.device
                every = torch.arange(n, device=device).expand(heads, n)
                wide_rows[b] = every
                if num_pages <= budget:
                    rows[b] = every
                    continue
            scored.append(b)
        if scored:
            every_request = len(scored) == count  # the usual batch: no copy of the queries picked out
            queries = step.query if every_request else step.query[scored]
            ranked = self._rank_pages(queries, [metadata[b] for b in scored], [pages[b] for b in scored])
            # equal pages and budgets: one _page_tokens call (prompts a few tokens apart differ in the last page only)
            groups: dict[tuple[int, int, int], list[int]] = {}
            for i, b in enumerate(scored):
                groups.setdefault((pages[b], *budgets[b]), []).append(i)
            for (num_pages, budget, wide_budget), members in groups.items():
                lengths = [step.prompt_lengths[scored[i]] for i in members]
                first, last = members[0], members[-1] + 1
                picked = ranked[first:last] if last - first == len(members) else ranked[members]  # a slice: no copy
                top = picked[:, :, : min(wide_budget, num_pages) - 1].reshape(len(members) * heads, -1)
                own = self._page_tokens(top[:, : budget - 1], num_pages, lengths)
                following = (
                    self._band_tokens(top[:, budget - 1 :]) if wide is not None and num_pages > wide_budget else None
                )
                for j, i in enumerate(members):
                    b, part = scored[i], slice(j * heads, (j + 1) * heads)
                    rows[b] = own[part]
                    if following is not None:
                        wide_rows[b] = following[part]
        picked = _stack_rows(rows)
        return picked, (_stack_rows(wide_rows) if wide is not None else None)  # [B·H, max k] each

    def _rank_pages(self, query: torch.Tensor, metadata: list[LayerMetadata], pages: list[int]) -> torch.Tensor:
        """Every page but the last of each request ranked best first per KV head: query [B, Hq, d] -> [B, H, P-1]
        page numbers (P: the most pages of any request; a request's own ranking is the first P_b - 1 of its row).
        Ties go by page (a stable sort: topk breaks ties its own way for each k), so the first budget - 1 are this
        selector's pick whether or not a wider pick is cut from the same ranking."""
        heads, count = self.info.num_kv_heads, len(pages)
        most = max(pages)
        bounds = upper_bounds(query.reshape(count * query.shape[1], -1), _stacked(metadata, most))  # [B·Hq, P]
        bounds = bounds.view(count, heads, -1, most)[..., :-1]  # [B, H, G, P-1]
        if min(pages) < most:  # a shorter prompt's padding and last page never rank
            columns = torch.arange(most - 1, device=bounds.device)
            beyond = columns >= torch.tensor(pages, device=bounds.device).unsqueeze(1) - 1  # [B, P-1]
            bounds = bounds.masked_fill(beyond[:, None, None], float("-inf"))
        if self.gqa == "max":
            grouped = (bounds * self.info.head_dim**-0.5).reshape(count * heads, -1, most - 1)  # [B·H, G, P-1]
            scores = group_max_probability(grouped).view(count, heads, most - 1)
        else:
            scores = bounds.amax(dim=2)
        return scores.sort(dim=-1, descending=True, stable=True).indices  # [B, H, P-1]

    def _select_each(
        self, step: StepQuery, metadata: list[LayerMetadata], wide: QuestSelector | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One request at a time: the adaptive head split ranks each request's heads together."""
        assert step.query is not None  # _select checked
        heads = self.info.num_kv_heads
        rows, wide_rows = [], []
        for b, n in enumerate(step.prompt_lengths):
            num_pages, budget = page_count(metadata[b]), self.page_budget(n, step.layer)
            wide_budget = budget if wide is None else max(budget, wide.page_budget(n, step.layer))
            device = step.query.device
            if num_pages <= wide_budget:
                every = torch.arange(n, device=device).expand(heads, n)
                wide_rows.append(every)
                if num_pages <= budget:
                    rows.append(every)
                    continue
            # score every page but the last, which is taken anyway
            bounds = upper_bounds(step.query[b], metadata[b])[:, :-1]  # either form: [Hq, P-1]
            grouped = bounds.view(heads, -1, num_pages - 1)  # [H, G, P-1]
            if self.gqa == "max":
                bounds = group_max_probability(grouped * self.info.head_dim**-0.5)  # [H, P-1]
            else:
                bounds = grouped.amax(dim=1)  # [H, P-1]
            order = adaptive_order(bounds, budget - 1, self.split.floor)  # flat head · (P-1) + page, best first
            rows.append(self._flat_page_tokens(order[: heads * (budget - 1)], num_pages, n))
            if wide is not None and num_pages > wide_budget:
                wide_rows.append(self._flat_page_tokens(order[: heads * (wide_budget - 1)], num_pages, n))
        return pad_rows(rows), (pad_rows(wide_rows) if wide is not None else None)  # [B·H, max k] each

    def _flat_page_tokens(self, flat: torch.Tensor, num_pages: int, n: int) -> torch.Tensor:
        """[H, k] prompt positions, -1 padded, of flat picks (head · (P-1) + page) and every head's last page."""
        heads, size = self.info.num_kv_heads, self.page_size
        pages = rows_from_flat(flat, heads, num_pages - 1)  # [H, k_p] ascending, -1 padded
        offsets = torch.arange(size, device=pages.device)
        last = torch.arange((num_pages - 1) * size, n, device=pages.device)
        rows = [torch.cat(((row[row >= 0][:, None] * size + offsets).flatten(), last)) for row in pages]
        out = torch.full((heads, max(len(r) for r in rows)), -1, dtype=torch.int64, device=pages.device)
        for h, row in enumerate(rows):
            out[h, : len(row)] = row
        return out

    def _band_tokens(self, band: torch.Tensor) -> torch.Tensor:
        """[H, k] prompt positions of ranked pages `band` [H, k_p] (never the last, so every page is whole), in the
        pages' rank order: what a wider budget adds past this one, likeliest first."""
        offsets = torch.arange(self.page_size, device=band.device)
        return (band[:, :, None] * self.page_size + offsets).flatten(1)

    def _page_tokens(self, top: torch.Tensor, num_pages: int, lengths: list[int]) -> torch.Tensor:
        """[R, k] prompt positions of pages `top` [R, k_p] (any order) and the last page, ascending: rows of
        `len(lengths)` requests of `num_pages` pages each, request j `lengths[j]` tokens long, its rows in turn."""
        rows, device = top.shape[0], top.device
        last = torch.full((rows, 1), num_pages - 1, dtype=top.dtype, device=device)
        pages = torch.cat((top.sort(dim=-1).values, last), dim=-1)  # [R, budget], ascending
        tokens = pages[:, :, None] * self.page_size + torch.arange(self.page_size, device=device)
        # only the last page can run past a prompt, and it is last in every row: trimming the tail drops exactly
        # its missing tokens and leaves no -1 inside a request's row; a shorter prompt of the group pads its tail
        tokens = tokens.flatten(1)[:, : top.shape[1] * self.page_size + max(lengths) - (num_pages - 1) * self.page_size]
        if min(lengths) < max(lengths):
            ends = torch.tensor(lengths, device=device).repeat_interleave(rows // len(lengths)).unsqueeze(1)
            tokens = tokens.masked_fill(tokens >= ends, -1)
        return tokens


def page_count(metadata: LayerMetadata) -> int:
    """Pages of one request's layer metadata, in either form."""
    return (metadata["max_code"] if "max_code" in metadata else metadata["page_max"]).shape[1]


def _stacked(metadata: list[LayerMetadata], pages: int) -> LayerMetadata:
    """Requests' metadata of one layer as one request's with B·H heads (head b·H + h is request b's head h), pages
    padded to `pages` (the padding is never ranked); 8-bit codes stay codes when every request's are."""
    if len(metadata) == 1 and page_count(metadata[0]) == pages:
        return metadata[0]
    if all("max_code" in m for m in metadata):
        return {
            "max_code": torch.cat([_pad_pages(m["max_code"], pages) for m in metadata]),
            "min_code": torch.cat([_pad_pages(m["min_code"], pages) for m in metadata]),
            "low": torch.cat([m["low"] for m in metadata]),
            "step": torch.cat([m["step"] for m in metadata]),
        }
    bounds = [dequantize_bounds(m) for m in metadata]  # mixed forms: each request's as float32
    return {
        "page_max": torch.cat([_pad_pages(high.float(), pages) for high, _ in bounds]),
        "page_min": torch.cat([_pad_pages(low.float(), pages) for _, low in bounds]),
    }


def _pad_pages(bounds: torch.Tensor, pages: int) -> torch.Tensor:
    """[H, P_b, d] -> [H, pages, d], zero pages after (masked out of the ranking by the caller)."""
    short = pages - bounds.shape[1]
    return torch.nn.functional.pad(bounds, (0, 0, 0, short)) if short else bounds


def _stack_rows(rows: list[torch.Tensor | None]) -> torch.Tensor:
    """pad_rows of every request's rows; one concatenation when they are all as wide (a batch of equal prompts)."""
    present = [r for r in rows if r is not None]
    assert len(present) == len(rows)  # every request got its rows
    if len(present) == 1:
        return present[0].contiguous()  # a request's every token is an expanded view
    if len({r.shape[1] for r in present}) == 1:
        return torch.cat(present)
    return pad_rows(present)
