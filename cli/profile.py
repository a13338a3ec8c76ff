"""`smartgen profile`: profiles a model over a calibration set and stores one profile per length range; renders profiles."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from smartgen.sysinfo import SAMPLES_DIR

from .errors import fail
from .options import (
    LINK,
    MODEL,
    SELECTION,
    Blocks,
    Budget,
    Calibration,
    LinkGbps,
    ModelFolder,
    Selector,
    load_model_folder,
    option,
)
from .progress import progress_bar
from .store_options import Db, open_store

if TYPE_CHECKING:
    from rich.console import Console

    from smartgen.store import Profile

PANEL_OUTPUT = "Output"
LINK_RATES = (10.0, 15.0, 25.0, 32.0)  # Gbit/s: the paper's cloud links
SHADES = " ░▒▓█"
PALETTE = ("#440154", "#3b528b", "#21918c", "#5ec962", "#fde725")  # viridis, low to high
SAMPLES_CALIBRATION = SAMPLES_DIR / "calibration.jsonl"


def _default_calibration() -> Path:
    """samples/calibration.jsonl of the working directory, else of the SmartGen checkout."""
    local = Path("samples/calibration.jsonl")
    return local if local.exists() or not SAMPLES_CALIBRATION.exists() else SAMPLES_CALIBRATION


def profile(
    model: ModelFolder,
    calibration: Calibration = None,
    ranges: Annotated[
        str, option(MODEL, "Prompt-length ranges [LO, HI) in tokens, one profile each, e.g. 1024-2048,2K-4K.")
    ] = "1024-2048,2048-4096",
    limit: Annotated[int | None, option(MODEL, "Use at most this many prompts per length range.", min=1)] = None,
    selector: Selector = "quest",
    budget: Budget = 0.1,
    blocks: Blocks = 1024,
    decode_tokens: Annotated[int, option(SELECTION, "Decode steps per prompt (selector calls per layer).", min=1)] = 16,
    link_gbps: LinkGbps = 15.0,
    measure_link: Annotated[
        bool,
        typer.Option(
            "--measure-link",
            help="Time a real full-KV transfer over an in-process lane paced at --link-gbps instead.",
            rich_help_panel=LINK,
        ),
    ] = False,
    retrain_hata: Annotated[
        bool,
        typer.Option(
            "--retrain-hata",
            help="hata: train new hash weights even when the store has some for this model.",
            rich_help_panel=SELECTION,
        ),
    ] = False,
    hata_prompts: Annotated[
        int, option(SELECTION, "hata: calibration prompts its hash weights are trained on.", min=1)
    ] = 24,
    hata_steps: Annotated[int, option(SELECTION, "hata: optimiser steps per layer (HATA's script: 300).", min=1)] = 300,
    db: Db = None,
    png: Annotated[
        Path | None,
        option(
            PANEL_OUTPUT,
            "Also write each profile's heat map to this PNG (one file per range: NAME-LO-HI.png when several).",
        ),
    ] = None,
) -> None:
    """Profile a model over a calibration set: which KV blocks the selector picks, and T_p / T_t for K_r.

    Decodes every prompt with all KV local, counts each KV entry's selections per layer, and
    stores one profile per length range in the profile database; ends with the heat map and
    K_r at a few link rates. T_t is the full KV's time at --link-gbps (or, with --measure-link, measured
    over an in-process lane paced at it). With --selector hata it first trains HATA's hash weights on the
    calibration set and stores them with the profiles (unless the store has them for this model).
    """
    from rich.console import Console

    from smartgen.apps.profiling import parse_ranges, write_heatmap_png
    from smartgen.selectors import selector_kind

    try:
        length_ranges = parse_ranges(ranges)
    except ValueError as exc:
        fail(str(exc))
    try:
        if not selector_kind(selector).sparse:
            fail(f"--selector {selector} selects every token: there is nothing to profile")
    except ValueError as exc:
        fail(f"--selector: {exc}")
    if link_gbps <= 0:
        fail(f"--link-gbps must be positive, got {link_gbps:g}")
    if png is not None:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            fail("--png needs matplotlib: pip install 'smartgen[plot]' (or pip install matplotlib)")
        if not png.parent.is_dir():
            fail(f"cannot write {png}: directory {png.parent} does not exist")
    store = open_store(db, create=True)  # before the long run: a bad database fails now, not after it
    with store:
        profiles = _run(
            store,
            model,
            calibration,
            length_ranges,
            selector,
            budget,
            blocks,
            decode_tokens,
            link_gbps,
            measure_link,
            limit,
            (retrain_hata, hata_prompts, hata_steps),
        )
        console = Console()
        for item in profiles:
            item = item.with_id(_add(store, item))
            render_profile(console, item)
            if png is not None:
                target = (
                    png
                    if len(profiles) == 1
                    else png.with_name(f"{png.stem}-{item.length_lo}-{item.length_hi}{png.suffix}")
                )
                write_heatmap_png(item, target)
                console.print(f"heat map written to {target}")
    covered = {(p.length_lo, p.length_hi) for p in profiles}
    for lo, hi in length_ranges:
        if (lo, hi) not in covered:
            console.print(f"[yellow]no calibration prompt has {lo}-{hi} tokens: no profile for that range[/]")
    console.print(f"stored {len(profiles)} profile(s) in {store.path}")


def _run(
    store,
    model: Path,
    calibration: Path | None,
    length_ranges,
    selector: str,
    budget: float,
    blocks: int,
    decode_tokens: int,
    link_gbps: float,
    measure_link: bool,
    limit: int | None,
    hata: tuple[bool, int, int] = (False, 24, 300),
) -> list:
    """Loads the calibration set, model and tokenizer and profiles with a progress bar; fails in one line."""
    from rich.console import Console

    from smartgen.apps.profiling import CalibrationError, LinkSpec, load_calibration
    from smartgen.apps.profiling import profile as run_profile
    from smartgen.selectors import selector_kind

    try:
        calibration_set = load_calibration(calibration or _default_calibration())
    except CalibrationError as exc:
        fail(str(exc))
    hf_model, tokenizer = load_model_folder(model)
    console = Console()
    link = LinkSpec("inproc" if measure_link else "rate", link_gbps)
    console.print(
        f"[bold]smartgen profile[/]: {model} · {selector} budget={budget:g} · M={blocks} · {calibration_set.name} "
        f"({len(calibration_set.prompts)} prompts) · ranges {', '.join(f'{lo}-{hi}' for lo, hi in length_ranges)} · "
        f"link {link.label} · database {store.path}"
    )
    params: dict = {"budget": budget}
    weights_id = None
    if selector_kind(selector).needs_training:
        weights_id, params["weights"] = _hash_weights(
            console, store, hf_model, tokenizer, calibration_set, hata, str(model)
        )
    try:
        with progress_bar(console, "prompts") as progress:
            task = progress.add_task("profiling", total=None)
            return run_profile(
                hf_model,
                tokenizer,
                calibration_set,
                selector,
                params,
                weights_id=weights_id,
                num_blocks=blocks,
                length_ranges=length_ranges,
                decode_tokens=decode_tokens,
                link=link,
                limit=limit,
                model_name=str(model),
                on_progress=lambda done, total: progress.update(task, completed=done, total=total),
            )
    except (CalibrationError, ValueError) as exc:
        fail(str(exc))


def _hash_weights(console: Console, store, model, tokenizer, calibration_set, hata: tuple[bool, int, int], name: str):
    """(id, weights): HATA's hash weights from the store, else trained on the calibration set and stored."""
    import time

    from smartgen.apps.hash_weights import ensure_hash_weights
    from smartgen.selectors.hata_train import HashTrainingConfig
    from smartgen.store import StoreError

    retrain, num_prompts, steps = hata
    start = time.monotonic()
    try:
        with console.status("HATA hash weights: training on the calibration set (once per model)"):
            weights_id, weights, trained = ensure_hash_weights(
                store,
                model,
                tokenizer,
                calibration_set,
                retrain=retrain,
                num_prompts=num_prompts,
                config=HashTrainingConfig(steps=steps),
                model_name=name,
            )
    except (StoreError, ValueError) as exc:
        fail(str(exc))
    what = f"trained in {time.monotonic() - start:.0f} s and stored" if trained else "from the store"
    console.print(f"HATA hash weights #{weights_id} ({len(weights)} layers): {what}")
    return weights_id, weights


def _add(store, item) -> int:
    from smartgen.store import StoreError

    try:
        return store.add(item)
    except StoreError as exc:
        fail(str(exc))


def duration(seconds: float) -> str:
    """3 significant digits in s, ms or µs."""
    for scale, unit in ((1.0, "s"), (1e-3, "ms"), (1e-6, "µs")):
        if seconds >= scale or unit == "µs":
            return f"{seconds / scale:.3g} {unit}"
    raise AssertionError


def heatmap(importance, width: int):
    """A rich Text: one row per layer, one cell per group of blocks (shade and colour by importance)."""
    from rich.text import Text

    from smartgen.apps.profiling import downsample_blocks

    cells = downsample_blocks(importance, max(8, width - 6))
    top = float(cells[2:].max()) if cells.shape[0] > 2 else float(cells.max())
    text = Text()
    for layer in range(cells.shape[0]):
        text.append(f"{layer:>4}  ", style="dim")
        for value in cells[layer].tolist():
            level = 0 if top <= 0 else min(len(SHADES) - 1, int(value / top * (len(SHADES) - 1) + 0.5))
            text.append(SHADES[level], style=PALETTE[max(0, level - 1)] if level else "")
        text.append("\n")
    return text


def render_profile(console: Console, item: Profile) -> None:
    """A profile's heat map (layers × blocks) and K_r at a few link rates."""
    from rich.table import Table

    params = " ".join(f"{k}={v}" for k, v in item.selector_params.items())
    console.print(
        f"[bold]profile #{item.id}[/]: {item.model} · {item.selector} {params} · prompts [{item.length_lo}, {item.length_hi}) · "
        f"{item.num_prompts} prompt(s), mean {item.mean_length:.0f} tokens · T_p {duration(item.prefill_seconds)} · "
        f"T_t {duration(item.transfer_seconds)} ({item.link})"
    )
    console.print(
        f"importance, layers (rows) × relative blocks (M = {item.num_blocks}); layers 0-1 are always sent whole:"
    )
    console.print(heatmap(item.importance, console.width), end="")
    table = Table(title="proactive budget K_r (blocks pushed during prefill)", title_justify="left")
    for column in ("link", "T_t", "K_r", "share of blocks"):
        table.add_column(column, justify="right")
    total = item.num_layers * item.num_blocks
    table.add_row(
        f"{item.link} (stored)", duration(item.transfer_seconds), str(item.k_r()), f"{item.k_r() / total:.1%}"
    )
    for gbps in LINK_RATES:
        k_r = item.k_r(gbps)
        table.add_row(f"{gbps:g} Gbit/s", duration(item.transfer_seconds_at(gbps)), str(k_r), f"{k_r / total:.1%}")
    console.print(table)
