"""`smartgen eval`: runs the long-context suite under several transfer schemes and prints accuracy per task and length."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from .errors import fail
from .lists import names as _split
from .options import Blocks, BudgetList, ModelFolder, SelectorList, StallRatio, load_model_folder, option
from .progress import progress_bar
from .store_options import Db

DEFAULT_STALL_RATIO = 4.7  # smartgen.apps.evaluation.DEFAULT_STALL_RATIO, kept here so --help imports no torch

if TYPE_CHECKING:
    from smartgen.apps.evaluation import EvalReport

PANEL_SUITE = "Suite"
PANEL_SCHEMES = "Schemes"
PANEL_QUANT = "Quantized KV (quant2)"
PANEL_OUTPUT = "Output"
SELECTORS = ("quest", "infinigen", "hata", "topk")
ROW_HEADER_WIDTH = 27  # task + length columns and the table's margins


def _length(text: str) -> int:
    """A prompt length in tokens: 1024, or 1K / 1.5k (x 1024)."""
    try:
        value = int(float(text[:-1]) * 1024) if text[-1] in "kK" else int(text)
    except ValueError:
        raise ValueError(f"--lengths needs token counts such as 1024 or 2K, got {text!r}") from None
    if value < 16:
        raise ValueError(f"--lengths: {text!r} is too short (at least 16 tokens)")
    return value


def _selector_spec(text: str) -> tuple[str, tuple[tuple[str, object], ...]]:
    """'quest:page_size=4' -> ('quest', (('page_size', 4),)), checked against the selector's own parameters."""
    import inspect

    from smartgen.apps.evaluation import LEARNED_PARAMS, parse_selector_spec
    from smartgen.selectors import selector_class

    name, params = parse_selector_spec(text)
    if name not in SELECTORS:
        raise ValueError(f"choose from {', '.join(SELECTORS)}, got {name!r}")
    accepted = set(inspect.signature(selector_class(name)).parameters) - {"info", "budget", *LEARNED_PARAMS}
    unknown = sorted(set(params) - accepted)
    if unknown:
        raise ValueError(f"{name} has no parameter {', '.join(unknown)} (it takes {', '.join(sorted(accepted))})")
    return name, tuple(sorted(params.items()))


def eval_command(
    model: ModelFolder,
    schemes: Annotated[
        str,
        option(PANEL_SCHEMES, "Comma-separated schemes: full-cache, smartgen, proactive-only, streamingllm, quant2."),
    ] = "full-cache,smartgen,proactive-only,streamingllm,quant2",
    selector: SelectorList = "quest",
    budget: BudgetList = "0.1",
    stall_ratio: StallRatio = DEFAULT_STALL_RATIO,
    profile_timings: Annotated[
        bool,
        typer.Option(
            "--profile-timings",
            help="Take T_p and T_t from the profile instead of --stall-ratio (on a CPU with a fast loopback "
            "that sends every block during prefill).",
            rich_help_panel=PANEL_SCHEMES,
        ),
    ] = False,
    blocks: Blocks = 1024,
    hata_weights: Annotated[
        Path | None,
        option(
            PANEL_SCHEMES,
            "HATA hash weights (safetensors from smartgen.selectors.hata.save_weights); "
            "default: the model's in the profile store (`smartgen profile --selector hata` trains them), "
            "else trained on calibration-variant prompts before the run.",
        ),
    ] = None,
    db: Db = None,
    tasks: Annotated[
        str, option(PANEL_SUITE, "Comma-separated tasks: passkey, niah_single, niah_multikey, kv_retrieval, vt.")
    ] = "passkey,niah_single,niah_multikey,kv_retrieval,vt",
    lengths: Annotated[str, option(PANEL_SUITE, "Comma-separated prompt lengths in tokens (1K = 1024).")] = "1024,2048",
    num: Annotated[int, option(PANEL_SUITE, "Prompts per task and length (needles at spread depths).", min=1)] = 10,
    seed: Annotated[int, option(PANEL_SUITE, "Seed of the suite (sample i of a cell gets seed + i).")] = 0,
    batch_size: Annotated[int, option(PANEL_SUITE, "Prompts decoded together.", min=1)] = 4,
    quant_bits: Annotated[int, option(PANEL_QUANT, "Bits per quantized K/V element.", min=1, max=8)] = 2,
    quant_group: Annotated[
        int, option(PANEL_QUANT, "Group size G: tokens per key group, channels per value group.", min=1)
    ] = 32,
    quant_residual: Annotated[
        int, option(PANEL_QUANT, "Residual window R: the last R tokens stay full precision.", min=0)
    ] = 128,
    recall_prompts: Annotated[
        int,
        option(
            PANEL_OUTPUT,
            "Prompts per task and length traced densely to measure each selector's recall of the exact "
            "top-k (same budget), overall and on the retrieval heads; 0 = off.",
            min=0,
        ),
    ] = 2,
    json_out: Annotated[
        Path | None,
        typer.Option(
            "--json",
            help="Also write the report (every sample's answer and score) to this JSON file.",
            rich_help_panel=PANEL_OUTPUT,
        ),
    ] = None,
) -> None:
    """Evaluate accuracy under transfer schemes: the RULER/passkey suite, one column per scheme.

    Every prompt runs through a prefill and a decode engine in one process (greedy decoding);
    the table shows accuracy (%) per task and length, over all prompts, and relative to the
    full cache. docs/eval.md explains the schemes. --stall-ratio sets K_r as serving would on such
    a link (proactive-only drops what it could not carry); --budget is also StreamingLLM's window.
    """
    from smartgen.apps.evalsuite import TASKS
    from smartgen.apps.evaluation import SCHEMES, Condition
    from smartgen.apps.quantization import KVQuantConfig

    names = _split(schemes)
    if not names or any(name not in SCHEMES for name in names):
        fail(f"--schemes must name some of {', '.join(SCHEMES)}, got {schemes!r}")
    try:
        selectors = [_selector_spec(text) for text in _split(selector)]
    except ValueError as exc:
        fail(f"--selector: {exc}")
    if not selectors:
        fail(f"--selector must name some of {', '.join(SELECTORS)}, got {selector!r}")
    task_names = _split(tasks)
    if not task_names or any(name not in TASKS for name in task_names):
        fail(f"--tasks must name some of {', '.join(TASKS)}, got {tasks!r}")
    try:
        budgets = [float(b) for b in _split(budget)]
        prompt_lengths = [_length(x) for x in _split(lengths)]
        quant = KVQuantConfig(quant_bits, quant_group, quant_residual)
    except ValueError as exc:
        fail(str(exc))
    if not budgets or min(budgets) <= 0:
        fail(f"--budget needs positive numbers, got {budget!r}")
    if not prompt_lengths:
        fail("--lengths is empty")
    if json_out is not None and not json_out.parent.is_dir():
        fail(f"cannot write {json_out}: directory {json_out.parent} does not exist")
    conditions: list[Condition] = []
    for name in names:
        if name in ("smartgen", "proactive-only"):
            conditions += [Condition(name, s, b, options) for s, options in selectors for b in budgets]
        elif name == "streamingllm":
            conditions += [Condition(name, budget=b) for b in budgets]
        else:
            conditions.append(Condition(name))
    weights = None
    if hata_weights is not None:
        from smartgen.selectors.hata import load_weights

        try:
            weights = load_weights(hata_weights)
        except (OSError, ValueError) as exc:
            fail(f"cannot read HATA weights from {hata_weights}: {exc}")
    ratio = None if profile_timings else stall_ratio
    report = _run(
        model,
        conditions,
        task_names,
        prompt_lengths,
        num,
        seed,
        db,
        blocks,
        ratio,
        quant,
        batch_size,
        weights,
        recall_prompts,
    )
    render(report)
    if json_out is not None:
        data = report.to_json() | {
            "settings": {
                "model": str(model),
                "tasks": task_names,
                "lengths": prompt_lengths,
                "num": num,
                "seed": seed,
                "blocks": blocks,
                "stall_ratio": ratio,
                "recall_prompts": recall_prompts,
                "quant": {"bits": quant_bits, "group": quant_group, "residual": quant_residual},
            }
        }
        json_out.write_text(json.dumps(data, indent=1) + "\n")
        typer.echo(f"report written to {json_out}")


def _run(
    model_path: Path,
    conditions,
    tasks,
    lengths,
    num,
    seed,
    db,
    blocks,
    stall_ratio,
    quant,
    batch_size,
    hata_weights,
    recall_prompts,
) -> EvalReport:
    """Loads the model, tokenizer and profiles, makes the suite and runs it with a progress bar."""
    from rich.console import Console

    from smartgen.apps.evalsuite import generate_suite
    from smartgen.apps.evaluation import StoreProfiles, evaluate_conditions
    from smartgen.selectors import selector_kind
    from smartgen.store import StoreError
    from smartgen.sysinfo import default_db_path

    wants_profiles = any(c.scheme in ("smartgen", "proactive-only") for c in conditions) and (
        db is not None or default_db_path().exists()
    )
    if wants_profiles:  # a bad database fails now, before the model loads
        try:
            from smartgen.store import ProfileStore

            ProfileStore(db, create=False).close()
        except StoreError as exc:
            fail(str(exc))
    hf_model, tokenizer = load_model_folder(model_path)
    console = Console()
    hata_source = "given" if hata_weights is not None else "trained on calibration-variant prompts"
    trains = any(selector_kind(c.selector).needs_training for c in conditions)
    if hata_weights is None and trains and (db is not None or default_db_path().exists()):
        from smartgen.apps.hash_weights import stored_hash_weights
        from smartgen.store import ProfileStore

        try:
            with ProfileStore(db, create=False) as store:
                found = stored_hash_weights(store, hf_model)
        except StoreError as exc:
            fail(str(exc))
        if found is not None:
            hata_source, hata_weights = f"#{found[0]} from {store.path}", found[1]
    profiles = None
    if wants_profiles:
        try:
            profiles = StoreProfiles(db, hf_model, blocks)
        except StoreError as exc:
            fail(str(exc))
    samples = generate_suite(tasks, lengths, num, seed, tokenizer, variant="eval")
    console.print(
        f"[bold]smartgen eval[/]: {model_path} · {len(samples)} prompts ({', '.join(tasks)} at {', '.join(map(str, lengths))} tokens) "
        f"· {len(conditions)} condition(s) · profiles: {profiles.store.path if profiles else 'none (streaming proactive set)'}"
        + (f" · HATA weights: {hata_source}" if trains else "")
    )
    try:
        with progress_bar(console) as progress:
            bar = progress.add_task("starting", total=len(samples) * len(conditions))
            return evaluate_conditions(
                hf_model,
                tokenizer,
                samples,
                conditions,
                profiles=profiles,
                num_blocks=blocks,
                stall_ratio=stall_ratio,
                recall_prompts=recall_prompts,
                quant=quant,
                batch_size=batch_size,
                hata_weights=hata_weights,
                on_progress=lambda done, total, label: progress.update(
                    bar, completed=done, total=total, description=label
                ),
            )
    except ValueError as exc:
        fail(str(exc))
    finally:
        if profiles is not None:
            profiles.close()


def render(report: EvalReport) -> None:
    """The accuracy table (%): rows per task and length, then all prompts and relative to the full cache.

    Columns that do not fit the terminal go to a second table (and so on), each with the row headers.
    """
    from rich.console import Console

    console = Console()
    labels = list(report.runs)
    chunk: list[str] = []
    width = ROW_HEADER_WIDTH
    for label in labels:
        need = max(6, *(len(word) for word in _header(label).split("\n"))) + 3
        if chunk and width + need > console.width:
            console.print(_table(report, chunk))
            chunk, width = [], ROW_HEADER_WIDTH
        chunk.append(label)
        width += need
    console.print(_table(report, chunk))
    for label, run in report.runs.items():
        if run.proactive_share is not None:
            source = (
                f"profile {', '.join(f'#{i}' for i in run.profile_ids)}"
                if run.profile_ids
                else f"the {run.strategy} strategy (no profile)"
            )
            console.print(f"{label}: K_r = {run.proactive_share:.0%} of the blocks, proactive set from {source}")
    recall = next((run.recall for run in report.runs.values() if run.recall), None)
    if recall is not None:
        heads = ", ".join(f"L{layer}h{head}" for layer, head in recall["retrieval_heads"]) or "none found"
        console.print(
            f"top-k recall: share of the exact top-k (same budget) each row holds, layers >= 2, over "
            f"{recall['prompts']} traced prompt(s); retrieval heads (>= 10% of full attention on the needle): {heads}; "
            "per layer and head in --json"
        )
        if run.kv_byte_ratio is not None:
            console.print(f"{label}: a quantized transfer moves {run.kv_byte_ratio:.1%} of the fp16 KV bytes")


def _header(label: str) -> str:
    return label.replace("-", "-\n").replace(" ", "\n")


def _table(report: EvalReport, labels: list[str]):
    from rich import box
    from rich.table import Table

    table = Table(
        title="accuracy (%) per task and length, [95% Wilson interval]", title_justify="left", box=box.SIMPLE_HEAD
    )
    # fold, never cut: piped to a file the console is 80 columns, and "smartg…" or "[84-10…" says nothing
    table.add_column("task", overflow="fold")
    table.add_column("length", justify="right", overflow="fold")
    for label in labels:
        table.add_column(_header(label), justify="right", overflow="fold")
    accuracy = {label: report.runs[label].accuracy() for label in labels}
    intervals = {label: report.runs[label].intervals() for label in labels}
    for cell in report.cells():
        table.add_row(
            cell[0],
            str(cell[1]),
            *(_pct_ci(accuracy[label].get(cell), intervals[label].get(cell)) for label in labels),
        )
    table.add_section()
    table.add_row(
        "all",
        "",
        *(_pct_ci(report.runs[label].overall(), report.runs[label].overall_interval()) for label in labels),
        style="bold",
    )
    if report.reference is not None:
        table.add_row("vs full-cache", "", *(_pct(report.relative_overall(label)) for label in labels))
    recalls = [report.runs[label].recall for label in labels]
    if any(recalls):
        table.add_section()
        table.add_row("top-k recall", "", *(_fraction(r, "recall") for r in recalls))
        table.add_row("retrieval heads", "recall", *(_fraction(r, "retrieval_recall") for r in recalls))
        table.add_row("", "mass kept", *(_fraction(r, "retrieval_mass") for r in recalls))
        table.add_row("", "top-1 kept", *(_fraction(r, "retrieval_top1") for r in recalls))
    return table


def _fraction(recall: dict | None, key: str) -> str:
    value = None if recall is None else recall.get(key)
    return "-" if value is None else f"{value:.2f}"


def _pct_ci(value: float | None, interval: tuple[float, float] | None) -> str:
    """ "83.3 [44-97]": accuracy (%) and its 95% Wilson interval, on two lines."""
    if value is None or interval is None:
        return _pct(value)
    return f"{100 * value:.1f}\n[{100 * interval[0]:.0f}-{100 * interval[1]:.0f}]"


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f}"
