"""Starts rlray's actors and waits on them. The classes are thin Ray actors over rlray's plain classes, each remote
method delegating in a few lines:

- ``RolloutActor`` over ``RolloutEngine`` (one vLLM engine per actor), named ``rlray:rollout-<i>``,
  placed in the rollout placement group, restarted by Ray up to ``resources.rollout.max_restarts``.
- ``ReferenceActor`` over ``ReferenceModel``, named ``rlray:reference-0`` (when
  ``resources.reference.placement == "actor"``), and the same class over the distillation teacher's model,
  named ``rlray:teacher-0`` (when ``teacher.path`` is set and ``resources.teacher.placement == "actor"``),
  restarted by Ray up to ``resources.reference.max_restarts`` / ``resources.teacher.max_restarts`` (a restart loads
  the frozen model again).
  Both live in ``rlray.launch.engine_actors``, which imports no torch (their handles travel to light processes).
- The reward Serve deployment lives in ``rlray.reward.server`` (Serve builds its own actors).
- ``MonitorActor`` lives in ``rlray.launch.monitor_actor``, which imports no torch (a lighter process).
"""

from __future__ import annotations

import json
import logging
import math
import signal
import threading
import time
from pathlib import Path
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from rlray.launch.engine_actors import WEIGHTS_GROUP, PartialRolloutActor, ReferenceActor, RolloutActor
from rlray.models.adapters import AdapterWeights, read_adapter_config
from rlray.models.loading import ModelError
from rlray.observe.startup import ActorTimes, Launched
from rlray.plan import RunPlan
from rlray.run import build

log = logging.getLogger(__name__)


KV_BLOCK_TOKENS = 16  # vLLM's KV-cache block size on CPU: a sequence holds whole blocks
KV_MARGIN = 1.25
DEFAULT_KV_CACHE_GIB = 1.0  # a model whose config does not say its attention shape


def kv_bytes_per_token(model_path: str, dtype: str) -> int | None:
    """Returns the KV-cache bytes of one token of the model at ``model_path`` (2 x layers x KV heads x head dim x
    dtype bytes, from its config.json), or None when the config does not give the attention shape."""
    try:
        conf = json.loads((Path(model_path) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    conf = conf.get("text_config", conf)
    try:
        layers, heads = int(conf["num_hidden_layers"]), int(conf["num_attention_heads"])
        kv_heads = int(conf.get("num_key_value_heads") or heads)
        head_dim = int(conf.get("head_dim") or int(conf["hidden_size"]) // heads)
    except (KeyError, TypeError, ValueError):
        return None
    return 2 * layers * kv_heads * head_dim * (2 if dtype == "bfloat16" else 4)


def auto_kv_cache_gib(plan: RunPlan, model_path: str, max_model_len: int) -> float:
    """Returns one rollout actor's CPU KV-cache size in GiB: ``rollout.kv_cache_gib``, or when None the most one actor
    holds at once, + 25%.

    That is its share of a step's sequences (prompts_per_step x samples_per_prompt, or eval.num_problems greedy
    ones, over resources.rollout.num_workers), each up to ``max_model_len`` tokens in whole 16-token blocks, times
    ``kv_bytes_per_token``; at least one full-length sequence (vLLM refuses less), rounded up to 1/64 GiB. vLLM
    zeroes the whole cache at start, so an oversized one is resident memory for nothing (1 GiB, the old
    default, was 8x what the benchmark's step needs). A step that needs more than the cache holds still runs:
    vLLM preempts and recomputes sequences. A model whose config.json lacks the attention shape gets 1 GiB.
    """
    if plan.engines.kv_cache_gib is not None:
        return plan.engines.kv_cache_gib
    per_token = kv_bytes_per_token(model_path, plan.engines.dtype)
    if per_token is None:
        return DEFAULT_KV_CACHE_GIB
    actors, cfg = plan.roles.rollout.count, plan.settings
    sequences = max(math.ceil(cfg.learner.prompts_per_step * plan.sampling.train.n / actors),
                    math.ceil(cfg.eval.num_problems / actors), 1)
    tokens = math.ceil(max_model_len / KV_BLOCK_TOKENS) * KV_BLOCK_TOKENS
    gib = sequences * tokens * per_token * KV_MARGIN / 2**30
    return math.ceil(max(gib, tokens * per_token / 2**30) * 64) / 64


def rollout_engine_kwargs(plan: RunPlan, max_model_len: int, cpu_threads: str | None = None,
                          model_path: str | None = None) -> dict:
    """Returns ``RolloutEngine`` keyword arguments from the run plan's ``engines`` (plain values only).

    Args:
        plan: the run plan.
        max_model_len: prompt + response cap, in tokens.
        cpu_threads: this actor's core list (see ``rollout_cpu_threads``).
        model_path: the local model folder, for sizing the KV cache (``auto_kv_cache_gib``); None: 1 GiB when
            ``rollout.kv_cache_gib`` is None.
    """
    e = plan.engines
    return {
        **adapter_engine_kwargs(plan),
        "dtype": e.dtype,
        "seed": e.seed,
        "max_model_len": max_model_len,
        "backend": e.backend,
        "enforce_eager": e.enforce_eager,
        "kv_cache_gib": (auto_kv_cache_gib(plan, model_path, max_model_len) if model_path
                         else e.kv_cache_gib or DEFAULT_KV_CACHE_GIB),
        "gpu_memory_utilization": e.gpu_memory_utilization,
        "tensor_parallel_size": e.tensor_parallel_size,
        "cpu_threads": cpu_threads,
        "weight_transfer": e.weight_transfer,
        # the exact sampler sums in the learner's order: its thread count (rlray.models.exact)
        "torch_threads": build.core_plan(plan.settings).learner_threads if e.backend == "exact" else None,
        **({"partial_segment_tokens": e.partial_segment_tokens} if e.partial_segment_tokens is not None else {}),
    }


def adapter_engine_kwargs(plan: RunPlan) -> dict:
    """Returns the ``RolloutEngine`` LoRA arguments of an adapter-only sync (``plan.engines.lora_slots`` > 0), else {}.

    lora_rank is ``model.lora.rank``, or the rank in ``model.adapter_path``'s adapter_config.json (the largest of
    ``r`` and its ``rank_pattern``); lora_slots is ``rollout.max_staleness + 2``, so that every version an async step
    may still sample with keeps its adapter while the next one is added (``rlray.plan.Engines``).

    Raises:
        rlray.models.ModelError: ``model.adapter_path`` has no adapter_config.json.
    """
    e = plan.engines
    if not e.lora_slots:
        return {}
    rank = e.lora_rank
    if e.adapter_path is not None:
        config = read_adapter_config(e.adapter_path)
        if config is None:
            raise ModelError(f"model.adapter_path='{e.adapter_path}' has no adapter_config.json")
        rank = AdapterWeights({}, config).rank
    return {"lora_rank": rank, "lora_slots": e.lora_slots}


def start_rollout_actors(
    plan: RunPlan,
    model_path: str,
    max_model_len: int,
    nodes: list[str] | None = None,
    namespace: str | None = None,
) -> list[ray.actor.ActorHandle]:
    """Returns ``resources.rollout.num_workers`` started rollout actors, named ``rlray:rollout-<i>``
    (``launch_rollout_actors``, then blocks until each engine is built, so start-up errors surface here)."""
    launched = launch_rollout_actors(plan, model_path, max_model_len, nodes, namespace)
    wait_started(launched)
    return [one.handle for one in launched]


def launch_rollout_actors(
    plan: RunPlan,
    model_path: str,
    max_model_len: int,
    nodes: list[str] | None = None,
    namespace: str | None = None,
) -> list[Launched]:
    """Asks for ``resources.rollout.num_workers`` rollout actors, named ``rlray:rollout-<i>``; returns them unwaited.

    Each actor gets its own core list (``resources.rollout.cpu_threads``, or this node's cores split
    evenly), its custom resources (``resources.rollout.custom_resources``: only nodes that offer them take it),
    node ``nodes[i]`` when given (``rlray.launch.placement.rollout_nodes``; soft: a restart after that node is
    lost goes to any node with the resources), and Ray restarts it up to
    ``resources.rollout.max_restarts`` times (the fleet re-sends its prompts and weights). ``wait_started``
    blocks until the engines are built. ``namespace`` (the run's own, from
    the driver) keeps the names of concurrent runs on one cluster (sweep trials) apart; the actors never join
    a placement group of the caller (a Tune trial's captures its children).
    """

    res = plan.roles.rollout
    if plan.engines.partial_segment_tokens is None:
        cls = ray.remote(RolloutActor)
    else:  # rollout.partial: weight pushes run beside a generation (concurrency groups cannot be set in .options)
        cls = ray.remote(concurrency_groups={WEIGHTS_GROUP: 1})(PartialRolloutActor)
    launched = []
    for i, threads in enumerate(rollout_cpu_threads(plan)):
        name = f"rlray:rollout-{i}"
        wait_for_name(name, namespace)
        strategy = NodeAffinitySchedulingStrategy(nodes[i], soft=True) if nodes else "DEFAULT"
        at = time.time()
        actor = cls.options(
            name=name,
            namespace=namespace,
            num_cpus=res.cpus,
            num_gpus=res.gpus,  # resources.rollout.gpus x tensor_parallel_size
            resources=dict(res.custom),
            max_restarts=plan.engines.max_restarts,
            max_task_retries=0,  # the fleet re-sends a dead actor's prompts itself
            scheduling_strategy=strategy,
        ).remote(model_path, rollout_engine_kwargs(plan, max_model_len, threads, model_path))
        launched.append(Launched(f"rollout-{i}", actor, actor.ready.remote(), at))
    return launched


def wait_started(launched: list[Launched]) -> dict[str, tuple[float, float, ActorTimes | None]]:
    """Waits until every actor of ``launched`` has started, all together; returns their start times.

    Returns:
        Per name: (launched at, ready at on this process, the actor's own ``ActorTimes`` or None), the input of
        ``rlray.observe.startup.startup_summary``.

    Raises:
        ray.exceptions.RayActorError, ray.exceptions.RayTaskError: an actor failed to start (the first to fail).
    """
    pending = {one.ready: one for one in launched}
    ready_at: dict[str, float] = {}
    while pending:
        done, _ = ray.wait(list(pending), num_returns=1)
        for ref in done:
            ray.get(ref)
            ready_at[pending.pop(ref).name] = time.time()
    timed = [one for one in launched if one.keeps_times]
    own = dict(zip([one.name for one in timed], ray.get([one.handle.startup_times.remote() for one in timed]), strict=True))
    return {one.name: (one.launched_at, ready_at[one.name], own.get(one.name)) for one in launched}


WAKE_SIGNAL = signal.SIGUSR1
"""The signal by which ``StartWatch`` stops the main thread (Ray uses neither SIGUSR1 nor SIGUSR2; rlray's stack dumps
use SIGUSR2, ``rlray.hangs.STACK_SIGNAL``)."""


def _start_failed(signum: int, frame: object) -> None:
    """``WAKE_SIGNAL``'s handler while a ``StartWatch`` is armed: stops the main thread as Ctrl-C would."""
    raise KeyboardInterrupt(f"signal {signum}: an actor failed to start")


class StartWatch:
    """Waits for actors to start in a background thread while the caller goes on (the learner group starts beside
    the engines); an actor that fails to start stops the caller's main thread at once, as a wait would have.

    ``watch`` starts the thread over ``wait_started(launched)``; while ``armed`` a failure sends ``WAKE_SIGNAL`` to the
    main thread, whose handler (installed by ``watch``, the previous one put back by ``disarm``) raises
    KeyboardInterrupt inside ``TorchTrainer.fit`` as Ctrl-C would, and the caller raises ``error``
    (``raise_failure``). A signal of its own, not SIGINT: a run started in the background by a shell script (``cmd
    &``), which ignores SIGINT, still starts its learner beside the engines (issue 39: with SIGINT the learner group
    waited for every engine there). Only for a caller on the main thread whose ``WAKE_SIGNAL`` has its default action:
    elsewhere (a Tune trial, a program with its own SIGUSR1 handler) ``wait_started`` runs before the caller goes on.
    """

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.armed = False
        self.interrupted = False
        self.error: BaseException | None = None
        self.started: dict[str, tuple[float, float, ActorTimes | None]] = {}
        self.thread: threading.Thread | None = None
        self._previous: Any = None  # WAKE_SIGNAL's handler before watch installed its own

    def watch(self, launched: list[Launched]) -> StartWatch:
        """Waits for ``launched`` in the background (on the main thread), else here; returns self.

        Raises:
            ray.exceptions.RayActorError, ray.exceptions.RayTaskError: off the main thread, an actor failed to start.
        """
        if threading.current_thread() is not threading.main_thread() or signal.getsignal(WAKE_SIGNAL) != signal.SIG_DFL:
            self.started = wait_started(launched)
            return self
        self._previous = signal.signal(WAKE_SIGNAL, _start_failed)
        self.armed = True
        self.thread = threading.Thread(target=self._wait, args=(launched,), name="rlray-actor-start", daemon=True)
        self.thread.start()
        return self

    def _wait(self, launched: list[Launched]) -> None:
        try:
            self.started = wait_started(launched)
        except BaseException as err:  # noqa: BLE001 - any failure is the run's start error, raised by the main thread
            with self.lock:
                self.error = err
                if self.armed:
                    self.interrupted = True  # a real signal: it also wakes a blocking call of the main thread
                    signal.pthread_kill(threading.main_thread().ident, WAKE_SIGNAL)

    def disarm(self, timeout_s: float = 0.0) -> None:
        """Ends the interrupts (the caller's guarded block is over) and puts ``WAKE_SIGNAL``'s previous handler back
        (on the main thread), then waits up to ``timeout_s`` for the thread."""
        with self.lock:
            self.armed = False
        if self._previous is not None and threading.current_thread() is threading.main_thread():
            signal.signal(WAKE_SIGNAL, self._previous)  # a signal sent while armed was delivered before this call
            self._previous = None
        if self.thread is not None:
            self.thread.join(timeout_s)

    def raise_failure(self) -> None:
        """Raises the start error of an actor when one interrupted the main thread (else returns)."""
        if self.interrupted and self.error is not None:
            raise self.error from None  # not chained to the interrupt it caused


def start_reference_actor(plan: RunPlan, model_path: str, namespace: str | None = None, *,
                          role: str = "reference") -> ray.actor.ActorHandle:
    """Returns a started ``ReferenceActor`` (``launch_reference_actor``, then blocks until its model is loaded).

    Raises:
        ValueError: an unknown role.
    """
    launched = launch_reference_actor(plan, model_path, namespace, role=role)
    wait_started([launched])
    return launched.handle


def launch_reference_actor(plan: RunPlan, model_path: str, namespace: str | None = None, *,
                           role: str = "reference") -> Launched:
    """Asks for a ``ReferenceActor`` in ``namespace`` and returns it unwaited: role "reference" (``rlray:reference-0``,
    resources.reference, ``model_path`` the policy's) or "teacher" (``rlray:teacher-0``, resources.teacher,
    ``model_path`` the teacher's).

    Raises:
        ValueError: an unknown role.
    """
    if role not in ("reference", "teacher"):
        raise ValueError(f"start_reference_actor: role={role!r}; use 'reference' or 'teacher'")
    res = plan.roles.reference_actor if role == "reference" else plan.roles.teacher_actor
    # a hang (watchdog.reference_call_s) or a death restarts it: it loads its frozen model again from model_path
    restarts = (plan.settings.resources.reference if role == "reference" else plan.settings.resources.teacher).max_restarts
    name = f"rlray:{role}-0"
    wait_for_name(name, namespace)
    at = time.time()
    actor = ray.remote(ReferenceActor).options(
        name=name, namespace=namespace, num_cpus=res.cpus, num_gpus=res.gpus, resources=dict(res.custom),
        max_restarts=restarts, scheduling_strategy="DEFAULT",
    ).remote(
        model_path,
        {"dtype": plan.parallelism.compute_dtype, "temperature": plan.sampling.train.temperature,
         "torch_threads": build.core_plan(plan.settings).learner_threads},
    )
    return Launched(f"{role}-0", actor, actor.ready.remote(), at)


def start_env_hosts(plan: RunPlan, namespace: str | None = None, *, model_dir: str | None = None) -> list[ray.actor.ActorHandle]:
    """Returns the started environment hosts ``rlray:env-<i>`` (resources.env), or [] without env.environments and
    env.agents.

    With env.agents or env.mcp_servers each host is an ``AgentHost`` (an ``EnvironmentHost`` that also serves the
    agent gateway and holds the MCP sessions; ``agent_host_kwargs``), else a plain ``EnvironmentHost``.

    Args:
        plan: the run plan.
        namespace: the run's Ray namespace.
        model_dir: the policy's local folder (an ``AgentHost`` tokenizes the agents' conversations with its
            tokenizer); None: ``model.path`` resolved.

    Raises:
        ValueError: an environment class or agent function cannot be loaded (raised by the first host; names it).
        rlray.envs.agents.mcp.McpStartError: an MCP server did not start.
    """
    launched = launch_env_hosts(plan, namespace, model_dir=model_dir)
    wait_started(launched)
    return [one.handle for one in launched]


def launch_env_hosts(plan: RunPlan, namespace: str | None = None, *, model_dir: str | None = None,
                     log_dir: str | Path | None = None) -> list[Launched]:
    """Asks for the environment hosts of ``start_env_hosts`` and returns them unwaited ([] without env.environments
    and env.agents); ``wait_started`` waits for their ``ping``. With ``log_dir`` (the run's log folder) host i's
    servers log to ``<log_dir>/servers/env-<i>/<server>.log`` (on the host's machine), else to a temporary folder.

    Raises:
        ValueError: an environment class or agent function cannot be loaded (raised by the first host; names it).
    """
    ep = plan.episodes
    if not ep.enabled:
        return []
    from rlray.envs.host import EnvironmentHost  # deferred: environments' imports only when configured

    res, env, hosts = plan.settings.resources.env, plan.settings.env, []
    gateway = bool(ep.agents or ep.tools)
    for i in range(plan.roles.env.count):
        wait_for_name(f"rlray:env-{i}", namespace)
        at = time.time()
        options = dict(name=f"rlray:env-{i}", namespace=namespace, num_cpus=plan.roles.env.cpus,
                       resources=dict(plan.roles.env.custom), max_restarts=res.max_restarts, scheduling_strategy="DEFAULT")
        kwargs = dict(tool_parser=env.tool_parser, step_timeout_s=ep.limits.step_timeout_s, threads=res.threads,
                      sandbox=env.sandbox, memory_gib=env.memory_gib, trl_parity=env.trl_parity,
                      servers=list(ep.servers),
                      server_log_dir=str(Path(log_dir, "servers", f"env-{i}")) if log_dir else "")
        if gateway:  # run_agents blocks while the host's agents run: the environments' calls need threads of their own
            from rlray.envs.agents.agent_host import AgentHost

            host = ray.remote(AgentHost).options(**options, max_concurrency=AGENT_HOST_CONCURRENCY).remote(
                dict(ep.environments), **kwargs, **agent_host_kwargs(plan, model_dir))
        else:
            host = ray.remote(EnvironmentHost).options(**options, max_concurrency=1).remote(
                dict(ep.environments), **kwargs)
        hosts.append(Launched(f"env-{i}", host, host.ping.remote(), at, keeps_times=False))
    return hosts


AGENT_HOST_CONCURRENCY = 8  # an AgentHost's calls at once: agent batches (async steps, DAPO refills) and env steps


def rollout_cpu_threads(plan: RunPlan) -> list[str]:
    """Returns each rollout actor's core list: resources.rollout.cpu_threads, or ``rlray.run.build.core_plan``'s."""
    return build.core_plan(plan.settings).rollout


def agent_host_kwargs(plan: RunPlan, model_dir: str | None = None) -> dict[str, Any]:
    """Returns the ``AgentHost`` keyword arguments of ``plan`` beyond ``EnvironmentHost``'s (plain values; the agents,
    the episode limits and the MCP servers are the run plan's ``episodes``)."""
    from rlray.models import resolve_model_path
    from rlray.run.agents import FleetSampler

    ep, cfg = plan.episodes, plan.settings
    return {
        "agents": dict(ep.agents),
        "model_dir": (model_dir or resolve_model_path(cfg.model.path, revision=cfg.model.revision)) if ep.agents else None,
        "chat_template": cfg.model.chat_template,
        "sampler_factory": FleetSampler,
        "max_turns": ep.limits.max_turns,
        "max_episode_tokens": ep.limits.max_episode_tokens,
        "episode_timeout_s": ep.limits.episode_timeout_s,
        "max_observation_tokens": ep.limits.max_observation_tokens,
        "mcp_servers": list(ep.tools),
        "gateway_host": cfg.env.gateway_host,
        "chat_template_kwargs": dict(cfg.rollout.chat_template_kwargs),
        "agent_batching": ep.agent_batching,
        "agent_threads": ep.agent_threads,
    }


def wait_for_name(name: str, namespace: str | None = None, timeout_s: float = 30.0) -> None:
    """Waits until no live actor holds ``name`` (a killed actor frees its name asynchronously).

    Raises:
        RuntimeError: the name is still taken after ``timeout_s`` (another run uses it).
    """
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            ray.get_actor(name, namespace=namespace)
        except ValueError:
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"a Ray actor named '{name}' is alive: another rlray run uses this cluster's names")
        time.sleep(0.2)


def kill_actors(actors: list[ray.actor.ActorHandle]) -> None:
    """Kills actors for good (no restart)."""
    for a in actors:
        ray.kill(a, no_restart=True)
