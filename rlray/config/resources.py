"""Config section resources: Ray resource requests, placement, threads and core pinning of each role."""

from __future__ import annotations

import math
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, Field

from rlray.config.base import CoreList, _Section

_BUILTIN = {"CPU": "cpus", "GPU": "gpus", "memory": None, "object_store_memory": None}


def _check_custom_resources(value: dict[str, float]) -> dict[str, float]:
    """Checks Ray custom resource amounts: names that are not CPU/GPU/memory, amounts > 0, whole above 1."""
    for name, amount in value.items():
        if not name or name in _BUILTIN:
            fix = f"use the role's {_BUILTIN[name]} field" if _BUILTIN.get(name) else "name a custom resource"
            raise ValueError(f"{{{name!r}: {amount:g}}}: {name!r} is not a custom resource; {fix}")
        if not math.isfinite(amount) or amount <= 0 or (amount > 1 and amount != int(amount)):
            raise ValueError(f"{{{name!r}: {amount:g}}}: give {name!r} an amount > 0, whole when above 1 (e.g. 0.5, 1 or 2)")
    return value


CustomResources = Annotated[dict[str, float], AfterValidator(_check_custom_resources)]
"""Ray custom resources of one worker ({name: amount}); a node offers them with `ray start --resources`."""


def _custom_field(role: str) -> Any:
    """Returns the ``custom_resources`` field of a role's section (its description names the role)."""
    example = f'{{"{role}_node": 1}}'
    return Field(
        default_factory=dict,
        description=(
            f"Ray custom resources per {role} worker ({{name: amount}}, e.g. {example}): only nodes that offer them "
            f"(`ray start --resources '{example}'`) take this role, so it lands on the nodes meant for it. "
            "Empty: any node with the CPUs/GPUs."
        ),
    )


class RolloutResources(_Section):
    """Ray resources of the rollout fleet (one vLLM engine per actor)."""

    num_workers: int = Field(1, ge=1, description="Rollout actors (engines), named rlray:rollout-<i>.")
    cpus: float = Field(0.25, gt=0.0, description="Logical Ray CPUs per actor (fractions allowed).")
    gpus: float = Field(0.0, ge=0.0, description="Ray GPUs per tensor-parallel rank of an actor.")
    custom_resources: CustomResources = _custom_field("rollout")
    tensor_parallel_size: int = Field(1, ge=1, description="GPUs per engine (vLLM tensor parallelism).")
    max_restarts: int = Field(
        2, ge=-1, description="Times Ray restarts a dead rollout actor (-1: without limit); its prompts go to another."
    )
    cpu_threads: CoreList | list[CoreList] | None = Field(
        None,
        description=(
            "Cores of each actor's vLLM CPU threads (VLLM_CPU_OMP_THREADS_BIND): one core list for every "
            "actor ('0-1'), a list with one per actor (['0', '1']), or None to split this node's cores "
            "evenly over the actors. Separate from the logical Ray CPUs above."
        ),
    )


class LearnerResources(_Section):
    """Ray resources of the Ray Train learner group."""

    num_workers: int = Field(1, ge=1, description="Ray Train data-parallel workers (learner ranks).")
    cpus: float = Field(0.25, gt=0.0, description="Logical Ray CPUs per worker (fractions allowed).")
    gpus: float = Field(0.0, ge=0.0, description="Ray GPUs per worker.")
    custom_resources: CustomResources = _custom_field("learner")
    strategy: Literal["ddp", "fsdp"] = Field(
        "ddp",
        description=(
            "Data parallelism over the learner workers: ddp (a whole model, gradients and optimizer state per worker) "
            "or fsdp (FSDP2: each worker holds 1/N of them, and the reference and teacher too, at the cost of "
            "gathering each layer's weights in its forward and backward); gloo on CPU, NCCL on GPU."
        ),
    )


class RewardResources(_Section):
    """Ray resources of the reward Serve application (used when reward.server.enabled)."""

    replicas: int = Field(1, ge=1, description="Serve replicas of the reward deployment.")
    cpus: float = Field(0.25, gt=0.0, description="Logical Ray CPUs per replica.")
    gpus: float = Field(0.0, ge=0.0, description="Ray GPUs per replica (for a reward model).")
    custom_resources: CustomResources = _custom_field("reward")


class JudgeResources(_Section):
    """Ray resources of each judge's Serve application (used when reward.judges is set)."""

    replicas: int = Field(1, ge=1, description="Serve replicas per judge, one engine each; a step's judgements are split over them.")
    cpus: float = Field(0.25, gt=0.0, description="Logical Ray CPUs per replica.")
    gpus: float = Field(0.0, ge=0.0, description="Ray GPUs per replica.")
    custom_resources: CustomResources = _custom_field("judge")
    cpu_threads: CoreList | None = Field(
        None,
        description="Cores of each replica's vLLM CPU threads ('0-1'); None: the environment's, else '0-1'.",
    )


class ReferenceResources(_Section):
    """Where the frozen reference model runs (used when algo.kl_coef > 0)."""

    placement: Literal["learner", "actor"] = Field(
        "learner",
        description="learner: a copy on every learner worker; actor: one Ray actor rlray:reference-0 shared by all ranks.",
    )
    cpus: float = Field(0.25, gt=0.0, description="Logical Ray CPUs of the reference actor.")
    gpus: float = Field(0.0, ge=0.0, description="Ray GPUs of the reference actor.")
    custom_resources: CustomResources = _custom_field("reference")
    max_restarts: int = Field(
        1, ge=-1,
        description=(
            "Times Ray restarts a dead reference actor (-1: without limit), which loads its model again; a logprobs "
            "call it had is made once more (watchdog.reference_call_s)."
        ),
    )


class TeacherResources(_Section):
    """Where the frozen distillation teacher runs (used when teacher.path is set)."""

    placement: Literal["learner", "actor"] = Field(
        "learner",
        description=(
            "learner: a copy on every learner worker (needed by teacher.divergence=jsd); actor: one Ray actor "
            "rlray:teacher-0 shared by all ranks, sending per-token logprobs of the sampled tokens (reverse_kl only)."
        ),
    )
    cpus: float = Field(0.25, gt=0.0, description="Logical Ray CPUs of the teacher actor.")
    gpus: float = Field(0.0, ge=0.0, description="Ray GPUs of the teacher actor.")
    custom_resources: CustomResources = _custom_field("teacher")
    max_restarts: int = Field(
        1, ge=-1,
        description=(
            "Times Ray restarts a dead teacher actor (-1: without limit), which loads its model again; a logprobs "
            "call it had is made once more (watchdog.reference_call_s)."
        ),
    )


class EnvResources(_Section):
    """Ray resources of the environment hosts (used when env.environments is set)."""

    num_workers: int = Field(1, ge=1, description="Environment host actors, named rlray:env-<i>; each runs many episodes.")
    cpus: float = Field(0.25, gt=0.0, description="Logical Ray CPUs per host (fractions allowed).")
    custom_resources: CustomResources = _custom_field("env")
    threads: int = Field(8, ge=1, description="Episodes' reset and step calls a host runs at once (threads).")
    max_restarts: int = Field(
        1, ge=-1, description="Times Ray restarts a dead host (-1: without limit); the step it died under runs its rollout again."
    )


class ResourcesConfig(_Section):
    """Ray resources per role and their placement. Thread counts are separate (learner.torch_threads, rollout cpu_threads)."""

    rollout: RolloutResources = Field(default_factory=RolloutResources)
    learner: LearnerResources = Field(default_factory=LearnerResources)
    reward: RewardResources = Field(default_factory=RewardResources)
    judge: JudgeResources = Field(default_factory=JudgeResources)
    reference: ReferenceResources = Field(default_factory=ReferenceResources)
    teacher: TeacherResources = Field(default_factory=TeacherResources)
    env: EnvResources = Field(default_factory=EnvResources)
    colocate: bool = Field(
        False,
        description="Rollout actors share the learner workers' GPUs (fractional gpus on both; weights by CUDA IPC).",
    )
    placement_strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = Field(
        "PACK", description="Ray placement-group strategy of the rollout actors and of the learner workers."
    )
    placement_timeout_s: float = Field(
        120.0, gt=0.0, description="Seconds to wait for a placement group before failing with what is missing."
    )
    node_wait_s: float = Field(
        60.0,
        ge=0.0,
        description=(
            "Seconds a step waits for a lost rollout actor to be back (Ray restarts it, up to resources.rollout."
            "max_restarts, once a node with its resources is alive: a preempted node's replacement) before it goes on "
            "with the remaining actors (rollout/actors_alive); it rejoins whenever it is back. With no actor left, "
            "the run fails after this wait. 0: go on at once."
        ),
    )
