"""Which prefill node a request goes to (roles/placement.py), as pure functions: least queued prompt tokens, prefix
affinity where one node likely holds the prompt's prefix, and the decode node's peers choosing with both."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from smartgen.engine.decode.control import LinkLoad
from smartgen.engine.prefix_cache import block_hashes
from smartgen.roles.peers import PrefillPeers
from smartgen.roles.placement import PrefillLoad, PrefixAffinity, choose_prefill


def test_the_least_queued_prompt_tokens_win_not_the_fewest_requests():
    # node 0 has one long prompt queued, node 1 three short ones: node 1 has less work ahead
    loads = [PrefillLoad(queued_tokens=8000, requests=1), PrefillLoad(queued_tokens=300, requests=3)]
    assert choose_prefill(loads, prompt_tokens=500) == 1


def test_ties_go_to_fewer_requests_then_to_the_first_listed():
    assert choose_prefill([PrefillLoad(0, 2), PrefillLoad(0, 1)], 100) == 1
    assert choose_prefill([PrefillLoad(0, 1), PrefillLoad(0, 1)], 100) == 0


def test_a_cached_prefix_wins_while_it_saves_more_than_the_extra_queue():
    idle = PrefillLoad(queued_tokens=0, requests=0)
    # node 1 prefilled this prompt's 4096-token prefix lately; its queue of 1000 tokens costs less than redoing it
    assert choose_prefill([idle, PrefillLoad(1000, 2, cached_tokens=4096)], prompt_tokens=5000) == 1
    # ... but not once its queue is longer than what the prefix saves
    assert choose_prefill([idle, PrefillLoad(6000, 2, cached_tokens=4096)], prompt_tokens=5000) == 0


def test_no_node_to_choose_from_is_an_error():
    with pytest.raises(ValueError):
        choose_prefill([], 10)


@given(
    st.lists(st.tuples(st.integers(0, 10**6), st.integers(0, 64), st.integers(0, 10**5)), min_size=1, max_size=8),
    st.integers(1, 10**5),
)
def test_the_choice_has_the_least_cost_of_all(nodes, prompt_tokens):
    loads = [PrefillLoad(q, r, c) for q, r, c in nodes]
    chosen = choose_prefill(loads, prompt_tokens)
    assert all(loads[chosen].cost(prompt_tokens) <= load.cost(prompt_tokens) for load in loads)


def _keys(tokens: list[int]) -> list[bytes]:
    return block_hashes(tokens, 4)


def test_affinity_counts_the_leading_blocks_a_node_was_sent():
    affinity = PrefixAffinity(block_tokens=4)
    system = list(range(100, 112))  # 3 blocks
    affinity.sent(_keys(system + [1, 2, 3, 4]), "A")
    affinity.sent(_keys(system + [9, 9, 9, 9, 9, 9, 9, 9]), "B")
    prompt = system + [1, 2, 3, 4, 5, 6, 7, 8]
    assert affinity.cached_tokens(_keys(prompt), "A") == 16  # the shared 3 blocks and its own 4th
    assert affinity.cached_tokens(_keys(prompt), "B") == 12  # the shared blocks only
    assert affinity.cached_tokens(_keys(prompt), "C") == 0
    assert affinity.cached_tokens(_keys([7] * 16), "A") == 0  # another prefix altogether


def test_affinity_forgets_a_lost_node_and_keeps_only_the_most_recent_blocks():
    affinity = PrefixAffinity(block_tokens=4, max_blocks=3)
    affinity.sent(_keys(list(range(12))), "A")
    affinity.sent(_keys(list(range(12))), "B")
    affinity.forget("A")
    assert affinity.cached_tokens(_keys(list(range(12))), "A") == 0
    assert affinity.cached_tokens(_keys(list(range(12))), "B") == 12
    affinity.sent(_keys([50] * 8), "B")  # 2 more blocks: the two least recent go
    assert len(affinity) == 3
    assert affinity.cached_tokens(_keys(list(range(12))), "B") == 0  # its first block went, so its prefix did


class _Engine:
    """What PrefillPeers needs of a decode engine: the hooks it sets, and links to attach."""

    on_link_lost = None
    choose_link = None

    def attach(self, link) -> None:
        pass


class _Link:
    alive = True


def _peers(affinity: PrefixAffinity | None) -> tuple[PrefillPeers, list[Any], Any]:
    engine: Any = _Engine()
    links: list[Any] = [_Link(), _Link()]
    made = iter(links)
    peers = PrefillPeers(engine, [("a", 1), ("b", 2)], lambda host, port: next(made), affinity=affinity)
    peers.connect_all()
    return peers, links, engine


def test_the_peers_send_a_conversations_next_turn_where_its_prefix_went():
    peers, links, engine = _peers(PrefixAffinity(block_tokens=4))
    assert engine.choose_link == peers._choose
    turn1 = torch.arange(40)
    first = peers._choose([LinkLoad(links[0], 0, 0), LinkLoad(links[1], 0, 0)], turn1)
    assert first is links[0]
    # its next turn: the first node now has a bit more queued, but it holds the 40-token prefix
    turn2 = torch.cat([turn1, torch.arange(200, 220)])
    loads = [LinkLoad(links[0], 20, 1), LinkLoad(links[1], 0, 0)]
    assert peers._choose(loads, turn2) is links[0]
    # another conversation goes to the idle node
    assert peers._choose(loads, torch.arange(500, 540)) is links[1]
    sent = {p["address"]: (p["sent"], p["affine"]) for p in peers.snapshot()}
    assert sent == {"a:1": (2, 1), "b:2": (1, 0)}
    # node a lost: what it held is forgotten, and a turn of its conversation goes by load alone
    peers._on_lost(links[0], "test")
    peers.stop()
    assert peers.affinity is not None and peers.affinity.cached_tokens(block_hashes(turn2, 4), ("a", 1)) == 0


def test_without_affinity_the_peers_choose_by_queued_tokens():
    peers, links, _ = _peers(None)
    loads = [LinkLoad(links[0], 900, 1), LinkLoad(links[1], 100, 4)]
    assert peers._choose(loads, torch.arange(64)) is links[1]
    assert peers._choose(loads, None) is links[1]
    peers.stop()
