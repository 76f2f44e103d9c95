"""Config of reward.judges: generative reward models (an LLM judge on its own Ray Serve application), with the
default templates and score patterns of each mode (``MODE_DEFAULTS``; the modes' behaviour, rendering and parsing,
is ``rlray.reward.judges.modes``)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

import jinja2
from pydantic import Field, model_validator

from rlray.config.base import _Section

DEFAULT_TEMPLATES: dict[str, str] = {
    "pointwise": (
        "You are grading a response to a prompt.\n\nPrompt:\n{{ prompt }}\n\nResponse:\n{{ response }}\n\n"
        "How good is the response, from 0 (wrong or useless) to 10 (fully correct and helpful)? "
        "End with one line: Score: <number>"
    ),
    "group": (
        "Below are {{ responses | length }} responses to the same prompt. Score each from 0 to 10, comparing them "
        "with one another: a better response gets a higher score.\n\nPrompt:\n{{ prompt }}\n"
        "{% for r in responses %}\nResponse {{ loop.index }}:\n{{ r }}\n{% endfor %}\n"
        "Answer with one line per response: Response <k>: <score>"
    ),
}
_NUMBER = r"(-?\d+(?:\.\d+)?)"
_POSITION = r"(?i)response\s*(\d+)\s*[:=-]\s*"


@dataclass(frozen=True)
class ModeDefaults:
    """The config's side of a judge mode: its defaults and what validation asks of its entries.

    Attributes:
        template: the built-in Jinja template of the judge's user turn.
        number_prefix, label_prefix: what the default pattern puts before a numeric score, and before the labels.
        groups: the groups ``parse.pattern`` must have, and what they capture (for the message).
        logprobs: ``logprobs=true`` (scoring by the labels' first-token probabilities) is allowed in this mode.
    """

    template: str
    number_prefix: str
    label_prefix: str
    groups: tuple[int, str]
    logprobs: bool


MODE_DEFAULTS: dict[str, ModeDefaults] = {
    "pointwise": ModeDefaults(DEFAULT_TEMPLATES["pointwise"], r"(?i)score\s*[:=]?\s*", r"(?i)\b", (1, "the score"), True),
    "group": ModeDefaults(DEFAULT_TEMPLATES["group"], _POSITION, _POSITION, (2, "the position, then the score"), False),
}
JUDGE_NAME = re.compile(r"^[A-Za-z0-9_-]+$")
RESERVED_TERMS = ("reward", "reward_model", "env", "overlong")


def _labels_pattern(labels: dict[str, float]) -> str:
    """Returns a group matching any of ``labels`` as a whole word, longest first (case-insensitive with the flag)."""
    return "(" + "|".join(re.escape(k) for k in sorted(labels, key=len, reverse=True)) + r")\b"


class JudgeParseConfig(_Section):
    """How a judge's output becomes a score (a failed parse fails the sample's reward, counted, never a zero)."""

    pattern: str | None = Field(
        None,
        description=(
            "Regular expression that finds the score in the judge's output: one group (the score) in pointwise mode, "
            "two (the response's 1-based position as shown, then its score) in group mode. None: 'Score: N' "
            "(pointwise), 'Response K: N' (group), or any of the labels as a word."
        ),
    )
    labels: dict[str, float] = Field(
        default_factory=dict,
        description="Labels the judge writes and their numbers, e.g. {correct: 1.0, wrong: 0.0} (matched "
        "case-insensitively); empty: the score is a number in [min_score, max_score].",
    )
    min_score: float = Field(0.0, description="Lowest numeric score; a number below it fails to parse.")
    max_score: float = Field(10.0, description="Highest numeric score; a number above it fails to parse.")
    match: Literal["first", "last"] = Field(
        "last", description="Which match counts when the pattern matches more than once (per position in group mode)."
    )


class JudgeConfig(_Section):
    """One judge: an LLM on its own Serve application (rlray-judge-<name>) whose verdict is a weighted reward term.

    Logged as reward/<name> (the term's mean) with reward/judge_* (calls, latency, cache hits, parse failures,
    tokens) for all judges together; its raw output is kept with the samples.
    """

    name: str = Field("judge", description="Term name (metric reward/<name>, Serve application rlray-judge-<name>).")
    path: str = Field(
        ..., description="The judge model: a Hugging Face folder, a Hub id (org/name), a .gguf file or an alias (as model.path)."
    )
    revision: str | None = Field(
        None,
        description="The Hub revision (branch, tag or commit hash) of a Hub id in this judge's path; null: the repository's "
        "default branch. Ignored for folders, .gguf files and aliases.",
    )
    weight: float = Field(1.0, description="Weight of the judge's score in the summed reward.")
    mode: Literal["pointwise", "group"] = Field(
        "pointwise",
        description=(
            "pointwise: one call per response; group: the G responses of a prompt in one call, scored relative to "
            "each other (RULER-style), shown in an order shuffled per call (seeded by run.seed and the step)."
        ),
    )
    template: str | None = Field(
        None,
        description=(
            "Jinja template of the judge's user turn, with prompt, messages, response (group: responses), columns "
            "and each of the row's columns by name; None: the mode's built-in one."
        ),
    )
    system_prompt: str | None = Field(None, description="Jinja template of a system turn; None: none.")
    prefill: str = Field(
        "",
        description="Jinja text the judge's answer starts with (e.g. 'Verdict:'); it is parsed with the output.",
    )
    parse: JudgeParseConfig = Field(default_factory=JudgeParseConfig)
    logprobs: bool = Field(
        False,
        description=(
            "Score by the judge's probabilities of the labels' first tokens instead of sampling: the labels' "
            "expected number (pointwise, needs parse.labels; one token is generated)."
        ),
    )
    max_new_tokens: int = Field(64, ge=1, description="Tokens the judge may write per verdict.")
    temperature: float = Field(0.0, ge=0.0, description="The judge's sampling temperature (0.0 greedy: cacheable).")
    backend: Literal["vllm", "hf"] = Field("vllm", description="The judge's engine: vLLM, or transformers (hf).")
    dtype: Literal["auto", "bfloat16", "float32"] = Field(
        "auto", description="The judge's dtype; auto: bfloat16 with a GPU or native CPU bf16, else float32."
    )
    max_model_len: int = Field(2048, ge=16, description="The judge's context in tokens (judge prompt + verdict).")
    kv_cache_gib: float = Field(1.0, gt=0.0, description="The judge's KV cache on CPU, in GiB per replica (vLLM).")
    enforce_eager: bool = Field(True, description="vLLM only: skip graph compilation (CPU start ~30 s instead of ~2 min).")
    timeout_s: float = Field(
        120.0, gt=0.0, description="Seconds one call (a chunk of a step's judgements to a replica) may take; then retried."
    )
    attempts: int = Field(
        3, ge=1, description="Tries of a call (exponential back-off from 1 s); then its samples' rewards fail and the run goes on."
    )
    cache_entries: int = Field(
        100_000, ge=0,
        description="Judgements cached for the run, by (prompt, responses, row, template, judge version); 0 disables.",
    )

    @model_validator(mode="after")
    def _check(self) -> JudgeConfig:
        if not JUDGE_NAME.match(self.name):
            raise ValueError(f"name={self.name!r}: use letters, digits, '_' and '-' (it names a Serve application)")
        for key in ("template", "system_prompt", "prefill"):
            text = getattr(self, key)
            try:
                jinja2.Environment().from_string(text or "")  # compiled: an unknown filter or test fails here too
            except jinja2.TemplateSyntaxError as err:
                raise ValueError(f"{key} is not a valid Jinja template: line {err.lineno}: {err.message}") from None
        p = self.parse
        if not p.labels and p.min_score >= p.max_score:
            raise ValueError(f"parse.min_score={p.min_score} must be below parse.max_score={p.max_score}")
        try:
            groups = re.compile(self.score_pattern).groups
        except re.error as err:
            raise ValueError(f"parse.pattern={p.pattern!r} is not a regular expression: {err}") from None
        want, what = MODE_DEFAULTS[self.mode].groups
        if groups != want:
            raise ValueError(f"parse.pattern={self.score_pattern!r} has {groups} groups; mode {self.mode} needs {want} "
                             f"({what})")  # fmt: skip
        if self.logprobs and (not MODE_DEFAULTS[self.mode].logprobs or not p.labels):
            raise ValueError("logprobs=true scores by the labels' probabilities: it needs mode pointwise and parse.labels "
                             "(e.g. {correct: 1.0, wrong: 0.0})")  # fmt: skip
        return self

    @property
    def judge_template(self) -> str:
        """Returns the Jinja template of the judge's user turn: ``template``, else the mode's built-in one."""
        return self.template if self.template is not None else MODE_DEFAULTS[self.mode].template

    @property
    def score_pattern(self) -> str:
        """Returns ``parse.pattern``, else the mode's default: 'Score: N', 'Response K: N', or the labels as words."""
        if self.parse.pattern is not None:
            return self.parse.pattern
        defaults = MODE_DEFAULTS[self.mode]
        if self.parse.labels:
            return defaults.label_prefix + _labels_pattern(self.parse.labels)
        return defaults.number_prefix + _NUMBER

    @property
    def app_name(self) -> str:
        """Returns the judge's Serve application name, ``rlray-judge-<name>``."""
        return f"rlray-judge-{self.name}"
