"""The run context every run kind fills in (rlray.run.context.RunContext) and the stage timer of online steps
(rlray.run.experience.StageTimer). No model is loaded: the context only holds the learner, so a stand-in object does."""

from __future__ import annotations

import time
from dataclasses import dataclass

import pytest

from rlray.config import Config
from rlray.data import PromptRow, PromptStream
from rlray.learner.collective import Collective
from rlray.plan import resolve_plan
from rlray.run.context import RunContext, StepResult
from rlray.run.experience import StageTimer


@dataclass
class MinimalRun(RunContext):
    """A run kind that fills in only the abstract methods, so every other method is RunContext's default."""

    stream: PromptStream | None = None

    def run_step(self, step):
        return StepResult({})

    def evaluate_when_due(self, steps_done):
        return {}

    def progress_text(self, steps_done, metrics):
        return f"step {steps_done}"

    def data_epoch(self):
        return self.stream.epoch

    def cursor_state(self):
        return self.stream.state_dict()

    def load_cursor_state(self, state):
        self.stream.load_state_dict(state)


class ThreeRanks(Collective):
    rank = 2
    world = 3


LEARNER = object()  # RunContext never calls the learner in the methods tested here


def _stream() -> PromptStream:
    return PromptStream([PromptRow(f"r:{i}", f"question {i}", {"answer": str(i)}) for i in range(5)], seed=1, shuffle=True)


def test_run_context_cannot_be_made_without_its_abstract_methods():
    with pytest.raises(TypeError, match="abstract"):
        RunContext(resolve_plan(Config()), Collective(), LEARNER, None)

    @dataclass
    class NoProgress(RunContext):  # progress_text missing
        def run_step(self, step):
            return StepResult({})

        def evaluate_when_due(self, steps_done):
            return {}

        def data_epoch(self):
            return 0

        def cursor_state(self):
            return {}

        def load_cursor_state(self, state):
            pass

    with pytest.raises(TypeError, match="progress_text"):
        NoProgress(resolve_plan(Config()), Collective(), LEARNER, None)


def test_rank_and_world_come_from_the_collective():
    one = MinimalRun(resolve_plan(Config()), Collective(), LEARNER, None)
    assert (one.rank, one.world) == (0, 1)
    ctx = MinimalRun(resolve_plan(Config()), ThreeRanks(), LEARNER, None)
    assert (ctx.rank, ctx.world) == (2, 3)


def test_start_metrics_default_is_empty_and_adopt_plan_replaces_the_plan():
    ctx = MinimalRun(resolve_plan(Config()), Collective(), LEARNER, None)
    assert ctx.start_metrics() == {}
    new = resolve_plan(Config.model_validate({"learner": {"lr": 2e-6}}))
    ctx.adopt_plan(new)
    assert ctx.plan is new and ctx.settings.learner.lr == 2e-6


def test_default_reload_rollouts_and_close_do_nothing():
    stream = _stream()
    stream.next_batch(3)
    ctx = MinimalRun(resolve_plan(Config()), Collective(), LEARNER, "tok", policy_version=4, stream=stream)
    before = (ctx.cursor_state(), ctx.policy_version, ctx.tokenizer, ctx.learner, ctx.tracker)
    assert ctx.reload_rollouts() is None
    assert ctx.close() is None
    assert (ctx.cursor_state(), ctx.policy_version, ctx.tokenizer, ctx.learner, ctx.tracker) == before


def test_a_step_result_defaults_to_no_samples_and_no_ledger():
    result = MinimalRun(resolve_plan(Config()), Collective(), LEARNER, None).run_step(0)
    assert (result.metrics, result.samples, result.prompt_ids) == ({}, [], None)


def test_stage_timer_adds_up_blocks_of_the_same_stage():
    timer = StageTimer()
    with timer("x"):
        time.sleep(0.02)
    first = timer.metrics["timing/x_s"]
    with timer("x"):
        time.sleep(0.02)
    assert 0.02 <= first < 1.0
    assert first + 0.02 <= timer.metrics["timing/x_s"] < 2.0
    assert list(timer.metrics) == ["timing/x_s"]
    assert timer.elapsed_s() >= timer.metrics["timing/x_s"]


def test_stage_timer_records_a_block_that_raises():
    timer = StageTimer()
    with pytest.raises(RuntimeError, match="boom"), timer("rollout"):
        time.sleep(0.02)
        raise RuntimeError("boom")
    assert 0.02 <= timer.metrics["timing/rollout_s"] < 1.0
