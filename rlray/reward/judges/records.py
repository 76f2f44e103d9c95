"""The judges' records, as plain values: ``JudgeSpec`` (a judge's definition; the Serve user_config), ``JudgeItem``
(one judgement asked), ``JudgeRequest`` (a chunk of them), ``JudgeVerdict`` and ``JudgeReply`` (what comes back),
and ``JudgeError``. The package docstring (``rlray.reward.judges``) describes the modes, templates and scores.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
from dataclasses import dataclass, field
from typing import Any

from rlray.reward.functions import RewardFunctionError

# Why a judgement failed ("" when it did not): its output did not parse; the rendered prompt does not fit the judge's
# max_model_len; the template raised (e.g. an undefined name); the judge serves another mode than the caller asks;
# the judge did not answer (timeouts and errors past the client's tries).
FAILURES = ("", "parse", "too_long", "template", "mode", "unavailable")
RESERVED_VARIABLES = ("prompt", "messages", "response", "responses", "columns")


class JudgeError(RewardFunctionError):
    """A judge that cannot be used (a template that does not render on the data, labels the tokenizer cannot tell
    apart); the message names the ``reward.judges[i]`` key and the fix."""


@dataclass(frozen=True)
class JudgeSpec:
    """One judge's definition, as plain values (the run plan holds one per ``reward.judges[i]``,
    ``rlray.plan.Judge.spec``; ``rlray.launch.judges.judge_specs`` resolves its model path).

    Attributes:
        name: the judge's term name (metric ``reward/<name>``).
        mode: "pointwise" or "group" (a key of ``JUDGE_MODES``; ``modes.judge_mode`` picks the object, with
            ``logprobs`` "label_logprobs").
        model_path: the judge model's local Hugging Face folder.
        template, system_prompt, prefill: Jinja texts (module docstring); system_prompt None: no system turn.
        pattern: the regular expression that finds the score (one group; group mode: position and score).
        labels: (label, number) pairs; empty: the score is a number within [min_score, max_score].
        min_score, max_score: the range of a numeric score (a number outside it fails to parse).
        match: "first" or "last": which match of ``pattern`` counts.
        logprobs: score by the labels' first-token probabilities (pointwise, with labels).
        max_new_tokens: tokens the judge may write (1 with ``logprobs``).
        temperature: the judge's sampling temperature (0.0 greedy).
        seed: the judge's sampling seed, the same at every call.
        backend, dtype, max_model_len, kv_cache_gib, enforce_eager, cpu_threads: the judge's ``RolloutEngine``.
    """

    name: str
    mode: str
    model_path: str
    template: str
    pattern: str
    system_prompt: str | None = None
    prefill: str = ""
    labels: tuple[tuple[str, float], ...] = ()
    min_score: float = 0.0
    max_score: float = 10.0
    match: str = "last"
    logprobs: bool = False
    max_new_tokens: int = 64
    temperature: float = 0.0
    seed: int = 0
    backend: str = "vllm"
    dtype: str = "float32"
    max_model_len: int = 2048
    kv_cache_gib: float = 1.0
    enforce_eager: bool = True
    cpu_threads: str | None = None

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> JudgeSpec:
        """Returns the spec of ``dataclasses.asdict(spec)`` (a Serve user_config, where tuples became lists)."""
        return cls(**{**data, "labels": tuple((str(k), float(v)) for k, v in data.get("labels", ()))})

    @functools.cached_property
    def definition(self) -> str:
        """Returns a short hash of everything that decides a verdict (the model, texts, parse rule and sampling), a
        part of the judge cache's key."""
        fields = dataclasses.asdict(self)
        for engine_only in ("name", "backend", "kv_cache_gib", "enforce_eager", "cpu_threads"):
            fields.pop(engine_only)
        return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:16]


@dataclass(frozen=True)
class JudgeItem:
    """One judgement asked of a judge.

    Attributes:
        prompt: the prompt as the dataset has it (a string or ``{role, content}`` messages).
        responses: the response (pointwise: one) or the G responses in the order shown to the judge (group).
        columns: the prompt row's other columns.
    """

    prompt: str | list[dict[str, Any]]
    responses: tuple[str, ...]
    columns: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class JudgeVerdict:
    """What a judge said about one ``JudgeItem``.

    Attributes:
        scores: one per response in the order shown; NaN where it failed.
        output: the judge's raw output (the prefill, then the generated text); with ``logprobs`` also the labels'
            probabilities; for a failure without output, the reason.
        failure: "" or one of ``FAILURES``.
        prompt_tokens, output_tokens: tokens the judge read and wrote for it.
    """

    scores: tuple[float, ...]
    output: str
    failure: str = ""
    prompt_tokens: int = 0
    output_tokens: int = 0


@dataclass(frozen=True)
class JudgeRequest:
    """A chunk of judgements sent to one judge replica: ``mode`` (what the caller expects the judge to serve) and
    ``items``."""

    mode: str
    items: list[JudgeItem]


@dataclass(frozen=True)
class JudgeReply:
    """A replica's answer to a ``JudgeRequest``.

    Attributes:
        version: the judge's version (``reward.version`` when it was deployed).
        definition: ``JudgeSpec.definition`` of the judge that answered.
        verdicts: one per item, in order.
        judge_s: seconds the replica spent on it (rendering, generating, parsing).
    """

    version: int
    definition: str
    verdicts: list[JudgeVerdict]
    judge_s: float = 0.0
