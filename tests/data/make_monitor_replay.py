"""Writes tests/data/monitor_replay.jsonl: a real run of two in-process nodes (tiny model, slow link), recorded.

Run from the repository root: `.venv/bin/python tests/data/make_monitor_replay.py`. The pilot and snapshot
tests of the dashboard replay it; regenerate it only on purpose (the snapshots follow it).
"""

import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tiny_models import IdTokenizer, tiny_config  # noqa: E402

from smartgen.engine.policy import get_policy  # noqa: E402
from smartgen.roles.decode_node import DecodeNode  # noqa: E402
from smartgen.roles.planner import NodePlanner  # noqa: E402
from smartgen.roles.prefill_node import PrefillNode  # noqa: E402
from smartgen.roles.recorder import frame, write_frame  # noqa: E402
from smartgen.roles.service import GenerationParams  # noqa: E402
from smartgen.runtime.models import kv_layout, model_from_config, model_info  # noqa: E402
from smartgen.selectors import make_selector  # noqa: E402

OUT = Path(__file__).with_name("monitor_replay.jsonl")
GBPS = 0.0008  # slow enough that speculation takes a few seconds on the tiny model


def main() -> None:
    torch.manual_seed(0)
    model = model_from_config(tiny_config("llama"))
    layout = kv_layout(model, num_blocks=64)
    info = model_info(model)
    prefill = PrefillNode(
        model,
        make_selector("quest", info, budget=0.2, page_size=4),
        layout,
        NodePlanner(layout, None, "streaming", link_gbps=GBPS),
        port=0,
        secret="s",
        link_gbps=GBPS,
        model_name="tiny-llama",
    )
    prefill.start()
    decode = DecodeNode(
        model,
        IdTokenizer(),
        make_selector("quest", info, budget=0.2, page_size=4),
        layout,
        get_policy("smartgen"),
        [prefill.address],
        secret="s",
        max_batch=4,
        max_tokens=1024,
        model_name="tiny-llama",
    )
    decode.start()
    prompts = [torch.randint(3, 90, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (400, 300)]

    def run(prompt: list[int], delay: float) -> None:
        time.sleep(delay)
        handle = decode.scheduler.submit(prompt, GenerationParams(max_tokens=160, ignore_eos=True))
        list(handle.events(timeout=120))

    threads = [threading.Thread(target=run, args=(p, d)) for p, d in zip(prompts, (0.0, 1.5))]
    for t in threads:
        t.start()
    with OUT.open("w") as file:
        start = time.time()
        while any(t.is_alive() for t in threads) or time.time() - start < 3:
            write_frame(file, frame(decode.scheduler.status(), [prefill.snapshot()]))
            time.sleep(0.25)
        time.sleep(1.1)
        write_frame(file, frame(decode.scheduler.status(), [prefill.snapshot()]))
    decode.stop()
    prefill.stop()
    print(f"wrote {OUT} ({sum(1 for _ in OUT.open())} frames)")


if __name__ == "__main__":
    main()
