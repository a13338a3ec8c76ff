"""KV selectors behind one interface, looked up by name: dense, topk, quest, infinigen, hata, streaming."""

from __future__ import annotations

import importlib

from smartgen.selectors.base import ModelInfo, PrefillLayer, Selector, StepQuery, budget_tokens

__all__ = [
    "ModelInfo",
    "PrefillLayer",
    "Selector",
    "StepQuery",
    "budget_tokens",
    "SELECTORS",
    "make_selector",
    "selector_class",
    "selector_kind",
]

SELECTORS = {
    "dense": "smartgen.selectors.dense:DenseSelector",
    "topk": "smartgen.selectors.topk:ExactTopKSelector",
    "quest": "smartgen.selectors.quest:QuestSelector",
    "infinigen": "smartgen.selectors.infinigen:InfiniGenSelector",
    "hata": "smartgen.selectors.hata:HATASelector",
    "streaming": "smartgen.selectors.streaming:StreamingSelector",
}


def selector_class(name: str) -> type[Selector]:
    """The Selector class registered under `name` (imported on first use)."""
    try:
        module_name, class_name = SELECTORS[name].split(":")
    except KeyError:
        raise ValueError(f"unknown selector {name!r}; choose one of {', '.join(SELECTORS)}") from None
    return getattr(importlib.import_module(module_name), class_name)


def selector_kind(selector: str | Selector) -> type[Selector]:
    """A selector's class, from its name or an instance: what the contract says it needs (`needs_training`,
    `needs_warmup`, `learned_param`, `sparse`), for code outside this package that must not test names."""
    return selector_class(selector) if isinstance(selector, str) else type(selector)


def make_selector(name: str, info: ModelInfo, **params: object) -> Selector:
    """Builds a selector by name; `params` are its own (budget, page size, alpha, ...)."""
    return selector_class(name)(info, **params)
