"""``resolve_plan``: a validated ``Config`` turned, once, into the run's ``RunPlan``.

Each decision of a run is taken here and nowhere else (docs/architecture.md, "Where does a decision live"): role
placements, the learner's parallelism and the micro-batching in force on it, the context length, sampling, episode
limits, tools, judges, reward terms, snapshots and tracking. Nothing is loaded or started: only config fields are
read (and ``model.dtype=auto`` resolved on this machine).
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import yaml

from rlray.config import Config, ConfigError, validate_tree
from rlray.config.env import ServerConfig
from rlray.config.judge import JudgeConfig
from rlray.envs.agents.mcp import McpServerSpec
from rlray.envs.limits import EpisodeLimits
from rlray.envs.servers import ServerSpec
from rlray.envs.servers.hosted import HostedServer
from rlray.envs.servers.openenv import OpenEnvOptions
from rlray.learner.batching import MicroBatching
from rlray.models import resolve_dtype
from rlray.plan.records import (
    Deadlines,
    Engines,
    Episodes,
    Judge,
    Lengths,
    Parallelism,
    RewardTerms,
    RoleResources,
    Roles,
    RunPlan,
    Sampling,
    Snapshots,
    Tracking,
)
from rlray.reward.judges.records import JudgeSpec
from rlray.reward.scorer import term_name
from rlray.rollout.types import SamplingSpec


def resolve_plan(cfg: Config) -> RunPlan:
    """Returns the plan of ``cfg``: every decision of the run, taken once.

    Raises:
        rlray.config.ConfigError: the micro-batching in force does not divide a rank's mini-batch (an FSDP learner
            with ``learner.tokens_per_microbatch``, which cuts by ``learner.sequences_per_microbatch`` instead).
    """
    parallelism = resolve_parallelism(cfg)
    return RunPlan(
        roles=resolve_roles(cfg),
        parallelism=parallelism,
        lengths=resolve_lengths(cfg),
        sampling=resolve_sampling(cfg),
        engines=resolve_engines(cfg),
        episodes=resolve_episodes(cfg),
        reward=resolve_reward(cfg),
        snapshots=Snapshots(cfg.checkpoint_uri, cfg.checkpoint.every_steps, cfg.run.max_steps, cfg.checkpoint.keep_last,
                            cfg.checkpoint.resume_from),
        tracking=Tracking(cfg.tracking.mlflow_uri, cfg.tracking.experiment, cfg.run.name, cfg.tracking.tensorboard_dir),
        deadlines=Deadlines(**cfg.watchdog.model_dump()),
        max_steps=cfg.run.max_steps,
        uses_gpus=uses_gpus(cfg),
        settings=cfg,
        source=cfg.model_dump(),
        config_hash=cfg.config_hash(),
    )


def plan_from_tree(tree: dict[str, Any]) -> RunPlan:
    """Returns the plan of a config tree (the learner ranks' shipped ``WorkerArgs.config``, a stored
    ``config/resolved.yaml``), validated first.

    Raises:
        rlray.config.ConfigError: the tree does not validate (names the keys), or ``resolve_plan``'s checks fail.
    """
    return resolve_plan(validate_tree(copy.deepcopy(tree)))


def replan(plan: RunPlan, overrides: list[str], *, origin: str = "overrides") -> tuple[RunPlan, dict[str, tuple[Any, Any]]]:
    """Returns (the plan of ``plan``'s config with ``overrides`` applied, {key: (old, new)}): the one way a run's
    config in force changes (a rollback's ``guard.rollback_overrides``, the OOM fallback). Re-validated and
    re-resolved, so the new plan's decisions follow the new values.

    ``key=value`` sets a value (YAML-parsed); ``key*=factor`` multiplies the current one, so each call compounds
    (two rollbacks with ``learner.lr*=0.5`` quarter the learning rate).

    Raises:
        rlray.config.ConfigError: an unknown key (named, with ``origin``: the config key the overrides come from)
            or a result the schema rejects, naming the key.
    """
    tree = copy.deepcopy(plan.source)
    changes: dict[str, tuple[Any, Any]] = {}
    for item in overrides:
        key, raw = item.split("=", 1)
        scale = key.endswith("*")
        key = key.rstrip("*").strip()
        *path, leaf = key.split(".")
        node = tree
        for part in path:
            node = node.get(part) if isinstance(node, dict) else None
            if node is None:
                break
        if not isinstance(node, dict) or leaf not in node:
            raise ConfigError(f"{origin}: unknown key '{key}'")
        old = node[leaf]
        node[leaf] = old * float(raw) if scale else yaml.safe_load(raw)
        changes[key] = (old, node[leaf])
    return resolve_plan(validate_tree(tree)), changes


def uses_gpus(cfg: Config) -> bool:
    """Returns True when the learner or the rollout asks for GPUs (``RunPlan.uses_gpus``)."""
    return cfg.resources.learner.gpus > 0 or cfg.resources.rollout.gpus > 0


def compute_dtype(cfg: Config) -> str:
    """Returns ``model.dtype`` with "auto" resolved on this machine: "bfloat16" or "float32" (``models.resolve_dtype``;
    a GPU counts when the run uses GPUs, ``uses_gpus``)."""
    return resolve_dtype(cfg.model.dtype, gpu=uses_gpus(cfg))


def _resources(count: int, cpus: float, gpus: float, custom: dict[str, float]) -> RoleResources:
    return RoleResources(count, cpus, gpus, tuple(sorted(custom.items())))


def resolve_roles(cfg: Config) -> Roles:
    """Returns which roles run and where (see ``Roles`` for each rule)."""
    res, online = cfg.resources, cfg.algo.family == "online"
    reference = "off"
    if online and (cfg.algo.kl_coef > 0 or cfg.guard.kl_threshold is not None):
        if cfg.algo.kl_coef > 0 and res.reference.placement == "actor":
            reference = "actor"
        elif cfg.model.lora.rank or cfg.model.adapter_path is not None:
            reference = "lora_base"
        else:
            reference = "learner"
    r = res.rollout
    return Roles(
        online=online,
        reference=reference,
        teacher=res.teacher.placement if cfg.teacher.enabled else "off",
        critic=cfg.algo.algorithm.needs_critic,
        reward_server=online and cfg.reward.server.enabled,
        judges=tuple(j.app_name for j in cfg.reward.judges) if online else (),
        env_hosts=online and cfg.env.enabled,
        rollout=_resources(r.num_workers, r.cpus, r.gpus * r.tensor_parallel_size, r.custom_resources),
        learner=_resources(res.learner.num_workers, res.learner.cpus, res.learner.gpus, res.learner.custom_resources),
        reward=_resources(res.reward.replicas, res.reward.cpus, res.reward.gpus, res.reward.custom_resources),
        judge=_resources(res.judge.replicas, res.judge.cpus, res.judge.gpus, res.judge.custom_resources),
        reference_actor=_resources(1, res.reference.cpus, res.reference.gpus, res.reference.custom_resources),
        teacher_actor=_resources(1, res.teacher.cpus, res.teacher.gpus, res.teacher.custom_resources),
        env=_resources(res.env.num_workers, res.env.cpus, 0.0, res.env.custom_resources),
        placement_strategy=res.placement_strategy,
        placement_timeout_s=res.placement_timeout_s,
    )


def resolve_parallelism(cfg: Config) -> Parallelism:
    """Returns the learner's parallelism and the micro-batching in force on its ranks (the FSDP rule: ``Parallelism``).

    Raises:
        rlray.config.ConfigError: under FSDP with a token budget, ``learner.sequences_per_microbatch`` x ranks does
            not divide ``learner.sequences_per_minibatch`` (the validator checks it only without a budget).
    """
    ln, res = cfg.learner, cfg.resources.learner
    world = res.num_workers
    strategy = res.strategy if world > 1 else "single"
    exact = cfg.rollout.max_new_tokens if cfg.rollout.backend == "exact" else None  # the exact sampler's layout
    configured = MicroBatching(sequences=ln.sequences_per_microbatch, tokens=ln.tokens_per_microbatch,
                               packing=ln.sequence_packing, share_prefixes=ln.share_prefixes, exact_new_tokens=exact)
    in_force = MicroBatching(sequences=ln.sequences_per_microbatch, tokens=None, packing=ln.sequence_packing,
                             share_prefixes=ln.share_prefixes) if strategy == "fsdp" else configured
    if (cfg.algo.family == "online" and in_force.tokens is None and configured.tokens is not None
            and ln.sequences_per_minibatch % (ln.sequences_per_microbatch * world)):
        raise ConfigError(
            f"learner.tokens_per_microbatch={ln.tokens_per_microbatch} is not used by an FSDP learner (it cuts by "
            f"sequences): learner.sequences_per_microbatch={ln.sequences_per_microbatch} x {world} learner worker(s) "
            f"does not divide learner.sequences_per_minibatch={ln.sequences_per_minibatch}; pick a divisor"
        )
    return Parallelism(strategy=strategy, world_size=world, gpu=res.gpus > 0, compute_dtype=compute_dtype(cfg),
                       micro_batching=in_force, frozen_micro_batching=configured,
                       rows_per_minibatch=ln.sequences_per_minibatch // world)


def resolve_lengths(cfg: Config) -> Lengths:
    """Returns the run's lengths in tokens; ``context_tokens`` is the engine's max_model_len (``Lengths``)."""
    prompt, new, eval_new = cfg.data.max_prompt_tokens, cfg.rollout.max_new_tokens, cfg.eval_max_new_tokens
    single = prompt + max(new, eval_new)
    episode = cfg.episode_tokens if cfg.env.enabled else None
    return Lengths(prompt_tokens=prompt, max_new_tokens=new, eval_max_new_tokens=eval_new, episode_tokens=episode,
                   context_tokens=max(single, episode) if episode is not None else single,
                   response_tokens=episode - prompt if episode is not None else new)


def resolve_sampling(cfg: Config) -> Sampling:
    """Returns the training (step 0's) and evaluation SamplingSpecs of ``rollout.*`` and ``eval.*``."""
    r = cfg.rollout
    train = SamplingSpec(n=r.samples_per_prompt, max_new_tokens=r.max_new_tokens, temperature=r.temperature,
                         top_p=r.top_p, seed=cfg.run.seed * 1_000_003, top_k=r.top_k, min_p=r.min_p, stop=tuple(r.stop))
    greedy = SamplingSpec(n=1, max_new_tokens=cfg.eval_max_new_tokens, temperature=0.0, top_p=1.0, stop=tuple(r.stop))
    return Sampling(train=train, eval=greedy, seed=cfg.run.seed, pass_k=cfg.eval.pass_k)


def resolve_engines(cfg: Config) -> Engines:
    """Returns what the rollout actors' engines are built with (``Engines``): the compute dtype, the resolved weight
    sync (``Config.weight_sync_backend``) and LoRA sync (``Config.adapter_sync``)."""
    r, adapter = cfg.rollout, cfg.adapter_sync
    sync = cfg.weight_sync_backend
    return Engines(backend=r.backend, dtype=compute_dtype(cfg), seed=cfg.run.seed, enforce_eager=r.enforce_eager,
                   kv_cache_gib=r.kv_cache_gib, gpu_memory_utilization=r.gpu_memory_utilization,
                   tensor_parallel_size=cfg.resources.rollout.tensor_parallel_size,
                   weight_transfer=None if sync == "object_store" else sync,
                   lora_slots=r.max_staleness + 2 if adapter else 0, lora_rank=cfg.model.lora.rank if adapter else 0,
                   adapter_path=cfg.model.adapter_path if adapter else None,
                   max_restarts=cfg.resources.rollout.max_restarts,
                   partial_segment_tokens=r.partial_segment_tokens if r.partial else None)


def resolve_episodes(cfg: Config) -> Episodes:
    """Returns the environments, agents, MCP tools and episode limits of ``env.*``."""
    env = cfg.env
    tools = tuple(McpServerSpec(s.name, tuple(s.command or ()), s.url or "", s.timeout_s, dict(s.env))
                  for s in env.mcp_servers)
    return Episodes(environments=tuple(env.environments.items()), agents=tuple(env.agents.items()), column=env.column,
                    default=env.default,
                    limits=EpisodeLimits(env.max_turns, cfg.episode_tokens, env.max_observation_tokens,
                                         env.episode_timeout_s, env.step_timeout_s),
                    tools=tools, reward_weight=env.reward_weight,
                    servers=tuple(hosted_server(name, s) for name, s in env.servers.items()),
                    agent_batching=env.agent_batching, agent_threads=env.agent_threads)


def hosted_server(name: str, server: ServerConfig) -> HostedServer:
    """Returns the hosts' record of ``env.servers.<name>``, its ``python`` and ``cwd`` made absolute (the hosts may
    run in another folder; a relative ``python`` that names no file stays as written, a command on PATH)."""
    def absolute(path: str | None) -> str:
        return str(Path(path).expanduser().resolve()) if path else ""

    spec = ServerSpec(name, command=tuple(server.command or ()), url=server.url or "", python=absolute(server.python),
                      cwd=absolute(server.cwd), env=dict(server.env), host=server.host,
                      max_sessions=server.max_sessions, start_timeout_s=server.start_timeout_s,
                      max_restarts=server.max_restarts)
    o = server.openenv
    return HostedServer(spec, server.protocol, OpenEnvOptions(o.action_field, o.observation_field,
                                                              tuple(o.reset_columns), o.show_reset))


def resolve_reward(cfg: Config) -> RewardTerms:
    """Returns the terms of the summed reward: functions, reward model, judges and the environment's reward."""
    rw = cfg.reward
    return RewardTerms(
        functions=tuple((term_name(f.function, f.name), f.weight) for f in rw.functions),
        model_path=rw.model_path, model_weight=rw.model_weight,
        judges=tuple(resolve_judge(cfg, j) for j in rw.judges),
        env_weight=cfg.env.reward_weight if cfg.env.enabled else 0.0, version=rw.version,
    )


def resolve_judge(cfg: Config, j: JudgeConfig) -> Judge:
    """Returns the plan's record of the ``reward.judges`` entry ``j``: its definition and engine as a ``JudgeSpec``
    (seeded with ``run.seed``, ``j.dtype`` resolved for ``resources.judge.gpus``), its ``model_path`` the configured
    ``j.path`` (``Judge.spec``)."""
    res = cfg.resources.judge
    spec = JudgeSpec(
        name=j.name, mode=j.mode, model_path=j.path, template=j.judge_template, pattern=j.score_pattern,
        system_prompt=j.system_prompt, prefill=j.prefill, labels=tuple(j.parse.labels.items()),
        min_score=j.parse.min_score, max_score=j.parse.max_score, match=j.parse.match, logprobs=j.logprobs,
        max_new_tokens=j.max_new_tokens, temperature=j.temperature, seed=cfg.run.seed, backend=j.backend,
        dtype=resolve_dtype(j.dtype, gpu=res.gpus > 0), max_model_len=j.max_model_len, kv_cache_gib=j.kv_cache_gib,
        enforce_eager=j.enforce_eager, cpu_threads=res.cpu_threads,
    )  # fmt: skip
    return Judge(j.name, j.mode, j.weight, j.app_name, j.path, j.revision, spec)
