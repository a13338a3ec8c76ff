"""Selectors in `smartgen eval`: HATA wired in (weights trained or given), 95% Wilson intervals per cell."""

import json

import pytest
from tiny_models import save_tiny_model
from typer.testing import CliRunner

from smartgen.apps.evalsuite import generate_suite
from smartgen.apps.evaluation import Condition, SampleResult, SchemeRun, evaluate_conditions, wilson_interval
from smartgen.cli.app import app
from smartgen.runtime.models import load_model, model_info
from smartgen.selectors.hata import random_weights, save_weights

LENGTH = 256
runner = CliRunner()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from transformers import AutoTokenizer

    folder = save_tiny_model(tmp_path_factory.mktemp("tiny"))
    return folder, load_model(folder), AutoTokenizer.from_pretrained(folder)


@pytest.mark.parametrize(
    "mean,n,low,high",
    [(0.5, 10, 0.2366, 0.7634), (1.0, 6, 0.6097, 1.0), (0.0, 20, 0.0, 0.1611), (0.9, 20, 0.6990, 0.9721)],
)
def test_wilson_interval_matches_known_values(mean, n, low, high):
    got = wilson_interval(mean, n)
    assert got == pytest.approx((low, high), abs=1e-4)
    assert wilson_interval(0.5, 0) == (0.0, 1.0)


def test_scheme_runs_report_an_interval_per_cell():
    results = [SampleResult("passkey", 1024, 0.5, i, "x", float(i < 3), 1000, 8, 10, 0, 0) for i in range(4)]
    run = SchemeRun("full-cache", "full-cache", "dense", {}, results)
    assert run.intervals() == {("passkey", 1024): wilson_interval(0.75, 4)}
    data = json.loads(json.dumps(run.to_json()))
    assert data["ci95"]["passkey@1024"] == pytest.approx(list(wilson_interval(0.75, 4)))
    assert data["overall_ci95"] == pytest.approx(list(wilson_interval(0.75, 4)))


def test_hata_trains_its_weights_once_and_keeps_them_out_of_the_report(tiny):
    _, model, tokenizer = tiny
    samples = generate_suite(["passkey"], [LENGTH], 1, 0, tokenizer)
    conditions = [Condition("smartgen", "hata", 0.3), Condition("proactive-only", "hata", 0.3)]
    report = evaluate_conditions(model, tokenizer, samples, conditions, num_blocks=64)
    assert set(report.runs) == {"smartgen hata 30%", "proactive-only hata 30%"}
    for run in report.runs.values():
        assert run.selector == "hata" and run.selector_params == {"budget": 0.3}
        assert len(run.results) == 1 and run.results[0].selected_entries > 0


def test_cli_eval_runs_hata_with_given_weights(tiny, tmp_path, monkeypatch):
    folder, model, _ = tiny
    monkeypatch.setenv("SMARTGEN_DB", str(tmp_path / "none.db"))
    save_weights(random_weights(model_info(model), rbit=16), tmp_path / "w.safetensors")
    out = tmp_path / "eval.json"
    args = ["eval", "--model", str(folder), "--num", "1", "--lengths", str(LENGTH), "--tasks", "passkey"]
    args += ["--schemes", "smartgen", "--selector", "hata", "--budget", "0.3", "--blocks", "64"]
    result = runner.invoke(app, [*args, "--hata-weights", str(tmp_path / "w.safetensors"), "--json", str(out)])
    assert result.exit_code == 0, result.output
    assert "smartgen" in result.output and "Wilson" in result.output
    data = json.loads(out.read_text())
    assert list(data["runs"]) == ["smartgen hata 30%"] and "ci95" in data["runs"]["smartgen hata 30%"]
    bad = runner.invoke(app, [*args, "--hata-weights", str(tmp_path / "missing.safetensors")])
    assert bad.exit_code != 0 and "HATA weights" in bad.output


def test_selector_specs_parse_and_label_their_parameters():
    from smartgen.apps.evaluation import parse_selector_spec

    assert parse_selector_spec("quest") == ("quest", {})
    assert parse_selector_spec("infinigen:partial_ratio=0.5; speculate=False") == (
        "infinigen",
        {"partial_ratio": 0.5, "speculate": False},
    )
    assert parse_selector_spec("quest:page_size=4")[1] == {"page_size": 4}
    with pytest.raises(ValueError, match="key=value"):
        parse_selector_spec("quest:page_size")
    cond = Condition("smartgen", "quest", 0.2, (("page_size", 4),))
    assert cond.label == "smartgen quest(page_size=4) 20%"


def test_cli_eval_passes_selector_parameters_and_rejects_unknown_ones(tiny, tmp_path, monkeypatch):
    folder, _, _ = tiny
    monkeypatch.setenv("SMARTGEN_DB", str(tmp_path / "none.db"))
    out = tmp_path / "eval.json"
    args = ["eval", "--model", str(folder), "--num", "1", "--lengths", str(LENGTH), "--tasks", "passkey"]
    args += ["--schemes", "smartgen", "--budget", "0.3", "--blocks", "64"]
    result = runner.invoke(app, [*args, "--selector", "quest,quest:page_size=4", "--json", str(out)])
    assert result.exit_code == 0, result.output
    runs = json.loads(out.read_text())["runs"]
    assert set(runs) == {"smartgen quest 30%", "smartgen quest(page_size=4) 30%"}
    assert runs["smartgen quest(page_size=4) 30%"]["selector_params"] == {"budget": 0.3, "page_size": 4}
    bad = runner.invoke(app, [*args, "--selector", "quest:pages=4"])
    assert bad.exit_code != 0 and "no parameter pages" in bad.output


def test_oracle_recall_beside_accuracy(tiny):
    """The oracle recalls itself whole; proactive-only at the default stall ratio holds no prompt token of layers >= 2."""
    _, model, tokenizer = tiny
    samples = generate_suite(["passkey", "niah_single"], [LENGTH], 2, 0, tokenizer)
    conditions = [
        Condition("full-cache"),
        Condition("smartgen", "topk", 0.2),
        Condition("smartgen", "quest", 0.2, (("page_size", 4),)),
        Condition("proactive-only", "topk", 0.2),
        Condition("streamingllm", budget=0.2),
    ]
    report = evaluate_conditions(model, tokenizer, samples, conditions, num_blocks=64, recall_prompts=1)
    assert report.runs["full-cache"].recall is None
    oracle = report.runs["smartgen topk 20%"].recall
    assert oracle is not None and oracle["prompts"] == 2  # one per cell: passkey and niah_single
    assert oracle["recall"] == pytest.approx(1.0) and oracle["size"] == pytest.approx(1.0)
    assert 0.5 < oracle["mass"] <= oracle["oracle_mass"] + 1e-4  # a query head's own top-k holds the most of it
    per_head = oracle["kv_recall_per_head"]  # [L][H]: layers 0-1 are never scored
    assert len(per_head) == 4 and per_head[0] == [None, None] and per_head[2] == [pytest.approx(1.0)] * 2
    top1 = oracle["top1_hit_per_head"]  # [L][Hq]: whether each query head's most attended token is in its row
    assert len(top1[3]) == 4 and all(0.0 <= v <= 1.0 for v in top1[3]) and top1[1] == [None] * 4
    dropped = report.runs["proactive-only topk 20%"]
    assert dropped.proactive_share == 0.5 and dropped.recall is not None and dropped.recall["recall"] == 0.0
    for label in ("smartgen quest(page_size=4) 20%", "streamingllm 20%"):
        recall = report.runs[label].recall
        assert recall is not None and 0.0 < recall["recall"] < 1.0
    data = json.loads(json.dumps(report.to_json()))
    assert data["runs"]["smartgen topk 20%"]["oracle_recall"]["recall"] == pytest.approx(1.0)


def test_recall_samples_take_the_first_of_each_cell_with_a_needle(tiny):
    from smartgen.apps.evaluation import recall_samples

    samples = generate_suite(["passkey", "vt"], [LENGTH, 320], 3, 0, tiny[2])
    chosen = recall_samples(samples, 2)
    assert all(s.needle_spans for s in chosen)
    cells = [(s.task, s.length) for s in chosen]
    assert all(cells.count(cell) <= 2 for cell in cells) and ("passkey", 320) in cells
    assert [s for s in samples if s in chosen][:2] == [s for s in samples if (s.task, s.length) == cells[0]][:2]


def test_cli_eval_stall_ratio_sets_k_r_and_prints_recall(tiny, tmp_path, monkeypatch):
    monkeypatch.setenv("SMARTGEN_DB", str(tmp_path / "none.db"))
    base = ["eval", "--model", str(tiny[0]), "--num", "1", "--lengths", str(LENGTH), "--tasks", "passkey"]
    base += ["--schemes", "proactive-only", "--selector", "topk", "--budget", "0.2", "--blocks", "64"]
    out = tmp_path / "eval.json"
    result = runner.invoke(app, [*base, "--stall-ratio", "1.25", "--json", str(out)])
    assert result.exit_code == 0, result.output
    assert "K_r = 60% of the blocks" in result.output and "top-k recall" in result.output
    data = json.loads(out.read_text())
    assert data["settings"]["stall_ratio"] == 1.25 and data["settings"]["recall_prompts"] == 2
    assert 0 < data["runs"]["proactive-only topk 20%"]["oracle_recall"]["recall"] < 1
    result = runner.invoke(app, [*base, "--recall-prompts", "0"])
    assert result.exit_code == 0 and "K_r = 50% of the blocks" in result.output and "top-k recall" not in result.output
    result = runner.invoke(app, [*base, "--stall-ratio", "0"])
    assert result.exit_code == 2 and "--stall-ratio" in result.output
