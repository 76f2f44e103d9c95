"""What each role asks of the Ray cluster, a fit check before anything starts, and placement groups.

``role_requests(plan)`` turns the run plan's roles (``rlray.plan.Roles``) into one request per role (rollout,
learner, reward, judge, reference, teacher, env). ``check_fit`` compares them with the cluster and raises one error that says which
role wants what and what the cluster has, before any actor starts. The rollout actors' nodes are
chosen by a placement group that is released once read (``rollout_nodes``); Ray Train builds the learner's own group with
the same strategy (ScalingConfig.placement_strategy), and Serve places the reward replicas.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import ray
from ray.util.placement_group import placement_group, placement_group_table, remove_placement_group

from rlray.plan import RunPlan

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


def role_requests(plan: RunPlan) -> list[RoleRequest]:
    """Returns the Ray resources each role of the run asks for (roles that are off are left out), from the plan's
    roles (``rlray.plan.Roles``: the rollout's resources are asked for even by offline runs)."""
    roles = plan.roles
    out = [RoleRequest("rollout", roles.rollout.count, roles.rollout.bundle()),
           RoleRequest("learner", roles.learner.count, roles.learner.bundle())]
    if roles.reward_server:
        out.append(RoleRequest("reward", roles.reward.count, roles.reward.bundle()))
    if roles.judges:  # one Serve application per judge, resources.judge.replicas each
        out.append(RoleRequest("judge", roles.judge.count * len(roles.judges), roles.judge.bundle()))
    if roles.reference == "actor":
        out.append(RoleRequest("reference", 1, roles.reference_actor.bundle()))
    if roles.teacher == "actor":
        out.append(RoleRequest("teacher", 1, roles.teacher_actor.bundle()))
    if roles.env_hosts:
        out.append(RoleRequest("env", roles.env.count, roles.env.bundle()))
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


def check_cluster(plan: RunPlan) -> list[RoleRequest]:
    """Checks the run's requests (``role_requests``) against the connected cluster and returns them.

    Raises:
        PlacementError: they do not fit (see ``check_fit``).
    """
    requests = role_requests(plan)
    check_fit(requests, *cluster_totals())
    return requests


def rollout_nodes(plan: RunPlan) -> list[str]:
    """Returns the node id (hex) for each rollout actor, chosen by a placement group that is then released.

    A placement group of one bundle per rollout actor (``resources.placement_strategy``) is reserved, its
    bundle-to-node map read, and the group removed; the actors are then pinned softly to those nodes
    (``start_rollout_actors``). Kept as a group, a bundle on a lost node is rescheduled by the GCS without
    back-off while no node can take it (Ray 2.60: the GCS spun at ~85% of a core after a node loss here;
    ray-project/ray#65007), and a pending bundle holds back placement groups created after it. Pinned softly,
    an actor that Ray restarts after its node is lost goes to any node with its resources.

    Raises:
        PlacementError: the group is not ready within ``resources.placement_timeout_s`` (other work
            holds the resources); the message says what is available.
    """
    roles = plan.roles
    one, count, strategy = roles.rollout.bundle(), roles.rollout.count, roles.placement_strategy
    pg = placement_group([one] * count, strategy=strategy, name=f"rlray:rollout:{os.getpid()}")
    try:
        ray.get(pg.ready(), timeout=roles.placement_timeout_s)
    except ray.exceptions.GetTimeoutError:
        remove_placement_group(pg)
        raise PlacementError(
            f"the rollout placement group ({count} x {_fmt(one)}, {strategy}) was not "
            f"ready within resources.placement_timeout_s={roles.placement_timeout_s:g} s; available now: "
            f"{_fmt(ray.available_resources())}. Other actors hold the resources, or the strategy cannot be met."
        ) from None
    try:
        nodes = placement_group_table(pg)["bundles_to_node_id"]
    finally:
        remove_placement_group(pg)
    return [nodes[i] for i in range(count)]
