"""Offline long-context evaluation suite (RULER / passkey style), generated from a seed."""

from smartgen.apps.evalsuite.scoring import passkey_score, score_sample, string_match_all, string_match_part
from smartgen.apps.evalsuite.surface import VARIANTS, filler_sentences
from smartgen.apps.evalsuite.tasks import MAX_NEW_TOKENS, TASKS, Sample, generate_suite, generate_task, task_depths

__all__ = [
    "TASKS",
    "VARIANTS",
    "MAX_NEW_TOKENS",
    "Sample",
    "generate_task",
    "generate_suite",
    "task_depths",
    "filler_sentences",
    "string_match_all",
    "string_match_part",
    "passkey_score",
    "score_sample",
]
