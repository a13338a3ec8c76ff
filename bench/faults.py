"""Every fault and bad input of issue #11 against real nodes, each tried N times: outcome, time to detect, to recover.

    .venv/bin/python bench/faults.py [--repeat 3] [--only kill,freeze,http]

Real `smartgen serve` processes of the sample model on 127.0.0.1 (lease 3 s, handshake timeout 1 s): one prefill
node for the faults that fail requests, two with `--on-prefill-failure recompute` for those that recover them, one
with a small `--max-store-bytes` for admission. Detect: from the fault to the first sign the system saw it (an error
event, /health, a prefill node's held KV at zero, a closed socket, a 4xx, a log line); recover: from the fault's end
(a restarted node listening again, SIGCONT, room again) to service, or for a recomputed request from the kill to its
next token.
Times are wall clock on whatever machine runs this: read them as orders of magnitude, not as assertions.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from fault_inputs import HTTP_INPUTS, bad_http, empty_secret, hostile
from fault_nodes import (
    COMMON,
    KV_BYTES,
    SECRET,
    Fault,
    Trial,
    client_disconnect,
    freeze_decode,
    freeze_prefill,
    freeze_prefill_recompute,
    health,
    kill_decode,
    kill_prefill,
    kill_prefill_recompute,
    store_full,
    wait_for,
)

from smartgen.apps.bench.models import SAMPLE_MODEL
from smartgen.apps.cluster import ClusterSpec, LocalCluster


# -- the run ---------------------------------------------------------------------------------------------
def spec(db: Path, prefill_nodes: int = 1, decode: tuple[str, ...] = (), prefill: tuple[str, ...] = ()) -> ClusterSpec:
    return ClusterSpec(
        SAMPLE_MODEL,
        blocks=16,
        prefill_nodes=prefill_nodes,
        max_batch=4,
        max_tokens=1024,
        db=db,
        decode_extra=(*COMMON, *decode),
        prefill_extra=(*COMMON, *prefill),
    )


def groups(db: Path) -> list[tuple[str, ClusterSpec, list[tuple[str, Fault]]]]:
    single: list[tuple[str, Fault]] = [
        ("kill -9 prefill mid-stream, restart", kill_prefill),
        ("SIGSTOP prefill (frozen)", freeze_prefill),
        ("SIGSTOP decode (frozen)", freeze_decode),
        ("kill -9 decode, restart", kill_decode),
        ("client disconnect mid-stream", client_disconnect),
        *((f"HTTP: {name}", bad_http(name)) for name in HTTP_INPUTS),
        *(
            (f"peer: {kind}", hostile(kind))
            for kind in (
                "wrong secret",
                "16 MiB meta before auth",
                "meta a JSON array",
                "silent connection",
                "push without control",
            )
        ),
        ("serve without a secret", empty_secret),
    ]
    recompute: list[tuple[str, Fault]] = [
        ("kill -9 1 of 2 prefill mid-decode (recompute)", kill_prefill_recompute),
        ("SIGSTOP 1 of 2 prefill mid-decode (recompute)", freeze_prefill_recompute),
    ]
    store: list[tuple[str, Fault]] = [("prefill store full", store_full)]
    return [
        ("one prefill node", spec(db), single),
        ("two prefill nodes, recompute", spec(db, 2, ("--on-prefill-failure", "recompute")), recompute),
        ("store cap 1.5 requests", spec(db, prefill=("--max-store-bytes", str(KV_BYTES * 3 // 2))), store),
    ]


def seconds(values: list[float | None]) -> str:
    known = [v for v in values if v is not None]
    if not known:
        return "-"
    middle = statistics.median(known)
    return f"{middle:.2f}" if len(known) == 1 else f"{middle:.2f} ({min(known):.2f}-{max(known):.2f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3, help="tries per fault (default 3)")
    parser.add_argument("--only", default="", help="comma-separated words; run only faults whose name has one")
    args = parser.parse_args()
    if args.repeat < 1:
        parser.error("--repeat must be at least 1")
    words = [w.strip().lower() for w in args.only.split(",") if w.strip()]
    os.environ["SMARTGEN_SECRET"] = SECRET
    rows: list[tuple[str, int, str, str, str]] = []
    started = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp:
        for title, cluster_spec, faults in groups(Path(tmp) / "none.db"):
            chosen = [(n, f) for n, f in faults if not words or any(w in n.lower() for w in words)]
            if not chosen:
                continue
            print(f"# {title}: starting nodes", file=sys.stderr)
            with LocalCluster(cluster_spec) as cluster:
                wait_for(lambda: health(cluster)["ready"])
                for name, fault in chosen:
                    trials = []
                    for attempt in range(args.repeat):
                        try:
                            trials.append(fault(cluster, 100 * len(rows) + attempt))
                        except Exception as exc:  # a fault the system did not survive is a result, not a crash
                            trials.append(Trial(False, f"{type(exc).__name__}: {exc}"[:60]))
                            wait_for(lambda: health(cluster)["ready"], timeout=30)
                    ok = sum(t.ok for t in trials)
                    outcome = next((t.outcome for t in trials if not t.ok), trials[-1].outcome)
                    rows.append(
                        (
                            name,
                            len(trials),
                            f"{ok}/{len(trials)} ok: {outcome}",
                            seconds([t.detect_s for t in trials]),
                            seconds([t.recover_s for t in trials]),
                        )
                    )
                    print(f"  {name}: {ok}/{len(trials)}", file=sys.stderr)
    header = ("fault", "tries", "outcome", "detect s", "recover s")
    widths = [max(len(str(row[i])) for row in [header, *rows]) for i in range(5)]
    for row in [header, tuple("-" * w for w in widths), *rows]:
        print(" | ".join(str(cell).ljust(width) for cell, width in zip(row, widths)).rstrip())
    print(
        f"\n{len(rows)} faults, {sum(r[1] for r in rows)} tries in {time.monotonic() - started:.0f} s; "
        "detect/recover: median (min-max) over the tries"
    )


if __name__ == "__main__":
    main()
