"""The records of a ``RunPlan``: each decision of a run, taken once from the config (``rlray.plan.resolve``).

Frozen dataclasses of plain values. Every size carries its unit; a field's docstring names the config keys it
comes from. The driver, the preflight, ``rlray plan``, the placement check, ``rlray.run.build`` and rank 0's lead
read these fields instead of comparing config keys again.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from rlray.envs.agents.mcp import McpServerSpec
from rlray.envs.limits import EpisodeLimits
from rlray.envs.servers.hosted import HostedServer
from rlray.learner.batching import MicroBatching
from rlray.reward.judges.records import JudgeSpec
from rlray.rollout.types import SamplingSpec

if TYPE_CHECKING:
    from rlray.plan.settings import Settings

REFERENCE_PLACES = ("off", "learner", "lora_base", "actor")
"""Where the reference model lives: nowhere, a frozen copy on every learner rank, the LoRA policy's base with the
adapters off (no copy), or its own actor (rlray:reference-0)."""
TEACHER_PLACES = ("off", "learner", "actor")
"""Where the teacher lives: nowhere, a frozen copy on every learner rank, or its own actor (rlray:teacher-0)."""


@dataclass(frozen=True)
class RoleResources:
    """One role's Ray resources: ``count`` workers of ``cpus`` CPUs, ``gpus`` GPUs and ``custom`` resources each.

    Attributes:
        count: workers (actors, ranks, Serve replicas) of the role.
        cpus: CPUs per worker (fractions allowed).
        gpus: GPUs per worker (a rollout actor: ``resources.rollout.gpus`` x ``tensor_parallel_size``).
        custom: custom Ray resources per worker, as sorted (name, amount) pairs.
    """

    count: int
    cpus: float
    gpus: float
    custom: tuple[tuple[str, float], ...] = ()

    def bundle(self) -> dict[str, float]:
        """Returns one worker's Ray resources: {"CPU": cpus, "GPU": gpus (when > 0), **custom}."""
        return {"CPU": self.cpus, **({"GPU": self.gpus} if self.gpus else {}), **dict(self.custom)}


@dataclass(frozen=True)
class Roles:
    """Which roles run and where: the one place each placement is decided.

    Attributes:
        online: the run samples (``algo.family == "online"``): rollout actors, environment hosts, the reward server
            and the judges exist only then.
        reference: where the reference model lives (``REFERENCE_PLACES``). Wanted when online and ``algo.kl_coef`` >
            0 or ``guard.kl_threshold`` is set; its own actor only with ``algo.kl_coef`` > 0 and
            ``resources.reference.placement == "actor"`` (a KL guard alone keeps it on the learner); on the learner
            "lora_base" with ``model.lora.rank`` or ``model.adapter_path``, else "learner".
        teacher: where the teacher lives (``TEACHER_PLACES``): "off" without ``teacher.path``, else
            ``resources.teacher.placement``.
        critic: PPO's value model trains beside the policy (the algorithm's ``needs_critic``).
        reward_server: the reward runs as the Serve application ``reward.server.app_name`` (online and
            ``reward.server.enabled``), else in learner rank 0's process.
        judges: the Serve application name of each ``reward.judges`` entry (online only; () without judges).
        env_hosts: environment host actors run (online and ``env.environments`` or ``env.agents`` set).
        rollout: the rollout actors' resources (``resources.rollout``; asked of the cluster even offline).
        learner: the learner ranks' resources (``resources.learner``).
        reward: the reward server's replicas (``resources.reward``), asked of the cluster with
            ``reward.server.enabled``.
        judge: each judge application's replicas (``resources.judge``).
        reference_actor: the reference actor's resources (``resources.reference``).
        teacher_actor: the teacher actor's resources (``resources.teacher``).
        env: the environment hosts' resources (``resources.env``).
        placement_strategy: how the rollout actors' and the learner's workers spread over nodes
            (``resources.placement_strategy``: PACK, SPREAD, STRICT_PACK or STRICT_SPREAD).
        placement_timeout_s: how long the rollout actors' placement group may take to be ready, in seconds.
    """

    online: bool
    reference: str
    teacher: str
    critic: bool
    reward_server: bool
    judges: tuple[str, ...]
    env_hosts: bool
    rollout: RoleResources
    learner: RoleResources
    reward: RoleResources
    judge: RoleResources
    reference_actor: RoleResources
    teacher_actor: RoleResources
    env: RoleResources
    placement_strategy: str
    placement_timeout_s: float

    @property
    def reference_on_learner(self) -> bool:
        """Returns True when every learner rank holds a frozen reference copy (not LoRA's base, not an actor)."""
        return self.reference == "learner"


@dataclass(frozen=True)
class Parallelism:
    """How the learner's ranks split the work, and the micro-batching in force on them.

    Attributes:
        strategy: "single" (one rank), "ddp" or "fsdp" (``resources.learner.strategy`` with more than one rank).
        world_size: learner ranks (``resources.learner.num_workers``).
        gpu: the learner asks for GPUs (``resources.learner.gpus`` > 0).
        compute_dtype: ``model.dtype`` with "auto" resolved on this machine ("bfloat16" or "float32").
        micro_batching: the micro-batching a learner rank runs. THE rule: an FSDP-sharded learner cuts by
            sequences, not tokens (every rank must run as many forwards, each one gathers the weights; a token
            budget could cut ranks unevenly), so ``learner.tokens_per_microbatch`` is dropped under FSDP.
        frozen_micro_batching: what a reference or teacher actor runs (its own process, not sharded): the
            configured ``learner.*`` micro-batching, token budget included.
        rows_per_minibatch: sequences per rank per optimizer step (``learner.sequences_per_minibatch`` / world).
    """

    strategy: str
    world_size: int
    gpu: bool
    compute_dtype: str
    micro_batching: MicroBatching
    frozen_micro_batching: MicroBatching
    rows_per_minibatch: int

    @property
    def sharded(self) -> bool:
        """Returns True when the policy is FSDP2-sharded over the ranks."""
        return self.strategy == "fsdp"


@dataclass(frozen=True)
class Engines:
    """The rollout engines: what each rollout actor's ``RolloutEngine`` is built with (``rollout.*``,
    ``resources.rollout``, ``model.*``).

    Attributes:
        backend: "vllm", "hf" or "exact" (``rollout.backend``).
        dtype: the engines' dtype, the learner's compute dtype (``Parallelism.compute_dtype``).
        seed: the engines' seed (``run.seed``; each step's sampling has its own, ``Sampling.for_step``).
        enforce_eager: vLLM without CUDA graphs (``rollout.enforce_eager``).
        kv_cache_gib: one engine's CPU KV cache in GiB (``rollout.kv_cache_gib``); None: sized per actor from the
            model and its share of a step (``rlray.launch.actors.auto_kv_cache_gib``).
        gpu_memory_utilization: the share of a GPU vLLM may take (``rollout.gpu_memory_utilization``).
        tensor_parallel_size: GPUs per engine (``resources.rollout.tensor_parallel_size``).
        weight_transfer: how new weights reach the engines besides the object store: "nccl" or "ipc" (the resolved
            ``rollout.weight_sync``), None through the object store.
        lora_slots: adapter versions an engine keeps with an adapter-only weight sync (the resolved
            ``rollout.lora_sync``): ``rollout.max_staleness`` + 2, so that every version an async step may still
            sample with keeps its adapter while the next one is added; 0: merged weights, no LoRA in the engine.
        lora_rank: the adapters' rank with an adapter-only sync (``model.lora.rank``; with ``adapter_path`` the
            launch reads the rank from its adapter_config.json instead).
        adapter_path: the adapter an adapter-only sync starts from (``model.adapter_path``), None without.
        max_restarts: times Ray restarts a dead rollout actor (``resources.rollout.max_restarts``).
        partial_segment_tokens: partial rollouts (``rollout.partial``): new tokens per generation segment, between
            which a weight update may load (``rollout.partial_segment_tokens``); None when partial rollouts are off.
    """

    backend: str
    dtype: str
    seed: int
    enforce_eager: bool
    kv_cache_gib: float | None
    gpu_memory_utilization: float
    tensor_parallel_size: int
    weight_transfer: str | None
    lora_slots: int
    lora_rank: int
    adapter_path: str | None
    max_restarts: int
    partial_segment_tokens: int | None = None


@dataclass(frozen=True)
class Lengths:
    """The run's lengths, in tokens.

    Attributes:
        prompt_tokens: the longest prompt (``data.max_prompt_tokens``).
        max_new_tokens: a training completion's cap (``rollout.max_new_tokens``).
        eval_max_new_tokens: an evaluation completion's cap (``eval.max_new_tokens``, else the training cap).
        episode_tokens: the longest episode with environments (``Config.episode_tokens``), None without.
        context_tokens: a rollout engine's context length (vLLM's max_model_len): the longest prompt plus the
            longest generation, with environments at least the longest episode. The driver gives it to the
            engines and ``rlray plan`` sizes their KV cache with it.
        response_tokens: the longest response a learner row holds: the episode less the prompt with environments,
            else ``max_new_tokens``.
    """

    prompt_tokens: int
    max_new_tokens: int
    eval_max_new_tokens: int
    episode_tokens: int | None
    context_tokens: int
    response_tokens: int


@dataclass(frozen=True)
class Sampling:
    """The sampling of the run's completions (``rollout.*``), and the evaluation's.

    Attributes:
        train: step 0's training SamplingSpec; ``for_step`` gives any step's (only its seed differs).
        eval: the evaluation's SamplingSpec: one greedy completion of up to ``eval_max_new_tokens``.
        seed: ``run.seed``.
        pass_k: completions per problem for eval/pass@k (``eval.pass_k``; 1: off).
    """

    train: SamplingSpec
    eval: SamplingSpec
    seed: int
    pass_k: int

    def for_step(self, step: int) -> SamplingSpec:
        """Returns the training SamplingSpec of 0-based ``step``: the seed is seed * 1_000_003 + step, so samples
        depend on the seed, the step, the prompts and the weights only."""
        return dataclasses.replace(self.train, seed=self.step_seed(step))

    def step_seed(self, step: int) -> int:
        """Returns the seed of 0-based ``step``'s sampling and of its judge calls."""
        return self.seed * 1_000_003 + step

    def pass_at_k(self) -> SamplingSpec | None:
        """Returns eval/pass@k's SamplingSpec (``pass_k`` samples at the training temperature, the eval cap, seeded
        with ``run.seed``), None when ``pass_k`` is 1."""
        if self.pass_k <= 1:
            return None
        return dataclasses.replace(self.train, n=self.pass_k, max_new_tokens=self.eval.max_new_tokens, seed=self.seed)


@dataclass(frozen=True)
class Episodes:
    """Environments and agents (``env.*``), and the limits that end an episode.

    Attributes:
        environments: name -> "module:Class" of each environment (``env.environments``).
        agents: name -> "module:function" of each agent (``env.agents``).
        column: the row column naming a row's environment or agent (``env.column``).
        default: the environment or agent of rows without one (``env.default``), or None.
        limits: the one limits record of environment and agent episodes (``rlray.envs.limits.EpisodeLimits``:
            env.max_turns, ``Config.episode_tokens``, env.max_observation_tokens, env.episode_timeout_s,
            env.step_timeout_s; ``max_new_tokens`` 0, set per step from its sampling).
        tools: the MCP servers whose tools the hosts offer (``env.mcp_servers``).
        reward_weight: weight of the environment's reward in the summed reward (``env.reward_weight``).
        servers: the environment servers the hosts start or reach (``env.servers``; paths made absolute).
        agent_batching: how the hosts gather their agents' calls into engine calls (``env.agent_batching``:
            ``lockstep`` or ``window``, ``rlray.envs.agents.agent_host.TickBatcher``).
        agent_threads: the most synchronous agent episodes a host runs at once per batch (``env.agent_threads``,
            ``rlray.envs.agents.admission.Admission``).
    """

    environments: tuple[tuple[str, str], ...]
    agents: tuple[tuple[str, str], ...]
    column: str
    default: str | None
    limits: EpisodeLimits
    tools: tuple[McpServerSpec, ...]
    reward_weight: float
    servers: tuple[HostedServer, ...] = ()
    agent_batching: str = "lockstep"
    agent_threads: int = 64

    @property
    def enabled(self) -> bool:
        """Returns True when environments, servers or agents are configured (``EnvConfig.enabled``): rows may run as
        multi-turn episodes, and environment hosts start."""
        return bool(self.environments or self.agents or self.servers)

    @property
    def episode_environments(self) -> list[str]:
        """Returns the names a row's env.column may give to run an environment episode: env.environments and
        env.servers (agents run apart)."""
        return [name for name, _ in self.environments] + [s.spec.name for s in self.servers]


@dataclass(frozen=True)
class Judge:
    """One ``reward.judges`` entry as the run combines and serves it.

    Attributes:
        name: the judge's term name (``reward.judges[i].name``; metric ``reward/<name>``).
        mode: "pointwise" or "group" (``reward.judges[i].mode``).
        weight: its weight in the summed reward (``reward.judges[i].weight``).
        app_name: its Serve application (``rlray-judge-<name>``).
        path: the judge model as configured (``reward.judges[i].path``; the driver's ``resolve_paths`` made a local
            path absolute and a Hub id its snapshot folder).
        revision: its revision (``reward.judges[i].revision``), None for the default branch.
        spec: the judge's definition and engine (``rlray.reward.judges.JudgeSpec``: templates, parse rule, sampling
            seeded with ``run.seed``, ``reward.judges[i].dtype`` resolved for ``resources.judge.gpus``,
            ``resources.judge.cpu_threads``). Its ``model_path`` is ``path`` as configured: an alias or a GGUF file
            is resolved (converted once) where the judge is checked or deployed (``rlray.launch.judges.judge_specs``).
    """

    name: str
    mode: str
    weight: float
    app_name: str
    path: str
    revision: str | None
    spec: JudgeSpec


@dataclass(frozen=True)
class RewardTerms:
    """What sums into a sample's reward.

    Attributes:
        functions: (name, weight) of each ``reward.functions`` entry (name: its ``name``, else its function spec).
        model_path: the reward model (``reward.model_path``), None without.
        model_weight: its weight (``reward.model_weight``).
        judges: the judges (``reward.judges``).
        env_weight: the environment's reward weight (``env.reward_weight``; 0 without environments).
        version: ``reward.version`` (a new one hot-swaps a served scorer).
    """

    functions: tuple[tuple[str, float], ...]
    model_path: str | None
    model_weight: float
    judges: tuple[Judge, ...]
    env_weight: float
    version: int


@dataclass(frozen=True)
class Snapshots:
    """Where and how often the run keeps snapshots (``checkpoint.*``).

    Attributes:
        uri: the snapshot root (``Config.checkpoint_uri``).
        every_steps: a snapshot every this many steps (``checkpoint.every_steps``), and one after the last step.
        last_step: the run's last step (``run.max_steps``).
        keep_last: complete snapshots kept (``checkpoint.keep_last``; Ray Train's num_to_keep).
        resume_from: the snapshot to resume from ("latest", a path or URI), None for a fresh run.
    """

    uri: str
    every_steps: int
    last_step: int
    keep_last: int
    resume_from: str | None

    def due(self, step: int) -> bool:
        """Returns True when 1-based ``step`` ends with a snapshot: every ``every_steps`` steps, and the last one."""
        return step % self.every_steps == 0 or step == self.last_step


@dataclass(frozen=True)
class Tracking:
    """Where the run logs (``tracking.*``): the MLflow ``mlflow_uri`` and ``experiment``, the run's ``run_name``
    (None: MLflow picks one) and the TensorBoard folder ``tensorboard_dir`` (None: off)."""

    mlflow_uri: str
    experiment: str
    run_name: str | None
    tensorboard_dir: str | None


@dataclass(frozen=True)
class Deadlines:
    """How long the run waits on each kind of remote call, and what a call past its deadline does (``watchdog.*``;
    ``rlray.hangs``: the stuck process's stacks, an ``rlray: hang`` line and alert, then the action).

    Attributes:
        env_call_s: one call to an environment host (``watchdog.env_call_s``), seconds.
        engine_call_s: one generate call on a rollout actor, queueing excluded (``watchdog.engine_call_s``), seconds.
        weight_push_s: one object-store weight push to a rollout actor, queueing excluded (``watchdog.weight_push_s``).
        reference_call_s: one logprobs call of a learner rank to the reference or teacher actor, queueing behind the
            other ranks' calls included (``watchdog.reference_call_s``), seconds.
        learner_step_s: one learner step on a rank (``watchdog.learner_step_s``), seconds.
        collective_s: one wait of a learner rank in a timed collective (``watchdog.collective_s``), seconds.
        on_hang: "restart" the actor, or "stop" the run (``watchdog.on_hang``).
        stacks_timeout_s: the wait for a stuck process's stacks (``watchdog.stacks_timeout_s``), seconds.
    """

    env_call_s: float
    engine_call_s: float
    weight_push_s: float
    reference_call_s: float
    learner_step_s: float
    collective_s: float
    on_hang: str
    stacks_timeout_s: float


@dataclass(frozen=True)
class RunPlan:
    """A run, resolved once from its validated config (``rlray.plan.resolve_plan``).

    Attributes:
        roles: which roles run and where (placements, resources).
        parallelism: the learner's ranks and the micro-batching in force on them.
        lengths: the prompt, completion, episode and context lengths (tokens).
        sampling: the training and evaluation SamplingSpecs.
        engines: what the rollout actors' engines are built with.
        episodes: environments, agents, tools and episode limits.
        reward: the terms of the summed reward.
        snapshots: where snapshots go.
        tracking: where the run logs.
        deadlines: the deadlines of the remote calls the run waits on, and the action past one.
        max_steps: RL steps of the run (``run.max_steps``).
        uses_gpus: the learner or the rollout asks for GPUs (``resources.{learner,rollout}.gpus`` > 0); it decides
            ``model.dtype=auto`` and whether ``rlray plan`` needs the GPUs' memory.
        settings: the validated config the plan was resolved from, handed out read-only for the settings the run
            reads as they are (algorithm hyper-parameters, optimizer, ``data.*``, ``eval.*``, ``guard.*``,
            ``run.*``, ``offline.*``, ...). Nothing may assign to it: a change (a rollback, the OOM fallback) makes
            a new plan through ``rlray.plan.replan``, so decisions and settings never disagree.
        source: the config tree in force as plain data (``Config.model_dump()``, secrets included: never log it
            whole): what a snapshot stores, what the learner ranks receive and what ``replan`` edits.
        config_hash: the hash of the config in force (``Config.config_hash``; snapshots and MLflow tags keep it).
    """

    roles: Roles
    parallelism: Parallelism
    lengths: Lengths
    sampling: Sampling
    engines: Engines
    episodes: Episodes
    reward: RewardTerms
    snapshots: Snapshots
    tracking: Tracking
    deadlines: Deadlines
    max_steps: int
    uses_gpus: bool
    settings: Settings = field(repr=False, compare=False)
    source: dict[str, Any] = field(repr=False, compare=False)
    config_hash: str = ""

    def to_yaml(self) -> str:
        """Returns the config in force as YAML text (``Config.to_yaml``): what MLflow keeps as artifacts."""
        return self.settings.to_yaml()
