"""Rollout samples kept for people: which rows of a step to keep, the record, and its two encodings.

Each online step keeps ``tracking.samples_per_step`` of its rollouts (``pick_rows``). A kept row becomes a
``StepSample``, which goes to MLflow as one table per step (``table_columns``: ``samples/step_<step>.json``)
and to the monitor's page (``json_row``). Both encodings are JSON-safe: a failed reward term (NaN) is the
string "failed", a skipped term (None) is null, a failed reward or a missing advantage is null.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

FAILED = "failed"  # a reward term that failed (NaN in the experience table), as JSON shows it


@dataclass(frozen=True)
class StepSample:
    """One kept rollout of an online step.

    Attributes:
        step: the 1-based step (the MLflow step of its metrics).
        prompt_id: the dataset id of the prompt.
        prompt: the prompt as the policy saw it (decoded prompt tokens, chat template included).
        completion: the decoded response (special tokens kept, so EOS shows).
        reward: the summed reward; NaN when a reward function failed (the sample was left out of the update).
        terms: each reward term's value: a float, NaN (failed) or None (the term skipped the sample).
        advantage: the sequence advantage (the first loss token's advantage); NaN when no token counts.
        finish_reason: 'stop' (EOS) or 'length' (max_new_tokens), or an environment's stop reason.
        policy_version: the policy version that generated it.
        response_tokens: the response length in tokens.
        stop_reason: why a multi-turn episode ended (``rlray.envs.episode.STOP_REASONS``); None for a single-turn row.
        num_turns: the episode's assistant turns; None for a single-turn row.
        turn_rewards: the environment's reward after each turn (None where it gave none); None for a single-turn row.
        segments: the completion cut where the response mask flips: (sampled, text) pairs in order, sampled True for
            the model's tokens (loss mask on) and False for observation tokens (the environment's replies, chat
            template included). Empty for a single-turn row, and for a row whose mask is all off (its reward failed,
            or ``algo.mask_truncated``), where sampled text cannot be told from observations.
        segment: which token sequence of an agent episode the row holds when the agent rewrote its history and the
            episode was cut (0 the first; each trained on its own, ``env/template_drift``); None otherwise.
        failure: why the sample has no reward, naming the source ("environment 'calc' (env_error): step raised
            KeyError: 'a' (at env.py:12)", "reward function 'f': ValueError: ..."); None when it has one.
        judge_outputs: each judge's raw output on the sample, by judge name (``reward.judges``; a group-mode judge's
            output covers the sample's whole group); empty without judges.
        version_parts: the completion cut where the policy version that sampled its tokens changes (a generation that
            took a weight update, ``rollout.partial``): (version, tokens, text) triples in order, each part decoded on
            its own; empty when every token has one version (``policy_version``).
    """

    step: int
    prompt_id: str
    prompt: str
    completion: str
    reward: float
    terms: dict[str, float | None]
    advantage: float
    finish_reason: str
    policy_version: int
    response_tokens: int
    stop_reason: str | None = None
    num_turns: int | None = None
    turn_rewards: tuple[float | None, ...] | None = None
    segments: tuple[tuple[bool, str], ...] = ()
    segment: int | None = None
    failure: str | None = None
    judge_outputs: dict[str, str] = field(default_factory=dict)
    version_parts: tuple[tuple[int, int, str], ...] = ()


def value_runs(values: list[Any]) -> list[tuple[int, int, Any]]:
    """Returns the runs of equal values of ``values`` as (start, end, value), end exclusive, in order.

    E.g. [0, 0, 1, 2, 2] gives [(0, 2, 0), (2, 3, 1), (3, 5, 2)]; [] gives [].
    """
    runs: list[tuple[int, int, Any]] = []
    for i, v in enumerate(values):
        if runs and runs[-1][2] == v:
            runs[-1] = (runs[-1][0], i + 1, v)
        else:
            runs.append((i, i + 1, v))
    return runs


def mask_runs(mask: list[bool]) -> list[tuple[int, int, bool]]:
    """Returns the runs of equal values of ``mask`` as (start, end, value), end exclusive, in order.

    E.g. [T, T, F, F, F, T] gives [(0, 2, True), (2, 5, False), (5, 6, True)]; [] gives [].
    """
    return value_runs([bool(m) for m in mask])


def pick_rows(group_ids: list[int], count: int, seed: int, step: int) -> list[int]:
    """Returns the sorted indices of ``count`` rows to keep, spread across the prompt groups.

    Groups are visited in a random order, taking one random row of each per round, until ``count`` rows are
    taken (all rows when there are fewer). The same (group_ids, count, seed, step) always gives the same rows.

    Args:
        group_ids: [B] the group (prompt) of each row.
        count: rows to keep (``tracking.samples_per_step``); 0 keeps none.
        seed: ``run.seed``.
        step: the step (any fixed numbering).
    """
    rng = np.random.default_rng([seed, step])
    groups: dict[int, list[int]] = {}
    for i, g in enumerate(group_ids):
        groups.setdefault(int(g), []).append(i)
    order = [sorted(groups)[int(j)] for j in rng.permutation(len(groups))]
    pools = {g: [groups[g][int(j)] for j in rng.permutation(len(groups[g]))] for g in order}
    picked: list[int] = []
    while len(picked) < min(count, len(group_ids)):
        for g in order:
            if pools[g] and len(picked) < count:
                picked.append(pools[g].pop())
    return sorted(picked)


def _number(value: float | None) -> float | None:
    """Returns ``value``, or None when it is None, NaN or infinite (JSON has no NaN)."""
    return None if value is None or not math.isfinite(value) else float(value)


def _term(value: float | None) -> float | str | None:
    """Returns a term's JSON value: the float, "failed" for NaN, None (skipped) for None."""
    if value is None:
        return None
    return FAILED if math.isnan(value) else _number(value)


def json_row(sample: StepSample) -> dict[str, Any]:
    """Returns ``sample`` as a JSON-safe dict (the monitor page's record); ``terms`` stays a nested object, each
    segment is {role: "assistant" | "observation", text}, each version part {version, tokens, text}, and a turn reward
    that is None or NaN is null.

    Rows written before episodes were kept (no stop_reason, num_turns, turn_rewards, segments, segment), failures
    (no failure) or version parts (no version_parts) stay readable: the page treats a missing field as null."""
    return {
        "step": sample.step,
        "prompt_id": sample.prompt_id,
        "prompt": sample.prompt,
        "completion": sample.completion,
        "reward": _number(sample.reward),
        "terms": {name: _term(v) for name, v in sample.terms.items()},
        "advantage": _number(sample.advantage),
        "finish_reason": sample.finish_reason,
        "policy_version": sample.policy_version,
        "response_tokens": sample.response_tokens,
        "stop_reason": sample.stop_reason,
        "num_turns": sample.num_turns,
        "turn_rewards": None if sample.turn_rewards is None else [_number(r) for r in sample.turn_rewards],
        "segments": [{"role": "assistant" if sampled else "observation", "text": text} for sampled, text in sample.segments],
        "segment": sample.segment,
        "failure": sample.failure,
        "judge_outputs": dict(sample.judge_outputs),
        "version_parts": [{"version": v, "tokens": n, "text": text} for v, n, text in sample.version_parts],
    }


def table_columns(samples: list[StepSample]) -> dict[str, list[Any]]:
    """Returns the step's samples as table columns (``mlflow.log_table``): the fields of ``json_row`` with each
    reward term in its own column ``reward/<term>`` (null where a sample lacks the term) and each judge's raw output
    in its own column ``judge/<name>``."""
    rows = [json_row(s) for s in samples]
    names = sorted({name for r in rows for name in r["terms"]})
    judges = sorted({name for r in rows for name in r["judge_outputs"]})
    nested = ("terms", "judge_outputs")
    columns: dict[str, list[Any]] = {k: [r[k] for r in rows] for k in rows[0] if k not in nested} if rows else {}
    for name in names:
        columns[f"reward/{name}"] = [r["terms"].get(name) for r in rows]
    for name in judges:
        columns[f"judge/{name}"] = [r["judge_outputs"].get(name) for r in rows]
    return columns


def rows_from_table(table: dict[str, Any]) -> list[dict[str, Any]]:
    """Returns the ``json_row`` records of a samples table read back from MLflow (the inverse of ``table_columns``).

    Args:
        table: the artifact ``samples/step_<step>.json`` as parsed JSON, pandas' "split" layout
            ``{"columns": [...], "data": [[...], ...]}`` (what ``mlflow.log_table`` writes).

    Each ``reward/<term>`` column goes back into ``terms`` and each ``judge/<name>`` column into ``judge_outputs``; a
    null term may mean the term skipped the sample or that the sample lacked the term (the table cannot tell them
    apart). Columns an older or newer rlray wrote
    (fields this one does not know, or lacks) are kept as they are.

    Raises:
        ValueError: ``table`` is not in the "split" layout (the message names what is missing).
    """
    if not isinstance(table, dict) or not isinstance(table.get("columns"), list) or not isinstance(table.get("data"), list):
        raise ValueError("a samples table must be {'columns': [...], 'data': [[...], ...]} (mlflow.log_table's layout); "
                         f"got keys {sorted(table) if isinstance(table, dict) else type(table).__name__}")
    rows = []
    for values in table["data"]:
        row: dict[str, Any] = {"terms": {}, "judge_outputs": {}}
        for column, value in zip(table["columns"], values, strict=True):
            if column.startswith("reward/"):
                row["terms"][column.removeprefix("reward/")] = value
            elif column.startswith("judge/"):
                if value is not None:
                    row["judge_outputs"][column.removeprefix("judge/")] = value
            else:
                row[column] = value
        rows.append(row)
    return rows
