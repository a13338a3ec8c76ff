"""`smartgen eval` mechanics on a tiny random model: scheme wiring, proactive-only drops, quant2 at the hand-off, the CLI.

Scores are ~0 on a random model; what is tested is what each scheme moves and attends.
"""

import json

import pytest
import torch
from tiny_models import save_tiny_model
from typer.testing import CliRunner

from smartgen.apps.evalsuite import generate_suite
from smartgen.apps.evaluation import Condition, EvalReport, SampleResult, SchemeRun, evaluate
from smartgen.apps.quantization import KVQuantConfig, KVQuantizer, quantize_kv
from smartgen.apps.simulate import SimulationConfig, calibrate, simulate
from smartgen.apps.synthetic import SyntheticTrace
from smartgen.cli.app import app
from smartgen.engine.policy import POLICIES, get_policy
from smartgen.runtime.models import load_model
from smartgen.runtime.pipeline import InprocPipeline
from smartgen.runtime.prefill import PrefillRunner
from smartgen.selectors import make_selector
from smartgen.selectors.base import StepQuery

LENGTH = 256
QUANT = KVQuantConfig(bits=2, group=8, residual=16)
runner = CliRunner()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from transformers import AutoTokenizer

    folder = save_tiny_model(tmp_path_factory.mktemp("tiny"))
    return folder, load_model(folder), AutoTokenizer.from_pretrained(folder)


@pytest.fixture(scope="module")
def samples(tiny):
    return generate_suite(["passkey", "niah_single"], [LENGTH], 2, 0, tiny[2])


def _run(tiny, samples, scheme, selector="quest", budget=0.5, **kwargs):
    _, model, tokenizer = tiny
    report = evaluate(model, tokenizer, samples, scheme, selector, {"budget": budget}, num_blocks=64, **kwargs)
    [run] = report.runs.values()
    return run


def test_streaming_selector_rows():
    info = model_info_stub()
    selector = make_selector("streaming", info, budget=0.2, sinks=4)
    index = selector.select(StepQuery(2, None, None, torch.tensor([100, 30]), [100, 30]), [{}, {}])
    assert index.shape == (4, 20)
    assert index[0].tolist() == [0, 1, 2, 3, *range(84, 100)] and torch.equal(index[0], index[1])
    assert index[2].tolist() == [0, 1, 2, 3, 28, 29] + [-1] * 14  # 20% of 30 = 6 tokens, padded
    assert make_selector("streaming", info, budget=3, sinks=4).select(
        StepQuery(2, None, None, torch.tensor([50]), [50]), [{}]
    )[0].tolist() == [0, 1, 2]
    assert make_selector("streaming", info, budget=1.0).select(StepQuery(2, None, None, torch.tensor([9]), [9]), [{}])[
        0
    ].tolist() == list(range(9))
    with pytest.raises(ValueError):
        make_selector("streaming", info, budget=0)


def model_info_stub():
    from smartgen.selectors.base import ModelInfo

    return ModelInfo(num_layers=4, num_q_heads=4, num_kv_heads=2, head_dim=16, hidden_size=64)


def test_full_cache_equals_the_dense_reference(tiny, samples):
    _, model, tokenizer = tiny
    run = _run(tiny, samples, "full-cache")
    assert run.selector == "dense" and run.strategy is None
    for sample, result in zip(samples, run.results):
        ids = torch.tensor([tokenizer(sample.prompt)["input_ids"]])
        with torch.no_grad():
            out = model.generate(
                ids,
                max_new_tokens=sample.max_new_tokens,
                do_sample=False,
                eos_token_id=tokenizer.eos_token_id,
                pad_token_id=tokenizer.pad_token_id,
            )
        assert result.prediction == tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)
        assert result.remote_entries == 0 and result.fetched_tokens == 0


def test_proactive_only_never_fetches_and_attends_less(tiny, samples):
    smartgen = _run(tiny, samples, "smartgen", stall_ratio=5.0)
    dropped = _run(tiny, samples, "proactive-only", stall_ratio=5.0)
    # 4 layers at T_t = 5 T_p: K_r is the floor, layers 0-1, so layers 2-3 get no prompt KV at all
    assert smartgen.proactive_share == dropped.proactive_share == 0.5
    assert smartgen.strategy == dropped.strategy == "streaming"
    assert sum(r.fetched_tokens for r in smartgen.results) > 0
    compared = 0
    for full, kept in zip(smartgen.results, dropped.results):
        assert kept.fetched_tokens == 0 and kept.remote_entries == 0
        if full.new_tokens > 1 and kept.new_tokens > 1:  # answers may end at EOS at different steps: per decode step
            assert kept.selected_entries / (kept.new_tokens - 1) < full.selected_entries / (full.new_tokens - 1)
            compared += 1
    assert compared


def test_proactive_only_in_the_engine_drops_exactly_the_unsent_entries():
    from smartgen.engine.layout import KVLayout

    layout = KVLayout(num_layers=4, num_kv_heads=2, head_dim=8, dtype=torch.float32, num_blocks=16)
    cfg = SimulationConfig(
        layout=layout, lengths=(160,), steps=5, select_ratio=0.2, gbps=0.05, prefill_seconds_per_token=1e-4
    )
    importance = calibrate(cfg, SyntheticTrace(4, 2, ratio=0.2))
    kept = simulate(cfg, POLICIES["proactive-only"], importance)
    fetched = simulate(cfg, POLICIES["partial+profile+parallel"], importance)  # the same plan, remote entries fetched
    assert kept.mismatches == 0 and kept.path_bytes["on_demand"] == 0 and kept.path_bytes["speculative"] == 0
    assert kept.path_bytes["proactive"] == fetched.path_bytes["proactive"] and fetched.path_bytes["on_demand"] > 0
    assert kept.requests[0]["fetched_tokens"] == 0 and kept.requests[0]["on_demand_ratio"] == 0
    assert fetched.requests[0]["fetched_tokens"] > 0
    assert not kept.all_local and kept.prefill_requests_left == 0


def test_proactive_only_policy():
    policy = get_policy("proactive-only", strategy="streaming")
    assert policy.drop_remote and not policy.speculative and policy.proactive == "budget"
    assert not any(p.drop_remote for name, p in POLICIES.items() if name != "proactive-only")


def test_quant2_quantizes_the_kv_at_the_hand_off(tiny, samples):
    _, model, tokenizer = tiny
    ids = tokenizer(samples[0].prompt)["input_ids"]
    handed: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    PrefillRunner(model, None).run(ids, on_layer=lambda layer, k, v, meta: handed.__setitem__(layer, (k, v)))
    with InprocPipeline(model, get_policy("full"), "dense", num_blocks=64, kv_transform=KVQuantizer(QUANT)) as pipeline:
        batch, _ = pipeline.prepare([ids], 2)
        slot = pipeline.decode_engine.slot_of(batch.request_ids[0])
        n = len(ids)
        for layer, (k, v) in handed.items():
            k_hat, v_hat = quantize_kv(k, v, QUANT)
            assert torch.equal(pipeline.decode_engine.pool.k[layer, slot, :n], k_hat)
            assert torch.equal(pipeline.decode_engine.pool.v[layer, slot, :n], v_hat)
            assert not torch.equal(k_hat, k)
        pipeline.release(batch.request_ids)


def test_quant2_run_reports_the_transfer_bytes(tiny, samples):
    run = _run(tiny, samples, "quant2", quant=QUANT)
    assert run.selector == "dense" and 0.2 < run.kv_byte_ratio < 0.5
    assert len(run.results) == len(samples)


def test_streamingllm_attends_its_window(tiny, samples):
    full = _run(tiny, samples, "full-cache")
    window = _run(tiny, samples, "streamingllm", budget=0.1)
    assert window.selector == "streaming" and window.selector_params == {"budget": 0.1, "sinks": 4}
    for a, b in zip(full.results, window.results):
        assert b.fetched_tokens == 0
        if a.new_tokens > 1 and b.new_tokens > 1:
            assert b.selected_entries / (b.new_tokens - 1) < a.selected_entries / (a.new_tokens - 1)


def test_conditions_and_labels():
    assert Condition("full-cache").label == "full-cache"
    assert Condition("smartgen", "infinigen", 0.2).label == "smartgen infinigen 20%"
    assert Condition("streamingllm", budget=0.1).label == "streamingllm 10%"
    with pytest.raises(ValueError, match="unknown scheme"):
        Condition("h2o")


def _result(task, score):
    return SampleResult(task, 1024, 0.5, 0, "x", score, 1000, 8, 10, 0, 0)


def test_report_accuracy_relative_and_json():
    full = SchemeRun(
        "full-cache", "full-cache", "dense", {}, [_result("passkey", 1.0), _result("passkey", 1.0), _result("vt", 0.0)]
    )
    sparse = SchemeRun(
        "smartgen quest 10%",
        "smartgen",
        "quest",
        {"budget": 0.1},
        [_result("passkey", 1.0), _result("passkey", 0.0), _result("vt", 1.0)],
    )
    report = EvalReport({"full-cache": full}).merge(EvalReport({sparse.label: sparse}))
    assert report.cells() == [("passkey", 1024), ("vt", 1024)]
    assert report.runs[sparse.label].accuracy() == {("passkey", 1024): 0.5, ("vt", 1024): 1.0}
    assert report.relative(sparse.label) == {("passkey", 1024): 0.5, ("vt", 1024): None}  # the reference scored 0 on vt
    assert report.relative_overall(sparse.label) == pytest.approx(1.0)
    data = json.loads(json.dumps(report.to_json()))
    assert data["runs"][sparse.label]["accuracy"] == {"passkey@1024": 0.5, "vt@1024": 1.0}
    assert data["runs"]["full-cache"]["relative_overall"] == pytest.approx(1.0)


def test_cli_eval_prints_the_table_and_writes_json(tiny, tmp_path, monkeypatch):
    monkeypatch.setenv("SMARTGEN_DB", str(tmp_path / "none.db"))
    out = tmp_path / "eval.json"
    result = runner.invoke(
        app,
        [
            "eval",
            "--model",
            str(tiny[0]),
            "--num",
            "1",
            "--lengths",
            str(LENGTH),
            "--tasks",
            "passkey",
            "--schemes",
            "full-cache,proactive-only,streamingllm,quant2",
            "--budget",
            "0.3",
            "--blocks",
            "64",
            "--quant-group",
            "8",
            "--quant-residual",
            "16",
            "--json",
            str(out),
        ],
    )
    assert result.exit_code == 0, result.output
    for text in ("accuracy", "passkey", "vs full-cache", "quant2", "K_r ="):
        assert text in result.output
    assert "…" not in result.output  # piped (80 columns): cells fold, never get cut
    data = json.loads(out.read_text())
    assert set(data["runs"]) == {"full-cache", "proactive-only quest 30%", "streamingllm 30%", "quant2"}
    assert data["cells"] == [f"passkey@{LENGTH}"] and data["settings"]["quant"] == {
        "bits": 2,
        "group": 8,
        "residual": 16,
    }
    assert len(data["runs"]["quant2"]["samples"]) == 1 and data["runs"]["quant2"]["kv_byte_ratio"] < 1


@pytest.mark.parametrize(
    "args,message",
    [
        (["--schemes", "full-cache,h2o"], "error: --schemes"),
        (["--selector", "dense"], "error: --selector"),
        (["--tasks", "passkey,essay"], "error: --tasks"),
        (["--budget", "0"], "error: --budget"),
        (["--lengths", "abc"], "error: --lengths"),
        (["--quant-group", "0"], "quant-group"),
    ],
)
def test_cli_eval_fails_in_one_line(tiny, args, message):
    result = runner.invoke(app, ["eval", "--model", str(tiny[0]), *args])
    assert result.exit_code == 2
    assert message in result.output


def test_cli_eval_without_a_model_folder(tmp_path):
    result = runner.invoke(app, ["eval", "--model", str(tmp_path / "missing")])
    assert result.exit_code == 2 and "error: no model folder" in result.output


def test_results_keep_the_order_of_the_samples(tiny):
    mixed = generate_suite(["passkey", "niah_single"], [160, LENGTH], 1, 0, tiny[2])
    run = _run(tiny, mixed, "full-cache")
    assert [(r.task, r.length) for r in run.results] == [(s.task, s.length) for s in mixed]


def test_a_profile_gives_importance_and_timings(tiny, samples):
    from types import SimpleNamespace

    profile = SimpleNamespace(
        importance=torch.rand(4, 64), prefill_seconds_per_token=1e-4, transfer_seconds_per_token=1e-4, id=7
    )
    run = _run(tiny, samples, "proactive-only", profiles=lambda length: profile, stall_ratio=None)
    # the profile's timings, T_t = T_p: K_r = L·M·(L-1)/L = 3 of 4 layers' blocks
    assert run.strategy == "profile" and run.profile_ids == [7] and run.proactive_share == 0.75
    # the default stall ratio 4.7 overrides them: (L-1)/(L·4.7) < 2/L, so K_r is the floor, layers 0-1
    assert _run(tiny, samples, "proactive-only", profiles=lambda length: profile).proactive_share == 0.5
    # a stall ratio of 1.25: K_r = 3/(4·1.25) = 60% of the blocks
    assert _run(tiny, samples, "proactive-only", profiles=lambda length: profile, stall_ratio=1.25).proactive_share == (
        pytest.approx(0.6, abs=0.01)
    )


def _stored_profile(fingerprint: str, budget: float, lo: int = 128, hi: int = 512):
    from smartgen.store import Profile

    return Profile(
        model_fingerprint=fingerprint,
        model="tiny",
        selector="quest",
        selector_params={"budget": budget},
        length_lo=lo,
        length_hi=hi,
        calibration="inline",
        calibration_hash="0" * 64,
        num_prompts=1,
        decode_tokens=4,
        mean_length=256.0,
        prefill_seconds=0.01,
        transfer_seconds=0.02,
        kv_bytes_per_token=256,
        link="rate:15",
        importance=torch.rand(4, 64),
    )


def test_store_profiles_prefer_the_same_budget(tiny, tmp_path):
    from smartgen.apps.evaluation import StoreProfiles
    from smartgen.runtime.fingerprint import model_fingerprint
    from smartgen.store import ProfileStore

    db = tmp_path / "profiles.db"
    fingerprint = model_fingerprint(tiny[1])
    with ProfileStore(db) as store:
        ids = {budget: store.add(_stored_profile(fingerprint, budget)) for budget in (0.1, 0.2)}
    profiles = StoreProfiles(db, tiny[1], 64)
    try:
        assert profiles.source("quest", 0.2)(LENGTH).id == ids[0.2]
        assert profiles.source("quest", 0.1)(LENGTH).id == ids[0.1]
        assert profiles.source("quest", 0.3)(LENGTH).id in ids.values()  # no profile at that budget: another one
        assert profiles.source("topk", 0.1) is None
    finally:
        profiles.close()
    result = runner.invoke(
        app,
        [
            "eval",
            "--model",
            str(tiny[0]),
            "--num",
            "1",
            "--lengths",
            str(LENGTH),
            "--tasks",
            "passkey",
            "--schemes",
            "smartgen",
            "--budget",
            "0.2",
            "--blocks",
            "64",
            "--db",
            str(db),
        ],
    )
    assert result.exit_code == 0, result.output
    assert f"proactive set from profile #{ids[0.2]}" in " ".join(result.output.split())
