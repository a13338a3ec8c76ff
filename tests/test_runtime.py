"""The model runtime against Hugging Face's own generate, for every supported family."""

import copy

import pytest
import torch
from conftest import wait_until
from tiny_models import FAMILIES, hf_greedy, tiny_config
from transformers import AutoModelForCausalLM

from smartgen.engine.policy import get_policy
from smartgen.runtime.models import ModelLoadError, load_model, model_from_config
from smartgen.runtime.pipeline import InprocPipeline
from smartgen.runtime.sampling import Sampler

NEW_TOKENS = 8


def _prompt(length: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(3, 97, (length,), generator=torch.Generator().manual_seed(seed))


def _hf(model, prompt: torch.Tensor):
    return hf_greedy(model, prompt, NEW_TOKENS)


@pytest.fixture(scope="module", params=FAMILIES)
def family_model(request):
    return request.param, model_from_config(tiny_config(request.param))


def test_dense_all_local_equals_hf_generate(family_model):
    family, model = family_model
    prompt = _prompt(40)
    expected, expected_logits = _hf(model, prompt)
    with InprocPipeline(model, get_policy("full"), "dense", num_blocks=16) as pipeline:
        [result] = pipeline.generate([prompt], NEW_TOKENS, keep_logits=True)
    assert result.tokens == expected, family
    for ours, theirs in zip(result.logits, expected_logits[1:]):
        torch.testing.assert_close(ours, theirs.float(), atol=1e-4, rtol=1e-4)


def test_smartgen_attention_equals_the_family_s_own_eager_attention(family_model):
    """The hook against an independent reference: the same weights under transformers' eager attention (a
    soft-capping family's eager path once took the SDPA mask interface's booleans as logits to add)."""
    family, model = family_model
    reference = AutoModelForCausalLM.from_config(copy.deepcopy(model.config), attn_implementation="eager")
    reference.load_state_dict(model.state_dict())
    ids = _prompt(40)[None]
    with torch.no_grad():
        ours, theirs = model(input_ids=ids).logits, reference.eval()(input_ids=ids).logits
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=1e-4, msg=family)


def test_padded_batch_equals_each_prompt_alone(family_model):
    family, model = family_model
    prompts = [_prompt(40, seed=2), _prompt(23, seed=3), _prompt(9, seed=4)]
    expected = [_hf(model, p)[0] for p in prompts]
    with InprocPipeline(model, get_policy("full"), "dense", num_blocks=16) as pipeline:
        results = pipeline.generate(prompts, NEW_TOKENS)
    assert [r.tokens for r in results] == expected, family


def test_dense_with_kv_split_between_lanes_equals_all_local(family_model):
    """Partial transfer: most KV is fetched on demand while decoding; the numbers must not change."""
    family, model = family_model
    prompts = [_prompt(40, seed=5), _prompt(31, seed=6)]
    with InprocPipeline(model, get_policy("full"), "dense", num_blocks=16) as pipeline:
        local = pipeline.generate(prompts, NEW_TOKENS, keep_logits=True)
    with InprocPipeline(model, get_policy("partial"), "dense", num_blocks=16) as pipeline:
        split = pipeline.generate(prompts, NEW_TOKENS, keep_logits=True)
    for a, b in zip(local, split):
        assert a.tokens == b.tokens, "lanes must never change the output"
        # fetched (remote-first) rows sum in another order than local spans: equal up to rounding
        for x, y in zip(a.logits, b.logits):
            torch.testing.assert_close(x, y, atol=1e-5, rtol=1e-5)
    if family not in ("gemma3", "gemma2"):  # gemma's sliding layers keep only a window, which may all be local
        assert any(r.metrics.remote_entries > 0 for r in split)


def test_sampling_is_seeded():
    model = model_from_config(tiny_config("llama"))
    prompt = _prompt(30)
    runs = []
    for _ in range(2):
        with InprocPipeline(
            model, get_policy("full"), "dense", num_blocks=16, sampler=Sampler(temperature=1.0, top_p=0.9, seed=7)
        ) as p:
            runs.append(p.generate([prompt], NEW_TOKENS)[0].tokens)
    assert runs[0] == runs[1]
    with pytest.raises(ValueError):
        Sampler(top_p=0.0)


def test_eos_ends_a_request_early():
    model = model_from_config(tiny_config("llama"))
    prompt = _prompt(30)
    expected, _ = _hf(model, prompt)
    eos = expected[2]
    with InprocPipeline(model, get_policy("full"), "dense", num_blocks=16) as pipeline:
        [result] = pipeline.generate([prompt], NEW_TOKENS, eos_token_id=eos)
    assert result.tokens == expected[: expected.index(eos) + 1]


def test_load_from_a_local_folder(tmp_path):
    model = model_from_config(tiny_config("qwen3"))
    model.save_pretrained(tmp_path / "m")
    loaded = load_model(tmp_path / "m")
    prompt = _prompt(20)
    assert _hf(loaded, prompt)[0] == _hf(model, prompt)[0]
    with pytest.raises(ModelLoadError, match="no model folder"):
        load_model(tmp_path / "missing")
    (tmp_path / "bad").mkdir()
    with pytest.raises(ModelLoadError, match="cannot load"):
        load_model(tmp_path / "bad")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_runs_and_stays_close_to_hf(dtype):
    model = model_from_config(tiny_config("llama")).to(dtype)
    prompt = _prompt(24)
    expected, expected_logits = _hf(model, prompt)
    with InprocPipeline(model, get_policy("partial"), "dense", num_blocks=16) as pipeline:
        [result] = pipeline.generate([prompt], NEW_TOKENS, keep_logits=True)
    assert result.tokens[0] == expected[0]  # the first token comes from the same prefill
    # our decode attention accumulates in fp32, SDPA in the model dtype: close, not equal
    torch.testing.assert_close(result.logits[0], expected_logits[1].float(), atol=0.15, rtol=0.05)


def test_infinigen_reads_each_family_s_query(family_model):
    """InfiniGen rebuilds the next layer's query from the attention input: q/k norms and fused projections too."""
    family, model = family_model
    policy = get_policy("smartgen", strategy="streaming")
    with InprocPipeline(model, policy, "infinigen", {"budget": 0.5}, num_blocks=16) as pipeline:
        [result] = pipeline.generate([_prompt(40, seed=8)], 4)
    assert len(result.tokens) == 4, family


def test_a_model_loaded_the_plain_way_is_refused_clearly():
    from transformers import AutoModelForCausalLM

    from smartgen.runtime.models import ModelLoadError

    plain = AutoModelForCausalLM.from_config(tiny_config("llama"), attn_implementation="sdpa")
    with pytest.raises(ModelLoadError, match="not through SmartGen's hook: load it with"):
        InprocPipeline(plain, get_policy("partial"), "dense", num_blocks=16)


def test_a_family_without_what_the_runtime_needs_is_refused_on_every_path():
    from transformers import AutoModelForCausalLM, GPTNeoXConfig

    from smartgen.runtime.decode import DecodeRunner
    from smartgen.runtime.models import ModelLoadError
    from smartgen.runtime.prefill import PrefillRunner

    neox = AutoModelForCausalLM.from_config(
        GPTNeoXConfig(vocab_size=97, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=96)
    )
    for entry in (
        lambda: InprocPipeline(neox, get_policy("partial"), "dense", num_blocks=16),
        lambda: PrefillRunner(neox, None),
        lambda: DecodeRunner(neox, None, None),
        lambda: model_from_config(neox.config),
    ):
        with pytest.raises(ModelLoadError, match="is not supported"):
            entry()


def test_a_family_our_attention_cannot_reach_is_refused_before_transformers_builds_it(tmp_path):
    """Falcon's attention dispatch knows no registered function: building it under "smartgen" dies inside
    transformers (KeyError). It is refused from its config alone, on every entry point, with the reason."""
    from transformers import FalconConfig
    from typer.testing import CliRunner

    from smartgen.cli.app import app

    config = FalconConfig(
        vocab_size=97, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, new_decoder_architecture=True
    )
    config.save_pretrained(tmp_path / "falcon")  # a config and no weights: the refusal must not need them
    reason = "model type 'falcon' is not supported: its decoder layers are not at model.model.layers"
    with pytest.raises(ModelLoadError, match=reason):
        model_from_config(config)
    assert config._attn_implementation != "smartgen"  # the check leaves the caller's config as it was
    with pytest.raises(ModelLoadError, match=reason):
        load_model(tmp_path / "falcon")
    folder = str(tmp_path / "falcon")
    for args in (
        ["profile", "--model", folder, "--db", str(tmp_path / "p.db")],
        ["eval", "--model", folder],
        ["serve", "--role", "both", "--model", folder, "--http", "127.0.0.1:0"],
        ["serve", "--role", "prefill", "--model", folder, "--listen", "127.0.0.1:0"],
    ):
        result = CliRunner().invoke(app, args, env={"SMARTGEN_SECRET": "s"})
        assert result.exit_code == 2 and reason in result.output and "Traceback" not in result.output, args


def test_a_device_this_machine_lacks_is_refused_with_the_reason_on_every_entry_point(tmp_path):
    from typer.testing import CliRunner

    from smartgen.apps.bench import BenchConfig
    from smartgen.cli.app import app
    from smartgen.runtime.models import check_device

    assert check_device("cpu") == torch.device("cpu")
    with pytest.raises(ModelLoadError, match="'banana' is not a torch device"):
        check_device("banana")
    with pytest.raises(ModelLoadError, match="runs on cpu or cuda devices"):
        check_device("meta")
    if not torch.cuda.is_available():
        with pytest.raises(ModelLoadError, match="'cuda:0': this machine has no CUDA device"):
            load_model(tmp_path, device="cuda:0")  # before the folder is even read
        with pytest.raises(ValueError, match="--device: device 'cuda': this machine has no CUDA device"):
            BenchConfig(device="cuda")
        result = CliRunner().invoke(
            app, ["serve", "--role", "both", "--model", "samples/sample-model", "--device", "cuda"]
        )
        assert result.exit_code == 2 and "no CUDA device" in result.output and "Traceback" not in result.output


def test_a_policy_whose_budget_cannot_be_known_is_refused():
    model = model_from_config(tiny_config("llama"))
    with pytest.raises(ValueError, match="plans with a profile: pass importance="):
        InprocPipeline(model, get_policy("smartgen"), "dense", num_blocks=16)
    with pytest.raises(ValueError, match="pass prefill_seconds_per_token="):
        InprocPipeline(model, get_policy("smartgen", strategy="streaming"), "dense", num_blocks=16, gbps=1.0)
    with InprocPipeline(
        model,
        get_policy("smartgen", strategy="streaming"),
        "dense",
        num_blocks=16,
        gbps=1.0,
        prefill_seconds_per_token=1e-6,
    ) as pipeline:  # the transfer time comes from the link rate (8x the prefill here): K_r is below every block
        assert pipeline.prefill_engine.planner.budget(64, "budget") < pipeline.layout.num_layers * 16


def test_a_failing_prefill_surfaces_its_own_error_and_frees_everything(capfd):
    model = model_from_config(tiny_config("llama"))

    def broken(layer, k, v):
        raise RuntimeError("the quantizer broke")

    with InprocPipeline(model, get_policy("partial"), "dense", num_blocks=16, kv_transform=broken) as pipeline:
        with pytest.raises(RuntimeError, match="the quantizer broke"):
            pipeline.generate([_prompt(20), _prompt(30, seed=2)], 4)
        assert pipeline.decode_engine.pool.num_free == 8
        wait_until(lambda: pipeline.prefill_engine.store.num_requests == 0, 30, "the prefill side to free both")
    assert "Traceback" not in capfd.readouterr().err
