"""A prefill node and a decode node in one process, joined by an in-process (optionally paced) link.

The real engines and runners on both sides; only the transport is in-process and the
selector metadata is handed over directly. Used by tests, `smartgen eval` and benchmarks;
`smartgen serve` puts the same pieces in two processes.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from transformers import PreTrainedModel

from smartgen.engine.decode import DecodeEngine, RequestFailed
from smartgen.engine.layout import DEFAULT_NUM_BLOCKS
from smartgen.engine.metrics import RequestMetrics
from smartgen.engine.planning import Planner
from smartgen.engine.policy import Policy, check_quantizable
from smartgen.engine.prefill import PrefillEngine
from smartgen.engine.prefix_cache import DEFAULT_BLOCK_TOKENS, PrefixCache
from smartgen.lanes.link import inproc_link
from smartgen.lanes.rate import transfer_seconds
from smartgen.runtime.decode import DecodeBatch, DecodeRunner
from smartgen.runtime.driver import DecodeDriver, DriverRequest, Finished
from smartgen.runtime.models import check_runnable, kv_layout, model_info
from smartgen.runtime.prefill import PrefillRunner
from smartgen.runtime.prefill_worker import KVTransform, PrefillWorker
from smartgen.runtime.sampling import Sampler
from smartgen.selectors import make_selector

__all__ = ["GenerationResult", "InprocPipeline", "KVTransform"]


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
        prefill_cache_bytes: int = 0,
        decode_cache_bytes: int = 0,
        prefix_block_tokens: int = DEFAULT_BLOCK_TOKENS,
    ) -> None:
        """`kv_transform(layer, k, v)` -> (k, v), [n, H, d] each, rewrites every layer's K/V at the
        prefill hand-off before it is stored and sent (the quantized-KV scheme). `prefill_cache_bytes` /
        `decode_cache_bytes`: the two sides' prefix caches (0: off)."""
        check_runnable(model)  # before anything reads the config: a clear refusal, not an AttributeError
        self.model = model
        self.kv_transform = kv_transform
        self.policy = policy
        info = model_info(model)
        self.selector = make_selector(selector, info, **(selector_params or {}))
        self.layout = kv_layout(model, num_blocks=num_blocks)
        check_quantizable(policy, self.layout.head_dim)
        if gbps and not transfer_seconds_per_token:  # the link's own rate, unless measured timings were given
            transfer_seconds_per_token = transfer_seconds(self.layout.kv_bytes(1), gbps)
        _check_timings(policy, importance, prefill_seconds_per_token, transfer_seconds_per_token)
        self.planner = Planner(
            info.num_layers, num_blocks, importance, prefill_seconds_per_token, transfer_seconds_per_token
        )
        self.prefill_engine = PrefillEngine(
            self.layout, self.planner, prefix_cache=PrefixCache(prefill_cache_bytes, prefix_block_tokens)
        )
        # On CUDA the pool lives on the GPU, so split/reorder and gathers run as Triton kernels.
        self.decode_engine = DecodeEngine(
            self.layout,
            num_slots=max_batch,
            max_tokens=max_tokens,
            device=str(model.device),
            prefix_cache=PrefixCache(decode_cache_bytes, prefix_block_tokens),
            quantized=bool(policy.quantize_bits),  # this pipeline's one scheme: a staging region only for quant2
        )
        prefill_end, decode_end = inproc_link(gbps)
        self._prefill_link = prefill_end
        self.prefill_engine.attach(prefill_end, self.decode_engine.pool.geometry)
        self.decode_engine.attach(decode_end)
        self.sampler = sampler or Sampler()
        self.prefill_runner = PrefillRunner(model, self.selector, self.sampler)
        self.decode_runner = DecodeRunner(model, self.selector, self.decode_engine, self.sampler)

    def close(self) -> None:
        self.decode_runner.close()
        self.decode_engine.close()
        self.prefill_engine.close()

    def __enter__(self) -> InprocPipeline:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @contextmanager
    def _running(self) -> Iterator[tuple[DecodeDriver, list[BaseException]]]:
        """A decode driver over this pipeline's engines, with the prefill side running beside it."""
        driver = DecodeDriver(self.decode_runner, prefill_timeout=600)
        prefill = PrefillWorker(
            self.prefill_engine, self.prefill_runner, kv_transform=self.kv_transform, log_failures=False
        )
        stop = threading.Event()
        worker = threading.Thread(target=prefill.run, args=(stop, 0.02), name="prefill", daemon=True)
        worker.start()
        try:
            yield driver, prefill.errors
        except BaseException:
            driver.cancel_all("generation failed")
            raise
        finally:
            stop.set()
            worker.join(timeout=10)

    def _requests(
        self, prompts: list[list[int] | torch.Tensor], max_new_tokens: int, eos_token_id: int | None, keep_logits: bool
    ) -> list[DriverRequest]:
        if max_new_tokens < 1:
            raise ValueError("max_new_tokens must be >= 1")
        stop = (lambda token: token == eos_token_id) if eos_token_id is not None else (lambda token: False)
        return [
            DriverRequest(
                uuid.uuid4().hex,
                torch.as_tensor(p, dtype=torch.int64).flatten(),
                self.policy,
                max_new_tokens,
                self.sampler,
                stop=stop,
                keep_logits=keep_logits,
            )
            for p in prompts
        ]

    @staticmethod
    def _raise_failure(events: list, errors: list[BaseException]) -> None:
        failed = [e for e in events if isinstance(e, Finished) and e.failed]
        if failed:
            if errors:
                raise errors[0]
            raise RequestFailed(failed[0].error or "request failed")

    def generate(
        self,
        prompts: list[list[int] | torch.Tensor],
        max_new_tokens: int,
        eos_token_id: int | None = None,
        keep_logits: bool = False,
        on_token: Callable[[int], None] | None = None,
    ) -> list[GenerationResult]:
        """Generates up to `max_new_tokens` tokens for every prompt, decoding them as one batch (the decode driver)."""
        requests = self._requests(prompts, max_new_tokens, eos_token_id, keep_logits)
        finished: dict[str, Finished] = {}
        with self._running() as (driver, errors):
            for request in requests:
                self._raise_failure(driver.add(request), errors)
            # every request joins before the first step, so the batch (and its float rounding) never
            # depends on thread timing: evaluation and profiling get the same numbers every run
            while driver.prefilling:
                events = driver.collect_first_tokens()
                self._raise_failure(events, errors)
                finished.update({e.request_id: e for e in events if isinstance(e, Finished)})
                time.sleep(0.0002)  # do not spin a core the prefill side needs
            step = 0
            while driver.num_active:
                events = driver.step()
                self._raise_failure(events, errors)
                finished.update({e.request_id: e for e in events if isinstance(e, Finished)})
                step += 1
                if on_token:
                    on_token(step)
        return [
            GenerationResult(r.request_id, finished[r.request_id].tokens, finished[r.request_id].metrics, r.logits)
            for r in requests
        ]

    def prepare(self, prompts: list[list[int] | torch.Tensor], max_new_tokens: int) -> tuple[DecodeBatch, list[int]]:
        """Opens and prefills the requests and returns their decode batch and first tokens (for micro-benchmarks
        that time `decode_runner.step` alone); `release` frees them."""
        requests = self._requests(prompts, max_new_tokens + 1, None, False)
        with self._running() as (driver, errors):
            for request in requests:
                self._raise_failure(driver.add(request), errors)
            while driver.prefilling:
                self._raise_failure(driver.collect_first_tokens(), errors)
                time.sleep(0.0002)
        return driver.batch, [r.tokens[0] for r in requests]

    def release(self, request_ids: list[str]) -> None:
        """Frees requests `prepare` opened, on both sides."""
        for rid in request_ids:
            if self.decode_engine.has_request(rid):
                self.decode_engine.finish(rid)


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
