"""Guards: the trip decision, rollback overrides, the memory watchdog and the OOM fallback config."""

import math

import pytest
import torch

from rlray.config import ConfigError, GuardConfig, config_from_dict
from rlray.plan import replan, resolve_plan
from rlray.run import guards

OK = {"learner/loss": 0.1, "learner/grad_norm": 2.0, "algo/kl": 0.01}


def _check(metrics, nonfinite=0, elapsed=0.0, memory=None, **g):
    return guards.check_step(metrics, step=7, nonfinite_in_row=nonfinite, guard=GuardConfig(**g), elapsed_s=elapsed,
                            max_wall_time_s=100.0, memory_message=memory)


def test_kl_guard_trips_above_the_threshold_only():
    assert _check(OK) is None  # 0.01 <= 0.03 (the default)
    trip = _check({**OK, "algo/kl": 0.0301})
    assert (trip.reason, trip.keep_state) == ("kl_guard", False)
    assert "0.0301 nats > guard.kl_threshold=0.03" in trip.message and trip.message.startswith("step 7")
    assert _check({**OK, "algo/kl": 5.0}, kl_threshold=None) is None


def test_nonfinite_steps_stop_after_n_in_a_row():
    bad = {**OK, "learner/loss": math.nan, "algo/kl": math.nan}
    assert not guards.is_finite_step(bad) and not guards.is_finite_step({**OK, "learner/grad_norm": math.inf})
    assert guards.is_finite_step(OK)
    assert _check(bad, nonfinite=2, max_nonfinite_steps=3) is None  # skipped, not yet stopped; NaN KL is not a KL trip
    trip = _check(bad, nonfinite=3, max_nonfinite_steps=3)
    assert trip.reason == "nonfinite" and "3 steps in a row" in trip.message


def test_wall_time_and_memory_trips_keep_the_state():
    assert _check(OK, elapsed=100.0) is None
    wall = _check(OK, elapsed=100.5)
    assert (wall.reason, wall.keep_state) == ("wall_time", True) and "run.max_wall_time_s=100" in wall.message
    mem = _check(OK, memory="rank 0 RSS too high")
    assert (mem.reason, mem.keep_state, mem.message) == ("memory_cap", True, "step 7: rank 0 RSS too high")


def test_rollback_overrides_multiply_and_set_and_compound():
    plan = resolve_plan(config_from_dict({"learner": {"lr": 1e-4},
                                          "guard": {"rollback_overrides": ["learner.lr*=0.5", "algo.kl_coef=0.1"]}}))
    new, changes = guards.rollback_plan(plan)
    assert new.settings.learner.lr == pytest.approx(5e-5, rel=1e-12) and new.settings.algo.kl_coef == 0.1
    assert changes == {"learner.lr": (1e-4, pytest.approx(5e-5)), "algo.kl_coef": (0.04, 0.1)}
    again, _ = replan(new, ["learner.lr*=0.5"])
    assert again.settings.learner.lr == pytest.approx(2.5e-5, rel=1e-12)
    assert plan.settings.learner.lr == 1e-4 and plan.source["learner"]["lr"] == 1e-4  # the old plan is untouched
    assert new.source["learner"]["lr"] == pytest.approx(5e-5) and new.config_hash != plan.config_hash
    with pytest.raises(ConfigError, match="learner.lr"):
        replan(plan, ["learner.lr*=-1"])  # the schema still applies (lr > 0)
    with pytest.raises(ConfigError, match="guard.rollback_overrides: unknown key 'learner.rate'"):
        replan(plan, ["learner.rate=1"], origin="guard.rollback_overrides")
    with pytest.raises(ConfigError, match="unknown key 'nosection.rate'"):
        replan(plan, ["nosection.rate=1"])


def test_rollback_overrides_are_validated_at_load():
    with pytest.raises(ConfigError, match="guard.rollback_overrides item 'model.path=x'"):
        config_from_dict({"guard": {"rollback_overrides": ["model.path=x"]}})
    # the guard reads algo/kl, which is always the k3 estimate (learner.objective), whatever the loss uses
    assert config_from_dict({"algo": {"kl_estimator": "k1"}}).guard.kl_threshold == 0.03


def test_memory_watchdog_reports_a_breach_with_the_fix():
    dog = guards.MemoryWatchdog(cap_bytes=1, interval_s=0.05, rank=3).start()
    try:
        assert dog.message is not None and dog.peak_bytes > 1
        assert dog.message.startswith("learner rank 3 resident memory")
        assert "guard.memory_cap_gib" in dog.message and "learner.sequences_per_microbatch" in dog.message
    finally:
        dog.stop()
    roomy = guards.MemoryWatchdog(cap_bytes=2**50, interval_s=0.05, rank=0).start()
    roomy.stop()
    assert roomy.message is None
    assert guards.memory_cap_bytes(GuardConfig(memory_cap_gib=1.5), cuda=False) == int(1.5 * 2**30)


def test_oom_detection_and_fallback_config():
    assert guards.is_oom(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    assert guards.is_oom(RuntimeError("[enforce fail at alloc_cpu.cpp:117] DefaultCPUAllocator: can't allocate memory"))
    assert not guards.is_oom(RuntimeError("shape mismatch")) and not guards.is_oom(ValueError("out of memory"))
    cfg = config_from_dict({"learner": {"prompts_per_step": 2, "sequences_per_minibatch": 8, "sequences_per_microbatch": 4}})
    new, note = guards.oom_fallback_plan(resolve_plan(cfg))
    assert (new.settings.learner.sequences_per_microbatch, new.settings.model.gradient_checkpointing) == (2, True)
    assert new.parallelism.micro_batching.sequences == 2  # the plan's decisions follow the new values
    assert note == "learner.sequences_per_microbatch 4 -> 2, model.gradient_checkpointing False -> True"
    one, _ = guards.oom_fallback_plan(resolve_plan(config_from_dict({"learner": {"sequences_per_microbatch": 1}})))
    assert one.settings.learner.sequences_per_microbatch == 1
    budget, note = guards.oom_fallback_plan(resolve_plan(config_from_dict({"learner": {"tokens_per_microbatch": 4096}})))
    assert (budget.settings.learner.tokens_per_microbatch, budget.settings.learner.sequences_per_microbatch) == (2048, 8)
    assert budget.parallelism.micro_batching.tokens == 2048
    assert note == "learner.tokens_per_microbatch 4096 -> 2048, model.gradient_checkpointing False -> True"


@pytest.mark.gpu
def test_gpu_memory_cap_makes_larger_allocations_fail():
    fraction = guards.apply_gpu_memory_cap(GuardConfig(memory_cap_gib=1.0))
    total = torch.cuda.get_device_properties(0).total_memory
    assert fraction == pytest.approx(2**30 / total)
    with pytest.raises(torch.OutOfMemoryError):
        torch.empty(2 * 2**30, dtype=torch.uint8, device="cuda")
    torch.cuda.set_per_process_memory_fraction(1.0)
