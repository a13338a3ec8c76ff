"""Hand-initialised circuits of the sample model: a previous-token head at layer 2 and an induction head at 3.

Why: on these CPUs no run grew a copying head from a normal initialisation within the budget, not even
with a hand-made previous-token head (loss stayed at ln V for hundreds of steps; see MODEL_CARD.md).
So the model starts with a working copy mechanism above layer 1 and training builds retrieval on it.

Residual stream layout at initialisation (hidden 256):
    dims  0..31   token identity: embedding row = unit code c_t = [0.8·a_t (20 dims), 0.6·b_t (12 dims)],
                  a_t spread apart (low coherence) so that one token's code matches only itself
    dims 32..51   a of the previous token, written by layer 2's offset-1 head
    dims 52..71   a of the token two back (offset-2 head), dims 72..91: three back (offset-3 head),
                  dims 92..111 (ngram=4 only): four back (query head 1 moved from offset 1 to offset 4)
Layers 0-1 and every other head and MLP start with zero output projections (identity layers), so the
copying can only come from layers >= 2. The rope theta is large (1e12): pairs 0-5 turn fast and carry
position, pairs 6-15 turn by < 0.3 rad over 8K tokens and carry content, so matching works at any distance.

Layer 2, KV group 0 (query heads 0-3): q/k weights zero, biases that peak after RoPE at offsets 1, 1, 2, 3
(frozen); V reads a_t. Layer 3, KV group 0, query head 0: q = a of the current token, k = a of the
previous token (the static RoPE pairs only), V/O copy the attended token's code into dims 0..31, so the
tied output embedding predicts it: "after x comes what came after x before". Optionally (ngram=3 or 4)
layer 3, KV group 1, query head 4 does the same on n-grams, which tells apart needles that end alike
("... for {key} is: {value}") but carry different keys. ngram=3 (the 16-layer model up to December 2026)
finds the asked needle at its ":", but the value starts after a space token, where the 3-gram
(" ", ":", " is") no longer holds the key, so the first digit came from any needle; ngram=4 keeps the
key's last token in the match there.
"""

from __future__ import annotations

import math

import torch

POSITIONAL_LAYER = 2
INDUCTION_LAYER = 3
ID_DIMS, MATCH_DIMS = 32, 20


def positional_offsets(ngram: int) -> tuple[int, ...]:
    """The offset of each query head of layer 2's KV group 0 (head 1 repeats offset 1 unless a 4-gram needs it)."""
    return (1, 4, 2, 3) if ngram >= 4 else (1, 1, 2, 3)


def prev_slots(ngram: int) -> dict[int, int]:
    """Positional query head -> first residual dim it writes a_t to."""
    slots = {0: 32, 2: 52, 3: 72}
    if ngram >= 4:
        slots[1] = 92
    return slots


STATIC_FREQ = 1e-4  # RoPE pairs turning slower than this are "static": content, not position
INDUCTION_LOGIT = 25.0  # attention logit of an exact match
COPY_GAIN = 4.0  # 1-gram head alone: copied code vs the current token's own code in the output
COPY_GAIN_WITH_TRIGRAM = 2.0  # 1-gram head next to the 3-gram head, which outweighs it where they disagree
TRIGRAM_COPY_GAIN = 6.0


@torch.enable_grad()
def design_codes(vocab: int, seed: int, steps: int = 300) -> torch.Tensor:
    """[V, 32] unit codes whose first 20 dims (a_t) are spread apart: low |cos| between tokens."""
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(vocab, MATCH_DIMS, generator=g)
    a = torch.nn.Parameter(a / a.norm(dim=1, keepdim=True))
    opt = torch.optim.Adam([a], lr=0.01)
    off = ~torch.eye(vocab, dtype=torch.bool)
    for _ in range(steps):
        u = a / a.norm(dim=1, keepdim=True)
        loss = (u @ u.T)[off].pow(4).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    with torch.no_grad():
        a = a / a.norm(dim=1, keepdim=True)
        b = torch.randn(vocab, ID_DIMS - MATCH_DIMS, generator=g)
        b = b / b.norm(dim=1, keepdim=True)
        return torch.cat([0.8 * a, 0.6 * b], dim=1)


def positional_sharpness(inv_freq, used, offset: int, target: float = 0.98, context: int = 8192) -> float:
    """Smallest logit scale c (score = c·Σ_f cos((Δ - offset)θ_f)) that puts `target` of the weight on the offset."""
    delta = torch.arange(context, dtype=torch.float64)[:, None] - offset
    s = (used.double() * torch.cos(delta * inv_freq.double())).sum(1)
    c = 1.0
    while torch.softmax(c * s, 0)[offset] < target and c < 100:
        c *= 1.1
    return c


@torch.no_grad()
def install(model, seed: int = 0, trigram: bool = False, ngram: int = 0) -> list:
    """Initialise the circuits in place; returns the gradient hooks that keep the positional q/k frozen.

    ngram=0 is the 6-layer model's recipe; ngram=3 (or trigram=True) adds the 3-gram induction head (copy
    accuracy at init 0.93 at 2K and 0.89 at 4K instead of 0.39 and 0.14), ngram=4 a 4-gram one."""
    if trigram and not ngram:
        ngram = 3
    if ngram not in (0, 3, 4):
        raise ValueError(f"ngram must be 0, 3 or 4, not {ngram}")
    offsets, slots = positional_offsets(ngram), prev_slots(ngram)
    cfg = model.config
    d, hidden = cfg.head_dim, cfg.hidden_size
    group = cfg.num_attention_heads // cfg.num_key_value_heads
    layers = model.model.layers
    for layer in layers:  # identity layers: what the model learns is added from zero
        layer.self_attn.o_proj.weight.zero_()
        if layer.self_attn.o_proj.bias is not None:
            layer.self_attn.o_proj.bias.zero_()
        layer.mlp.down_proj.weight.zero_()

    codes = design_codes(cfg.vocab_size, seed)
    emb = model.model.embed_tokens.weight
    emb.copy_(0.005 * torch.randn(emb.shape, generator=torch.Generator().manual_seed(seed + 1)))
    emb[:, :ID_DIMS] = codes
    norm_scale = math.sqrt(hidden)  # RMSNorm of a unit-norm row: x · √hidden

    # layer 2: positional heads
    inv_freq = model.model.rotary_emb.inv_freq.float()  # [d/2]
    used = (inv_freq > STATIC_FREQ).float()
    attn = layers[POSITIONAL_LAYER].self_attn
    # score(Δ) = Re Σ_f q_f conj(k_f) e^{iΔθ_f}: with k_f = a and q_f = (c·√d / a) e^{-i·offset·θ_f}
    # the logit is c·Σ_f cos((Δ - offset)θ_f), largest at Δ = offset
    # the 3-gram recipe sized the logits for offset 1 alone; offset 4 needs them sharper
    sized_for = set(offsets) if ngram >= 4 else {offsets[0]}
    scale = max(positional_sharpness(inv_freq, used, offset) for offset in sized_for) * math.sqrt(d)
    amp = math.sqrt(scale)
    attn.k_proj.weight[:d].zero_()
    attn.k_proj.bias[:d] = torch.cat([amp * used, torch.zeros(d // 2)])
    for h, offset in enumerate(offsets[:group]):
        phase = offset * inv_freq
        rows = slice(h * d, (h + 1) * d)
        attn.q_proj.weight[rows].zero_()
        attn.q_proj.bias[rows] = torch.cat([torch.cos(phase), -torch.sin(phase)]) * (scale / amp) * used.repeat(2)
    attn.v_proj.weight[:d].zero_()
    attn.v_proj.bias[:d].zero_()
    attn.v_proj.weight[range(MATCH_DIMS), range(MATCH_DIMS)] = 1.0 / norm_scale  # v = a_t
    for h, first in slots.items():
        attn.o_proj.weight[range(first, first + MATCH_DIMS), range(h * d, h * d + MATCH_DIMS)] = 1.0

    # layer 3: induction head (KV group 0, query head 0)
    attn = layers[INDUCTION_LAYER].self_attn
    residual_norm = math.sqrt(hidden / (1.0 + len(slots) * 0.64))  # RMSNorm gain on code + the prev codes
    static = [i for i in range(d // 2) if inv_freq[i] <= STATIC_FREQ]
    static_dims = static + [i + d // 2 for i in static]
    assert len(static_dims) >= MATCH_DIMS, (
        f"need {MATCH_DIMS} static RoPE dims, got {len(static_dims)}; raise rope theta"
    )
    static_dims = static_dims[:MATCH_DIMS]
    for proj in (attn.k_proj, attn.v_proj):
        proj.weight[:d].zero_()
        proj.bias[:d].zero_()
    attn.q_proj.weight[:d].zero_()
    attn.q_proj.bias[:d].zero_()
    match_logit = (residual_norm**2) * 0.64 / math.sqrt(d)  # per unit of q/k gain
    gain = INDUCTION_LOGIT / match_logit
    prev = slots[0]
    attn.k_proj.weight[static_dims, range(prev, prev + MATCH_DIMS)] = 1.0
    attn.q_proj.weight[static_dims, range(MATCH_DIMS)] = gain
    attn.v_proj.weight[range(ID_DIMS), range(ID_DIMS)] = 1.0 / residual_norm  # v = c_t
    attn.o_proj.weight[range(ID_DIMS), range(ID_DIMS)] = COPY_GAIN_WITH_TRIGRAM if ngram else COPY_GAIN
    if ngram:
        _install_ngram_head(attn, residual_norm, static_dims, d, group, seed, ngram, slots)

    layer2 = layers[POSITIONAL_LAYER].self_attn
    q_mask = torch.ones(layer2.q_proj.out_features, 1)
    q_mask[: group * d] = 0
    k_mask = torch.ones(layer2.k_proj.out_features, 1)
    k_mask[:d] = 0
    return [
        layer2.q_proj.weight.register_hook(lambda g: g * q_mask),
        layer2.q_proj.bias.register_hook(lambda g: g * q_mask[:, 0]),
        layer2.k_proj.weight.register_hook(lambda g: g * k_mask),
        layer2.k_proj.bias.register_hook(lambda g: g * k_mask[:, 0]),
    ]


@torch.no_grad()
def _install_ngram_head(
    attn, residual_norm: float, static_dims: list[int], d: int, group: int, seed: int, n: int, slots: dict[int, int]
) -> None:
    """Layer 3, KV group 1, query head `group`: an n-gram induction head. q sums the codes of the current
    token and the n-1 before it, k those of the n tokens before the key position, each offset through
    its own rotation (so offsets do not match each other); a full n-token match scores INDUCTION_LOGIT,
    an (n-1)-of-n match (a distractor needle with another key) 1/n less."""
    rot = [
        torch.linalg.qr(torch.randn(MATCH_DIMS, MATCH_DIMS, generator=torch.Generator().manual_seed(seed + 10 + m)))[0]
        for m in range(n)
    ]
    kv, qh = slice(d, 2 * d), slice(group * d, (group + 1) * d)
    for proj, rows in ((attn.k_proj, kv), (attn.v_proj, kv), (attn.q_proj, qh)):
        proj.weight[rows].zero_()
        proj.bias[rows].zero_()
    k_static = [d + i for i in static_dims]
    q_static = [group * d + i for i in static_dims]
    gain_n = INDUCTION_LOGIT * math.sqrt(d) / (residual_norm**2 * n * 0.64)
    back = [0, slots[0], slots[2], slots[3]] + ([slots[1]] if n >= 4 else [])  # a of x_{i}, x_{i-1}, ... by offset
    query_sources = back[:n]  # a of x_i ... x_{i-n+1}
    key_sources = back[1 : n + 1]  # a of x_{j-1} ... x_{j-n}
    for r, q_src, k_src in zip(rot, query_sources, key_sources):
        attn.q_proj.weight[q_static, q_src : q_src + MATCH_DIMS] = gain_n * r
        attn.k_proj.weight[k_static, k_src : k_src + MATCH_DIMS] = r
    attn.v_proj.weight[range(d, d + ID_DIMS), range(ID_DIMS)] = 1.0 / residual_norm
    attn.o_proj.weight[range(ID_DIMS), range(group * d, group * d + ID_DIMS)] = TRIGRAM_COPY_GAIN


@torch.no_grad()
def positional_head_check(model, length: int = 1024, ngram: int = 0) -> list[float]:
    """Mean attention weight of each positional head on its offset (random tokens)."""
    ids = torch.randint(3, model.config.vocab_size, (1, length))
    impl = model.config._attn_implementation
    model.config._attn_implementation = "eager"
    try:
        att = model(input_ids=ids, output_attentions=True).attentions[POSITIONAL_LAYER][0]  # [H, n, n]
    finally:
        model.config._attn_implementation = impl
    rows = torch.arange(8, length)
    return [round(float(att[h, rows, rows - off].mean()), 4) for h, off in enumerate(positional_offsets(ngram))]


@torch.no_grad()
def copy_accuracy(model, length: int = 1024, span: int = 100, seed: int = 0) -> float:
    """Next-token accuracy on the second copy of `span` random tokens placed `length` tokens back."""
    g = torch.Generator().manual_seed(seed)
    seq = torch.randint(3, model.config.vocab_size, (span,), generator=g)
    filler = torch.randint(3, model.config.vocab_size, (length - 2 * span - 1,), generator=g)
    bos = torch.tensor([model.config.bos_token_id])  # a trained model parks idle attention on <s>
    ids = torch.cat([bos, seq, filler, seq]).unsqueeze(0)
    pred = model(input_ids=ids).logits[0, -span:-1].argmax(-1)
    return float((pred == ids[0, -span + 1 :]).float().mean())
