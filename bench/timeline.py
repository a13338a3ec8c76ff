"""Prints each request's timeline on the decode node from a `smartgen bench` run: what every joiner waited for.

    python bench/timeline.py runs/bench-.../results.json [--scheme smartgen] [--all-rounds]

Per measured round of each scheme, one line per request in the order they were sent: when it was sent (client's
clock, from the round's start), then on the node's clock from its arrival there: its first token, its layers 0-1
local, its forecast asked and landed and the entries it asked for, its join into the running batch, its first decoded
token (the one its own first step computed), its whole cache local; the link wait of its first step, of the rest,
and the worst one; and how many of its steps were taken back and redone. Under it, where a round's TBT went: the mean
gap between tokens (from the third on, as TBT counts) and their link wait while another request's forecast picks
crossed (a joiner's), while some request of the round still awaited its first token (the burst's prefills) and
after, and apart each request's wait for the first token its decode node's own step computed after the prefill
node's (ms); and the decode node's CPU seconds over the round by thread role (what shared its CPU with the decode
step), then each node's CPU by thread role during the burst's prefills and after, in ms a second (`cpu_timeline`).
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

MILESTONES = ("dense_local", "forecast_asked", "forecast_landed", "joined", "fully_local")


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1000:.0f}"


def _count(value: int | None) -> str:
    return "-" if value is None else str(value)


def request_line(request: dict[str, Any]) -> list[str]:
    """One request's cells: sent, ttft, each milestone, first decoded token, waits (ms)."""
    if request.get("error"):
        return [_ms(request.get("sent")), f"failed: {request['error']}"]
    ctl = request.get("node_ctl") or []
    first = int(request.get("prefill_tokens") or 1)  # the first token its own decode step computed
    milestones = request.get("milestones") or {}
    waits = (request.get("token_waits") or [])[first:]
    return [
        _ms(request.get("sent")),
        _ms(ctl[0] if ctl else None),
        *(_ms(milestones.get(name)) for name in MILESTONES[:3]),
        _count(request.get("forecast_entries")),
        *(_ms(milestones.get(name)) for name in MILESTONES[3:]),
        _ms(ctl[first] if len(ctl) > first else None),
        str(first),
        _ms(waits[0] if waits else None),
        _ms(sum(waits[1:]) if len(waits) > 1 else None),
        _ms(max(waits[1:]) if len(waits) > 1 else None),
        _count(request.get("deferred_steps")),
    ]


# "fc ent": the (token, head) entries its forecast asked for (- in a run from before they were kept); "from": the token
# index its own first step computed; "wait rest" and "max": its later steps' link waits; "deferred": its steps taken
# back and redone (a fetch past --fetch-stall-ms parked it, or its fetches held the batch past its share, --step-share)
HEADER = [
    "sent",
    "ttft",
    "dense",
    "fc ask",
    "fc land",
    "fc ent",
    "joined",
    "all local",
    "first dec",
    "from",
    "wait1",
    "wait rest",
    "max",
    "deferred",
]


def forecast_windows(requests: list[dict[str, Any]]) -> list[tuple[int, float, float]]:
    """(request's position, asked, landed) of every forecast that crossed while others ran, on the round's clock."""
    windows = []
    for i, r in enumerate(requests):
        marks = r.get("milestones") or {}
        if "forecast_asked" in marks and "forecast_landed" in marks:
            sent = r.get("sent") or 0.0
            windows.append((i, sent + marks["forecast_asked"], sent + marks["forecast_landed"]))
    return windows


def phases(requests: list[dict[str, Any]]) -> str:
    """Where the round's TBT went: the gaps between decoded tokens (from the third token on, as TBT counts) split by
    phase, while another request's forecast picks crossed (a joiner's: they take the link ahead of every push), while
    any request still awaited its first token (the burst's prefills) and after (mean gap and mean link wait, ms, with
    their count); apart, each request's first token of its own decode node's steps where the prefill node gave the
    tokens before it (its wait to join). A gap counts in the first phase its end falls in. Times on the round's
    clock: each request's sending plus the node's offsets (the node's arrival lags the sending by a few ms)."""
    done = [r for r in requests if not r.get("error") and r.get("node_ctl")]
    if not done:
        return "no request finished"
    prefills_end = max((r.get("sent") or 0.0) + r["node_ctl"][0] for r in done)
    windows = forecast_windows(done)
    # a run from before the timeline (no token_waits) shows its waits as "-", not as none
    split: dict[str, tuple[list[float], list[float]]] = {
        "beside a joiner's forecast": ([], []),
        "during prefills": ([], []),
        "after": ([], []),
    }
    own_first = []
    for i, r in enumerate(done):
        times = [(r.get("sent") or 0.0) + t for t in r["node_ctl"]]
        waits = r.get("token_waits") or []
        first = int(r.get("prefill_tokens") or 1)
        for t in range(2, len(times)):
            gap = times[t] - times[t - 1]
            if t == first:
                own_first.append(gap)
                continue
            if any(j != i and asked < times[t] <= landed for j, asked, landed in windows):
                phase = "beside a joiner's forecast"
            else:
                phase = "during prefills" if times[t] <= prefills_end else "after"
            gaps, link = split[phase]
            gaps.append(gap)
            if t < len(waits):
                link.append(waits[t])
    cells = [
        f"{name}: {len(gaps)} gaps, mean {_ms(statistics.fmean(gaps))}, "
        f"link wait {_ms(statistics.fmean(link) if link else None)}"
        for name, (gaps, link) in split.items()
        if gaps
    ]
    cells.append("first own token: " + (", ".join(_ms(g) for g in own_first) if own_first else "none"))
    return "; ".join(cells)


def prefills_end(requests: list[dict[str, Any]]) -> float | None:
    """When the round's last first token came (s on the round's clock): the end of the burst's prefills."""
    done = [r for r in requests if not r.get("error") and r.get("node_ctl")]
    return max((r.get("sent") or 0.0) + r["node_ctl"][0] for r in done) if done else None


def cpu_phases(timeline: dict[str, list[int]], end: float) -> str:
    """A node's CPU by thread role while some request awaited its first token and after, in ms a second (means over
    the round's seconds of the `cpu_timeline`; its first second holds the round's start, so a phase's edge is good to
    a second): roles that used 10 ms a second in either, busiest first."""
    length = max((len(series) for series in timeline.values()), default=0)
    cut = min(length, int(end) + 1)
    spans = {"during prefills": (0, cut), "after": (cut, length)}
    cells = []
    for name, (first, stop) in spans.items():
        if stop <= first:
            continue
        means = {role: sum(series[first:stop]) / (stop - first) for role, series in timeline.items()}
        shown = sorted((role for role, ms in means.items() if ms >= 10), key=lambda role: -means[role])
        cells.append(f"{name} ({stop - first} s): " + ", ".join(f"{role} {means[role]:.0f}" for role in shown))
    return "; ".join(cells)


def table(rows: list[list[str]]) -> str:
    widths = [max(len(row[i]) for row in rows if i < len(row)) for i in range(len(rows[0]))]
    return "\n".join("  ".join(cell.rjust(widths[i]) for i, cell in enumerate(row)) for row in rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", type=Path, help="a bench run's results.json (or its folder)")
    parser.add_argument("--scheme", action="append", help="only these schemes (repeatable); default: all")
    parser.add_argument("--all-rounds", action="store_true", help="warm-up rounds too")
    args = parser.parse_args()
    path = args.results / "results.json" if args.results.is_dir() else args.results
    try:
        results = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        parser.error(f"cannot read {path}: {exc}")
    if not isinstance(results, dict) or not isinstance(results.get("groups"), list):
        parser.error(f"{path} is not a `smartgen bench` results.json (no groups)")
    shown = 0
    for group in results["groups"]:
        if (group.get("warmup") and not args.all_rounds) or (args.scheme and group["scheme"] not in args.scheme):
            continue
        requests = sorted(group["requests"], key=lambda r: r.get("sent") or 0.0)
        print(f"\n{group['scheme']}, point {group['point']}, round {group['rep']} (ms; node clock from each arrival)")
        print(table([HEADER, *(request_line(r) for r in requests)]))
        print(phases(requests))
        if threads := group.get("decode_threads"):  # what shared the decode node's CPU with its steps
            print("decode node CPU by thread (s): " + ", ".join(f"{role} {sec:.2f}" for role, sec in threads.items()))
        if threads := group.get("prefill_threads"):  # what shared the prefill nodes' CPUs with prefill
            print("prefill node CPU by thread (s): " + ", ".join(f"{role} {sec:.2f}" for role, sec in threads.items()))
        end = prefills_end(requests)
        for node, timeline in (group.get("cpu_timeline") or {}).items():  # the same, by phase
            if timeline and end is not None:
                print(f"{node} node CPU by thread (ms a second): " + cpu_phases(timeline, end))
        shown += 1
    if not shown:
        print("no measured round of those schemes (--all-rounds shows the warm-ups)")


if __name__ == "__main__":
    main()
