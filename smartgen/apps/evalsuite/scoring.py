"""Scoring as RULER and the passkey test do it: references found in the output, or the first number."""

from __future__ import annotations

import re

__all__ = ["clean_prediction", "string_match_all", "string_match_part", "passkey_score", "score_sample"]

_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")
_FIRST_NUMBER = re.compile(r"\d+")


def clean_prediction(prediction: str) -> str:
    """RULER's post-processing: control characters become spaces, then strip."""
    return _CONTROL.sub(" ", prediction).strip()


def string_match_all(prediction: str, references: list[str]) -> float:
    """Fraction of references found in the prediction as case-insensitive substrings (RULER; 0-1, not ×100)."""
    if not references:
        raise ValueError("string_match_all needs at least one reference")
    text = clean_prediction(prediction).lower()
    return sum(ref.lower() in text for ref in references) / len(references)


def string_match_part(prediction: str, references: list[str]) -> float:
    """1.0 if any reference is found (RULER's QA metric)."""
    text = clean_prediction(prediction).lower()
    return float(any(ref.lower() in text for ref in references))


def passkey_score(prediction: str, key: str | int) -> float:
    """1.0 if the first run of digits in the prediction equals the key (landmark-attention / Quest)."""
    match = _FIRST_NUMBER.search(prediction)
    return float(match is not None and int(match.group()) == int(key))


def score_sample(sample, prediction: str) -> float:
    """The task's own metric: passkey's first-number test, RULER's string_match_all for the rest."""
    if sample.task == "passkey":
        return passkey_score(prediction, sample.references[0])
    return string_match_all(prediction, sample.references)
