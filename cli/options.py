"""The model, selection and link options, each declared once with one name and one help, and old spellings.

`serve`, `bench`, `demo`, `eval`, `profile` and `simulate` take them as `Annotated` aliases, the default set where
the command declares the parameter; a command taking several values of one (a sweep, or `eval`'s columns) takes the
`...List` alias of the same name and help. The other groups are declared the same way in lane_options.py (lanes and
where the nodes run), node_options.py (`serve`'s timeouts, secret and TLS) and store_options.py (`--db`). A concept
has one name everywhere; an old spelling still works: `new_name`, the root app's token normaliser, maps it to the new
name and says so.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Annotated, Any

import typer

from .errors import fail

MODEL, SELECTION, LINK = "Model", "Selection", "Link"
NATIVE = "native"  # --decode-ratio: the machine's own decode speed


def option(panel: str, help: str, **more: Any) -> Any:
    """A `typer.Option` in `panel` of the help: how every option here and a command's own are declared."""
    return typer.Option(help=help, rich_help_panel=panel, **more)


def _list(panel: str, help: str) -> Any:
    """The same option taking comma-separated values: a sweep, one point each (or, in `eval`, one column each)."""
    return typer.Option(help=f"One or more, comma-separated: {help}", rich_help_panel=panel)


# -- renamed options: the old spelling works and names the new one ----------------------------------
RENAMED = {"gbps": "link-gbps", "transfer-ratio": "stall-ratio", "policies": "schemes"}


def new_name(name: str) -> str:
    """click's `token_normalize_func`: an option's name as typed (without its dashes) -> the name it now has."""
    if name in RENAMED:
        typer.echo(f"note: --{name} is now --{RENAMED[name]}", err=True)
        return RENAMED[name]
    return name


def _positive(param: typer.CallbackParam, value: float) -> float:
    if value <= 0:
        fail(f"{param.opts[0]} must be positive, got {value:g}")
    return value


# -- Model -------------------------------------------------------------------------------------------
ModelFolder = Annotated[Path, option(MODEL, "Folder of a Hugging Face causal LM and its tokenizer (loaded offline).")]
Device = Annotated[
    str, option(MODEL, "Torch device for the model (cpu, cuda, cuda:1); refused where this machine lacks it.")
]
Calibration = Annotated[
    Path | None,
    option(
        MODEL, 'JSONL calibration set for profiling, one {"prompt": ...} per line (default: samples/calibration.jsonl).'
    ),
]


def load_model_folder(folder: Path) -> tuple[Any, Any]:
    """The model and tokenizer of `--model` (offline), or a one-line error saying what is wrong with the folder."""
    from transformers import AutoTokenizer

    from smartgen.runtime.models import ModelLoadError, load_model

    try:
        model = load_model(folder)
    except ModelLoadError as exc:
        fail(str(exc))
    try:
        return model, AutoTokenizer.from_pretrained(folder, local_files_only=True)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        fail(f"cannot load a tokenizer from {folder}: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}")


# -- Selection -----------------------------------------------------------------------------------------
_SELECTOR = (
    "KV selector: quest, infinigen, hata (its hash weights from `smartgen profile --selector hata`), topk or dense."
)
_BUDGET = "Selection budget: a share of the prompt (<= 1) or a token count (> 1)."
_BLOCKS = "KV blocks M per layer (a stored profile is used only with the same M)."
_SPECULATIVE = "Share of all blocks pushed per idle notice."
Selector = Annotated[str, option(SELECTION, _SELECTOR)]
SelectorList = Annotated[
    str, _list(SELECTION, f"{_SELECTOR} Its own parameters after a colon, ';' between them: quest:page_size=4.")
]
Budget = Annotated[float, option(SELECTION, _BUDGET, callback=_positive)]
BudgetList = Annotated[str, _list(SELECTION, _BUDGET)]
Blocks = Annotated[int, option(SELECTION, _BLOCKS, min=1)]
SpeculativeRatio = Annotated[float, option(SELECTION, _SPECULATIVE, min=0.001, max=1.0)]
SpeculativeRatioList = Annotated[str, _list(SELECTION, _SPECULATIVE)]

# -- Link ----------------------------------------------------------------------------------------------
_LINK_GBPS = (
    "Link rate in Gbit/s each way: what each side sends is paced to it, as on a cloud link (0 = unpaced; where the "
    "command takes --stall-ratio, 0 lets that set it)."
)
_STALL = (
    "Stall ratio R: the link's rate makes a full KV transfer of one request take R x its prefill (the paper's "
    "testbed: about 4.7; 7.1 at 15 Gbit/s); a given --link-gbps wins."
)
LinkGbps = Annotated[float, option(LINK, _LINK_GBPS, min=0.0)]
LinkGbpsList = Annotated[str, _list(LINK, _LINK_GBPS)]
StallRatio = Annotated[float, option(LINK, _STALL, min=0.01)]
StallRatioList = Annotated[str, _list(LINK, _STALL)]
DelayMs = Annotated[float, option(LINK, "Emulated one-way link delay in milliseconds.", min=0.0)]
DecodeRatio = Annotated[
    str,
    option(
        LINK,
        "Decode-side ratio D: emulate slower decode compute (a sleep per decode layer) so an all-local step's link "
        f"time moves D x a step's selected bytes (the paper's: about 0.15); `{NATIVE}`: this machine's own speed, its "
        "ratio reported.",
        metavar="<D|native>",
    ),
]


def parse_decode_ratio(text: str) -> float | None:
    """`--decode-ratio`'s value: a positive number, or None for `native`; anything else fails in one line."""
    if text.strip().lower() == NATIVE:
        return None
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0 < value < math.inf:
        fail(f"--decode-ratio must be a positive number or '{NATIVE}', got {text!r}")
    return value
