"""The one-command demo: a prefill node and a decode node as separate processes over a paced loopback link.

1. Profiles the model when the store has no profile for it (calibration set under samples/).
2. Picks a link rate at which a full KV transfer of the demo prompts takes `transfer_ratio`
   times their prefill, as on the paper's testbed (4.7x at 25-32 Gbit/s).
3. Starts `smartgen serve --role prefill` and `--role decode` as two processes on 127.0.0.1.
4. Sends the same long-context prompts (passkey, needle retrieval) under each scheme and
   scores the answers.
5. Stops both nodes (SIGINT) and returns the side-by-side results.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["DemoConfig", "SchemeResult", "run_demo"]


@dataclass(slots=True)
class DemoConfig:
    model: Path
    db: Path | None = None
    calibration: Path | None = None
    schemes: tuple[str, ...] = ("full", "smartgen")
    tasks: tuple[str, ...] = ("passkey", "niah_single")
    length: int = 2048
    per_task: int = 3
    selector: str = "quest"
    budget: float = 0.2
    blocks: int = 1024
    transfer_ratio: float = 5.0
    lane: str = "tcp"
    profile_prompts: int = 8
    seed: int = 0
    # monitoring (`demo --monitor`): told the nodes' status URLs once both are up (decode, [prefill]); and
    # called before the nodes stop, so a dashboard can keep watching until its user is done
    on_nodes: Callable[[str, list[str]], None] | None = None
    before_stop: Callable[[], None] | None = None


@dataclass(slots=True)
class SchemeResult:
    scheme: str
    ttft: list[float] = field(default_factory=list)
    ttst: list[float] = field(default_factory=list)
    tbt: list[float] = field(default_factory=list)
    scores: list[float] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)

    def mean(self, name: str) -> float | None:
        values = [v for v in getattr(self, name) if v is not None]
        return statistics.mean(values) if values else None


def _post_json(url: str, body: dict, timeout: float = 600) -> dict:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return json.loads(response.read())


def _wait_ready(ready_file: Path, process: subprocess.Popen, timeout: float, what: str) -> dict:
    """The node's ready file (its bound addresses), or a RuntimeError with the node's last log line."""
    from smartgen.roles.processes import read_ready_file

    try:
        return read_ready_file(ready_file, timeout, alive=lambda: process.poll() is None)
    except (RuntimeError, TimeoutError):
        if process.poll() is None:
            raise RuntimeError(f"the {what} did not come up within {timeout:.0f} s") from None
        last = process.stderr.read().strip().splitlines()[-1:] if process.stderr else []
        raise RuntimeError(f"the {what} exited early: {' '.join(last) or 'no output'}") from None


def ensure_profile(config: DemoConfig, say: Callable[[str], None]):
    """The store's profile for this model, selector and M; profiles the model first when there is none."""
    from transformers import AutoTokenizer

    from smartgen.apps.profiling import LinkSpec, load_calibration, profile
    from smartgen.runtime.fingerprint import model_fingerprint
    from smartgen.runtime.models import load_model
    from smartgen.store import NoProfileError, ProfileStore

    store = ProfileStore(config.db)  # a bad database fails now, before the model loads
    model = load_model(config.model)
    tokenizer = AutoTokenizer.from_pretrained(config.model, local_files_only=True)
    fingerprint = model_fingerprint(model)
    try:
        return store.best(fingerprint, config.selector, config.blocks, config.length).profile, model, tokenizer
    except NoProfileError:
        pass
    from smartgen.sysinfo import SAMPLES_DIR

    calibration = config.calibration or SAMPLES_DIR / "calibration.jsonl"
    say(
        f"no profile for {config.model.name} yet: profiling {config.profile_prompts} calibration prompts ({calibration.name})"
    )
    low, high = max(1, config.length // 2), config.length * 2
    profiles = profile(
        model,
        tokenizer,
        load_calibration(calibration),
        config.selector,
        {"budget": config.budget},
        num_blocks=config.blocks,
        length_ranges=[(low, high)],
        decode_tokens=8,
        link=LinkSpec("rate", 15.0),
        limit=config.profile_prompts,
        model_name=config.model.name,
    )
    if not profiles:
        raise RuntimeError(f"no calibration prompt of {calibration} falls in {low}-{high} tokens")
    store.add(profiles[0])
    return profiles[0], model, tokenizer


def run_demo(config: DemoConfig, say: Callable[[str], None] = print) -> tuple[list[SchemeResult], dict]:
    """Runs the whole demo; returns per-scheme results and a description of the setup."""
    from smartgen.apps.evalsuite import generate_task, score_sample
    from smartgen.lanes.rate import gbps_for, transfer_seconds
    from smartgen.runtime.models import kv_layout

    stored, model, tokenizer = ensure_profile(config, say)
    samples = [
        generate_task(task, config.length, config.seed + i, tokenizer, "eval", depth=(i + 0.5) / config.per_task)
        for task in config.tasks
        for i in range(config.per_task)
    ]
    mean_tokens = statistics.mean(len(tokenizer(s.prompt).input_ids) for s in samples)
    prefill_seconds = stored.prefill_seconds_per_token * mean_tokens
    kv_bytes = kv_layout(model, num_blocks=config.blocks).kv_bytes(int(mean_tokens))
    gbps = gbps_for(kv_bytes, config.transfer_ratio * prefill_seconds)
    setup = {
        "model": config.model.name,
        "prompt_tokens": round(mean_tokens),
        "prefill_s": prefill_seconds,
        "kv_mib": kv_bytes / 2**20,
        "link_gbps": gbps,
        "transfer_s": transfer_seconds(kv_bytes, gbps),
        "selector": f"{config.selector} {config.budget:g}",
        "profile": stored.id,
    }
    say(
        f"link paced at {gbps * 1000:.1f} Mbit/s: a full transfer of {setup['kv_mib']:.1f} MiB takes "
        f"{setup['transfer_s']:.2f} s vs {prefill_seconds:.2f} s of prefill ({config.transfer_ratio:g}x)"
    )
    del model
    run_dir = Path(tempfile.mkdtemp(prefix="smartgen-demo-"))
    common = [
        "--model",
        str(config.model),
        "--blocks",
        str(config.blocks),
        "--link-gbps",
        f"{gbps:.6f}",
        "--selector",
        config.selector,
        "--budget",
        str(config.budget),
        "--lane",
        config.lane,
    ]
    env = {**os.environ, "SMARTGEN_SECRET": os.environ.get("SMARTGEN_SECRET", "smartgen-demo")}
    if config.db is not None:
        env["SMARTGEN_DB"] = str(config.db)
    from smartgen.roles.processes import stop_processes

    launch = [sys.executable, "-m", "smartgen", "serve"]
    processes = []
    try:
        prefill = subprocess.Popen(
            [
                *launch,
                "--role",
                "prefill",
                "--listen",
                "127.0.0.1:0",
                "--status",
                "127.0.0.1:0",
                "--ready-file",
                str(run_dir / "prefill.json"),
                *common,
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        processes.append(prefill)
        prefill_ready = _wait_ready(run_dir / "prefill.json", prefill, 120, "prefill node")
        prefill_address = prefill_ready["listen"]
        decode = subprocess.Popen(
            [
                *launch,
                "--role",
                "decode",
                "--prefill",
                prefill_address,
                "--http",
                "127.0.0.1:0",
                "--ready-file",
                str(run_dir / "decode.json"),
                "--max-tokens",
                str(config.length * 2 + 64),
                *common,
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        processes.append(decode)
        http_address = _wait_ready(run_dir / "decode.json", decode, 120, "decode node")["http"]
        say(f"prefill node on {prefill_address}, decode node on http://{http_address}/v1")
        if config.on_nodes is not None:
            config.on_nodes(f"http://{http_address}", [f"http://{prefill_ready['status']}"])
        results = []
        for scheme in config.schemes:
            result = SchemeResult(scheme)
            for sample in samples:
                body = {
                    "prompt": sample.prompt,
                    "max_tokens": sample.max_new_tokens,
                    "temperature": 0,
                    "scheme": scheme,
                }
                try:
                    answer = _post_json(f"http://{http_address}/v1/completions", body)
                except OSError as exc:
                    result.errors.append(str(exc))
                    continue
                usage = answer["usage"]
                result.ttft.append(usage["ttft"])
                result.ttst.append(usage["ttst"])
                result.tbt.append(usage["tbt"])
                result.scores.append(score_sample(sample, answer["choices"][0]["text"]))
            say(f"{scheme}: {len(result.scores)} requests done")
            results.append(result)
        if config.before_stop is not None:
            config.before_stop()
        return results, setup
    finally:
        stop_processes(processes)
        shutil.rmtree(run_dir, ignore_errors=True)
