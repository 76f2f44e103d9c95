"""The scoring behind the built-in reward ``reasoning_gym`` (``rlray.reward.verifiers.reasoning_gym``): a
reasoning-gym generator's own ``score_answer`` on rows of a ``reasoning-gym:`` source (``rlray.data.rgym``).

Each row carries what the score needs (no process global): ``answer`` (the oracle answer, or None) and
``reasoning_gym`` = ``{"dataset": generator name, "config": the generator options of the source, "metadata":
repr(item metadata)}``; the prompt is the item's question. The entry ``{"question", "answer", "metadata"}`` is
rebuilt from them (``ast.literal_eval`` gives the metadata back exactly, tuples and integer keys included) and
scored by ``create_dataset(dataset, **config).score_answer(answer, entry)``, one generator instance per
(name, config) per process. Scores are reasoning-gym's: 1.0 right, 0.0 wrong, and for some generators partial
credit in between (the default scorer gives len(oracle) / len(answer) when the answer contains the oracle).

The answer scored is the text inside the completion's last ``<answer_tag>...</answer_tag>`` (reasoning-gym's own
``extract_answer``, its prompts' convention), None when there is none (every generator scores None 0.0 or a small
format credit); with ``answer_tag: null`` (``reward.functions[].kwargs``) the whole stripped completion is the
answer, and with ``untagged: last_number`` a completion without the tag answers its last number (``last_number``).
A ``score_answer`` that raises on malformed text (prime_factorization's ``int()``) scores 0.0, as the other
verifiers grade odd input; a row without the ``reasoning_gym`` column is skipped (None).

Reference: reasoning-gym, https://github.com/open-thought/reasoning-gym (``ProceduralDataset.score_answer``,
``reasoning_gym.utils.extract_answer``).
"""

from __future__ import annotations

import ast
import functools
import importlib
import json
import logging
import re
from typing import Any

log = logging.getLogger(__name__)


def score_item(item: dict[str, Any], question: Any, oracle: str | None, answer: str | None) -> float:
    """Returns the generator's ``score_answer(answer, entry)`` of one row's item, 0.0 when it raises (module docstring).

    Args:
        item: the row's ``reasoning_gym`` column: ``{"dataset", "config", "metadata"}``.
        question: the row's prompt (the item's question).
        oracle: the row's ``answer`` column.
        answer: the extracted answer (``extract_tagged``), or None.
    """
    entry = {"question": question, "answer": oracle, "metadata": ast.literal_eval(item["metadata"])}
    scorer = _scorer(item["dataset"], json.dumps(item["config"], sort_keys=True))
    try:
        return float(scorer.score_answer(answer, entry))
    except Exception:  # a generator's scorer failing on odd text is a wrong answer, not a crash
        log.debug("reasoning_gym: %s.score_answer failed on %r; 0", item["dataset"], answer, exc_info=True)
        return 0.0


def extract_tagged(text: str, tag: str) -> str | None:
    """Returns the stripped content of the last ``<tag>...</tag>`` of ``text``, or None (reasoning-gym's
    ``extract_answer``: ``"<answer> 12 </answer>"`` gives ``"12"``)."""
    matches = re.findall(rf"<{re.escape(tag)}>(.*?)</{re.escape(tag)}>", text, flags=re.DOTALL)
    return matches[-1].strip() if matches else None


def last_number(text: str) -> str | None:
    """Returns the last number of ``text`` (an optional minus sign, digits, an optional decimal part), or None:
    ``"58 + 26 = 84."`` gives ``"84"``, ``"23 - 60 = -37"`` gives ``"-37"``."""
    matches = re.findall(r"-?\d+(?:\.\d+)?", text)
    return matches[-1] if matches else None


@functools.lru_cache(maxsize=64)
def _scorer(name: str, config_json: str) -> Any:
    """Returns the generator instance that scores items of ``name`` built with the options ``config_json``."""
    rg = importlib.import_module("reasoning_gym")
    return rg.create_dataset(name, **json.loads(config_json))
