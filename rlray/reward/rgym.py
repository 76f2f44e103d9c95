"""The built-in reward ``reasoning_gym``: a reasoning-gym generator's own ``score_answer`` on rows of a
``reasoning-gym:`` source (``rlray.data.rgym``).

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
answer. A ``score_answer`` that raises on malformed text (prime_factorization's ``int()``) scores 0.0, as the
other verifiers grade odd input; a row without the ``reasoning_gym`` column is skipped (None).

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


def reasoning_gym(prompts: list, completions: list, *, answer_tag: str | None = "answer", **columns: Any
                  ) -> list[float | None]:  # fmt: skip
    """Returns each completion's reasoning-gym score in [0, 1] (module docstring), None where the row has no item.

    Args:
        prompts: B prompts (the items' questions, strings).
        completions: B completions (strings, or TRL conversational completions).
        answer_tag: the tag around the answer (``<answer>...</answer>``); None scores the whole stripped text.
        **columns: the rows' columns; reads ``answer`` and ``reasoning_gym`` (B values each).

    Raises:
        ModuleNotFoundError: reasoning-gym is not installed (the data source could not have been built either).
    """
    from rlray.reward.verifiers import completion_text  # the module that lists the built-ins imports this one

    items = columns.get("reasoning_gym") or [None] * len(completions)
    answers = columns.get("answer") or [None] * len(completions)
    out: list[float | None] = []
    for prompt, completion, item, oracle in zip(prompts, completions, items, answers, strict=True):
        if not isinstance(item, dict):
            out.append(None)
            continue
        text = completion_text(completion)
        answer = text.strip() if answer_tag is None else extract_tagged(text, answer_tag)
        entry = {"question": prompt, "answer": oracle, "metadata": ast.literal_eval(item["metadata"])}
        scorer = _scorer(item["dataset"], json.dumps(item["config"], sort_keys=True))
        try:
            out.append(float(scorer.score_answer(answer, entry)))
        except Exception:  # a generator's scorer failing on odd text is a wrong answer, not a crash
            log.debug("reasoning_gym: %s.score_answer failed on %r; 0", item["dataset"], answer, exc_info=True)
            out.append(0.0)
    return out


def extract_tagged(text: str, tag: str) -> str | None:
    """Returns the stripped content of the last ``<tag>...</tag>`` of ``text``, or None (reasoning-gym's
    ``extract_answer``: ``"<answer> 12 </answer>"`` gives ``"12"``)."""
    matches = re.findall(rf"<{re.escape(tag)}>(.*?)</{re.escape(tag)}>", text, flags=re.DOTALL)
    return matches[-1].strip() if matches else None


@functools.lru_cache(maxsize=64)
def _scorer(name: str, config_json: str) -> Any:
    """Returns the generator instance that scores items of ``name`` built with the options ``config_json``."""
    rg = importlib.import_module("reasoning_gym")
    return rg.create_dataset(name, **json.loads(config_json))
