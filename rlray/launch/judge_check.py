"""``rlray judge check CONFIG [--rows N]``: is the judge sane, before a run pays for it?

In this process, without Ray: the policy (``model.path``, the rollout backend) answers the first N training rows
with ``rollout.samples_per_prompt`` samples each, sampled as step 1 of the run would (or, with a response column,
each row's own response is judged); the reward functions score them (the references: every ``reward.functions``
term, e.g. ``gsm8k_correct``, and a labelled column when one is named); then each judge scores them through
the same client as in training (``rlray.reward.judges.client``; one engine at a time, so the policy's engine is
stopped first). A judge whose mode shows a group together (group mode) scores every group a second time in the
reverse order (position bias).
``rlray.reward.judges.stats`` turns the scores into the report.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from rlray.data import load_prompt_rows, prepare_prompts
from rlray.launch.actors import rollout_engine_kwargs
from rlray.launch.judges import check_judges, judge_specs
from rlray.models import load_tokenizer, resolve_model_path
from rlray.plan import RunPlan
from rlray.reward.judges import JudgeError, JudgeSpec, spec_mode
from rlray.reward.judges.client import JudgeClient, LocalJudgeCaller
from rlray.reward.judges.service import JudgeService
from rlray.reward.judges.stats import JudgeReport, agreement, position_bias, spread
from rlray.rollout import RolloutEngine
from rlray.run import build

log = logging.getLogger(__name__)


@dataclass
class CheckResult:
    """What ``judge_check`` did: the rows and responses judged, the references found, and one report per judge."""

    rows: int
    responses: int
    references: list[str]
    reports: list[JudgeReport]


def judge_check(plan: RunPlan, num_rows: int, *, threshold: float | None = None, response_column: str | None = None,
                label_column: str | None = None) -> CheckResult:  # fmt: skip
    """Returns the judges' reports on the first ``num_rows`` training rows (module docstring).

    Args:
        plan: the run plan of the config, its paths resolved (``rlray.plan.paths.resolve_paths``): its judges,
            reward terms, engines and sampling, and the ``model.*`` and ``data.*`` settings.
        num_rows: training rows to answer and judge.
        threshold: the judge score read as "yes" from (default: the middle of each judge's scale).
        response_column: judge each row's response in this column instead of the policy's samples.
        label_column: a column holding a reference value per row (a number or a boolean; above 0 is "yes").

    Raises:
        rlray.reward.judges.JudgeError: no reward.judges, a column the rows lack, or a judge that fails the
            preflight's checks.
        rlray.models.ModelError, rlray.data.DataError: the model or the data cannot be used.
    """
    cfg = plan.settings
    if not plan.reward.judges:
        raise JudgeError("the config has no reward.judges to check; add one (see docs/judges.md)")
    model_dir = resolve_model_path(cfg.model.path, revision=cfg.model.revision)
    tokenizer = load_tokenizer(model_dir, cfg.model.chat_template)
    rows = load_prompt_rows(cfg.data.train_files, prompt_column=cfg.data.prompt_column)[:num_rows]
    rows, ids, _ = prepare_prompts(rows, tokenizer, max_prompt_tokens=cfg.data.max_prompt_tokens,
                                   instruction=cfg.data.instruction, system_prompt=cfg.data.system_prompt)  # fmt: skip
    check_judges(plan, rows)
    for column in (c for c in (response_column, label_column) if c is not None):
        if lacking := [r.prompt_id for r in rows if column not in r.columns]:
            raise JudgeError(f"column '{column}' is missing from rows {lacking[:3]} of data.train_files; name a column "
                             f"of the data (it has {build.dataset_columns(rows)})")  # fmt: skip
    if response_column is not None:
        groups, texts, completion_ids = list(range(len(rows))), [str(r.columns[response_column]) for r in rows], None
    else:
        groups, texts, completion_ids = _generate(plan, model_dir, tokenizer, ids)
    prompts, columns = [rows[g].prompt for g in groups], [rows[g].columns for g in groups]
    reward = build.local_reward_client(cfg, build.dataset_columns(rows))
    try:
        references = reward.score(prompts, texts, columns, completion_ids).values
    finally:
        reward.close()
    names = [name for name, _ in plan.reward.functions]
    if label_column is not None:
        references[label_column] = [_label(rows[g].columns[label_column]) for g in groups]
        names.append(label_column)
    batch = Batch(prompts, texts, columns, groups)
    reports = [_judge(plan, spec, batch, {n: references[n] for n in names}, threshold)
               for spec in judge_specs(plan)]  # fmt: skip
    return CheckResult(len(rows), len(texts), names, reports)


@dataclass(frozen=True)
class Batch:
    """The samples judged: prompts (as the dataset has them), decoded responses, row columns and group ids."""

    prompts: list
    texts: list[str]
    columns: list[dict]
    groups: list[int]


def _judge(plan: RunPlan, spec: JudgeSpec, batch: Batch, references: dict[str, list],
           threshold: float | None) -> JudgeReport:  # fmt: skip
    """Returns one judge's report on ``batch``: its engine started in this process, used, then stopped."""
    service = JudgeService(spec, plan.reward.version)
    seed, bias, together = plan.sampling.step_seed(0), None, spec_mode(spec).together
    try:
        client = JudgeClient(spec.name, spec.mode, LocalJudgeCaller(service), cache_entries=0, attempts=1)
        t = time.perf_counter()
        got = client.score(batch.prompts, batch.texts, batch.columns, batch.groups, seed)
        seconds, stats = time.perf_counter() - t, client.take_stats()
        if together:  # the same groups in the reverse orders
            again = client.score(batch.prompts, batch.texts, batch.columns, batch.groups, seed, reverse=True)
            bias = position_bias(got.scores, again.scores, *client.plan(len(batch.texts), batch.groups, seed))
        client.close()
    finally:
        service.close()
    labels = [number for _, number in spec.labels]
    middle = (min(labels) + max(labels)) / 2 if labels else (spec.min_score + spec.max_score) / 2
    cut = middle if threshold is None else threshold
    return JudgeReport(
        spec.name, spec.mode, len(batch.texts), stats.parse_failures, stats.errors, seconds,
        spread(got.scores, batch.groups if together else None),
        [agreement(name, values, got.scores, judge_threshold=cut) for name, values in references.items()], bias,
        next((o for o in got.outputs if o), ""),
    )  # fmt: skip


def _generate(plan: RunPlan, model_dir: str, tokenizer: object, ids: list[list[int]]) -> tuple[list[int], list[str], list]:
    """Returns (each sample's row, its decoded text, its token ids): the policy's samples of the rows' prompts, as
    step 1 of the run samples them, in this process (the engine is stopped before the judges start)."""
    engine = RolloutEngine(model_dir, **rollout_engine_kwargs(plan, plan.lengths.context_tokens, None, model_dir))
    try:
        completions = engine.generate(ids, plan.sampling.for_step(0))
    finally:
        engine.shutdown()
    texts = tokenizer.batch_decode([c.response_token_ids for c in completions], skip_special_tokens=True)
    return [c.prompt_index for c in completions], texts, [list(c.response_token_ids) for c in completions]


def _label(value: object) -> float | None:
    """Returns a labelled column's value as a number (booleans 1/0; None where it is not a number)."""
    try:
        return float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return None
