"""Calibration profiling: importance from a known selection trace, timings, calibration files, fingerprints."""

from __future__ import annotations

import sys

import pytest
import torch
from tiny_models import tiny_config

from smartgen.apps.profiling import (
    CalibrationError,
    LinkSpec,
    downsample_blocks,
    load_calibration,
    measure_transfer,
    parse_ranges,
    profile,
    write_heatmap_png,
)
from smartgen.engine.layout import KVLayout
from smartgen.runtime.fingerprint import model_fingerprint
from smartgen.runtime.models import load_model, model_from_config
from smartgen.selectors.base import Selector, pad_rows


@pytest.fixture(scope="module")
def llama():
    return model_from_config(tiny_config("llama"))


class FixedSelector(Selector):
    """Picks tokens {0, 3} for KV head 0 and {3} for KV head 1, every step, every layer it is asked about."""

    name = "fixed"

    def __init__(self, info) -> None:
        super().__init__(info)
        self.layers: list[int] = []

    def select(self, step, metadata):
        self.layers.append(step.layer)
        return pad_rows([torch.tensor([[0, 3], [3, -1]]) for _ in step.prompt_lengths])


def _prompts(*lengths: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(1)
    return [torch.randint(3, 97, (n,), generator=generator).tolist() for n in lengths]


def test_importance_from_a_known_selection_trace(llama):
    from smartgen.runtime.models import model_info

    selector = FixedSelector(model_info(llama))
    short, long = profile(
        llama,
        None,
        _prompts(16, 16, 32),
        selector,
        num_blocks=16,
        length_ranges=[(10, 20), (20, 40)],
        decode_tokens=3,
    )
    assert sorted(set(selector.layers)) == [2, 3]  # layers 0-1 are dense and never reach the selector
    assert selector.layers.count(2) == 3 * 3  # decode_tokens steps per prompt
    # 16 tokens, 16 blocks: block m is token m, 2 entries (KV heads) each; 3 steps
    expected = torch.zeros(4, 16)
    expected[2:, 0] = 3 / 2  # token 0: head 0 only
    expected[2:, 3] = 6 / 2  # token 3: both heads
    torch.testing.assert_close(short.importance, expected, rtol=0, atol=0)
    # 32 tokens, 16 blocks: block m holds tokens 2m and 2m+1 (4 entries)
    expected = torch.zeros(4, 16)
    expected[2:, 0] = 3 / 4
    expected[2:, 1] = 6 / 4
    torch.testing.assert_close(long.importance, expected, rtol=0, atol=0)
    assert (short.num_prompts, short.mean_length, long.num_prompts, long.mean_length) == (2, 16.0, 1, 32.0)
    assert short.selector == "fixed" and short.decode_tokens == 3
    assert short.model_fingerprint == model_fingerprint(llama)
    assert short.prefill_seconds > 0


def test_profile_with_a_named_selector_and_timings(llama):
    layout = KVLayout(4, 2, 16, torch.float32)
    [result] = profile(
        llama,
        None,
        _prompts(24, 40, 30, 200),
        "topk",
        {"budget": 0.25},
        num_blocks=8,
        length_ranges=[(20, 64)],
        decode_tokens=2,
        link=LinkSpec("rate", 15.0),
        limit=2,
    )
    assert result.num_prompts == 2 and result.mean_length == 32.0  # --limit keeps the first two in the range
    assert result.selector_params == {"budget": 0.25} and result.link == "rate:15gbps"
    assert result.kv_bytes_per_token == layout.kv_bytes(1) == 2 * 4 * 2 * 16 * 4
    assert result.transfer_seconds == pytest.approx(layout.kv_bytes(1) * 32 * 8 / 15e9)
    assert result.importance[:2].abs().sum() == 0 and result.importance[2:].sum() > 0
    # topk with budget 0.25 picks a quarter of the prompt per head: entries average to 0.25 per step
    assert float(result.importance[2:].mean()) == pytest.approx(0.25 * 2, rel=0.15)


def test_infinigen_profiles_with_skew_from_the_first_prompt(llama):
    [result] = profile(
        llama, None, _prompts(24), "infinigen", {"budget": 0.25}, num_blocks=8, length_ranges=[(8, 64)], decode_tokens=2
    )
    assert result.selector_params == {"budget": 0.25, "skew": "calibration[0]"}


def test_profile_errors(llama):
    with pytest.raises(
        CalibrationError, match="no calibration prompt falls in 100-200 \\(prompts have 16-32 tokens\\)"
    ):
        profile(llama, None, _prompts(16, 32), "topk", length_ranges=[(100, 200)])
    with pytest.raises(ValueError, match="dense selector"):
        profile(llama, None, _prompts(16), "dense", length_ranges=[(8, 64)])
    with pytest.raises(ValueError, match="unknown selector"):
        profile(llama, None, _prompts(16), "nope", length_ranges=[(8, 64)])
    with pytest.raises(CalibrationError, match="all text or all token ids"):
        profile(llama, None, ["some text", *_prompts(16)], "topk", length_ranges=[(8, 64)])
    with pytest.raises(ValueError, match="tokenizer"):
        profile(llama, None, ["text needs a tokenizer"], "topk", length_ranges=[(1, 64)])


def test_measured_transfer_takes_the_paced_time():
    layout = KVLayout(4, 2, 64, torch.float32)  # 4 KiB per token per layer (K and V)
    seconds = measure_transfer(layout, 256, gbps=0.5)
    expected = layout.kv_bytes(256) * 8 / 0.5e9  # ~67 ms
    assert 0.9 * expected <= seconds <= expected + 0.5


def test_measured_link_is_recorded(llama):
    [result] = profile(
        llama,
        None,
        _prompts(32),
        "topk",
        num_blocks=8,
        length_ranges=[(8, 64)],
        decode_tokens=1,
        link=LinkSpec("inproc", 0.1),
    )
    assert result.link == "inproc:0.1gbps"
    assert result.transfer_seconds >= 0.9 * result.kv_bytes_per_token * 32 * 8 / 0.1e9


# -- calibration files and ranges --------------------------------------------------------------
def test_load_calibration(tmp_path):
    path = tmp_path / "cal.jsonl"
    path.write_text('{"prompt": "one", "answer": "x"}\n\n{"prompt": "two", "id": 3}\n')
    calibration = load_calibration(path)
    assert calibration.prompts == ("one", "two") and calibration.name == "cal.jsonl" and len(calibration.sha256) == 64


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("", "holds no prompts"),
        ("\n\n", "holds no prompts"),
        ('{"prompt": "ok"}\n{"prompt": \n', r"cal.jsonl:2: not JSON"),
        ('{"text": "no prompt field"}\n', r"cal.jsonl:1: expected an object with a \"prompt\" string"),
        ('["a list"]\n', "expected an object"),
        ('{"prompt": 5}\n', "expected an object"),
    ],
)
def test_bad_calibration_files(tmp_path, text, message):
    path = tmp_path / "cal.jsonl"
    path.write_text(text)
    with pytest.raises(CalibrationError, match=message):
        load_calibration(path)


def test_missing_calibration_file(tmp_path):
    with pytest.raises(CalibrationError, match="no calibration file at"):
        load_calibration(tmp_path / "absent.jsonl")


def test_parse_ranges():
    assert parse_ranges("1024-2048, 2K-4k") == [(1024, 2048), (2048, 4096)]
    for bad in ("", "1024", "2048-1024", "a-b", "0-5"):
        with pytest.raises(ValueError):
            parse_ranges(bad)


# -- rendering ------------------------------------------------------------------------------------
def test_downsample_blocks():
    importance = torch.arange(12, dtype=torch.float32).view(2, 6)
    torch.testing.assert_close(downsample_blocks(importance, 3), torch.tensor([[0.5, 2.5, 4.5], [6.5, 8.5, 10.5]]))
    assert downsample_blocks(importance, 100).shape == (2, 6)


def test_png_without_matplotlib_says_how_to_get_it(monkeypatch, tmp_path):
    from test_store import make_profile

    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(ImportError, match=r"smartgen\[plot\]"):
        write_heatmap_png(make_profile(), tmp_path / "x.png")


def test_png_is_written(tmp_path):
    pytest.importorskip("matplotlib")
    from test_store import make_profile

    write_heatmap_png(make_profile(), tmp_path / "x.png")
    assert (tmp_path / "x.png").read_bytes()[:4] == b"\x89PNG"


# -- fingerprints ---------------------------------------------------------------------------------
def test_fingerprint_is_stable_across_save_and_load(llama, tmp_path):
    llama.save_pretrained(tmp_path)
    loaded = load_model(tmp_path)
    assert model_fingerprint(loaded) == model_fingerprint(llama)
    assert model_fingerprint(load_model(tmp_path, dtype=torch.bfloat16)) != model_fingerprint(llama)  # rounded weights


def test_fingerprint_follows_the_weights_and_the_config(llama):
    base = model_fingerprint(llama)
    assert model_fingerprint(model_from_config(tiny_config("llama"), seed=1)) != base  # other weights
    config = tiny_config("llama")
    config.rope_parameters = {**config.rope_parameters, "rope_theta": 500000.0}
    assert model_fingerprint(model_from_config(config)) != base  # same weights, other RoPE
    config = tiny_config("llama")
    config.use_cache = False
    config.output_hidden_states = True
    assert model_fingerprint(model_from_config(config)) == base  # run-time switches are not identity


def test_fingerprint_ignores_widening(llama):
    bf16 = model_from_config(tiny_config("llama")).to(torch.bfloat16)
    widened = model_from_config(tiny_config("llama")).to(torch.bfloat16).float()
    assert model_fingerprint(bf16) == model_fingerprint(widened)
