"""The evaluation suite: determinism, lengths, references, depths, scoring, and eval/calibration/train apart."""

import pytest

from smartgen.apps.evalsuite import (
    MAX_NEW_TOKENS,
    TASKS,
    Sample,
    filler_sentences,
    generate_suite,
    generate_task,
    passkey_score,
    score_sample,
    string_match_all,
    string_match_part,
    task_depths,
)
from smartgen.apps.evalsuite.surface import TEMPLATES
from smartgen.apps.evalsuite.tokenizer import train_tokenizer


@pytest.fixture(scope="module")
def tokenizer():
    return train_tokenizer()


def test_same_seed_same_prompt_other_seed_other_prompt(tokenizer):
    for task in TASKS:
        a = generate_task(task, 1024, 7, tokenizer)
        b = generate_task(task, 1024, 7, tokenizer)
        c = generate_task(task, 1024, 8, tokenizer)
        assert a == b
        assert a.prompt != c.prompt and a.references != c.references


@pytest.mark.parametrize("length", [1024, 2048, 4096, 8192])
@pytest.mark.parametrize("variant", ["eval", "calibration", "train"])
def test_lengths_within_ten_percent_of_target(tokenizer, length, variant):
    for task in TASKS:
        sample = generate_task(task, length, 3, tokenizer, variant)
        n = len(tokenizer.encode(sample.prompt, add_special_tokens=False))
        assert n == sample.num_tokens
        assert abs(n + MAX_NEW_TOKENS[task] - length) <= 0.1 * length, (task, n)


def test_references_and_needles_are_in_the_prompt(tokenizer):
    for sample in generate_suite(TASKS, [1024], 3, 0, tokenizer):
        for ref in sample.references:
            assert ref in sample.prompt
        assert sample.needle_spans
        needles = [sample.prompt[a:b] for a, b in sample.needle_spans]
        assert all(any(ref in needle for needle in needles) for ref in sample.references)
        assert sample.answer.strip().split() == sample.references or sample.answer.strip() == sample.references[0]


def test_vt_chain_links_each_variable_to_the_last(tokenizer):
    sample = generate_task("vt", 2048, 5, tokenizer)
    first, *rest = sample.references
    assert len(sample.references) == 5
    value = sample.prompt[sample.needle_spans[0][0] :].split("\n")[0].split(" = ")[1]
    assert f"VAR {first} = {value}" in sample.prompt
    for a, b in zip(sample.references, rest):
        assert f"VAR {b} = VAR {a}" in sample.prompt
    assert f"value {value}" in sample.prompt[-300:]


def test_multikey_has_distractor_needles_with_other_keys(tokenizer):
    sample = generate_task("niah_multikey", 2048, 2, tokenizer)
    assert sample.prompt.count("special magic numbers for") == 4
    query_key = sample.prompt.rsplit(" for ", 1)[1].split(" ")[0]
    assert sample.prompt.count(f"for {query_key} is: ") == 1


def test_needles_sit_at_spread_depths(tokenizer):
    assert task_depths(5) == [0.0, 0.25, 0.5, 0.75, 1.0] and task_depths(1) == [0.5]
    suite = generate_suite(["passkey", "niah_single", "kv_retrieval"], [2048], 5, 0, tokenizer)
    for task in ("passkey", "niah_single", "kv_retrieval"):
        cell = [s for s in suite if s.task == task]
        assert [s.depth for s in cell] == task_depths(5)
        where = [s.needle_spans[0][0] / len(s.prompt) for s in cell]
        assert where == sorted(where) and where[0] < 0.15 and where[-1] > 0.85
        for s, w in zip(cell, where):
            assert abs(w - s.depth) < 0.15


def test_eval_and_calibration_never_share_a_prompt_or_a_filler_sentence(tokenizer):
    lengths = [1024, 2048]
    evaluation = generate_suite(TASKS, lengths, 8, 0, tokenizer, variant="eval")
    calibration = generate_suite(TASKS, lengths, 8, 0, tokenizer, variant="calibration")
    train = generate_suite(TASKS, lengths, 4, 0, tokenizer, variant="train")
    prompts = [s.prompt for s in evaluation]
    assert not set(prompts) & {s.prompt for s in calibration}
    assert not set(prompts) & {s.prompt for s in train}
    eval_filler, cal_filler, train_filler = (set(filler_sentences(v)) for v in ("eval", "calibration", "train"))
    assert not eval_filler & cal_filler and not train_filler & (eval_filler | cal_filler)
    for s in calibration:
        assert not any(sentence in s.prompt for sentence in eval_filler)
    for s in evaluation:
        assert not any(sentence in s.prompt for sentence in cal_filler)
    # same seeds give different answers across variants: the seeds are salted by variant
    assert not {tuple(s.references) for s in evaluation} & {tuple(s.references) for s in calibration}


def test_variants_share_no_template():
    def strings(variant):
        return {
            text
            for task in TEMPLATES[variant].values()
            for part, texts in task.items()
            if part != "sep"
            for text in texts
        }

    ev, cal, tr = strings("eval"), strings("calibration"), strings("train")
    assert not ev & cal and not ev & tr and not cal & tr


def test_string_match_all_is_rulers_metric():
    assert string_match_all("The answer: ABC and def.", ["abc", "DEF"]) == 1.0
    assert string_match_all("only abc\x00here", ["abc", "def"]) == 0.5
    assert string_match_all("", ["x"]) == 0.0
    assert string_match_part("abc", ["zzz", "ab"]) == 1.0
    with pytest.raises(ValueError):
        string_match_all("x", [])


def test_passkey_score_takes_the_first_number():
    assert passkey_score(" 12345. Remember it.", "12345") == 1.0
    assert passkey_score("is 0012345", 12345) == 1.0
    assert passkey_score("1234 then 12345", "12345") == 0.0
    assert passkey_score("no digits", "1") == 0.0


def test_score_sample_uses_the_task_metric(tokenizer):
    passkey = generate_task("passkey", 1024, 1, tokenizer)
    assert score_sample(passkey, passkey.answer) == 1.0
    assert score_sample(passkey, "9" + passkey.answer) == 0.0
    vt = generate_task("vt", 1024, 1, tokenizer)
    assert score_sample(vt, " ".join(vt.references[:2])) == pytest.approx(0.4)


def test_sample_checks_itself():
    with pytest.raises(ValueError):
        Sample(prompt="p", references=["1"], task="nope", length=10, depth=0.5, seed=0)
    with pytest.raises(ValueError):
        Sample(prompt="p", references=[], task="passkey", length=10, depth=0.5, seed=0)
    with pytest.raises(ValueError):
        Sample(prompt="p", references=["1"], task="passkey", length=10, depth=1.5, seed=0)


def test_keywords_are_single_tokens(tokenizer):
    from smartgen.apps.evalsuite.surface import KEY_ADJECTIVES, KEY_NOUNS, TASK_KEYWORDS

    assert len(tokenizer) <= 1024
    assert all(len(tokenizer.encode(" " + w, add_special_tokens=False)) == 1 for w in KEY_ADJECTIVES)
    assert all(len(tokenizer.encode("-" + w, add_special_tokens=False)) == 2 for w in KEY_NOUNS)
    assert all(len(tokenizer.encode(w, add_special_tokens=False)) == 1 for w in TASK_KEYWORDS)
    digits = tokenizer.convert_ids_to_tokens(tokenizer.encode("is 2048", add_special_tokens=False))
    assert digits[-4:] == ["2", "0", "4", "8"]


def test_committed_calibration_set_is_apart_from_the_eval_set(tokenizer):
    import json
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "samples" / "calibration.jsonl"
    if not path.exists():
        pytest.skip("samples/calibration.jsonl not generated (python samples/make_calibration.py)")
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(rows) >= 50 and {r["task"] for r in rows} == set(TASKS) and {r["length"] for r in rows} == {1024, 2048}
    assert all({"prompt", "task", "length"} <= set(r) for r in rows)
    evaluation = {s.prompt for s in generate_suite(TASKS, [1024, 2048], 10, 0, tokenizer, variant="eval")}
    assert not evaluation & {r["prompt"] for r in rows}
    assert not any(sentence in r["prompt"] for r in rows for sentence in filler_sentences("eval"))
