"""Judges (generative reward models): a model reads the prompt and a response, or a prompt's G responses, writes a
verdict, and the verdict is parsed into a score.

**Modes** (``modes``: one ``JudgeMode`` object each, picked by ``judge_mode``).

- *pointwise*: one call per (prompt, response). ``pattern`` (one group) finds the score in the output: a number
  within [min_score, max_score], or a label mapped to its number by ``labels``. The first or the last match counts
  (``match``).
- *group* (RULER-style): the G responses of a prompt are judged together in one call and scored relative to each
  other. ``pattern`` has two groups, the response's 1-based position as shown and its score (number or label); the
  caller shuffles the order per call and maps the scores back (``client``).
- *pointwise with label logprobs* (``logprobs``): one token is generated and the score is the expectation of the
  labels' numbers under the judge's probabilities of their first tokens, renormalised over the labels
  (``soft_score``; G-Eval, Liu et al. 2023, Sec. 2.3, over labels instead of digits). It never fails to parse.

A score that cannot be parsed is a *failed* score (NaN; ``JudgeVerdict.failure`` "parse"), never a silent zero.

**Templates.** ``template`` (the user turn), ``system_prompt`` and ``prefill`` (text the judge's answer starts with,
e.g. ``Verdict:``; the parsed output is the prefill followed by what the judge wrote) are Jinja, rendered in a
sandbox with undefined names as errors, from these variables:

- ``prompt``: the prompt as text (a conversational prompt of one message: its content; of several: one
  ``role: content`` paragraph per message); ``messages``: the prompt as a list of ``{role, content}`` messages;
- ``response`` (pointwise), or ``responses`` (group: the G responses in the order shown to the judge);
- ``columns``: the row's other columns; each is also a variable of its own unless it has one of the names above.

The rendered turns go through the judge tokenizer's chat template (with the generation prompt), then the prefill.

**Modules.** ``records`` (``JudgeSpec``: a judge's definition, plain values, the Serve user_config;
``JudgeItem``: one judgement asked; ``JudgeVerdict`` and ``JudgeReply``: what comes back), ``verdicts`` (templates
and parse rules), ``modes`` (the modes), ``service`` (``JudgeService``: renders, generates and parses), ``deployment``
(its Ray Serve application and caller), ``client`` (``JudgeClient``: one judge seen from the run: cache, chunks,
retries, shuffles), ``panel`` (``JudgePanel``: every judge of a run, their terms added to the reward through
``rlray.reward.combine``) and ``stats`` (``rlray judge check``'s figures). This package re-exports the records, the
template and parse helpers and the modes; the others are imported from their modules (they load the engine or
Ray Serve).
"""

from rlray.reward.judges.modes import (
    JUDGE_MODES,
    Group,
    JudgeMode,
    LabelLogprobs,
    Pointwise,
    judge_mode,
    register_judge_mode,
    render_turns,
    spec_mode,
)
from rlray.reward.judges.records import (
    FAILURES,
    RESERVED_VARIABLES,
    JudgeError,
    JudgeItem,
    JudgeReply,
    JudgeRequest,
    JudgeSpec,
    JudgeVerdict,
)
from rlray.reward.judges.verdicts import (
    compile_template,
    label_token_ids,
    parse_group,
    parse_score,
    prompt_text,
    render_with,
    row_variables,
    soft_score,
    template_variables,
)

__all__ = [
    "FAILURES",
    "Group",
    "JUDGE_MODES",
    "JudgeError",
    "JudgeItem",
    "JudgeMode",
    "JudgeReply",
    "JudgeRequest",
    "JudgeSpec",
    "JudgeVerdict",
    "LabelLogprobs",
    "Pointwise",
    "RESERVED_VARIABLES",
    "compile_template",
    "judge_mode",
    "label_token_ids",
    "parse_group",
    "parse_score",
    "prompt_text",
    "register_judge_mode",
    "render_turns",
    "render_with",
    "row_variables",
    "soft_score",
    "spec_mode",
    "template_variables",
]
