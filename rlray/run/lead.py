"""``OnlineLead``: what only learner rank 0 of an online run holds, built in one piece by ``build_lead``.

Rank 0 drives the rollouts and the reward for every rank: it holds the data stream and the prompts'
token ids, the held-out prompts of evaluation, the reward client, the rollout fleet (and the episode
rollout over it when environments are configured) and the rollout pipeline that keeps async steps in
flight. The other ranks hold no ``OnlineLead`` at all (``OnlineRun.lead`` is None there).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import ray

from rlray.cores import CorePlan
from rlray.data import PromptRow, PromptStream, load_prompt_rows, prepare_prompts
from rlray.hangs import HangWatch
from rlray.plan import RunPlan
from rlray.reward.judges.panel import JudgePanel
from rlray.reward.server import LocalRewardClient, ServeRewardClient
from rlray.rollout import RolloutSource, SamplingSpec
from rlray.rollout.fleet import RolloutFleet
from rlray.rollout.gcs import gcs_actor_node
from rlray.rollout.pipeline import RolloutPipeline
from rlray.run import build
from rlray.run.failures import LearningStreaks

log = logging.getLogger(__name__)

RewardClient = LocalRewardClient | ServeRewardClient


@dataclass
class FleetCounts:
    """The rollout fleet's and pipeline's cumulative counts already logged, so each step logs what happened since the
    last.

    Attributes:
        actor_failures: actor failures counted in rollout/actor_failures so far.
        rerun_prompts: re-sent prompts counted in rollout/rerun_prompts so far (the fleet's and the pipeline's).
        engine_calls: generate calls counted in rollout/engine_calls so far.
        stale_rerun_prompts: prompts counted in rollout/stale_rerun_prompts so far (the pipeline's).
    """

    actor_failures: int = 0
    rerun_prompts: int = 0
    engine_calls: int = 0
    stale_rerun_prompts: int = 0


@dataclass
class OnlineLead:
    """Rank 0's part of an online run.

    Attributes:
        stream: the training data cursor (its state lives in snapshots).
        prompt_ids: prompt_id -> chat-templated prompt token ids of every training row.
        skipped_long_prompts: training rows left out for exceeding ``data.max_prompt_tokens``.
        eval_prompts: the held-out (row, prompt token ids) pairs of evaluation (``eval.num_problems``).
        reward_columns: the datasets' extra column names (the reward functions' keyword arguments).
        reward: the reward client (in process, or the Serve application).
        reward_kwargs: the ``RewardScorer`` keyword arguments ``reward`` was built from (``build.scorer_kwargs``).
        fleet: the rollout actors.
        rollouts: what the step generates with: the fleet, or episodes over it when ``env.environments`` is set.
        pipeline: keeps the rollouts of async steps in flight (``rollout.max_staleness``).
        logged: the fleet's counts already logged (``FleetCounts``).
        streaks: steps in a row in which every sample failed, or no group had reward spread (``rlray.run.failures``).
        judges: the run's judges (``reward.judges``), None without any.
    """

    stream: PromptStream
    prompt_ids: dict[str, list[int]]
    skipped_long_prompts: int
    eval_prompts: list[tuple[PromptRow, list[int]]]
    reward_columns: list[str]
    reward: RewardClient
    reward_kwargs: dict[str, Any]
    fleet: RolloutFleet
    rollouts: RolloutSource
    pipeline: RolloutPipeline
    logged: FleetCounts
    streaks: LearningStreaks = field(default_factory=LearningStreaks)
    judges: JudgePanel | None = None

    def take_prompts(self, count: int) -> tuple[list[PromptRow], list[list[int]]]:
        """Returns the next ``count`` prompt rows and their token ids (advances the data cursor)."""
        rows = self.stream.next_batch(count)
        return rows, [self.prompt_ids[r.prompt_id] for r in rows]

    def renew_reward(self, plan: RunPlan) -> bool:
        """Rebuilds the reward client when ``cfg.reward`` asks for another one than it was built from (a rollback's
        ``guard.rollback_overrides`` under reward.*), and the judges' clients with it (weights, tries; the judges'
        applications stay as deployed); returns True when it did."""
        cfg = plan.settings
        kwargs = build.scorer_kwargs(cfg, self.reward_columns)
        judges = [j.model_dump() for j in cfg.reward.judges]
        judges_changed = judges != (self.judges.source if self.judges is not None else [])
        if kwargs == self.reward_kwargs and not judges_changed:
            return False
        if kwargs != self.reward_kwargs:
            self.reward.close()
            self.reward, self.reward_kwargs = build.reward_client(cfg, self.reward_columns, self.fleet.watch), kwargs
            log.info("the reward client was rebuilt for the config now in force")
        if judges_changed:
            if self.judges is not None:
                self.judges.close()
            self.judges = build.judge_panel(cfg, watch=self.fleet.watch)
            log.warning("the judges' clients were rebuilt for the config now in force (weights, tries, time-outs); "
                        "their Serve applications keep the judges as deployed: a new model or template needs "
                        "`rlray serve-reward` with a new reward.version")
        return True


def build_lead(plan: RunPlan, tokenizer: Any, actors: list[Any], env_hosts: list[Any], cores: CorePlan, *,
               take_prompts: Callable[[], tuple[list[PromptRow], list[list[int]]]],
               sampling_for: Callable[[int], SamplingSpec]) -> OnlineLead:
    """Returns rank 0's part of an online run: data, eval prompts, reward client, fleet, episodes and pipeline.

    Args:
        plan: the run plan in force.
        tokenizer: the policy's tokenizer (chat template set).
        actors: the rollout actor handles.
        env_hosts: the environment host actors ([] without environments).
        cores: this learner's core plan (``build.core_plan``): whether async rollouts can overlap the update.
        take_prompts: the pipeline's source of each step's prompts (``OnlineRun.take_prompts``: it reads
            learner.prompts_per_step from the config in force).
        sampling_for: the SamplingSpec of a 0-based step (``OnlineRun.sampling_for``).

    Raises:
        rlray.data.DataError: the prompt files cannot be read (names the file and line).
    """
    cfg = plan.settings
    render = dict(instruction=cfg.data.instruction, system_prompt=cfg.data.system_prompt)
    all_train_rows, train_rows, train_ids, skipped = build.training_prompts(cfg, tokenizer)
    stream = PromptStream(train_rows, seed=cfg.run.seed, shuffle=cfg.data.shuffle)
    eval_prompts: list[tuple[PromptRow, list[int]]] = []
    if cfg.eval.num_problems:
        eval_rows = load_prompt_rows(cfg.data.eval_files, prompt_column=cfg.data.prompt_column)[: cfg.eval.num_problems]
        rows, ids, _ = prepare_prompts(eval_rows, tokenizer, max_prompt_tokens=10**9, **render)
        eval_prompts = list(zip(rows, ids, strict=True))
    columns = build.dataset_columns(all_train_rows + [r for r, _ in eval_prompts])
    watch = hang_watch(plan)  # one watch: the fleet's, the episodes', the reward's and the judges' deadlines
    fleet = RolloutFleet(actors, node_wait_s=cfg.resources.node_wait_s, watch=watch,
                         partial=plan.engines.partial_segment_tokens is not None)
    rollouts = build.rollouts(cfg, fleet, env_hosts, tokenizer)
    here = ray.get_runtime_context().get_node_id()
    overlap, why = build.rollout_overlap(cfg, cores, shares_node=any(gcs_actor_node(a) in (None, here) for a in actors))
    if cfg.rollout.max_staleness:
        log.info("async rollouts (max_staleness %d): overlap %s (%s)", cfg.rollout.max_staleness,
                 "on" if overlap else "off", why)
    pipeline = RolloutPipeline(rollouts, take_prompts, sampling_for, cfg.rollout.max_staleness,
                               cursor=stream.state_dict, restore_cursor=stream.load_state_dict, overlap=overlap,
                               # episodes or agents sample turns after the submit; partial: across the push, per token
                               settle_before_push=rollouts is not fleet and not fleet.partial, recover=fleet.recover)
    return OnlineLead(
        stream=stream, prompt_ids={r.prompt_id: ids for r, ids in zip(train_rows, train_ids, strict=True)},
        skipped_long_prompts=skipped, eval_prompts=eval_prompts, reward_columns=columns,
        reward=build.reward_client(cfg, columns, watch), reward_kwargs=build.scorer_kwargs(cfg, columns), fleet=fleet,
        rollouts=rollouts, pipeline=pipeline, logged=FleetCounts(), judges=build.judge_panel(cfg, watch=watch),
    )


def hang_watch(plan: RunPlan) -> HangWatch:
    """Returns a watch over the remote calls the run waits on, with the plan's deadlines (``watchdog.*``): rank 0's
    over the fleet, episodes, reward and judges, and every rank's over its reference and teacher calls
    (``rlray.run.frozen_calls``); rank 0's alert is set once the run's services are known (``OnlineRun.watch_hangs``)."""
    d = plan.deadlines
    return HangWatch(d.on_hang, env_call_s=d.env_call_s, engine_call_s=d.engine_call_s, weight_push_s=d.weight_push_s,
                     reference_call_s=d.reference_call_s, stacks_timeout_s=d.stacks_timeout_s)
