"""Hints: each decode step ranks a wider selection, and the remote tokens it adds are pushed next; answers unchanged."""

import pytest
import torch
from tiny_models import tiny_config

from smartgen.engine.layout import KVLayout
from smartgen.engine.messages import Idle, MessageError
from smartgen.engine.planning import Planner
from smartgen.engine.policy import Policy, ProactiveMode, get_policy
from smartgen.engine.pool import PrefillStore
from smartgen.engine.prefill import OpenedRequest, PrefillEngine
from smartgen.lanes.base import Message
from smartgen.runtime.models import model_from_config
from smartgen.runtime.pipeline import InprocPipeline
from smartgen.selectors.base import ModelInfo
from smartgen.selectors.quest import QuestSelector
from smartgen.selectors.streaming import StreamingSelector

LENGTH = 256


def _run(scheme: str, record: list | None = None) -> tuple[list[int], dict[str, int]]:
    model = model_from_config(tiny_config("llama"))
    policy = get_policy(scheme, "sequential", 0.05)
    prompt = torch.randint(3, 97, (LENGTH,), generator=torch.Generator().manual_seed(5))
    with InprocPipeline(model, policy, "quest", {"budget": 0.25}, gbps=0.02, prefill_seconds_per_token=1e-5) as p:
        if record is not None:
            engine = p.prefill_engine
            push_hinted = engine.push_hinted

            def recorded(request, hints):
                record.append((request.length, hints.clone()))
                return push_hinted(request, hints)

            engine.push_hinted = recorded  # type: ignore[method-assign]
        (result,) = p.generate([prompt], 16)
        return result.tokens, p.prefill_engine.counters.snapshot()["bytes"]


def test_hints_are_pushed_and_change_no_token():
    hinted: list = []
    tokens, moved = _run("smartgen+hints", hinted)
    plain, _ = _run("smartgen")
    assert tokens == plain  # hints move bytes earlier; what a step attends to is the selector's alone
    assert hinted, "the wider selection should name remote tokens on a slow link"
    num_layers = tiny_config("llama").num_hidden_layers
    for length, hints in hinted:
        layer = hints // length
        assert bool((layer >= 2).all()) and bool((layer < num_layers).all())  # sparse layers only
    assert moved["speculative"] > 0


def test_policy_hints_need_speculation():
    with pytest.raises(ValueError, match="hints"):
        Policy("x", proactive=ProactiveMode.BUDGET, speculative=False, hints=0.5)
    with pytest.raises(ValueError, match="hints"):
        Policy("x", hints=-1.0)
    assert get_policy("smartgen+hints").hints > 0 and get_policy("smartgen").hints == 0


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
    request = OpenedRequest("r", 0, 64, get_policy("smartgen+hints"), None, None, None, entry, torch.ones(1))  # type: ignore[arg-type]
    with pytest.raises(MessageError, match="outside"):
        engine.push_hinted(request, torch.tensor([4 * 64]))
