"""Selection-led transfer: hints (a wider selection's remote entries pushed next) and prefetch (layer l+1's selection
speculated during layer l and fetched ahead); both move bytes earlier and leave every answer unchanged."""

import pytest
import torch
from tiny_models import tiny_config

import smartgen.engine.prefill as prefill_module
from smartgen.engine.layout import KVLayout
from smartgen.engine.messages import Idle, MessageError
from smartgen.engine.planning import Planner
from smartgen.engine.policy import Policy, ProactiveMode, get_policy
from smartgen.engine.pool import PrefillStore
from smartgen.engine.prefill import OpenedRequest, PrefillEngine
from smartgen.lanes.base import Message
from smartgen.runtime.emulation import Emulation
from smartgen.runtime.models import model_from_config
from smartgen.runtime.pipeline import InprocPipeline
from smartgen.selectors.base import ModelInfo
from smartgen.selectors.quest import QuestSelector
from smartgen.selectors.streaming import StreamingSelector

LENGTH = 256


def _run(scheme: str, record: list | None = None, fetches: list | None = None) -> tuple[list[int], dict[str, int]]:
    model = model_from_config(tiny_config("llama"))
    policy = get_policy(scheme, "sequential", 0.05)
    prompt = torch.randint(3, 97, (LENGTH,), generator=torch.Generator().manual_seed(5))
    with InprocPipeline(model, policy, "quest", {"budget": 0.25}, gbps=0.02, prefill_seconds_per_token=1e-5) as p:
        if record is not None:
            engine = p.prefill_engine
            note_hints = engine.note_hints

            def recorded(request, hints):
                record.append((request.length, hints.clone()))
                return note_hints(request, hints)

            engine.note_hints = recorded  # type: ignore[method-assign]
        if fetches is not None:
            decode = p.decode_engine
            send, prefetch = decode._send_fetches, decode.prefetch

            def sent(layer, requests, split, remote_of):
                out = send(layer, requests, split, remote_of)
                fetches.append(("step", layer, sum(int(e.numel()) for _, e, _, _ in out)))
                return out

            def ahead(layer, request_ids, index):
                before = sum(len(r.late) for r in decode._requests.values())
                prefetch(layer, request_ids, index)
                fetches.append(("ahead", layer, sum(len(r.late) for r in decode._requests.values()) - before))

            serve = p.prefill_engine._serve_fetch

            def served(link, message):
                for position, row in zip(message.positions.tolist(), message.heads):
                    fetches.extend(("entry", message.layer, (position, h)) for h in row.nonzero().flatten().tolist())
                return serve(link, message)

            p.prefill_engine._serve_fetch = served  # type: ignore[method-assign]
            decode._send_fetches = sent  # type: ignore[method-assign]
            decode.prefetch = ahead  # type: ignore[method-assign]
        (result,) = p.generate([prompt], 16)
        moved = p.prefill_engine.counters.snapshot()["bytes"]
        if fetches is not None:
            fetches.append(("prefetched", -1, result.metrics.prefetched_entries))
            counters = p.decode_engine.counters.snapshot()
            fetches += [("landed", kind, n["landed"]) for kind, n in counters["fetches"].items()]
            fetches.append(("landed", "all", counters["transfers"]["on_demand"]))
        return result.tokens, moved


def test_hints_are_pushed_and_change_no_token():
    hinted: list = []
    tokens, moved = _run("smartgen-paper+hints", hinted)
    plain, _ = _run("smartgen-paper")
    assert tokens == plain  # hints move bytes earlier; what a step attends to is the selector's alone
    assert hinted, "the wider selection should name remote tokens on a slow link"
    config = tiny_config("llama")
    num_layers, num_heads = config.num_hidden_layers, config.num_key_value_heads
    for length, hints in hinted:
        layer = hints // (length * num_heads)
        assert bool((layer >= 2).all()) and bool((layer < num_layers).all())  # sparse layers only
    assert moved["speculative"] > 0


def test_policy_hints_need_speculation():
    with pytest.raises(ValueError, match="hints"):
        Policy("x", proactive=ProactiveMode.BUDGET, speculative=False, hints=0.5)
    with pytest.raises(ValueError, match="hints"):
        Policy("x", hints=-1.0)
    assert get_policy("smartgen-paper+hints").hints > 0 and get_policy("smartgen-paper").hints == 0


def test_a_widened_selector_ranks_more_and_leaves_the_original_alone():
    info = ModelInfo(num_layers=4, num_q_heads=4, num_kv_heads=2, head_dim=8, hidden_size=32)
    quest = QuestSelector(info, budget=0.1)
    wide = quest.widened(0.5)
    assert wide is not None and wide.budget == pytest.approx(0.15) and quest.budget == 0.1
    assert quest.widened(0.0) is None
    assert QuestSelector(info, budget=0.9).widened(0.5).budget == 1.0  # a ratio stays a ratio
    assert QuestSelector(info, budget=64).widened(0.5).budget == 96  # a token count grows as one
    assert quest.page_budget(2048) < wide.page_budget(2048)
    assert StreamingSelector(info, budget=0.1).widened(0.5) is not None


def test_bad_hints_are_refused():
    payload = Idle("r", 3, torch.tensor([1, 2])).pack()
    assert torch.equal(Idle.unpack(payload).hints, torch.tensor([1, 2]))
    assert Idle.unpack(Idle("r", 3).pack()).hints is None
    bad = Message(payload.kind, "r", payload.meta, {"hints": torch.tensor([1.5])})
    with pytest.raises(MessageError, match="hints"):
        Idle.unpack(bad)
    layout = KVLayout(4, 2, 8, num_blocks=16)
    engine = PrefillEngine(layout, Planner(4, 16))
    entry = PrefillStore(layout).open("r", 64)
    entry.layers_ready = layout.num_layers
    request = OpenedRequest("r", 0, 64, get_policy("smartgen-paper+hints"), None, None, None, entry, torch.ones(1))  # type: ignore[arg-type]
    with pytest.raises(MessageError, match="outside"):
        engine.note_hints(request, torch.tensor([4 * 64 * 2]))  # 4 layers of 64 tokens, 2 KV heads


def test_prefetch_fetches_ahead_and_changes_no_token():
    """smartgen (hints and prefetch): layer l+1's speculated selection is fetched while layer l computes (never
    for layers 0-1), and layer l+1 then asks only for what that missed; the tokens are the paper's paths' own."""
    log: list = []
    tokens, _ = _run("smartgen-no-head-start", fetches=log)  # smartgen's decode steps, not the prefill node's
    plain, _ = _run("smartgen-paper")
    assert tokens == plain
    ahead = [(layer, n) for kind, layer, n in log if kind == "ahead"]
    assert ahead and all(layer >= 2 for layer, _ in ahead)
    assert sum(n for _, n in ahead) > 0, "some prefetch must go out on a slow link"
    (prefetched,) = [n for kind, _, n in log if kind == "prefetched"]
    assert prefetched > 0
    landed = {kind: n for what, kind, n in log if what == "landed"}  # the decode node counts each fetch by kind
    assert landed["prefetch"] > 0 and landed["step"] > 0
    assert landed["step"] + landed["prefetch"] + landed["forecast"] == landed["all"]
    entries = [(layer, e) for kind, layer, e in log if kind == "entry"]
    assert len(entries) == len(set(entries)), "an entry a prefetch asked for is never asked for again"


def test_policy_prefetch_cannot_drop_remote():
    with pytest.raises(ValueError, match="prefetch"):
        Policy("x", proactive=ProactiveMode.BUDGET, speculative=False, drop_remote=True, prefetch=True)
    assert get_policy("smartgen").prefetch and get_policy("smartgen").hints > 0
    assert not get_policy("smartgen-paper").prefetch and not get_policy("smartgen-paper+hints").prefetch


def test_hints_go_newest_first_as_much_as_a_window_moves():
    """Queued hints are pushed newest notice first, only (token, head) entries still unsent, as many as the link
    moves in the window since the last notice; the rest waits for the next window; a window the fetches used pushes
    none."""
    layout = KVLayout(4, 2, 8, num_blocks=16)
    engine = PrefillEngine(layout, Planner(4, 16))
    entry = PrefillStore(layout).open("r", 64)
    entry.layers_ready = layout.num_layers
    unsent = torch.ones(4, 64, 2, dtype=torch.bool)
    request = OpenedRequest("r", 0, 64, get_policy("smartgen"), None, None, None, entry, torch.ones(1), unsent=unsent)  # type: ignore[arg-type]
    pushed: list = []

    def push(req, entries):
        by_layer: dict[int, set[tuple[int, int]]] = {}
        for entry in entries.tolist():  # (layer * 64 + token) * 2 + head
            by_layer.setdefault(entry // 128, set()).add((entry % 128 // 2, entry % 2))
        pushed.append([(layer, sorted(by_layer[layer])) for layer in sorted(by_layer)])
        return 1

    def ids(layer: int, *entries: tuple[int, int]) -> torch.Tensor:
        return torch.tensor([(layer * 64 + token) * 2 + head for token, head in entries])

    engine._push_entries = push  # type: ignore[method-assign]
    engine.note_hints(request, ids(2, (1, 0), (2, 1), (3, 0)))  # an older notice
    engine.note_hints(request, ids(3, (10, 1), (11, 0)))  # the newest
    unsent[3, 11, 0] = False  # a fetch sent head 0 of token 11 in layer 3
    entry_cost = 2 * layout.token_bytes // 2
    request.link_rate = 2 * entry_cost / 0.01  # a 10 ms window moves two entries
    assert engine._take_hinted(request, 0.01, 0) == 1
    assert pushed[-1] == [(2, [(1, 0)]), (3, [(10, 1)])]  # the newest notice's unsent entry, then the older one's
    assert engine._take_hinted(request, 0.01, 10**6) == 0 and len(pushed) == 1  # fetches took the window
    assert engine._take_hinted(request, 0.01, 0) == 1 and pushed[-1] == [(2, [(2, 1), (3, 0)])]
    assert engine._take_hinted(request, 0.01, 0) is None  # nothing hinted is left: the plan's order goes next
    engine.note_hints(request, ids(1, (5, 0), (6, 0), (7, 1)))
    # the first notice (no window yet): what the link moves in one chained slice (the rate's 10 ms: two entries)
    assert engine._take_hinted(request, 0.0, 0) == 1 and pushed[-1] == [(1, [(5, 0), (6, 0)])]
    request.link_rate = 0.0
    assert engine._take_hinted(request, 0.0, 0) == 1 and pushed[-1] == [(1, [(7, 1)])]  # no rate: all of it
    engine.note_hints(request, ids(1, (8, 0), (9, 1), (10, 0)))
    assert engine._take_hinted(request, 0.0, 0) == 1 and pushed[-1] == [(1, [(8, 0), (9, 1), (10, 0)])]
    for _ in range(prefill_module.MAX_HINT_NOTICES + 5):
        engine.note_hints(request, torch.tensor([7]))
    assert len(request.hint_queue) == prefill_module.MAX_HINT_NOTICES  # the oldest are dropped


def test_prefetch_speculates_a_selection_only_for_the_requests_that_prefetch():
    """In a batch, layer l+1's speculated selection is made for the requests that prefetch that layer (remote KV
    left there, met by their last pick), not the whole batch: a selector pass over the others fetches nothing."""
    from concurrent.futures import Future
    from types import SimpleNamespace

    from smartgen.runtime.decode import DecodeBatch, _DecodeHandler

    captured = torch.randn(3, 1, 8)  # [B, T, D]: layer 1's attention input
    wanted: list[int] = [0, 2]
    submitted: list = []
    runner = SimpleNamespace(
        num_layers=4,
        ranges=lambda layer, batch: None,
        selector=SimpleNamespace(lookahead=False),
        engine=SimpleNamespace(prefetchers=lambda ids, layer: list(wanted)),
        capture=SimpleNamespace(get=lambda layer: captured),
        worker=SimpleNamespace(submit=lambda fn, *args: submitted.append(args) or Future()),
        prefetch=lambda *args: None,
        emulation=Emulation(),
    )
    batch = DecodeBatch(["a", "b", "c"], [10, 12, 14], [[{}], [{}], [{}]], torch.tensor([1, 2, 3]))
    _DecodeHandler(runner, batch)._look_ahead(1)  # type: ignore[arg-type]
    ((layer, sub, hidden),) = submitted
    assert layer == 2 and sub.request_ids == ["a", "c"] and sub.prompt_lengths == [10, 14]
    assert sub.positions.tolist() == [10, 14] and sub.last_tokens.tolist() == [1, 3]
    assert torch.equal(hidden, captured[[0, 2], -1])
    assert batch.request_ids == ["a", "b", "c"]  # the step's own batch is left whole
    wanted[:] = [0, 1, 2]
    _DecodeHandler(runner, batch)._look_ahead(1)  # type: ignore[arg-type]
    assert submitted[-1][1] is batch  # everyone prefetches: no copy
    wanted[:] = []
    _DecodeHandler(runner, batch)._look_ahead(1)  # type: ignore[arg-type]
    assert len(submitted) == 2  # nobody does: no pass at all
