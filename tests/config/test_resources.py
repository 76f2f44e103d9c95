"""Config section resources: defaults, bounds, core-list values and errors that name the dotted key."""

from __future__ import annotations

import pydantic
import pytest

from rlray.config import ConfigError, config_from_dict
from rlray.config.resources import (
    LearnerResources,
    ReferenceResources,
    ResourcesConfig,
    RolloutResources,
    TeacherResources,
)


def test_defaults():
    res = ResourcesConfig()
    assert (res.rollout.num_workers, res.rollout.cpus, res.rollout.gpus) == (1, 0.25, 0.0)
    assert (res.rollout.tensor_parallel_size, res.rollout.max_restarts, res.rollout.cpu_threads) == (1, 2, None)
    assert (res.learner.num_workers, res.learner.cpus, res.learner.gpus, res.learner.strategy) == (1, 0.25, 0.0, "ddp")
    assert (res.reward.replicas, res.reward.cpus, res.reward.gpus) == (1, 0.25, 0.0)
    assert (res.reference.placement, res.reference.cpus, res.reference.gpus) == ("learner", 0.25, 0.0)
    # a hang (watchdog.reference_call_s) or a death restarts the reference or teacher actor once by default
    assert (res.reference.max_restarts, res.teacher.max_restarts) == (1, 1)
    assert (res.colocate, res.placement_strategy, res.placement_timeout_s, res.node_wait_s) == (False, "PACK", 120.0, 60.0)
    assert all(getattr(res, role).custom_resources == {} for role in ("rollout", "learner", "reward", "reference",
                                                                      "teacher", "env"))


@pytest.mark.parametrize(
    ("section", "values"),
    [
        (RolloutResources, {"num_workers": 0}),
        (RolloutResources, {"cpus": 0.0}),  # gt 0
        (RolloutResources, {"gpus": -0.5}),
        (RolloutResources, {"tensor_parallel_size": 0}),
        (RolloutResources, {"max_restarts": -2}),  # -1 means no limit; below is refused
        (LearnerResources, {"strategy": "zero3"}),
        (ReferenceResources, {"placement": "driver"}),
        (ReferenceResources, {"max_restarts": -2}),
        (TeacherResources, {"max_restarts": -2}),
        (ResourcesConfig, {"placement_strategy": "pack"}),  # Ray's names are upper case
        (ResourcesConfig, {"placement_timeout_s": 0.0}),
        (RolloutResources, {"num_actors": 2}),  # unknown key
    ],
)
def test_out_of_range_values_are_refused(section, values):
    with pytest.raises(pydantic.ValidationError):
        section(**values)


def test_bounds_are_inclusive_where_documented():
    assert RolloutResources(max_restarts=-1, gpus=0.0).max_restarts == -1
    assert RolloutResources(cpus=0.01).cpus == 0.01


def test_core_lists_read_a_bare_number_as_text():
    assert RolloutResources(cpu_threads=1).cpu_threads == "1"  # cpu_threads=1 on the command line parses as int
    assert RolloutResources(cpu_threads=["0", 1]).cpu_threads == ["0", "1"]
    assert RolloutResources(cpu_threads="0,2-3").cpu_threads == "0,2-3"


def test_assignment_is_validated():
    res = ResourcesConfig()
    with pytest.raises(pydantic.ValidationError):
        res.learner.num_workers = 0
    res.learner.num_workers = 2
    assert res.learner.num_workers == 2


@pytest.mark.parametrize(
    ("tree", "message"),
    [
        ({"rollout": {"num_workers": 0}}, "resources.rollout.num_workers=0: Input should be greater than or equal to 1"),
        ({"learner": {"strategy": "zero3"}}, "resources.learner.strategy='zero3': Input should be 'ddp' or 'fsdp'"),
        ({"rollout": {"cpu_threads": "x"}}, "resources.rollout.cpu_threads='x' is not a core list"),
        ({"rollout": {"cpu_threads": ["0"], "num_workers": 2}}, "has 1 entries for resources.rollout.num_workers=2"),
        ({"node_wait_s": -1}, "resources.node_wait_s=-1: Input should be greater than or equal to 0"),
        ({"rollout": {"custom_resources": {"CPU": 1}}},
         "resources.rollout.custom_resources: {'CPU': 1}: 'CPU' is not a custom resource; use the role's cpus field"),
        ({"learner": {"custom_resources": {"GPU": 1}}}, "use the role's gpus field"),
        ({"env": {"custom_resources": {"memory": 1}}},
         "resources.env.custom_resources: {'memory': 1}: 'memory' is not a custom resource; name a custom resource"),
        ({"reward": {"custom_resources": {"rm_node": 0}}},
         "resources.reward.custom_resources: {'rm_node': 0}: give 'rm_node' an amount > 0, whole when above 1"),
        ({"teacher": {"custom_resources": {"t": 1.5}}}, "resources.teacher.custom_resources: {'t': 1.5}: give 't' an amount"),
        ({"reference": {"custom_resources": {"r": "many"}}}, "resources.reference.custom_resources.r='many'"),
    ],
)
def test_errors_name_the_dotted_key(tree, message):
    with pytest.raises(ConfigError) as err:
        config_from_dict({"resources": tree})
    assert message in str(err.value)


def test_fsdp_runs_on_the_cpu_with_lora_or_an_adapter():
    # FSDP2 over gloo (tests/learner/test_fsdp.py): no GPU needed, and peft adapters shard with the model
    cfg = config_from_dict({}, ["resources.learner.strategy=fsdp", "resources.learner.num_workers=2", "model.lora.rank=8"])
    assert (cfg.resources.learner.strategy, cfg.resources.learner.gpus, cfg.model.lora.rank) == ("fsdp", 0.0, 8)
    cfg = config_from_dict({}, ["resources.learner.strategy=fsdp", "resources.learner.num_workers=2",
                                "model.adapter_path=/some/adapter"])
    assert cfg.model.adapter_path == "/some/adapter"


def test_custom_resources_take_fractions_and_whole_amounts():
    cfg = config_from_dict({}, ["resources.rollout.custom_resources={rollout_node: 1}", "resources.node_wait_s=0",
                                "resources.learner.custom_resources={learner_node: 0.5, big: 2}"])
    assert cfg.resources.rollout.custom_resources == {"rollout_node": 1.0}
    assert cfg.resources.learner.custom_resources == {"learner_node": 0.5, "big": 2.0}
    assert cfg.resources.node_wait_s == 0.0


def test_loaded_values_reach_the_section():
    cfg = config_from_dict({"resources": {"rollout": {"num_workers": 2, "cpu_threads": ["0", "1"]}, "colocate": False}})
    assert cfg.resources.rollout.num_workers == 2
    assert cfg.resources.rollout.cpu_threads == ["0", "1"]
