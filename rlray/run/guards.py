"""Guards: decide when a run must stop (or roll back), cap memory, and fall back after an early OOM.

The checks are plain functions over a step's metrics, so they are tested without a cluster:
- KL: the step's mean per-token k3 KL to the reference (``algo/kl``) above ``guard.kl_threshold``.
- non-finite: a NaN/inf loss or gradient norm; the learner skips such an optimizer step, and the run
  stops after ``guard.max_nonfinite_steps`` in a row.
- wall time: ``run.max_wall_time_s`` since the driver started.
- memory: on GPU ``torch.cuda.set_per_process_memory_fraction``; on CPU an RSS watchdog thread.
"""

from __future__ import annotations

import gc
import logging
import math
import threading
from dataclasses import dataclass
from typing import Any

import psutil
import torch

from rlray.plan import RunPlan, replan
from rlray.plan.settings import GuardSettings

log = logging.getLogger(__name__)

GIB = 2**30


@dataclass(frozen=True)
class Trip:
    """A tripped guard.

    Attributes:
        reason: kl_guard | nonfinite | wall_time | memory_cap (the run's status is 'stopped: <reason>'), or hang (rank 0's
            evaluation hung under watchdog.on_hang=stop: the step boundary keeps the step, then the run fails).
        message: what happened, with the numbers and the config key to change.
        keep_state: True when the current weights are sound and worth a snapshot before stopping.
    """

    reason: str
    message: str
    keep_state: bool


def is_finite_step(metrics: dict[str, float]) -> bool:
    """Returns True when the step's loss and gradient norm are finite."""
    return all(math.isfinite(metrics[k]) for k in ("learner/loss", "learner/grad_norm"))


def check_step(
    metrics: dict[str, float],
    *,
    step: int,
    nonfinite_in_row: int,
    guard: GuardSettings,
    elapsed_s: float,
    max_wall_time_s: float,
    memory_message: str | None,
) -> Trip | None:
    """Returns the first guard a finished step trips, or None.

    Args:
        metrics: the step's metrics (``learner/loss``, ``learner/grad_norm``, ``algo/kl`` in nats/token).
        step: the step just finished (1-based).
        nonfinite_in_row: non-finite steps in a row, this one included.
        guard: thresholds (``cfg.guard``).
        elapsed_s: seconds since the run started.
        max_wall_time_s: the wall-clock limit in seconds.
        memory_message: the memory watchdog's message when it tripped, else None.
    """
    if nonfinite_in_row >= guard.max_nonfinite_steps:
        return Trip("nonfinite", f"step {step}: {nonfinite_in_row} steps in a row had a NaN/inf loss or gradient "
                    f"norm (guard.max_nonfinite_steps={guard.max_nonfinite_steps})", keep_state=False)
    kl = metrics.get("algo/kl", 0.0)
    if nonfinite_in_row == 0 and guard.kl_threshold is not None and kl > guard.kl_threshold:
        return Trip("kl_guard", f"step {step}: mean per-token k3 KL to the reference {kl:.4g} nats > "
                    f"guard.kl_threshold={guard.kl_threshold}", keep_state=False)
    if memory_message:
        return Trip("memory_cap", f"step {step}: {memory_message}", keep_state=True)
    if elapsed_s > max_wall_time_s:
        return Trip("wall_time", f"step {step}: {elapsed_s:.0f} s of wall time > run.max_wall_time_s={max_wall_time_s:g}",
                    keep_state=True)
    return None


def rollback_plan(plan: RunPlan) -> tuple[RunPlan, dict[str, tuple[Any, Any]]]:
    """Returns (the plan after ``guard.rollback_overrides``, {key: (old, new)}) through ``rlray.plan.replan``.

    ``key=value`` sets a value (YAML-parsed); ``key*=factor`` multiplies the current one, so each
    rollback compounds (two rollbacks with ``learner.lr*=0.5`` quarter the learning rate).

    Raises:
        ConfigError: an unknown key or a result the schema rejects, naming the key.
    """
    return replan(plan, list(plan.settings.guard.rollback_overrides), origin="guard.rollback_overrides")


# --------------------------------------------------------------------------------------------
# Memory
# --------------------------------------------------------------------------------------------
def memory_cap_bytes(guard: GuardSettings, *, cuda: bool) -> int:
    """Returns the per-worker memory cap in bytes: ``memory_cap_gib``, else ``memory_fraction`` of the
    GPU's memory (``cuda``) or of the machine's RAM."""
    if guard.memory_cap_gib is not None:
        return int(guard.memory_cap_gib * GIB)
    total = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory if cuda else psutil.virtual_memory().total
    return int(guard.memory_fraction * total)


def apply_gpu_memory_cap(guard: GuardSettings) -> float | None:
    """Caps this process's CUDA allocations (``torch.cuda.set_per_process_memory_fraction``); returns the
    fraction set, or None without CUDA. An allocation past the cap raises torch.OutOfMemoryError."""
    if not torch.cuda.is_available():
        return None
    device = torch.cuda.current_device()
    total = torch.cuda.get_device_properties(device).total_memory
    fraction = min(1.0, memory_cap_bytes(guard, cuda=True) / total)
    torch.cuda.set_per_process_memory_fraction(fraction, device)
    return fraction


class MemoryWatchdog:
    """Samples this process's resident memory (RSS) in a thread and remembers the first breach of a cap.

    Args:
        cap_bytes: the cap (``memory_cap_bytes``).
        interval_s: seconds between samples (``guard.memory_check_s``).
        rank: learner rank, for the message.

    Attributes:
        message: None until RSS exceeded the cap; then what happened and what to change.
        peak_bytes: the highest RSS seen.
    """

    def __init__(self, cap_bytes: int, interval_s: float, rank: int) -> None:
        self.cap_bytes = cap_bytes
        self.interval_s = interval_s
        self.rank = rank
        self.message: str | None = None
        self.peak_bytes = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rlray-memory-watchdog", daemon=True)

    def start(self) -> MemoryWatchdog:
        """Starts sampling (one sample is taken at once); returns self."""
        self.sample()
        self._thread.start()
        return self

    def sample(self) -> int:
        """Takes one RSS sample; returns it in bytes (and records a breach)."""
        rss = psutil.Process().memory_info().rss
        self.peak_bytes = max(self.peak_bytes, rss)
        if rss > self.cap_bytes and self.message is None:
            self.message = (
                f"learner rank {self.rank} resident memory {rss / GIB:.2f} GiB exceeds the cap "
                f"{self.cap_bytes / GIB:.2f} GiB (guard.memory_cap_gib / guard.memory_fraction); lower "
                "learner.sequences_per_microbatch, turn on model.gradient_checkpointing, or raise the cap"
            )
            log.error(self.message)
        return rss

    def stop(self) -> None:
        """Stops the sampling thread."""
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.sample()


# --------------------------------------------------------------------------------------------
# Out of memory at start
# --------------------------------------------------------------------------------------------
class EarlyOOM(RuntimeError):
    """An out-of-memory error while loading or during the first step; ``where`` is 'load' or 'first step'."""

    def __init__(self, where: str, cause: BaseException) -> None:
        super().__init__(f"out of memory at {where}: {cause}")
        self.where = where


def is_oom(err: BaseException) -> bool:
    """Returns True for torch.OutOfMemoryError and for the CPU allocator's out-of-memory RuntimeError."""
    text = str(err).lower()
    return isinstance(err, torch.OutOfMemoryError) or (
        isinstance(err, RuntimeError) and ("out of memory" in text or "can't allocate memory" in text)
    )


def oom_fallback_plan(plan: RunPlan) -> tuple[RunPlan, str]:
    """Returns (the plan with half the micro-batch and gradient checkpointing on, a note saying so), made by
    ``rlray.plan.replan``.

    Half the micro-batch is half ``learner.tokens_per_microbatch`` when a token budget is in force (the plan's
    ``parallelism.micro_batching``: an FSDP learner cuts by sequences), else half ``sequences_per_microbatch``
    (which keeps ``sequences_per_minibatch`` divisible: it was a multiple of micro-batch x ranks).
    """
    budget = plan.parallelism.micro_batching.tokens
    if budget is not None:  # the micro-batch is cut by tokens: halve the budget (never below the schema's 16)
        key, old, new = "tokens_per_microbatch", budget, max(16, budget // 2)
    else:
        key, old = "sequences_per_microbatch", plan.settings.learner.sequences_per_microbatch
        new = max(1, old // 2)
    was = plan.settings.model.gradient_checkpointing
    new_plan, _ = replan(plan, [f"learner.{key}={new}", "model.gradient_checkpointing=true"], origin="the OOM fallback")
    return new_plan, f"learner.{key} {old} -> {new}, model.gradient_checkpointing {was} -> True"


def free_memory() -> None:
    """Collects garbage and empties the CUDA cache, so a retry starts from free memory."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
