"""rollout.backend=exact: what the validator refuses (each field named), and what the plan and the engine get."""

from __future__ import annotations

import pytest

from rlray.config import ConfigError, config_from_dict
from rlray.launch.actors import rollout_engine_kwargs
from rlray.plan import resolve_plan
from rlray.run import build

EXACT = {"rollout": {"backend": "exact", "max_new_tokens": 24}}


@pytest.mark.parametrize(("tree", "named"), [
    ({"rollout": {"top_p": 0.9}}, "rollout.top_p < 1"),
    ({"rollout": {"top_k": 20}}, "rollout.top_k > 0"),
    ({"rollout": {"min_p": 0.05}}, "rollout.min_p > 0"),
    ({"rollout": {"stop": ["\n\n"]}}, "rollout.stop"),
    ({"model": {"lora": {"rank": 8}}}, "model.lora.rank > 0 or model.adapter_path"),
    ({"resources": {"learner": {"gpus": 1}}}, "resources.learner.gpus or resources.rollout.gpus > 0"),
    ({"resources": {"learner": {"num_workers": 2, "strategy": "fsdp"}}}, "resources.learner.strategy=fsdp"),
    ({"learner": {"sequence_packing": "on"}}, "learner.sequence_packing=on"),
    ({"env": {"environments": {"guess": "rlray.envs.builtin.guess:GuessNumberEnv"}}}, "env.environments or env.agents"),
    ({"teacher": {"path": "tiny-random@1", "divergence": "jsd"}}, "teacher.divergence=jsd"),
])  # fmt: skip
def test_what_cannot_be_exact_is_refused_by_name(tree, named):
    merged = {**tree, "rollout": {**EXACT["rollout"], **tree.get("rollout", {})}}
    with pytest.raises(ConfigError, match=f"rollout.backend=exact .*cannot be exact with {named}"):
        config_from_dict(merged)
    config_from_dict({**tree, "rollout": {**tree.get("rollout", {})}})  # the same config is fine with vllm


def test_the_plan_gives_the_learner_the_exact_layout_and_the_engine_the_learner_s_threads():
    cfg = config_from_dict({**EXACT, "learner": {"sequence_packing": "auto", "torch_threads": 3}})
    plan = resolve_plan(cfg)
    assert plan.parallelism.micro_batching.exact_new_tokens == 24  # rows alone in prompt + 24 tokens
    assert plan.parallelism.frozen_micro_batching.exact_new_tokens == 24  # a reference actor's too
    kwargs = rollout_engine_kwargs(resolve_plan(cfg), 280)
    assert kwargs["backend"] == "exact" and kwargs["torch_threads"] == build.core_plan(cfg).learner_threads == 3
    default = config_from_dict({})
    assert resolve_plan(default).parallelism.micro_batching.exact_new_tokens is None
    assert rollout_engine_kwargs(resolve_plan(default), 280)["torch_threads"] is None
