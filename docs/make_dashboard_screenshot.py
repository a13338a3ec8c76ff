"""Makes docs/dashboard.svg: the dashboard (textual's export_screenshot) watching `smartgen demo` mid-run.

Run from the repository root: `.venv/bin/python docs/make_dashboard_screenshot.py` (a few minutes: it runs the
demo on the sample model with SmartGen only, one prompt per task, and profiles the model first if needed).
"""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

from smartgen.apps.demo import DemoConfig, run_demo
from smartgen.sysinfo import SAMPLES_DIR
from smartgen.tui.app import DashboardApp
from smartgen.tui.feed import HttpFeed

OUT = Path(__file__).with_name("dashboard.svg")
SIZE = (120, 34)


def _share_local(app: DashboardApp) -> float:
    rows = app.model.mask_rows(64)
    cells = sum(len(r.cells) for r in rows)
    return sum(r.cells.count("L") for r in rows) / cells if cells else 0.0


async def _watch(decode: str, prefill: list[str], done: threading.Event, shot: dict) -> None:
    app = DashboardApp(HttpFeed(decode, prefill), interval=0.25)
    async with app.run_test(size=SIZE) as pilot:
        while not done.is_set():
            await pilot.pause(0.25)
            selected = app.model.selected()
            if selected is None or not selected.active or selected.state != "decoding":
                continue
            share = _share_local(app)
            rates = sum(r.current or 0 for r in app.model.path_rates())
            # the moment that shows most: KV partly local, data moving; the best one seen so far wins
            score = (0.3 < share < 0.95) + (rates > 0) + (len(app.model.requests()) > 1)
            if score >= shot.get("score", -1):
                shot.update(score=score, svg=app.export_screenshot(title="smartgen monitor dashboard"))


def main() -> None:
    done, shot = threading.Event(), {}
    watchers: list[threading.Thread] = []

    def on_nodes(decode: str, prefill: list[str]) -> None:
        thread = threading.Thread(target=lambda: asyncio.run(_watch(decode, prefill, done, shot)), daemon=True)
        thread.start()
        watchers.append(thread)

    def before_stop() -> None:
        done.set()
        for thread in watchers:
            thread.join(30)

    config = DemoConfig(
        model=SAMPLES_DIR / "sample-model",
        schemes=("smartgen", "partial"),
        per_task=1,
        on_nodes=on_nodes,
        before_stop=before_stop,
    )
    run_demo(config, say=print)
    if "svg" not in shot:
        raise SystemExit("no moment with a decoding request was seen; nothing written")
    OUT.write_text(shot["svg"])
    print(f"wrote {OUT} (score {shot['score']})")


if __name__ == "__main__":
    main()
