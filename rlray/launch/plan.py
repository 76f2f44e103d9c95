"""The capacity planner: the memory every role of a run needs, from the config and the models' config.json alone.

``rlray plan CONFIG [--gpus N --gpu-memory-gib M --nodes K]`` prints it before any resource is taken
(``rlray.launch.plan_report``), and the preflight's fit check (``check_fit``) uses the same figures. No weights are
loaded, so it answers for 7B and 70B models that cannot run here. What each role holds: ``rlray.launch.plan_roles``;
the arithmetic and its sources: ``rlray.models.memory``.

A config that asks for no GPUs, planned for GPUs, gets an assumed layout (``assumed_layout``): half the GPUs to
rollout engines, the rest to learner ranks, one GPU each; the report prints it as the overrides that set it.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass

from rlray.launch.placement import PlacementError, role_requests
from rlray.launch.plan_roles import (
    Hardware,
    Models,
    RoleMemory,
    frozen_actor,
    learner_rank,
    read_models,
    reward_model,
    rollout_engine,
)
from rlray.plan import ConfigError, RunPlan, replan

FIT_TOLERANCE = 0.25
"""The planner's validated accuracy (tests/launch/test_plan.py): the preflight fails only beyond it."""


@dataclass(frozen=True)
class Plan:
    """The memory plan of a config.

    Attributes:
        run: the run plan planned (``rlray.plan.resolve_plan``), with the assumed layout applied when there is one
            (``rlray.plan.replan``): the roles, parallelism and lengths a run of it would have; the memory below is
            planned from it, never from the config again.
        models: the shapes of its models.
        hardware: the GPUs planned for, or None (this machine's CPU).
        dtype: the compute dtype ("bfloat16" or "float32").
        assumed: the ``resources.*`` overrides of the layout the planner assumed, or () (the config's own).
        roles: each role's memory.
        problems: what does not fit besides memory (more GPUs asked for than the cluster has).
    """

    run: RunPlan
    models: Models
    hardware: Hardware | None
    dtype: str
    assumed: tuple[str, ...]
    roles: tuple[RoleMemory, ...]
    problems: tuple[str, ...] = ()

    @property
    def fits(self) -> bool:
        """Returns True when every role fits its budget and the GPUs asked for are there."""
        return all(r.fits for r in self.roles) and not self.problems


def plan_run(run: RunPlan, hardware: Hardware | None = None, models: Models | None = None) -> Plan:
    """Returns the memory plan of the run ``run`` on ``hardware`` (None: this machine's CPU).

    Args:
        run: the run's plan (``rlray.plan.resolve_plan``), the very one a run of the config uses.
        hardware: the GPUs; a config that asks for none gets the layout of ``assumed_layout``.
        models: the models' shapes; None reads them (``read_models``: config.json files only).

    Raises:
        ValueError: the config asks for GPUs and ``hardware`` is None.
        rlray.config.ConfigError: no layout of the GPUs fits the config's sizes (see ``assumed_layout``).
        rlray.models.ModelError: a model's config.json cannot be read.
    """
    if hardware is None and run.uses_gpus:
        raise ValueError("the config asks for GPUs: give their memory (--gpu-memory-gib) to plan it")
    run, assumed = assumed_layout(run, hardware)
    models = models or read_models(run)
    dtype = run.parallelism.compute_dtype  # the run's own
    return Plan(run, models, hardware, dtype, assumed, plan_roles(run, models, hardware, dtype),
                gpu_problems(run, hardware))


def plan_roles(run: RunPlan, models: Models, hardware: Hardware | None, dtype: str) -> tuple[RoleMemory, ...]:
    """Returns the memory of every role that ``run`` runs: learner rank, rollout engine (online), reference and teacher
    actors (when they are their own actors) and the reward model (``reward.model_path``)."""
    roles = run.roles
    learner_hw = hardware if roles.learner.gpus > 0 else None
    out = [learner_rank(run, models, dtype=dtype, gpu=learner_hw is not None, budget=learner_budget(run, learner_hw))]
    if roles.online:
        out.append(rollout_engine(run, models.policy, dtype=dtype, hardware=hardware if roles.rollout.gpus > 0 else None))
        if roles.reference == "actor":
            out.append(frozen_actor("reference actor", models.policy, run, dtype=dtype, gpus=roles.reference_actor.gpus,
                                    hardware=hardware))
        if models.teacher is not None and roles.teacher == "actor":
            out.append(frozen_actor("teacher actor", models.teacher, run, dtype=dtype, gpus=roles.teacher_actor.gpus,
                                    hardware=hardware))
    if models.reward is not None:
        out.append(reward_model(run, models.reward))
    return tuple(out)


def learner_budget(run: RunPlan, hardware: Hardware | None) -> tuple[float, str]:
    """Returns what one learner rank may use (GiB) and its source, as ``rlray.run.guards`` caps it (``hardware``: the
    learner's GPUs, None on the CPU).

    On a GPU: ``guard.memory_cap_gib`` or ``guard.memory_fraction`` of the GPU, less the rollout engine's
    ``rollout.gpu_memory_utilization`` share when colocated. On the CPU: ``guard.memory_cap_gib``, else
    ``guard.memory_fraction`` of this machine's RAM.
    """
    cfg = run.settings
    guard = cfg.guard
    if hardware is None:
        if guard.memory_cap_gib is not None:
            return guard.memory_cap_gib, "guard.memory_cap_gib"
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
        return guard.memory_fraction * ram, f"guard.memory_fraction {guard.memory_fraction:g} x this machine's {ram:.1f} GiB"
    size = hardware.gpu_memory_gib
    budget, source = guard.memory_fraction * size, f"guard.memory_fraction {guard.memory_fraction:g} x {size:g} GiB"
    if guard.memory_cap_gib is not None:
        budget, source = min(guard.memory_cap_gib, size), "guard.memory_cap_gib"
    if cfg.resources.colocate:
        util = cfg.rollout.gpu_memory_utilization
        budget, source = min(budget, (1 - util) * size), f"{source}, less the colocated engine's {util:g}"
    return budget, source


def assumed_layout(run: RunPlan, hardware: Hardware | None) -> tuple[RunPlan, tuple[str, ...]]:
    """Returns ``run`` with a GPU layout when it asks for no GPUs but is planned for GPUs (the config's plan with the
    overrides, ``rlray.plan.replan``), and the overrides that set it.

    One GPU: learner and rollout colocated on it (half each). More: ``total // 2`` rollout engines and the rest
    learner ranks, one GPU each (offline runs: every GPU to the learner), with fewer learner ranks when the config's
    batch sizes do not divide over them. A config that asks for GPUs, or no ``hardware``, is returned as it is.

    Raises:
        rlray.config.ConfigError: no number of learner ranks divides the config's batch sizes.
    """
    if hardware is None or hardware.total_gpus is None or run.uses_gpus:
        return run, ()
    total, online = hardware.total_gpus, run.roles.online
    if total == 1 and online:
        layouts = [["resources.learner.gpus=0.5", "resources.rollout.gpus=0.5", "resources.colocate=true"]]
    else:
        engines = total // 2 if online else 0
        rollout = [f"resources.rollout.num_workers={engines}", "resources.rollout.gpus=1"] if engines else []
        layouts = [[f"resources.learner.num_workers={n}", "resources.learner.gpus=1", *rollout]
                   for n in range(total - engines, 0, -1)]
    for overrides in layouts:
        try:
            return replan(run, overrides)[0], tuple(overrides)
        except ConfigError:
            continue
    raise ConfigError(f"no layout of {total} GPUs fits the config's batch sizes; set resources.learner and "
                      "resources.rollout (num_workers, gpus) yourself")


def gpu_problems(run: RunPlan, hardware: Hardware | None) -> tuple[str, ...]:
    """Returns a line when the config asks for more GPUs than ``hardware`` has (colocated rollout engines share the
    learner's), else ()."""
    if hardware is None or hardware.total_gpus is None:
        return ()
    requests = role_requests(run)
    colocate = run.settings.resources.colocate
    asked = sum(r.total().get("GPU", 0.0) for r in requests if not (colocate and r.role == "rollout"))
    if asked <= hardware.total_gpus:
        return ()
    wants = "; ".join(r.describe() for r in requests if r.total().get("GPU"))
    return (f"the config asks for {asked:g} GPUs ({wants}); the cluster has {hardware.total_gpus}",)


def check_fit(run: RunPlan) -> list[str]:
    """Returns warnings for the roles whose predicted peak exceeds their budget; fails beyond ``FIT_TOLERANCE``.

    The preflight's memory check, on the planner's figures (config.json files only). It runs when the config asks
    for GPUs and this machine shows their size (``local_gpu_memory_gib``), or on the CPU when
    ``guard.memory_cap_gib`` is set; otherwise it returns [] at once. A rollout engine whose KV cache alone does not
    fit only warns (vLLM runs with a smaller cache, slower).

    Raises:
        rlray.launch.placement.PlacementError: a role's peak exceeds its budget by more than ``FIT_TOLERANCE``
            (names the role, both sizes and the budget's source).
    """
    if run.uses_gpus:
        size = local_gpu_memory_gib()
        if size is None:
            return []
        hardware = Hardware(None, 1, size)
    elif run.settings.guard.memory_cap_gib is None:
        return []
    else:
        hardware = None
    warnings, errors = [], []
    for role in plan_run(run, hardware).roles:
        if role.fits:
            continue
        line = (f"{role.role} ({role.placement}) needs {role.total_gib:.2f} GiB, over its {role.budget_gib:.2f} GiB "
                f"({role.budget_source})")
        over = role.minimum_gib > role.budget_gib * (1 + FIT_TOLERANCE)
        (errors if over else warnings).append(line)
    if errors:
        raise PlacementError("predicted memory: " + "; ".join(errors) + " (more than the planner's 25% tolerance); "
                             "`rlray plan CONFIG` shows every term and the changes that fit")
    return warnings


def local_gpu_memory_gib() -> float | None:
    """Returns the memory of this machine's smallest GPU in GiB (``nvidia-smi``, no CUDA context is made), or None when
    nvidia-smi is absent or fails."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    try:
        out = subprocess.run([exe, "--query-gpu=memory.total", "--format=csv,noheader,nounits"], capture_output=True,
                             text=True, timeout=20, check=True).stdout
        sizes = [float(line) for line in out.split()]
    except (OSError, subprocess.SubprocessError, ValueError):
        return None
    return min(sizes) / 1024 if sizes else None
