"""Stages 1-3 of the online step on rank 0: prompts, rollout, rewards, and the step's experience table.

``collect_experience`` takes the step's rollout from the pipeline (stages 1-2), scores it (stage 3), applies
the algorithm's sampling extras (DAPO refills and overlong shaping, ReMax's greedy baseline;
``rlray.run.online_sampling``) and builds the experience table (``rlray.schema``) with its reward and
rollout metrics. Every sample without a reward carries why (``rlray.run.failures``: its episode's or its reward
function's error) into the table and the kept samples; the step's failures become alerts, and a run whose every
sample fails ``guard.max_failed_steps`` steps in a row stops. The kept samples of a step are decoded from that table
here too (``step_samples``).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa

from rlray import schema
from rlray.data import PromptRow, columns_json
from rlray.hangs import HangError
from rlray.learner import Normaliser
from rlray.observe.samples import StepSample, mask_runs, value_runs
from rlray.plan import RunPlan
from rlray.reward.judges.panel import JudgePanel
from rlray.reward.server import ScoreResult
from rlray.rollout import Completion, SamplingSpec
from rlray.run import build, online_sampling, segments
from rlray.run.agents import agent_metrics
from rlray.run.context import StepAlert
from rlray.run.episodes import add_env_reward, episode_metrics, server_restarts
from rlray.run.failures import failure_alerts, reward_failures, sample_failure, watch_learning
from rlray.run.lead import OnlineLead, RewardClient
from rlray.run.online_sampling import Rollouts

log = logging.getLogger(__name__)

REFILL_SEED_STRIDE = 100_003  # a DAPO refill round's sampling seed: the step's seed + round * stride


class StageTimer:
    """Wall time of a step's stages, kept as ``timing/<stage>_s`` metrics.

    ``with timer("rollout"): ...`` adds the block's seconds to ``timer.metrics["timing/rollout_s"]``.
    """

    def __init__(self) -> None:
        self.metrics: dict[str, float] = {}
        self._start = time.perf_counter()

    @contextmanager
    def __call__(self, stage: str) -> Iterator[None]:
        t = time.perf_counter()
        try:
            yield
        finally:
            key = f"timing/{stage}_s"
            self.metrics[key] = self.metrics.get(key, 0.0) + time.perf_counter() - t

    def elapsed_s(self) -> float:
        """Returns the seconds since the timer was made (the step's wall time so far)."""
        return time.perf_counter() - self._start


@dataclass
class Experience:
    """What stages 1-3 produce on rank 0.

    Attributes:
        table: the step's experience table (``schema.EXPERIENCE_SCHEMA``), one row per completion, groups whole.
        metrics: reward/*, rollout/*, env/* and algo/* statistics of the step, and the stages' timing/*.
        prompt_ids: the ids of the prompts the step took from the data stream, in the order taken: its own, then
            any DAPO refills (kept or not); the step's prompt ledger.
        alerts: the step's failure and no-signal alerts (``rlray.run.failures``).
    """

    table: pa.Table
    metrics: dict[str, float]
    prompt_ids: list[str]
    alerts: list[StepAlert] = field(default_factory=list)


def collect_experience(lead: OnlineLead, plan: RunPlan, tokenizer: Any, step: int, timer: StageTimer, *,
                       policy_version: int, world: int = 1) -> Experience:
    """Stages 1-3 (rank 0): returns 0-based ``step``'s experience table, its metrics, its prompt ledger and alerts.

    Samples without a reward (a failed episode, a reward function that failed) are counted in reward/failed, carry
    why in the table's ``failure`` column, and the first of each kind is an alert; a step whose groups all lack
    reward variance counts towards the ``no_signal`` alert (``rlray.run.failures.watch_learning``).

    Args:
        lead: rank 0's part of the run (data, pipeline, reward client, rollouts).
        plan: the run plan in force (its settings: ``RunPlan.settings``).
        tokenizer: the policy's tokenizer (decodes completions for the reward functions).
        step: the 0-based step.
        timer: the step's stage timer (rollout, reward and algo_sampling are added).
        policy_version: the learner's policy version the update starts from (staleness is measured against it).
        world: the learner ranks; a table with agent segments is laid out for them (``segments.layout_for_ranks``).

    Raises:
        rlray.reward.RewardFunctionError, rlray.data.DataError: a fault a retry cannot fix (the step stops the run).
        rlray.algos.DynamicSamplingError: DAPO could not fill the step within its rounds.
        rlray.run.failures.CannotLearnError: every sample failed in ``guard.max_failed_steps`` steps in a row.
        rlray.hangs.HangError: a rollout, reward or judge call hung under ``watchdog.on_hang=stop``, a DAPO refill's
            included (the step stays in flight and the refills' prompts go back to the stream, so the stop snapshot's
            resume takes every prompt of the step again: ``algorithm_sampling``).
    """
    cfg = plan.settings
    with timer("rollout"):  # 1-2. prompts and rollout; the pipeline keeps steps step+1..step+max_staleness in flight
        got = lead.pipeline.next(step)
    taken = [r.prompt_id for r in got.rows]
    try:
        with timer("reward"):  # 3. rewards (functions, reward model, judges)
            scored = score(lead.reward, got.rows, got.completions, tokenizer, cfg.env.reward_weight, lead.judges,
                           build.judge_seed(cfg, step))
        failed_rewards = reward_failures(got.completions, scored)  # and those of DAPO's refills, below
        with timer("algo_sampling"):  # DAPO refill, overlong shaping, ReMax's greedy baseline
            drawn = Rollouts(got.rows, got.prompt_ids, got.completions, scored.values, scored.outputs)
            drawn, baseline, algo_metrics = algorithm_sampling(lead, plan, tokenizer,
                                                               build.sampling_for_step(cfg, step), drawn, taken,
                                                               failed_rewards)
    except HangError:  # a reward, judge or refill call hung under watchdog.on_hang=stop: a snapshot retakes the prompts
        lead.pipeline.keep_in_flight(step)
        raise
    failures = [sample_failure(c, r, failed_rewards.get(id(c), ""))
                for c, r in zip(drawn.completions, drawn.rewards["reward"], strict=True)]
    mask_truncated = cfg.algo.mask_truncated
    table = build_experience(drawn.rows, drawn.prompt_ids, drawn.completions, drawn.rewards, baseline,
                             mask_truncated=mask_truncated, failures=failures, judge_outputs=drawn.judge_outputs)
    stats = rollout_stats(table, drawn.rewards, cfg.learner.prompts_per_step, policy_version, mask_truncated=mask_truncated)
    stats.update(episode_metrics(drawn.completions))
    stats.update(agent_metrics(drawn.completions, set(cfg.env.agents)))
    if cfg.env.servers or cfg.env.agents:  # servers the hosts run (env.servers, agents' verifiers bridges)
        stats.update(server_restarts(getattr(lead.rollouts, "hosts", [])))
    alerts = failure_alerts(drawn.completions, failures)
    alerts += watch_learning(lead.streaks, failures, step=step + 1, no_signal=stats["algo/groups_without_signal"] == 1.0,
                             group_size=cfg.rollout.samples_per_prompt, max_failed_steps=cfg.guard.max_failed_steps)
    if stats["algo/groups_without_signal"] == 1.0:
        log.warning("step %d: no prompt group has rewards that differ: the advantages are zero and the update "
                    "carries no reward signal (algo/groups_without_signal=1)", step + 1)
    for alert in alerts:
        log.warning("%s: %s", alert.kind, alert.message)
    judged = lead.judges.take_metrics() if lead.judges is not None else {}  # every judge call since the last step
    metrics = {**stats, **algo_metrics, **judged, **timer.metrics, "reward/version": float(scored.version)}
    table = segments.layout_for_ranks(table, len(drawn.completions), world, cfg.minibatches_per_epoch)
    return Experience(table, metrics, taken, alerts)


def score(reward: RewardClient, rows: list[PromptRow], completions: list[Completion], tokenizer: Any,
          env_reward_weight: float = 1.0, judges: JudgePanel | None = None, judge_seed: int = 0) -> ScoreResult:
    """Stage 3: returns the reward version and {"reward", <term name>, ...}, one value per completion (and the
    judges' raw outputs, ``ScoreResult.outputs``).

    Each completion is scored with its prompt as the dataset had it (a string or TRL messages), its
    decoded text (special tokens skipped; an episode's text holds every turn and observation), its token
    ids and its row's other columns (TRL's keyword arguments). Term values: a float, NaN (failed) or
    None (the term skipped the sample). The judges (``judges``) add their terms next, a prompt's completions
    forming one group (``rlray.reward.judges.panel``; ``judge_seed`` seeds the order groups are shown in); an
    episode is judged on its whole text, its final conversation. Episodes add the environment's reward as the
    term "env" (``rlray.run.episodes.add_env_reward``, weighted by env.reward_weight).
    """
    texts = tokenizer.batch_decode([c.response_token_ids for c in completions], skip_special_tokens=True)
    prompts = [rows[c.prompt_index].prompt for c in completions]
    columns = [rows[c.prompt_index].columns for c in completions]
    got = reward.score(prompts, texts, columns, [list(c.response_token_ids) for c in completions])
    if judges is not None:
        got = judges.score(got, prompts, texts, columns, [c.prompt_index for c in completions], judge_seed)
    if any(c.episode is not None for c in completions):
        got = dataclasses.replace(got, values=add_env_reward(got.values, completions, env_reward_weight))
    return got


def algorithm_sampling(lead: OnlineLead, plan: RunPlan, tokenizer: Any, sampling: SamplingSpec, batch: Rollouts,
                       taken: list[str], failed_rewards: dict[int, str] | None = None,
                       ) -> tuple[Rollouts, list[float] | None, dict[str, float]]:
    """Stage 3's algorithm extras (rank 0): DAPO refill, overlong shaping and ReMax's greedy baseline
    (``online_sampling.apply``); returns (rollouts, ReMax baseline per completion or None, metrics).

    The ids of refill prompts are appended to ``taken`` (the step's prompt ledger) as they are taken from the
    stream, whether or not their groups are kept; the failure texts of the refills' rewards are added to
    ``failed_rewards`` (``rlray.run.failures.reward_failures``).

    Raises:
        rlray.hangs.HangError: a refill's rollout, reward or judge call (or the greedy baseline's) hung under
            ``watchdog.on_hang=stop``; the data cursor is first set back to where it was before the first refill, so
            the stop snapshot (its step kept in flight by ``collect_experience``) hands a resume the same refills.
    """
    cfg = plan.settings
    failed_rewards = {} if failed_rewards is None else failed_rewards
    weight, judge_seed = cfg.env.reward_weight, sampling.seed or 0  # the step's seed (build.judge_seed)
    cursor: list[dict] = []  # the data cursor before the first refill took its prompts

    def draw(num_prompts: int, round_index: int) -> Rollouts:  # stages 1-3 for further prompts, reseeded per round
        if not cursor:
            cursor.append(lead.stream.state_dict())
        rows, ids = lead.take_prompts(num_prompts)
        taken.extend(r.prompt_id for r in rows)
        seed = None if sampling.seed is None else sampling.seed + REFILL_SEED_STRIDE * round_index
        completions = lead.rollouts.generate(ids, dataclasses.replace(sampling, seed=seed), rows)
        result = score(lead.reward, rows, completions, tokenizer, weight, lead.judges,
                       judge_seed + REFILL_SEED_STRIDE * round_index)
        failed_rewards.update(reward_failures(completions, result))
        return Rollouts(rows, ids, completions, result.values, result.outputs)

    def greedy(b: Rollouts) -> Rollouts:  # one temperature-0 completion per prompt, scored
        greedy_spec = SamplingSpec(n=1, max_new_tokens=sampling.max_new_tokens, temperature=0.0, stop=sampling.stop)
        done = lead.rollouts.generate(b.prompt_ids, greedy_spec, b.rows)  # episodes: one greedy episode per prompt
        got = score(lead.reward, b.rows, done, tokenizer, weight, lead.judges, judge_seed)
        return Rollouts(b.rows, b.prompt_ids, done, got.values, got.outputs)

    try:
        return online_sampling.apply(batch, draw, greedy, build.sampling_extras(cfg))
    except HangError:  # the refills' prompts go back to the stream: a resume takes them again, in the same order
        if cursor:
            lead.stream.load_state_dict(cursor[0])
        raise


def build_experience(
    rows: list[PromptRow],
    prompt_ids: list[list[int]],
    completions: list[Completion],
    rewards: dict[str, list[float]],
    baseline_rewards: list[float] | None = None,
    *,
    mask_truncated: bool = False,
    failures: list[str] | None = None,
    judge_outputs: dict[str, list[str]] | None = None,
) -> pa.Table:
    """Returns the step's experience table (``schema.EXPERIENCE_SCHEMA``), one row per completion, then one per earlier
    segment of an agent episode cut where its agent rewrote history (``segments.experience_rows``: the episode's
    reward, group and sample index, its own tokens; ``segment`` numbers them).

    ``baseline_rewards`` (ReMax: the greedy response's reward, one per completion) fills baseline_reward.
    response_mask is the completion's loss mask (all True for single-turn rollouts). A completion whose
    reward (or baseline) is NaN failed in the reward stage: its response_mask is all False, so no
    advantage statistic and no loss term sees it (``algos.estimators`` takes a row as valid when its
    mask has a True), and its reward stays NaN in the table. With ``mask_truncated`` (``algo.mask_truncated``)
    a completion that hit max_new_tokens (finish_reason "length") is masked the same way, its reward kept.
    ``failures`` (B texts, "" for a sample with a reward; ``rlray.run.failures.sample_failure``) fills ``failure``;
    ``judge_outputs`` ({judge name: one raw output per completion}) fills judge_outputs.
    """
    comps = {k: v for k, v in rewards.items() if k != "reward"}
    extra = {} if baseline_rewards is None else {"baseline_reward": baseline_rewards}
    if failures is not None:
        extra["failure"] = [text or None for text in failures]
    if judge_outputs:
        extra["judge_outputs"] = [{k: v[i] for k, v in judge_outputs.items()} for i in range(len(completions))]
    scored = [math.isfinite(r) for r in rewards["reward"]]
    if baseline_rewards is not None:
        scored = [ok and math.isfinite(b) for ok, b in zip(scored, baseline_rewards, strict=True)]
    laid = segments.experience_rows(completions)  # a sample's row, then the earlier segments of cut agent episodes
    sample = [completions[i] for i, _, _ in laid]
    seqs = [c for _, c, _ in laid]
    cut = {"segment": [j for _, _, j in laid]} if len(laid) > len(completions) else {}
    return schema.make_table(
        {
            **{k: [v[i] for i, _, _ in laid] for k, v in extra.items()},
            "prompt_id": [rows[c.prompt_index].prompt_id for c in sample],
            "group_id": [c.prompt_index for c in sample],
            "sample_index": [c.sample_index for c in sample],
            "prompt_token_ids": [t.prompt_token_ids or prompt_ids[t.prompt_index] for t in seqs],
            "response_token_ids": [t.response_token_ids for t in seqs],
            "response_mask": [[scored[i] and (not mask_truncated or t.finish_reason != "length") and m for m in t.loss_mask]
                              for (i, t, _) in laid],
            "rollout_logprobs": [t.rollout_logprobs for t in seqs],
            "reward": [rewards["reward"][i] for i, _, _ in laid],
            "reward_components": [{k: v[i] for k, v in comps.items()} for i, _, _ in laid],
            "prompt_columns": [columns_json(rows[c.prompt_index]) for c in sample],
            "policy_version": [t.policy_version for t in seqs],
            "token_versions": [t.versions for t in seqs],
            "finish_reason": [t.finish_reason for t in seqs],
            **episode_columns(seqs),
            **cut,
        }
    )


def episode_columns(completions: list[Completion]) -> dict[str, list]:
    """Returns the experience columns of episodes (stop_reason, num_turns, turn_rewards), {} when none is an episode."""
    if all(c.episode is None for c in completions):
        return {}
    return {
        "stop_reason": [c.episode.stop_reason if c.episode else None for c in completions],
        "num_turns": [c.episode.num_turns if c.episode else None for c in completions],
        "turn_rewards": [[math.nan if r is None else r for r in c.episode.turn_rewards] if c.episode else None
                         for c in completions],
    }


def rollout_stats(
    table: pa.Table, rewards: dict[str, list[float]], prompts_per_step: int, learner_version: int, *,
    mask_truncated: bool = False,
) -> dict[str, float]:
    """Returns reward/* and rollout/* metrics of a step's experience (rank 0).

    Reward statistics are over the samples that have a reward; ``reward/failed`` counts the others (a
    reward function raised, timed out or returned NaN: ``build_experience`` masked them out). A group
    has no signal when fewer than 2 of its samples enter the update (a reward and a True in their
    response_mask) or their rewards are all equal. With ``mask_truncated``, ``rollout/truncated_masked``
    counts the samples left out of the loss for hitting max_new_tokens (finish_reason "length").
    Staleness of a sample = the learner's policy version that the update starts from, minus the
    version that generated the sample (0 in synchronous mode, at most rollout.max_staleness).
    Reward and group statistics are over the samples (the table's first ``len(rewards["reward"])`` rows); token,
    truncation and staleness statistics over every row (agent segments included); token staleness and partial
    samples (``version_stats``) too.
    """
    lengths = np.asarray(table.column("response_token_ids").combine_chunks().value_lengths(), dtype=np.float64)
    r = np.asarray(rewards["reward"], dtype=np.float64)
    ok = np.isfinite(r)
    samples = table.slice(0, len(r))  # one row per sample; agent segment rows follow (``segments.experience_rows``)
    in_update = ok & np.asarray([any(m) for m in samples.column("response_mask").to_pylist()], dtype=bool)
    groups = np.where(in_update, r, np.nan).reshape(prompts_per_step, -1)
    finish = table.column("finish_reason").to_pylist()
    truncated = np.asarray([f == "length" for f in finish], dtype=bool)
    extra = {"rollout/truncated_masked": float(truncated.sum())} if mask_truncated else {}
    spread = [np.ptp(g[np.isfinite(g)]) > 0 if np.isfinite(g).sum() >= 2 else False for g in groups]
    staleness = learner_version - np.asarray(table.column("policy_version").to_pylist(), dtype=np.float64)
    return {
        "reward/mean": float(r[ok].mean()) if ok.any() else math.nan,
        "reward/std": float(r[ok].std()) if ok.any() else math.nan,
        "reward/failed": float((~ok).sum()),
        **term_metrics(rewards, "reward"),
        "algo/groups_without_signal": float(1.0 - np.mean(spread)),
        "rollout/response_tokens_mean": float(lengths.mean()),
        "rollout/truncated_rate": float(truncated.mean()),
        **extra,
        "rollout/generated_tokens": float(lengths.sum()),
        "rollout/policy_version": float(min(table.column("policy_version").to_pylist())),
        "rollout/staleness_mean": float(staleness.mean()),
        "rollout/staleness_max": float(staleness.max()),
        **version_stats(table, learner_version),
    }


def version_stats(table: pa.Table, learner_version: int) -> dict[str, float]:
    """Returns how much of a step's experience partial rollouts (``rollout.partial``) took across weight updates.

    - ``rollout/partial_samples_frac``: rows whose ``token_versions`` hold more than one policy version (a generation
      that took a weight update), over every row (0 without partial rollouts).
    - ``rollout/token_staleness_mean`` / ``_max``: ``learner_version`` minus each sampled response token's version
      (``response_mask`` True: an episode's observation tokens are not sampled and are left out), the mean over
      those tokens of every row (denominator: their count) and the largest; NaN when no row has one. Without
      partial rollouts every token has its sample's version, so the max equals ``rollout/staleness_max`` and the
      mean weighs ``rollout/staleness_mean`` by the sampled length.

    Args:
        table: the step's experience (``schema.EXPERIENCE_SCHEMA``; its ``token_versions`` and ``response_mask``
            columns, [rows] lists of T).
        learner_version: the learner's policy version the update starts from.
    """
    per_row = table.column("token_versions").to_pylist()
    masks = table.column("response_mask").to_pylist()
    tokens = np.asarray([v for row, mask in zip(per_row, masks, strict=True) for v, m in zip(row, mask, strict=True) if m],
                        dtype=np.float64)
    staleness = learner_version - tokens
    return {
        "rollout/partial_samples_frac": float(np.mean([len(set(row)) > 1 for row in per_row])),
        "rollout/token_staleness_mean": float(staleness.mean()) if tokens.size else math.nan,
        "rollout/token_staleness_max": float(staleness.max()) if tokens.size else math.nan,
    }


def term_metrics(rewards: dict[str, list[float | None]], prefix: str) -> dict[str, float]:
    """Returns ``<prefix>/<term>`` and ``<prefix>/<term>_skipped`` for every reward term but the summed "reward".

    ``<term>`` is the mean over the samples the term scored (None: skipped; NaN: failed, both left out;
    NaN when none was scored); ``<term>_skipped`` counts the samples it returned None for (TRL's rule:
    the term does not apply). The reward model's raw score is ``reward/model_score`` (``online_sampling``).

    Args:
        rewards: {"reward": [B], <term>: [B] floats, NaN or None} (``RewardScorer.score``).
        prefix: "reward" for a step, "eval" for evaluation.
    """
    out: dict[str, float] = {}
    for name, values in rewards.items():
        if name in ("reward", "reward_model"):
            continue
        scored = [v for v in values if v is not None and math.isfinite(v)]
        out[f"{prefix}/{name}"] = float(np.mean(scored)) if scored else math.nan
        out[f"{prefix}/{name}_skipped"] = float(sum(v is None for v in values))
    return out


def minibatch_normalisers(table: pa.Table, plan: RunPlan, world: int) -> list[Normaliser]:
    """Returns the global token and sequence counts of each mini-batch (rank 0, after all masking).

    Mini-batch m takes rows [m*k, (m+1)*k) of every rank's shard, k = (rows / world) / minibatches_per_epoch:
    sequences_per_minibatch / world, or more in a step with agent segments (``segments.layout_for_ranks``).
    """
    cfg = plan.settings
    valid = np.array([sum(m) for m in table.column("response_mask").to_pylist()], dtype=np.float64)
    per_rank = table.num_rows // world
    k = per_rank // cfg.minibatches_per_epoch
    norms = []
    for m in range(per_rank // k):
        idx = np.concatenate([np.arange(r * per_rank + m * k, r * per_rank + (m + 1) * k) for r in range(world)])
        norms.append(Normaliser(float(max(valid[idx].sum(), 1.0)), float(len(idx)), world))
    return norms


def step_samples(tokenizer: Any, table: pa.Table, rows: list[int], advantages: list[float], step: int) -> list[StepSample]:
    """Returns the kept samples of 1-based ``step`` (rank 0): rows ``rows`` of the step's experience table with
    prompt and completion decoded (special tokens kept, so the chat template and EOS show) and ``advantages``
    (``rlray.run.online.sample_advantages``)."""
    picked = table.take(rows).to_pylist() if rows else []
    prompts = tokenizer.batch_decode([r["prompt_token_ids"] for r in picked], skip_special_tokens=False)
    completions = tokenizer.batch_decode([r["response_token_ids"] for r in picked], skip_special_tokens=False)
    return [
        StepSample(
            step=step, prompt_id=r["prompt_id"], prompt=prompt, completion=completion,
            reward=math.nan if r["reward"] is None else float(r["reward"]), terms=dict(r["reward_components"] or []),
            advantage=adv, finish_reason=r["finish_reason"], policy_version=int(r["policy_version"]),
            response_tokens=len(r["response_token_ids"]), stop_reason=r["stop_reason"], num_turns=r["num_turns"],
            turn_rewards=None if r["turn_rewards"] is None else tuple(r["turn_rewards"]),
            segments=episode_segments(tokenizer, r), segment=r["segment"], failure=r["failure"],
            judge_outputs=dict(r["judge_outputs"] or []), version_parts=version_parts(tokenizer, r),
        )
        for r, prompt, completion, adv in zip(picked, prompts, completions, advantages, strict=True)
    ]


def episode_segments(tokenizer: Any, row: dict[str, Any]) -> tuple[tuple[bool, str], ...]:
    """Returns an episode row's response cut where its response_mask flips, each run decoded (special tokens kept):
    (True, sampled text) or (False, observation text); () for a single-turn row (no num_turns) and for a row whose
    mask is all off (``StepSample.segments``)."""
    mask = row["response_mask"]
    if row["num_turns"] is None or not any(mask):
        return ()
    ids = row["response_token_ids"]
    return tuple((sampled, tokenizer.decode(ids[a:b], skip_special_tokens=False)) for a, b, sampled in mask_runs(mask))


def version_parts(tokenizer: Any, row: dict[str, Any]) -> tuple[tuple[int, int, str], ...]:
    """Returns a row's response cut where its ``token_versions`` change, each run as (version, tokens, its text
    decoded with special tokens kept); () when every token has one version (``StepSample.version_parts``)."""
    versions = row["token_versions"]
    if len(set(versions)) < 2:
        return ()
    ids = row["response_token_ids"]
    return tuple((v, b - a, tokenizer.decode(ids[a:b], skip_special_tokens=False)) for a, b, v in value_runs(versions))
