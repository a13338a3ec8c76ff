"""`smartgen profile` and `smartgen profiles …` through typer's CliRunner, on a tiny model and tokenizer built here."""

from __future__ import annotations

import json
import sys

import pytest
from sqlite_utils import Database
from test_store import make_profile
from tiny_models import tiny_config
from typer.testing import CliRunner

from smartgen.cli.app import app
from smartgen.runtime.models import model_from_config
from smartgen.store import ProfileStore

runner = CliRunner(env={"COLUMNS": "160"})  # rich wraps tables to the terminal width
WORDS = "the quick brown fox jumps over a lazy dog while seven bright stars shine above the quiet harbor town".split()


def _text(num_words: int, seed: int) -> str:
    return " ".join(WORDS[(seed * 7 + i * 3) % len(WORDS)] for i in range(num_words))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A 4-layer Llama and a byte-level BPE (vocab 300) saved like a Hugging Face checkpoint."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    folder = tmp_path_factory.mktemp("tiny-llama")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<pad>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([_text(40, seed) for seed in range(50)], trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    tokenizer.save_pretrained(folder)
    config = tiny_config("llama")
    config.vocab_size = len(tokenizer)
    model_from_config(config).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def calibration(tmp_path_factory):
    path = tmp_path_factory.mktemp("cal") / "calibration.jsonl"
    lines = [
        json.dumps({"prompt": _text(n, seed), "answer": "ignored"}) for seed, n in enumerate((6, 9, 12, 40, 50, 60))
    ]
    path.write_text("\n".join(lines) + "\n")
    return path


def _ok(result):
    assert result.exit_code == 0, result.output
    return result.output


def _error(result, message: str) -> str:
    assert result.exit_code != 0
    assert "Traceback" not in result.output
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert any(line.startswith("error: ") and message in line for line in lines), result.output
    return result.output


@pytest.fixture
def db(tmp_path):
    """A store with three synthetic profiles: two of one model at two length ranges, one of another."""
    path = tmp_path / "profiles.db"
    with ProfileStore(path) as store:
        store.add(make_profile(1024, 2048, seed=1))
        store.add(make_profile(2048, 4096, seed=2))
        store.add(make_profile(1024, 2048, fingerprint="e" * 64, seed=3, layers=6))
    return path


# -- smartgen profile ------------------------------------------------------------------------------
def test_profile_a_tiny_model(model_dir, calibration, tmp_path):
    db = tmp_path / "p.db"
    args = [
        "profile",
        "--model",
        str(model_dir),
        "--calibration",
        str(calibration),
        "--selector",
        "topk",
        "--budget",
        "0.25",
        "--blocks",
        "16",
        "--ranges",
        "1-30,30-200,400-500",
        "--decode-tokens",
        "2",
        "--db",
        str(db),
    ]
    output = _ok(runner.invoke(app, args))
    assert "stored 2 profile(s)" in output
    assert "no calibration prompt has 400-500 tokens" in output
    assert "proactive budget K_r" in output and "32 Gbit/s" in output
    assert "█" in output or "▓" in output  # the heat map
    with ProfileStore(db) as store:
        short, long = store.list()
    assert (short.length_lo, short.length_hi, long.length_lo, long.length_hi) == (1, 30, 30, 200)
    assert short.num_prompts == 3 and long.num_prompts == 3
    assert short.selector == "topk" and short.selector_params == {"budget": 0.25}
    assert short.calibration == "calibration.jsonl" and short.model == str(model_dir) and short.link == "rate:15gbps"
    assert short.importance.shape == (4, 16)


def test_profile_measured_link_and_limit(model_dir, calibration, tmp_path):
    db = tmp_path / "p.db"
    args = [
        "profile",
        "--model",
        str(model_dir),
        "--calibration",
        str(calibration),
        "--selector",
        "quest",
        "--blocks",
        "8",
        "--ranges",
        "30-200",
        "--decode-tokens",
        "1",
        "--limit",
        "1",
        "--measure-link",
        "--link-gbps",
        "1",
        "--db",
        str(db),
    ]
    _ok(runner.invoke(app, args))
    with ProfileStore(db) as store:
        [stored] = store.list()
    assert stored.num_prompts == 1 and stored.link == "inproc:1gbps"


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("", "holds no prompts"),
        ('{"prompt": "a"}\nnot json\n', "calibration.jsonl:2: not JSON"),
        ('{"question": "a"}\n', 'expected an object with a "prompt" string'),
    ],
)
def test_profile_bad_calibration(model_dir, tmp_path, content, message):
    path = tmp_path / "calibration.jsonl"
    path.write_text(content)
    _error(
        runner.invoke(
            app, ["profile", "--model", str(model_dir), "--calibration", str(path), "--db", str(tmp_path / "p.db")]
        ),
        message,
    )


def test_profile_errors(model_dir, calibration, tmp_path):
    base = ["--calibration", str(calibration), "--db", str(tmp_path / "p.db")]
    _error(runner.invoke(app, ["profile", "--model", str(tmp_path / "nothing"), *base]), "no model folder")
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "config.json").write_text("{not json")
    _error(runner.invoke(app, ["profile", "--model", str(tmp_path / "broken"), *base]), "cannot load a model")
    _error(
        runner.invoke(
            app, ["profile", "--model", str(model_dir), *base, "--calibration", str(tmp_path / "absent.jsonl")]
        ),
        "no calibration file",
    )
    _error(
        runner.invoke(app, ["profile", "--model", str(model_dir), *base, "--ranges", "5000-6000"]),
        "no calibration prompt falls in 5000-6000",
    )
    _error(
        runner.invoke(app, ["profile", "--model", str(model_dir), *base, "--ranges", "2048-1024"]), "bad length range"
    )
    _error(
        runner.invoke(app, ["profile", "--model", str(model_dir), *base, "--budget", "0"]), "--budget must be positive"
    )
    missing_dir = ["--db", str(tmp_path / "no" / "dir" / "p.db")]
    _error(
        runner.invoke(app, ["profile", "--model", str(model_dir), "--calibration", str(calibration), *missing_dir]),
        "does not exist",
    )


def test_png_without_matplotlib(model_dir, calibration, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    args = [
        "profile",
        "--model",
        str(model_dir),
        "--calibration",
        str(calibration),
        "--png",
        str(tmp_path / "h.png"),
        "--db",
        str(tmp_path / "p.db"),
    ]
    _error(runner.invoke(app, args), "--png needs matplotlib: pip install 'smartgen[plot]'")


def test_default_database_from_the_environment(tmp_path, monkeypatch, db):
    monkeypatch.setenv("SMARTGEN_DB", str(db))
    assert "1024-2048" in _ok(runner.invoke(app, ["profiles", "list"]))
    monkeypatch.delenv("SMARTGEN_DB")
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "xdg"))
    first = _ok(runner.invoke(app, ["profiles", "list"]))  # a first run: nothing stored yet is not an error
    assert (
        f"no profiles yet; `smartgen profile` stores them in {tmp_path / 'xdg' / 'smartgen' / 'profiles.db'}" in first
    )
    _error(runner.invoke(app, ["profiles", "show", "1"]), "no profile database at")


# -- smartgen profiles -----------------------------------------------------------------------------
def test_list_and_show(db):
    output = _ok(runner.invoke(app, ["profiles", "list", "--db", str(db)]))
    for text in ("1024-2048", "2048-4096", "ffffffffffff", "eeeeeeeeeeee", "quest budget=0.1"):
        assert text in output
    listed = json.loads(_ok(runner.invoke(app, ["profiles", "list", "--db", str(db), "--json"])))
    assert [p["id"] for p in listed] == [1, 2, 3] and listed[0]["lengths"] == "[1024, 2048)"
    output = _ok(runner.invoke(app, ["profiles", "show", "2", "--db", str(db)]))
    assert "profile #2" in output and "proactive budget K_r" in output and "calibration.jsonl" in output
    shown = json.loads(_ok(runner.invoke(app, ["profiles", "show", "2", "--db", str(db), "--json"])))
    assert shown["id"] == 2 and shown["k_r"] == make_profile(2048, 4096).k_r()


def test_rm(db):
    assert "removed profile 2" in _ok(runner.invoke(app, ["profiles", "rm", "2", "--db", str(db)]))
    with ProfileStore(db) as store:
        assert [p.id for p in store.list()] == [1, 3]
    _error(runner.invoke(app, ["profiles", "rm", "2", "--db", str(db)]), "no profile 2")


def test_export_and_import(db, tmp_path):
    exported = json.loads(_ok(runner.invoke(app, ["profiles", "export", "1", "--db", str(db), "--format", "json"])))
    assert exported["format"] == "smartgen-profile" and exported["importance"]["shape"] == [4, 8]
    target = tmp_path / "p1.json"
    _ok(runner.invoke(app, ["profiles", "export", "1", "--db", str(db), "-o", str(target)]))
    other = tmp_path / "other.db"
    assert "imported profile 1" in _ok(runner.invoke(app, ["profiles", "import", str(target), "--db", str(other)]))
    with ProfileStore(db) as a, ProfileStore(other) as b:
        assert a.get(1).importance.numpy().tobytes() == b.get(1).importance.numpy().tobytes()
    assert "imported profile 2" in _ok(
        runner.invoke(app, ["profiles", "import", "-", "--db", str(other)], input=target.read_text())
    )
    (tmp_path / "bad.json").write_text("{")
    _error(runner.invoke(app, ["profiles", "import", str(tmp_path / "bad.json"), "--db", str(other)]), "is not JSON")
    (tmp_path / "bad.json").write_text('{"format": "something else"}')
    _error(
        runner.invoke(app, ["profiles", "import", str(tmp_path / "bad.json"), "--db", str(other)]),
        "not a SmartGen profile export",
    )
    _error(runner.invoke(app, ["profiles", "export", "9", "--db", str(db)]), "no profile 9")


def test_compare(db):
    output = _ok(runner.invoke(app, ["profiles", "compare", "1", "2", "--db", str(db)]))
    assert "recall" in output and "Jaccard" in output and "10% of layers >= 2" in output
    output = _ok(runner.invoke(app, ["profiles", "compare", "1", "1", "--db", str(db), "--k-r", "20"]))
    assert "1.000" in output
    output = _ok(runner.invoke(app, ["profiles", "compare", "1", "2", "--db", str(db), "--k-r", "32"]))
    assert "covers every block" in output
    _error(runner.invoke(app, ["profiles", "compare", "1", "3", "--db", str(db)]), "different shapes")
    _error(runner.invoke(app, ["profiles", "compare", "1", "7", "--db", str(db)]), "no profile 7")


def test_profiles_errors(db, tmp_path):
    _error(runner.invoke(app, ["profiles", "show", "1", "--db", str(tmp_path / "absent.db")]), "no profile database at")
    _error(runner.invoke(app, ["profiles", "show", "99", "--db", str(db)]), "no profile 99")
    (tmp_path / "junk.db").write_bytes(b"junk" * 1000)
    _error(
        runner.invoke(app, ["profiles", "list", "--db", str(tmp_path / "junk.db")]), "not a SmartGen profile database"
    )
    Database(db).table("_migrations").insert({"name": "m002_future", "applied_at": "2030"})
    _error(runner.invoke(app, ["profiles", "list", "--db", str(db)]), "newer SmartGen")


def test_profile_hata_trains_and_stores_its_hash_weights_once(model_dir, calibration, tmp_path):
    """HATA's weights are a step of `smartgen profile`, kept in the store, reused, and read by `smartgen eval`."""
    from smartgen.runtime.fingerprint import model_fingerprint
    from smartgen.runtime.models import load_model
    from smartgen.selectors.hata import weights_from_bytes

    db = tmp_path / "p.db"
    args = ["profile", "--model", str(model_dir), "--calibration", str(calibration), "--selector", "hata"]
    args += ["--blocks", "8", "--ranges", "30-200", "--decode-tokens", "1", "--db", str(db), "--hata-steps", "3"]
    args += ["--hata-prompts", "4"]
    output = _ok(runner.invoke(app, args))
    assert "HATA hash weights #1" in output and "trained in" in output and "stored 1 profile(s)" in output
    fingerprint = model_fingerprint(load_model(model_dir))
    with ProfileStore(db) as store:
        record = store.hash_weights(fingerprint)
        [profile] = store.list()
    assert record is not None and record.id == 1 and record.rbit == 128 and record.steps == 3
    assert record.num_prompts == 4 and record.calibration == "calibration.jsonl" and record.num_layers == 2
    weights = weights_from_bytes(record.weights)
    assert sorted(weights) == [2, 3] and weights[2].shape[2] == 128  # layers >= 2, [H, d, rbit]
    assert profile.selector == "hata" and profile.selector_params == {"budget": 0.1, "weights": "store:1"}
    again = _ok(runner.invoke(app, args))
    assert "HATA hash weights #1" in again and "from the store" in again
    retrained = _ok(runner.invoke(app, [*args, "--retrain-hata"]))
    assert "HATA hash weights #2" in retrained and "trained in" in retrained
    with ProfileStore(db) as store:
        assert [r.id for r in store.list_hash_weights(fingerprint)] == [1, 2]
        assert [p.selector_params["weights"] for p in store.list()] == ["store:1", "store:1", "store:2"]
    evaluated = runner.invoke(
        app,
        ["eval", "--model", str(model_dir), "--schemes", "smartgen", "--selector", "hata", "--tasks", "passkey"]
        + ["--lengths", "200", "--num", "1", "--blocks", "8", "--recall-prompts", "0", "--db", str(db)],
        env={"COLUMNS": "200"},
    )
    assert evaluated.exit_code == 0, evaluated.output
    assert f"HATA weights: #2 from {db}" in " ".join(evaluated.output.split())
