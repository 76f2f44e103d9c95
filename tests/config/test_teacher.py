"""Config section teacher (and resources.teacher): defaults, the derived weights, and errors that name the key."""

from __future__ import annotations

import pytest

from rlray.config import ConfigError, config_from_dict
from rlray.config.teacher import TeacherConfig


def test_defaults_are_off():
    cfg = config_from_dict({})
    t = cfg.teacher
    assert (t.path, t.weight, t.divergence, t.beta) == (None, 1.0, "reverse_kl", 0.5)
    assert (cfg.resources.teacher.placement, cfg.resources.teacher.cpus, cfg.resources.teacher.gpus) == ("learner", 0.25, 0.0)
    assert not t.enabled and t.reverse_kl_weight == 0.0 and t.jsd_weight == 0.0


def test_weights_follow_the_divergence():
    assert TeacherConfig(path="tiny-random@1", weight=0.5).reverse_kl_weight == 0.5
    assert TeacherConfig(path="tiny-random@1", weight=0.5).jsd_weight == 0.0
    jsd = TeacherConfig(path="tiny-random@1", weight=2.0, divergence="jsd", beta=0.1)
    assert (jsd.reverse_kl_weight, jsd.jsd_weight, jsd.beta) == (0.0, 2.0, 0.1)


@pytest.mark.parametrize(
    ("override", "key"),
    [
        ({"teacher": {"weight": 0.0}}, "teacher.weight"),
        ({"teacher": {"weight": -1.0}}, "teacher.weight"),
        ({"teacher": {"beta": 1.5}}, "teacher.beta"),
        ({"teacher": {"beta": -0.1}}, "teacher.beta"),
        ({"teacher": {"divergence": "forward_kl"}}, "teacher.divergence"),
        ({"teacher": {"weight": True}}, "teacher.weight"),
        ({"resources": {"teacher": {"placement": "driver"}}}, "resources.teacher.placement"),
        ({"teacher": {"model_path": "x"}}, "teacher.model_path"),
    ],
)
def test_bad_values_name_the_key(override, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        config_from_dict(override)


def test_jsd_needs_the_teacher_on_the_learner():
    with pytest.raises(ConfigError, match=r"teacher.divergence='jsd' with resources.teacher.placement='actor'.*"
                                          r"set resources.teacher.placement=learner"):
        config_from_dict({"teacher": {"path": "tiny-random@1", "divergence": "jsd"},
                          "resources": {"teacher": {"placement": "actor"}}})
    ok = config_from_dict({"teacher": {"path": "tiny-random@1"}, "resources": {"teacher": {"placement": "actor"}}})
    assert ok.teacher.reverse_kl_weight == 1.0  # reverse KL runs with the teacher as its own actor


def test_a_teacher_needs_an_online_algorithm():
    with pytest.raises(ConfigError, match=r"teacher.path='tiny-random@1' with the offline method algo.name='dpo'"):
        config_from_dict({"algo": {"name": "dpo"}, "teacher": {"path": "tiny-random@1"}})


def test_the_pure_distillation_config():
    from pathlib import Path

    from rlray.config import load_config

    cfg = load_config(Path(__file__).resolve().parents[2] / "configs" / "distill_tiny.yaml")
    assert (cfg.model.path, cfg.teacher.path, cfg.teacher.divergence, cfg.teacher.weight) == (
        "tiny-random", "tiny-random@1", "reverse_kl", 1.0)
    assert cfg.reward.functions == [] and cfg.reward.model_path is None  # task reward off
    assert cfg.algo.family == "online" and cfg.resources.teacher.placement == "learner"
