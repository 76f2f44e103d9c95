"""The run's settings, turned into the plain values and objects of the building blocks.

Building-block packages (``rlray.learner``, ``rlray.reward``, ``rlray.rollout``) never read the config:
every place that turns its sections into their arguments is here, used by the run (rank 0's
step, every rank's learner) and by the driver (``rlray.launch``: the reward server, ``rlray eval``). The run's
decisions (placements, parallelism and micro-batching, lengths, sampling, episode limits) are taken once by
``rlray.plan.resolve_plan``; the functions here build objects from the plan's parts and the settings read as they
are (``RunPlan.settings``, typed ``rlray.plan.settings.Settings``: this module never imports ``rlray.config``).
"""

from __future__ import annotations

import functools
import os
import random
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from rlray import algos
from rlray.cache import prompt_cache_dir
from rlray.cores import CorePlan, parse_core_list, plan_cores
from rlray.data import PromptRow, load_prompt_rows, prepare_prompts
from rlray.data.prompts import prompt_messages
from rlray.hangs import HangWatch
from rlray.learner import LossSpec, PolicyLearner
from rlray.learner import online as learner_online
from rlray.learner.batching import MicroBatching
from rlray.learner.critic import build_critic
from rlray.learner.parallel import parallel_kind, strategy_for
from rlray.learner.policy import OptimizerSpec
from rlray.models import resolve_model_path
from rlray.plan import compute_dtype, resolve_plan  # compute_dtype: build.compute_dtype for its callers
from rlray.plan.settings import Settings
from rlray.reward import RewardScorer
from rlray.reward.judges.client import JudgeCaller, JudgeClient
from rlray.reward.judges.deployment import ServeJudgeCaller
from rlray.reward.judges.panel import JudgePanel, JudgeTerm
from rlray.reward.server import LocalRewardClient, ServeRewardClient
from rlray.rollout import RolloutSource, SamplingSpec
from rlray.run import online_sampling
from rlray.run.agents import AgentRollout
from rlray.run.episodes import EpisodeRollout
from rlray.run.rerun import RerunOnFault


def seed_everything(seed: int) -> None:
    """Seeds python's, numpy's and torch's global generators with ``seed``."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def learner_kwargs(cfg: Settings, world: int, *, with_reference: bool = True, teacher_dir: str | None = None) -> dict[str, Any]:
    """Returns ``PolicyLearner`` keyword arguments from the config.

    The parallelism strategy (``rlray.learner.parallel``, ``parallel_kind``): DDP (``ray.train.torch.prepare_model``)
    or FSDP2 (bf16 mixed precision when the compute dtype is bf16) by ``resources.learner.strategy`` when ``world`` > 1,
    on the CPU (gloo) as on GPUs (NCCL); one GPU rank moves the model to its GPU (``Single``).
    The reference model is built when the KL is in use or the KL guard is on (it needs the KL), unless
    ``with_reference`` is False (a reference actor, or offline runs). The teacher
    (``teacher_dir``: ``teacher.path`` resolved by the driver) is held on the learner only with
    ``resources.teacher.placement == "learner"``. Both placements are the plan's (``rlray.plan.Roles``).
    """
    plan = resolve_plan(cfg)
    par, roles = plan.parallelism, plan.roles
    gpu = par.gpu and torch.cuda.is_available()
    parallel = strategy_for(parallel_kind(cfg.resources.learner.strategy, world), gpu=gpu,
                            mixed_precision=par.compute_dtype == "bfloat16")
    ln = cfg.learner
    return dict(
        dtype=par.compute_dtype,
        temperature=cfg.rollout.temperature,
        optim=OptimizerSpec(lr=ln.lr, max_grad_norm=ln.max_grad_norm, betas=ln.betas, weight_decay=ln.weight_decay,
                            warmup_steps=ln.warmup_steps, name=ln.optimizer),
        parallel=parallel,
        use_reference=roles.reference != "off" and with_reference,
        gradient_checkpointing=cfg.model.gradient_checkpointing,
        lora=cfg.model.lora.model_dump() if cfg.model.lora.rank else None,
        adapter_path=cfg.model.adapter_path,
        teacher_path=teacher_dir if roles.teacher == "learner" else None,
    )


def ppo_critic(cfg: Settings, model_dir: str, parallel: Any) -> PolicyLearner:
    """Returns PPO's critic learner: a value head on ``critic.model_path`` (resolved), or on the policy checkpoint,
    under the policy learner's parallelism strategy (``learner_kwargs``' ``parallel``)."""
    path = (resolve_model_path(cfg.critic.model_path, revision=cfg.critic.model_revision, key="critic.model_path")
            if cfg.critic.model_path else model_dir)  # fmt: skip
    return build_critic(path, dtype=compute_dtype(cfg), lr=cfg.critic.lr, max_grad_norm=cfg.critic.max_grad_norm, parallel=parallel)


def sampling_for_step(cfg: Settings, step: int) -> SamplingSpec:
    """Returns the training SamplingSpec of 0-based ``step``.

    The seed is per call (seed * 1_000_003 + step): samples depend on the seed, the step, the prompts
    and the weights only (``rlray.plan.Sampling.for_step``).
    """
    return resolve_plan(cfg).sampling.for_step(step)


def eval_sampling(cfg: Settings) -> SamplingSpec:
    """Returns the evaluation SamplingSpec: one greedy completion of up to ``eval_max_new_tokens`` tokens."""
    return resolve_plan(cfg).sampling.eval


def sampling_extras(cfg: Settings) -> online_sampling.SamplingExtras:
    """Returns the plain values of the sampling extras (DAPO's dynamic sampling and overlong shaping, ReMax's greedy
    baseline) from ``cfg.algo``, its registry entry, ``learner.prompts_per_step`` and the plan's generation cap."""
    a = cfg.algo
    return online_sampling.SamplingExtras(
        dynamic_sampling=a.algorithm.dynamic_sampling,
        greedy_baseline=a.algorithm.greedy_baseline,
        target_groups=cfg.learner.prompts_per_step,
        max_rounds=a.dynamic_sampling_max_rounds,
        max_new_tokens=resolve_plan(cfg).lengths.max_new_tokens,
        metric=a.dynamic_sampling_metric,
        overlong_cache_tokens=a.overlong_cache_tokens,
        overlong_penalty_factor=a.overlong_penalty_factor,
    )


def scorer_kwargs(cfg: Settings, columns: list[str] | None = None) -> dict[str, Any]:
    """Returns the keyword arguments of ``RewardScorer`` for ``cfg.reward`` (plain values; also the Serve user_config).

    Args:
        cfg: the run's config.
        columns: the datasets' extra column names (``dataset_columns``) for the reward functions' signature
            check, or None when unknown (a reward server deployed before the data is read).
    """
    return {
        "functions": [f.model_dump() for f in cfg.reward.functions],
        "model_path": cfg.reward.model_path,
        "model_weight": cfg.reward.model_weight,
        "columns": columns,
    }


def training_prompts(cfg: Settings, tokenizer: Any) -> tuple[list[PromptRow], list[PromptRow], list[list[int]], int]:
    """Returns (every row of ``data.train_files``, the rows a run streams, their chat-templated prompt token ids, the
    number of rows skipped as longer than ``data.max_prompt_tokens``): what an online run's rank 0 streams when it
    starts (``rlray.run.lead.build_lead``) and what ``rlray ledger --check`` rebuilds (``rlray.run.ledger``).

    Raises:
        rlray.data.DataError: a data file is missing or has a bad row, or a prompt is too long with
            ``data.long_prompts=error``.
    """
    rows = load_prompt_rows(cfg.data.train_files, prompt_column=cfg.data.prompt_column)
    kept, ids, skipped = prepare_prompts(rows, tokenizer, max_prompt_tokens=cfg.data.max_prompt_tokens,
                                         long_prompts=cfg.data.long_prompts, instruction=cfg.data.instruction,
                                         system_prompt=cfg.data.system_prompt, cache=prompt_cache_dir())
    return rows, kept, ids, skipped


def dataset_columns(rows: list[PromptRow]) -> list[str]:
    """Returns the extra column names of prompt rows (every row's ``columns`` keys), sorted."""
    return sorted({name for row in rows for name in row.columns})


def local_reward_client(cfg: Settings, columns: list[str] | None = None,
                        watch: HangWatch | None = None) -> LocalRewardClient:
    """Returns an in-process reward client over the scorer described by ``cfg.reward``; ``watch`` reports each user
    function killed at its timeout, with its stacks (``HangWatch.killed``; raises ``HangError`` under stop)."""
    scorer = RewardScorer(**scorer_kwargs(cfg, columns))
    if watch is not None:
        scorer.watch_hangs(watch.killed)
    return LocalRewardClient(scorer, cfg.reward.version)


def reward_client(cfg: Settings, columns: list[str] | None = None,
                  watch: HangWatch | None = None) -> LocalRewardClient | ServeRewardClient:
    """Returns the Serve application's client when the plan runs a reward server (``rlray.plan.Roles.reward_server``:
    online with ``reward.server.enabled``), else an in-process scorer; ``watch`` (rank 0's) reports each try of a
    request past ``reward.server.client_timeout_s`` with the replicas' stacks (``serve_timeouts``), and each process
    killed at its own timeout (the scorer's, a user function's) with its stacks (``HangWatch.killed``)."""
    srv = cfg.reward.server
    if resolve_plan(cfg).roles.reward_server:
        then = (f"retrying (reward.server.client_attempts={srv.client_attempts} tries in all; then the step fails "
                "with RewardServerUnavailableError)")
        return ServeRewardClient(srv.app_name, attempts=srv.client_attempts, timeout_s=srv.client_timeout_s,
                                 on_timeout=serve_timeouts(watch, srv.app_name, f"reward server '{srv.app_name}'",
                                                           "reward.server.client_timeout_s", srv.client_timeout_s, then),
                                 on_hang=None if watch is None else watch.killed)
    return local_reward_client(cfg, columns, watch)


def serve_timeouts(watch: HangWatch | None, app_name: str, who: str, key: str, deadline_s: float,
                   then: str) -> Callable[[str, float], object] | None:
    """Returns a Serve client's ``on_timeout``: (call, seconds waited) -> ``watch.timed_out`` for application
    ``app_name`` under ``key``'s ``deadline_s`` (the report; raises ``HangError`` under ``watchdog.on_hang=stop``);
    None without a watch."""
    if watch is None:
        return None
    return functools.partial(watch.timed_out, app_name, who, deadline_s=deadline_s, key=key, then=then)


def judge_seed(cfg: Settings, step: int) -> int:
    """Returns the seed of 0-based ``step``'s judge calls (group mode: the order each group is shown in), the step's
    sampling seed (``sampling_for_step``)."""
    return resolve_plan(cfg).sampling.step_seed(step)


def judge_panel(cfg: Settings, callers: list[JudgeCaller] | None = None,
                watch: HangWatch | None = None) -> JudgePanel | None:
    """Returns the run's judges (``reward.judges``) as a ``JudgePanel``, None without judges.

    Args:
        cfg: the run's config.
        callers: one caller per judge (``rlray judge check`` passes local services); None: each judge's Serve
            application (``rlray-judge-<name>``), its batches split over ``resources.judge.replicas`` chunks.
    """
    if not resolve_plan(cfg).reward.judges:
        return None
    callers = callers or [ServeJudgeCaller(j.app_name) for j in cfg.reward.judges]
    return JudgePanel([
        JudgeTerm(j.name, j.weight, JudgeClient(
            j.name, j.mode, caller, chunks=cfg.resources.judge.replicas, timeout_s=j.timeout_s, attempts=j.attempts,
            cache_entries=j.cache_entries,
            on_timeout=serve_timeouts(watch, j.app_name, f"judge '{j.name}'", f"reward.judges[{i}].timeout_s",
                                      j.timeout_s, f"retrying (reward.judges[{i}].attempts={j.attempts} tries in all; "
                                      "then its samples' rewards fail, NaN, and the run goes on)")))
        for i, (j, caller) in enumerate(zip(cfg.reward.judges, callers, strict=True))
    ], source=[j.model_dump() for j in cfg.reward.judges])  # fmt: skip


def episode_rollout(cfg: Settings, fleet: Any, hosts: list[Any], tokenizer: Any) -> EpisodeRollout:
    """Returns the episode rollout of ``cfg.env`` over ``fleet`` and the environment hosts (rank 0; ``rlray eval``)."""
    ep = resolve_plan(cfg).episodes
    limits = ep.limits

    def prepare(messages: list[dict]) -> list[dict]:
        return prompt_messages(messages, instruction=cfg.data.instruction, system_prompt=cfg.data.system_prompt)

    envs = ep.episode_environments
    default = ep.default if ep.default in envs else None  # a default agent is AgentRollout's
    return EpisodeRollout(fleet, hosts, tokenizer, limits, env_column=ep.column, default_env=default,
                          known_envs=envs, prepare=prepare,
                          chat_template_kwargs=cfg.rollout.chat_template_kwargs, prompt_column=cfg.data.prompt_column,
                          watch=fleet.watch)


def rollouts(cfg: Settings, fleet: Any, hosts: list[Any], tokenizer: Any) -> RolloutSource:
    """Returns what a run samples from (rank 0; ``rlray eval``): the fleet; the episode rollout over it when
    env.environments is set; ``AgentRollout`` around either when env.agents is set; and a multi-turn rollout inside
    ``RerunOnFault`` (a step whose rollout actor or host died under it is rolled out again, whole)."""
    ep = resolve_plan(cfg).episodes
    inner = episode_rollout(cfg, fleet, hosts, tokenizer) if ep.episode_environments else fleet
    if ep.agents:
        inner = AgentRollout(fleet, hosts, inner, tokenizer, env_column=ep.column, default=ep.default,
                             agents=[name for name, _ in ep.agents], environments=ep.episode_environments,
                             prompt_column=cfg.data.prompt_column, watch=fleet.watch,
                             episode_timeout_s=cfg.env.episode_timeout_s, agent_threads=ep.agent_threads)
    return inner if inner is fleet else RerunOnFault(inner, fleet, hosts)


def update_spec(cfg: Settings, world: int) -> learner_online.UpdateSpec:
    """Returns the plain values of stages 4-6 from ``cfg.algo`` (its registry entry gives the advantage estimator and
    the policy loss), ``cfg.learner``, ``cfg.critic`` and ``cfg.teacher``.

    With one epoch and one mini-batch the update is on-policy: old logprobs are taken inside the
    update (no extra forward), unless the KL sits in the reward, whose penalty needs them first, or a
    reverse-KL teacher needs them as the student's logprobs (``learner_online.add_reverse_kl``).
    """
    a, ln, algorithm, plan = cfg.algo, cfg.learner, cfg.algo.algorithm, resolve_plan(cfg)
    kl_in_loss = a.kl_in == "loss"
    loss = LossSpec(
        clip_eps_low=a.clip_eps_low,
        clip_eps_high=a.clip_eps_high,
        kl_coef=a.kl_coef if kl_in_loss else 0.0,
        kl_estimator=a.kl_estimator,
        loss_agg=a.loss_agg,
        max_response_tokens=plan.lengths.max_new_tokens,
        policy_loss=algorithm.policy_loss,
        dual_clip=a.dual_clip,
        entropy_coef=a.entropy_coef,
        correction=a.rollout_correction.mode,
        correction_min=a.rollout_correction.ratio_min,
        correction_max=a.rollout_correction.ratio_max,
        jsd_weight=cfg.teacher.jsd_weight,
        jsd_beta=cfg.teacher.beta,
    )
    advantage = algos.AdvantageSpec(
        std_scale=a.adv_std_scale,
        eps=a.adv_eps,
        gamma=a.gamma,
        lam=a.gae_lambda,
        reward_kl_coef=0.0 if kl_in_loss else a.kl_coef,
        kl_estimator=a.kl_estimator,
    )
    off_policy = ln.epochs > 1 or cfg.minibatches_per_epoch > 1
    return learner_online.UpdateSpec(
        estimator=algorithm.advantage,
        loss=loss,
        advantage=advantage,
        epochs=ln.epochs,
        rows_per_minibatch=ln.sequences_per_minibatch // world,
        batching=plan.parallelism.micro_batching,
        old_logprobs_before_update=off_policy or (not kl_in_loss and a.kl_coef > 0) or cfg.teacher.reverse_kl_weight > 0,
        value_clip_eps=cfg.critic.value_clip_eps,
        loss_world_size=world,
        distill_weight=cfg.teacher.reverse_kl_weight,
    )


def micro_batching(cfg: Settings) -> MicroBatching:
    """Returns the micro-batching in force on a learner rank (``rlray.plan.Parallelism.micro_batching``: an FSDP
    learner cuts by sequences, its token budget dropped)."""
    return resolve_plan(cfg).parallelism.micro_batching


def frozen_micro_batching(cfg: Settings) -> MicroBatching:
    """Returns the micro-batching of a reference or teacher actor (``learner.*`` as configured, token budget included;
    ``rlray.plan.Parallelism.frozen_micro_batching``)."""
    return resolve_plan(cfg).parallelism.frozen_micro_batching


def rollout_overlap(cfg: Settings, plan: CorePlan, *, shares_node: bool) -> tuple[bool, str]:
    """Returns (overlap, why): whether an async run's rollouts of the steps ahead run while a step trains
    (``rollout.overlap``; ``rlray.rollout.pipeline.RolloutPipeline``), and a line for the log.

    auto is on when the stages have their own hardware: a stage on GPU, no rollout actor on the learner's node
    (``shares_node`` False), or the cores split between them (``plan.learner_cores`` set, by ``plan_cores`` on 8+
    cores or by hand); off when they share one machine's cores, where two stages at once take as long as one after
    the other plus contention (SmolLM2 on 2 cores: the async step 1.31x the synchronous one).

    Args:
        cfg: the run's config.
        plan: ``core_plan(cfg)`` on the learner's machine.
        shares_node: a rollout actor runs on the learner's node (or where they run is unknown).
    """
    if cfg.rollout.max_staleness == 0:
        return False, "synchronous"
    if cfg.rollout.overlap != "auto":
        return cfg.rollout.overlap == "on", f"rollout.overlap={cfg.rollout.overlap}"
    if resolve_plan(cfg).uses_gpus:
        return True, "a stage on GPU"
    if not shares_node:
        return True, "the rollout actors run on other nodes than the learner"
    if plan.learner_cores is not None:
        return True, "the stages have their own cores"
    return False, ("the rollout and the update share this node's cores: the steps ahead generate when their step "
                   "comes (rollout.overlap=on to overlap anyway)")


def core_plan(cfg: Settings, cores: list[int] | None = None) -> CorePlan:
    """Returns ``plan_cores`` for ``cfg`` on this machine (``cores``: default ``os.sched_getaffinity(0)``), with what
    the config sets by hand taking precedence: ``resources.rollout.cpu_threads``, ``learner.torch_threads``
    and ``learner.cpu_affinity`` (a set learner affinity without set threads gives one thread per pinned core)."""
    res = cfg.resources
    cores = sorted(cores if cores is not None else os.sched_getaffinity(0))
    plan = plan_cores(cores, rollout_actors=res.rollout.num_workers, learner_workers=res.learner.num_workers,
                      rollout_on_gpu=res.rollout.gpus > 0, learner_on_gpu=res.learner.gpus > 0,
                      overlap=cfg.rollout.max_staleness > 0)
    threads = res.rollout.cpu_threads
    rollout = list(threads) if isinstance(threads, list) else [threads] * res.rollout.num_workers if threads else plan.rollout
    affinity = cfg.learner.cpu_affinity
    learner_cores = (list(affinity) if isinstance(affinity, list) else [affinity] * res.learner.num_workers
                     if affinity is not None else plan.learner_cores)
    if rollout is not plan.rollout and affinity is None and cfg.learner.torch_threads is None:
        learner_cores = None  # the rollout's cores are set by hand: do not pin the learner against them
    torch_threads = cfg.learner.torch_threads
    if torch_threads is None:
        torch_threads = len(parse_core_list(learner_cores[0])) if learner_cores else (
            plan.learner_threads if rollout is plan.rollout else max(1, len(cores) // res.learner.num_workers))
    return CorePlan(rollout, torch_threads, learner_cores, plan.why)
