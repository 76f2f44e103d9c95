"""An algorithm of the user's own code (no change in rlray/) validates in a config and runs a real step, in this
process and on the Ray Train workers.

"sign_grpo" (docs/examples/sign_grpo.py): the advantage is the sign of the group-centred reward (+1 above the group
mean, -1 below), with PPO's clipped loss. ``register`` makes it known in the calling process; a run names it in
``algo.user_algorithms``, which every process that validates the config loads before it reads ``algo.name``. In the
step test, stages 1-3 run on a rank-0 context without Ray (a fixed rollout, a scripted reward: the pattern of
tests/faults/test_step_faults.py), stages 4-6 on a real tiny learner, exactly as ``rlray.run.online.run_step`` runs
them on one rank; the Ray test trains a step through ``run_training``, whose workers learn the entry from the config
alone.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch

from rlray import schema
from rlray.algos import ALGORITHMS, Algorithm, load_algorithms, register
from rlray.config import Config, ConfigError, config_from_dict, load_config
from rlray.learner import PolicyLearner
from rlray.learner import online as learner_online
from rlray.learner.policy import OptimizerSpec
from rlray.plan import resolve_plan
from rlray.run import build, experience
from rlray.run.experience import StageTimer
from tests.faults.test_step_faults import _completions, _FixedScorer, _rank0_ctx
from tests.run.test_algos_e2e import _overrides

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = "docs/examples/sign_grpo.py:SIGN_GRPO"  # relative to the repository (as a config in it would say)


@pytest.fixture
def example(monkeypatch):
    """Returns the module of docs/examples/sign_grpo.py (the working folder is the repository's during the test) and
    forgets "sign_grpo" after the test, so no other test sees it."""
    monkeypatch.chdir(REPO)
    (entry,) = load_algorithms([EXAMPLE])
    del ALGORITHMS[entry.name]  # loaded, not registered: each test registers it its own way
    yield sys.modules[entry.advantage.__module__]
    ALGORITHMS.pop("sign_grpo", None)


@pytest.fixture
def sign_grpo_algorithm(example):
    """Registers "sign_grpo" from this process's code, as docs/adding_an_algorithm.md shows."""
    sign_grpo = example.sign_grpo
    return register(Algorithm("sign_grpo", "online", advantage=sign_grpo, policy_loss="ppo_clip", needs_groups=True))


def _cfg(*overrides: str):
    return config_from_dict({}, [
        "algo.name=sign_grpo", "learner.prompts_per_step=2", "rollout.samples_per_prompt=4", "rollout.max_new_tokens=8",
        "learner.sequences_per_minibatch=8", "learner.sequences_per_microbatch=4", "algo.kl_coef=0.04",
        "model.dtype=float32", "learner.lr=1e-3", *overrides])  # fmt: skip


def test_an_unregistered_name_is_refused():
    assert "sign_grpo" not in ALGORITHMS
    with pytest.raises(ConfigError, match=r"algo.name='sign_grpo': Input should be 'grpo', .*'sft'"):
        _cfg()


def test_a_registered_algorithm_validates_and_reads_its_entry(sign_grpo_algorithm):
    cfg = _cfg()
    assert cfg.algo.family == "online" and cfg.algo.algorithm is sign_grpo_algorithm
    spec = build.update_spec(cfg, 1)
    assert spec.estimator is sign_grpo_algorithm.advantage and spec.loss.policy_loss == "ppo_clip"
    extras = build.sampling_extras(cfg)
    assert not extras.dynamic_sampling and not extras.greedy_baseline
    with pytest.raises(ConfigError, match="the group estimator 'sign_grpo' needs at least 2 samples per prompt"):
        _cfg("rollout.samples_per_prompt=1", "learner.sequences_per_minibatch=2", "learner.sequences_per_microbatch=2")


def test_a_registered_algorithm_runs_a_step(sign_grpo_algorithm, tiny_model_path):
    cfg = _cfg()
    lengths = [3, 2, 4, 1, 2, 5, 3, 3]
    rewards = [1.0, 0.0, 0.5, 0.25] + [0.0, 0.0, 1.0, 0.0]
    ctx = _rank0_ctx(cfg, _completions(lengths), _FixedScorer(rewards))
    table = experience.collect_experience(ctx.lead, resolve_plan(cfg), ctx.tokenizer, 0, StageTimer(), policy_version=0).table
    learner = PolicyLearner(tiny_model_path, dtype="float32", optim=OptimizerSpec(lr=1e-3, max_grad_norm=1.0),
                            temperature=1.0, use_reference=True)  # fmt: skip
    before = {n: p.detach().clone() for n, p in learner.module.named_parameters()}

    spec = build.update_spec(cfg, 1)  # stages 4-6 as online.run_step runs them on one rank
    batch = learner_online.reference_and_old(learner, schema.collate(table, 0), spec)
    batch = learner_online.advantages(batch, spec, lambda d: d)
    metrics = learner_online.update(learner, batch, experience.minibatch_normalisers(table, resolve_plan(cfg), 1), spec, lambda d: d)

    # group means 1.75 / 4 = 0.4375 and 1 / 4 = 0.25: signs [+, -, +, -] and [-, -, +, -] on every response token
    signs = torch.tensor([1.0, -1.0, 1.0, -1.0, -1.0, -1.0, 1.0, -1.0])
    expected = torch.where(batch.response_mask, signs[:, None], 0.0)
    assert torch.equal(batch.advantages, expected)
    # the KL to the reference is on; at the first step the policy is the reference, and the update takes its own
    # detached logprobs as the reference's (no reference pass in stage 4)
    assert batch.returns is None and batch.ref_logprobs is None and learner.has_reference
    # on-policy (ratio 1) the PPO-clip loss of a token is -A: token mean -(3 - 2 + 4 - 1 - 2 - 5 + 3 - 3) / 23
    assert metrics["learner/pg_loss"] == pytest.approx(3 / 23, abs=1e-6)
    assert all(math.isfinite(v) for v in metrics.values())
    changed = [n for n, p in learner.module.named_parameters() if not torch.equal(p.detach(), before[n])]
    assert changed and metrics["learner/grad_norm"] > 0  # the step moved the policy
    assert metrics["algo/kl"] == 0.0 and not learner.at_reference  # the next step makes its reference pass


def test_the_config_names_a_user_algorithm_and_every_validation_loads_it(example):
    cfg = _cfg(f"algo.user_algorithms=[{EXAMPLE}]")
    assert cfg.algo.algorithm is example.SIGN_GRPO and cfg.algo.family == "online"
    absolute = f"{REPO}/docs/examples/sign_grpo.py:SIGN_GRPO"
    assert cfg.algo.user_algorithms == [absolute]  # workers in another folder find the file
    assert build.update_spec(cfg, 1).estimator is example.sign_grpo
    # what a Ray Train worker does with the dumped config: validating again is a no-op (the same entry)
    assert Config.model_validate(cfg.model_dump()).algo.algorithm is example.SIGN_GRPO
    # a fresh process: nothing registered yet, the config alone brings the entry
    del ALGORITHMS["sign_grpo"]
    assert Config.model_validate(cfg.model_dump()).algo.algorithm is example.SIGN_GRPO


@pytest.mark.parametrize(("spec", "error"), [
    ("docs/examples/nothere.py:SIGN_GRPO", r"algo.user_algorithms\[0\]='docs/examples/nothere.py:SIGN_GRPO': cannot load .*"
                                           r"file not found"),
    ("docs/examples/sign_grpo.py:sign_grpo", r"'sign_grpo' in .* is function, not an rlray.algos.Algorithm"),
    ("docs/examples/sign_grpo.py", r"write 'package.module:NAME' or 'path/to/file.py:NAME'"),
    ("no_such_module_here:SIGN", r"cannot load 'no_such_module_here': ModuleNotFoundError"),
])  # fmt: skip
def test_a_bad_user_algorithm_spec_is_one_line_naming_it(example, spec, error):
    with pytest.raises(ConfigError, match=error):
        _cfg(f"algo.user_algorithms=[{spec}]")


def test_a_user_algorithm_cannot_take_a_registered_name(example, tmp_path):
    (tmp_path / "mine.py").write_text(
        "from rlray.algos import Algorithm, estimators\n"
        "GRPO = Algorithm('grpo', 'online', advantage=estimators.grpo, policy_loss='ppo_clip')\n")
    with pytest.raises(ConfigError, match=r"algo.user_algorithms\[0\]=.*algorithm 'grpo' is already registered"):
        _cfg(f"algo.user_algorithms=[{tmp_path}/mine.py:GRPO]")


@pytest.mark.ray
def test_a_user_algorithm_trains_a_step_on_the_ray_workers(example, ray_session, tmp_path, gsm8k_dir):
    """The Ray Train workers are other processes: they know "sign_grpo" only through algo.user_algorithms."""
    from rlray.launch.driver import run_training
    from rlray.observe.tracking import get_run, get_run_metrics

    for split, n in (("train", 8), ("test", 2)):  # rank 0 renders every prompt at start
        lines = (gsm8k_dir / f"{split}.jsonl").read_text().splitlines()[:n]
        (tmp_path / f"{split}.jsonl").write_text("\n".join(lines) + "\n")
    mlflow_uri = f"sqlite:///{tmp_path}/mlflow.db"
    overrides = _overrides("grpo", tmp_path, tmp_path, tmp_path / "unused.jsonl", mlflow_uri)
    cfg = load_config(REPO / "configs/algos/grpo.yaml",
                      [*overrides, "run.max_steps=1", "algo.name=sign_grpo", f"algo.user_algorithms=[{EXAMPLE}]"])
    result = run_training(cfg)
    assert result.status == "FINISHED"
    metrics = get_run_metrics(mlflow_uri, result.run_id)
    assert get_run(mlflow_uri, result.run_id).data.params["algo.name"] == "sign_grpo"
    assert [s for s, _ in metrics["learner/pg_loss"]] == [1]
    assert all(math.isfinite(v) for _, v in metrics["learner/loss"] + metrics["learner/grad_norm"])
    # sign advantages: |A| is 1 on a token of a sequence off its group's mean, 0 on the mean, never more
    (_, adv_abs_mean), = metrics["algo/advantage_abs_mean"]
    assert 0.0 < adv_abs_mean <= 1.0
