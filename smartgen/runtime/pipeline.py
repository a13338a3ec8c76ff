"""A prefill node and a decode node in one process, joined by an in-process (optionally paced) link.

The real engines and runners on both sides; only the transport is in-process and the
selector metadata is handed over directly. Used by tests, `smartgen eval` and benchmarks;
`smartgen serve` puts the same pieces in two processes.
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from transformers import PreTrainedModel

from smartgen.engine.decode import DecodeEngine
from smartgen.engine.layout import DEFAULT_NUM_BLOCKS
from smartgen.engine.metrics import RequestMetrics
from smartgen.engine.planning import Planner
from smartgen.engine.policy import Policy
from smartgen.engine.prefill import PrefillEngine
from smartgen.lanes.link import inproc_link
from smartgen.lanes.rate import transfer_seconds
from smartgen.runtime.decode import DecodeBatch, DecodeRunner
from smartgen.runtime.models import check_runnable, kv_layout, model_info
from smartgen.runtime.prefill import PrefillRunner
from smartgen.runtime.sampling import Sampler
from smartgen.selectors import make_selector

__all__ = ["GenerationResult", "InprocPipeline", "KVTransform"]

# kv_transform(layer, k [n, H, d], v [n, H, d]) -> (k, v): applied at the prefill hand-off
KVTransform = Callable[[int, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


@dataclass(slots=True)
class GenerationResult:
    request_id: str
    tokens: list[int]  # generated tokens, the first from prefill
    metrics: RequestMetrics
    logits: list[torch.Tensor] = field(default_factory=list)  # [V] per generated token, when kept


class InprocPipeline:
    """Generates with disaggregated prefill and decode in one process."""

    def __init__(
        self,
        model: PreTrainedModel,
        policy: Policy,
        selector: str = "dense",
        selector_params: dict | None = None,
        *,
        importance: torch.Tensor | None = None,
        prefill_seconds_per_token: float = 0.0,
        transfer_seconds_per_token: float = 0.0,
        gbps: float | None = None,
        num_blocks: int = DEFAULT_NUM_BLOCKS,
        max_batch: int = 8,
        max_tokens: int = 8192,
        sampler: Sampler | None = None,
        kv_transform: KVTransform | None = None,
    ) -> None:
        """`kv_transform(layer, k, v)` -> (k, v), [n, H, d] each, rewrites every layer's K/V at the
        prefill hand-off before it is stored and sent (the quantized-KV scheme)."""
        check_runnable(model)  # before anything reads the config: a clear refusal, not an AttributeError
        self.model = model
        self.kv_transform = kv_transform
        self.policy = policy
        info = model_info(model)
        self.selector = make_selector(selector, info, **(selector_params or {}))
        self.layout = kv_layout(model, num_blocks=num_blocks)
        if gbps and not transfer_seconds_per_token:  # the link's own rate, unless measured timings were given
            transfer_seconds_per_token = transfer_seconds(self.layout.kv_bytes(1), gbps)
        _check_timings(policy, importance, prefill_seconds_per_token, transfer_seconds_per_token)
        self.planner = Planner(
            info.num_layers, num_blocks, importance, prefill_seconds_per_token, transfer_seconds_per_token
        )
        self.prefill_engine = PrefillEngine(self.layout, self.planner)
        # On CUDA the pool lives on the GPU, so split/reorder and gathers run as Triton kernels.
        self.decode_engine = DecodeEngine(
            self.layout, num_slots=max_batch, max_tokens=max_tokens, device=str(model.device)
        )
        prefill_end, decode_end = inproc_link(gbps)
        self._prefill_link = prefill_end
        self.prefill_engine.attach(prefill_end, self.decode_engine.pool.geometry)
        self.decode_engine.attach(decode_end)
        self.prefill_runner = PrefillRunner(model, self.selector, sampler or Sampler())
        self.decode_runner = DecodeRunner(model, self.selector, self.decode_engine, sampler or Sampler())

    def close(self) -> None:
        self.decode_runner.close()
        self.decode_engine.close()
        self.prefill_engine.close()

    def __enter__(self) -> InprocPipeline:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _prefill_worker(
        self, prompts: dict[str, torch.Tensor], errors: list[BaseException], stop: threading.Event
    ) -> None:
        served = 0
        while served < len(prompts) and not stop.is_set():
            request = self.prefill_engine.next_request(timeout=0.05)
            if request is None:
                continue
            served += 1
            rid = request.request_id
            try:
                output = self.prefill_runner.run(prompts[rid], on_layer=functools.partial(self._hand_off, rid))
                self.prefill_engine.finish_prefill(rid, output.first_token)
            except BaseException as exc:  # reported to the caller, never swallowed
                errors.append(exc)
                return

    def _hand_off(self, request_id: str, layer: int, k: torch.Tensor, v: torch.Tensor, metadata: dict) -> int:
        """One prefilled layer: its K/V to the engine (pushed per plan), its selector metadata to the decode side."""
        if self.kv_transform is not None:
            k, v = self.kv_transform(layer, k, v)
        pushed = self.prefill_engine.prefill_layer(request_id, layer, k, v)
        self.prefill_engine.send_metadata(request_id, layer, metadata)
        return pushed

    def prepare(self, prompts: list[list[int] | torch.Tensor], max_new_tokens: int) -> tuple[DecodeBatch, list[int]]:
        """Opens the requests, prefills them on the prefill side and returns the decode batch and first tokens."""
        if max_new_tokens < 1:
            raise ValueError("max_new_tokens must be >= 1")
        ids = [torch.as_tensor(p, dtype=torch.int64).flatten() for p in prompts]
        lengths = [int(p.numel()) for p in ids]
        request_ids = [self.decode_engine.open(n, self.policy, max_new_tokens=max_new_tokens) for n in lengths]
        errors: list[BaseException] = []
        stop = threading.Event()
        worker = threading.Thread(
            target=self._prefill_worker, args=(dict(zip(request_ids, ids)), errors, stop), daemon=True
        )
        worker.start()
        try:
            first = []
            for rid in request_ids:
                try:
                    first.append(self.decode_engine.wait_first_token(rid, timeout=600))
                except Exception as exc:
                    stop.set()
                    worker.join(timeout=5)
                    if errors:
                        raise errors[0] from exc
                    raise
            if self.policy.wait_for_all:
                for rid in request_ids:
                    self.decode_engine.wait_all_local(rid, timeout=600)
        except BaseException:
            for rid in request_ids:
                self.decode_engine.abort(rid, "prefill failed")
            raise
        finally:
            stop.set()
            worker.join(timeout=10)
        metadata = [self.decode_engine.request_metadata(rid) for rid in request_ids]
        batch = DecodeBatch(request_ids, lengths, metadata, torch.tensor(first))
        return batch, first

    def release(self, request_ids: list[str]) -> None:
        """Frees finished requests on both sides."""
        for rid in request_ids:
            if rid in self.decode_engine._requests:
                self.decode_engine.finish(rid)

    def generate(
        self,
        prompts: list[list[int] | torch.Tensor],
        max_new_tokens: int,
        eos_token_id: int | None = None,
        keep_logits: bool = False,
        on_token: Callable[[int], None] | None = None,
    ) -> list[GenerationResult]:
        """Generates up to `max_new_tokens` tokens for every prompt, decoding them as one batch."""
        batch, first = self.prepare(prompts, max_new_tokens)
        request_ids = list(batch.request_ids)
        results = {
            rid: GenerationResult(rid, [tok], self.decode_engine.metrics(rid)) for rid, tok in zip(request_ids, first)
        }
        try:
            if eos_token_id is not None:
                batch.drop([b for b, tok in enumerate(first) if tok != eos_token_id])
            for step in range(1, max_new_tokens):
                if not batch.request_ids:
                    break
                tokens, logits = self.decode_runner.step(batch)
                self.decode_engine.end_step(batch.request_ids)
                keep = []
                for b, rid in enumerate(batch.request_ids):
                    results[rid].tokens.append(int(tokens[b]))
                    if keep_logits:
                        results[rid].logits.append(logits[b])
                    if eos_token_id is None or int(tokens[b]) != eos_token_id:
                        keep.append(b)
                batch.advance(tokens)
                if len(keep) < len(batch.request_ids):
                    batch.drop(keep)
                if on_token:
                    on_token(step)
        except BaseException:
            for rid in request_ids:
                self.decode_engine.abort(rid, "generation failed")
            raise
        self.release(request_ids)
        return [results[rid] for rid in request_ids]


def _check_timings(
    policy: Policy, importance: torch.Tensor | None, prefill_seconds_per_token: float, transfer_seconds_per_token: float
) -> None:
    """Refuses a policy whose proactive budget K_r cannot be known from what was given."""
    if policy.proactive != "budget":
        return
    if policy.strategy == "profile" and importance is None:
        raise ValueError(
            f"scheme {policy.name!r} plans with a profile: pass importance= (a stored profile's), "
            "or choose another proactive-set strategy (get_policy(name, strategy='streaming'))"
        )
    if transfer_seconds_per_token > 0 and prefill_seconds_per_token <= 0:
        raise ValueError(
            f"scheme {policy.name!r} sizes its proactive set from prefill and transfer time: with a paced link, "
            "pass prefill_seconds_per_token= too (a profile's, or measured)"
        )


def wait_until(condition: Callable[[], bool], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.001)
    return True
