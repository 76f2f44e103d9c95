"""What each role asks of the Ray cluster, a fit check before anything starts, and placement groups.

``role_requests(cfg)`` turns ``resources:`` into one request per role (rollout, learner, reward,
reference). ``check_fit`` compares them with the cluster and raises one error that says which
role wants what and what the cluster has, before any actor starts. The rollout actors then live in
one placement group (``rollout_placement_group``); Ray Train builds the learner's own group with
the same strategy (ScalingConfig.placement_strategy), and Serve places the reward replicas.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group

from rlray.config import Config
from rlray.cores import parse_core_list

_EPS = 1e-9


class PlacementError(RuntimeError):
    """The resources asked for cannot be placed on the cluster; the message names roles and amounts."""


@dataclass(frozen=True)
class RoleRequest:
    """Resources one role asks for: ``count`` workers of ``per_worker`` each ({"CPU": x, "GPU": y, <custom>: z})."""

    role: str
    count: int
    per_worker: dict[str, float]

    def total(self) -> dict[str, float]:
        """Returns count * per_worker."""
        return {k: v * self.count for k, v in self.per_worker.items()}

    def describe(self) -> str:
        """Returns e.g. 'rollout wants 2 x {CPU: 0.25} = {CPU: 0.5}'."""
        return f"{self.role} wants {self.count} x {_fmt(self.per_worker)} = {_fmt(self.total())}"


def _fmt(resources: dict[str, float]) -> str:
    return "{" + ", ".join(f"{k}: {v:g}" for k, v in sorted(resources.items())) + "}"


def bundle(cpus: float, gpus: float, custom: dict[str, float] | None = None) -> dict[str, float]:
    """Returns one worker's Ray resources: {"CPU": cpus, "GPU": gpus (when > 0), **custom}."""
    return {"CPU": cpus, **({"GPU": gpus} if gpus else {}), **(custom or {})}


def rollout_bundle(cfg: Config) -> dict[str, float]:
    """Returns one rollout actor's Ray resources (its GPUs are gpus x tensor_parallel_size)."""
    r = cfg.resources.rollout
    return bundle(r.cpus, r.gpus * r.tensor_parallel_size, r.custom_resources)


def role_requests(cfg: Config) -> list[RoleRequest]:
    """Returns the Ray resources each role of ``cfg`` asks for (roles that are off are left out)."""
    res = cfg.resources
    out = [
        RoleRequest("rollout", res.rollout.num_workers, rollout_bundle(cfg)),
        RoleRequest("learner", res.learner.num_workers, bundle(res.learner.cpus, res.learner.gpus, res.learner.custom_resources)),
    ]
    if cfg.reward.server.enabled:
        out.append(RoleRequest("reward", res.reward.replicas, bundle(res.reward.cpus, res.reward.gpus, res.reward.custom_resources)))
    if cfg.algo.kl_coef > 0 and res.reference.placement == "actor":
        out.append(RoleRequest("reference", 1, bundle(res.reference.cpus, res.reference.gpus, res.reference.custom_resources)))
    if cfg.teacher.enabled and res.teacher.placement == "actor":
        out.append(RoleRequest("teacher", 1, bundle(res.teacher.cpus, res.teacher.gpus, res.teacher.custom_resources)))
    if cfg.env.enabled:
        out.append(RoleRequest("env", res.env.num_workers, bundle(res.env.cpus, 0.0, res.env.custom_resources)))
    return out


def check_fit(requests: list[RoleRequest], cluster: dict[str, float], nodes: list[dict[str, float]]) -> None:
    """Checks that the requests fit the cluster's totals and that every bundle fits on one node.

    Args:
        requests: what each role asks for.
        cluster: total resources of the cluster ({"CPU": 2.0, "GPU": 0, ...}).
        nodes: total resources of each alive node.

    Raises:
        PlacementError: naming every role's request, the shortfall and what the cluster has.
    """
    need: dict[str, float] = {}
    for r in requests:
        for k, v in r.total().items():
            need[k] = need.get(k, 0.0) + v
    short = {k: v for k, v in need.items() if v > cluster.get(k, 0.0) + _EPS}
    too_big = [
        r for r in requests
        if not any(all(v <= node.get(k, 0.0) + _EPS for k, v in r.per_worker.items()) for node in nodes)
    ]
    if not short and not too_big:
        return
    has = {k: cluster.get(k, 0.0) for k in sorted(set(need) | {"CPU", "GPU"})}
    lines = [r.describe() for r in requests]
    if short:
        lines.append(f"together they want {_fmt(need)}, but the cluster has {_fmt(has)}")
    for r in too_big:
        lines.append(f"one {r.role} worker ({_fmt(r.per_worker)}) fits on no single node; largest nodes: "
                     + ", ".join(_fmt(n) for n in nodes[:4]))
    raise PlacementError(
        "the requested resources do not fit the Ray cluster:\n  - " + "\n  - ".join(lines)
        + "\nLower resources.<role>.cpus/gpus or num_workers (fractions are allowed), or add nodes (a custom resource: "
        "nodes started with `ray start --resources`)."
    )


def cluster_totals() -> tuple[dict[str, float], list[dict[str, float]]]:
    """Returns (cluster total resources, per-node totals of alive nodes) of the connected cluster."""
    nodes = [dict(n["Resources"]) for n in ray.nodes() if n.get("Alive")]
    return dict(ray.cluster_resources()), nodes


def check_cluster(cfg: Config) -> list[RoleRequest]:
    """Checks ``cfg``'s requests against the connected cluster and returns them.

    Raises:
        PlacementError: they do not fit (see ``check_fit``).
    """
    requests = role_requests(cfg)
    check_fit(requests, *cluster_totals())
    return requests


def rollout_placement_group(cfg: Config) -> PlacementGroup:
    """Returns a ready placement group with one bundle per rollout actor (strategy from resources).

    Raises:
        PlacementError: the group is not ready within ``resources.placement_timeout_s`` (other work
            holds the resources); the message says what is available.
    """
    res = cfg.resources
    one = rollout_bundle(cfg)
    pg = placement_group([one] * res.rollout.num_workers, strategy=res.placement_strategy, name=f"rlray:rollout:{os.getpid()}")
    try:
        ray.get(pg.ready(), timeout=res.placement_timeout_s)
    except ray.exceptions.GetTimeoutError:
        remove_placement_group(pg)
        raise PlacementError(
            f"the rollout placement group ({res.rollout.num_workers} x {_fmt(one)}, {res.placement_strategy}) was not "
            f"ready within resources.placement_timeout_s={res.placement_timeout_s:g} s; available now: "
            f"{_fmt(ray.available_resources())}. Other actors hold the resources, or the strategy cannot be met."
        ) from None
    return pg


def split_cores(count: int, cores: list[int]) -> list[str]:
    """Returns one core list per actor, splitting ``cores`` into ``count`` contiguous parts.

    With fewer cores than actors, actor i gets core ``cores[i % len(cores)]``.

    Example: ``split_cores(2, [0, 1])`` is ``["0", "1"]``; ``split_cores(1, [0, 1])`` is ``["0-1"]``.
    """
    if count <= len(cores):
        parts = [cores[len(cores) * i // count : len(cores) * (i + 1) // count] for i in range(count)]
    else:
        parts = [[cores[i % len(cores)]] for i in range(count)]
    return [_core_list(p) for p in parts]


def _core_list(cores: list[int]) -> str:
    """Returns "a-b" for a contiguous run of two or more cores, else "a,b,..."."""
    if len(cores) > 1 and cores == list(range(cores[0], cores[-1] + 1)):
        return f"{cores[0]}-{cores[-1]}"
    return ",".join(str(c) for c in cores)


SPLIT_MIN_CORES = 8  # async on CPU splits the cores between rollout and learner from this many cores on


@dataclass(frozen=True)
class CorePlan:
    """How the CPU roles of a run share one machine's cores when the config leaves it to rlray.

    Attributes:
        rollout: one core list per rollout actor (its vLLM CPU threads: their number and the cores they run on).
        learner_threads: torch intra-op threads per learner worker (and per reference/teacher actor).
        learner_cores: one core list per learner worker to pin it to, or None (not pinned).
        why: one line for the log: which rule chose this.
    """

    rollout: list[str]
    learner_threads: int
    learner_cores: list[str] | None
    why: str


def plan_cores(cores: list[int], *, rollout_actors: int, learner_workers: int, rollout_on_gpu: bool,
               learner_on_gpu: bool, overlap: bool) -> CorePlan:
    """Returns the default use of ``cores`` by the rollout actors and learner workers of a run on one machine.

    The rule follows when the stages compute:

    - **They take turns** (a synchronous run: ``rollout.max_staleness=0``), or one of them runs on GPUs: each
      stage gets every core while it runs. The rollout actors split the cores among themselves, the learner
      workers split them too (threads = cores // workers, at least 1), nothing is pinned. A split between the
      stages would leave half the cores idle in every stage.
    - **They overlap** (async, both on CPU) on ``SPLIT_MIN_CORES`` cores or more: the rollout actors get the last
      ``n // 2`` cores and the learner workers the others, each side pinned to its own, so they do not fight.
    - **They overlap on fewer cores**: shared as in a synchronous run. A split halves each stage's cores, and
      since CPU compute scales about linearly with cores at these sizes, max(rollout on n/2, update on n/2) is
      no shorter than rollout + update on n: the split only pays where scaling is sublinear (many cores). On
      2 cores (SmolLM2, `benchmarks/grpo_vs_trl.py`) the shared async step took 1.12x the sync step.

    Args:
        cores: the cores this machine gives the run (``os.sched_getaffinity(0)``), at least one.
        rollout_actors, learner_workers: how many of each role run on this machine (>= 1).
        rollout_on_gpu, learner_on_gpu: the role computes on GPUs (its CPU threads only feed them).
        overlap: the rollout of step t+1 runs while step t's update does (``rollout.max_staleness > 0``).

    Raises:
        ValueError: no cores, or a role count below 1.

    Example: 2 cores, 1 actor, 1 worker, sync or async: rollout ["0-1"], 2 learner threads, unpinned; 16 cores
    async: rollout ["8-15"], 8 learner threads pinned to ["0-7"].
    """
    if not cores or rollout_actors < 1 or learner_workers < 1:
        raise ValueError(f"plan_cores: cores={cores}, rollout_actors={rollout_actors}, learner_workers={learner_workers}")
    cores = sorted(cores)
    n = len(cores)
    if not overlap or rollout_on_gpu or learner_on_gpu or n < SPLIT_MIN_CORES:
        why = ("synchronous: the stages take turns, each on every core" if not overlap
               else "a stage on GPU: no CPU split" if (rollout_on_gpu or learner_on_gpu)
               else f"async on {n} < {SPLIT_MIN_CORES} cores: a split would slow each stage more than overlap saves")
        return CorePlan(split_cores(rollout_actors, cores), max(1, n // learner_workers), None, why)
    rollout_part = cores[n - max(1, n // 2):]
    learner_part = cores[: n - len(rollout_part)]
    learner_lists = split_cores(learner_workers, learner_part)
    threads = max(1, len(learner_part) // learner_workers)
    return CorePlan(split_cores(rollout_actors, rollout_part), threads, learner_lists,
                    "async on CPU: rollout and update overlap, each on its own cores")


def core_plan(cfg: Config, cores: list[int] | None = None) -> CorePlan:
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


def rollout_cpu_threads(cfg: Config) -> list[str]:
    """Returns each rollout actor's core list: resources.rollout.cpu_threads, or ``core_plan``'s."""
    return core_plan(cfg).rollout
