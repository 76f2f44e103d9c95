"""Config of reward.judges: defaults by mode, and errors that name the key (templates, patterns, labels, names)."""

from __future__ import annotations

import re

import pytest

from rlray.config import ConfigError, config_from_dict


def _judge(**entry) -> dict:
    return {"reward": {"judges": [{"path": "tiny-random", **entry}]}}


def test_defaults_follow_the_mode():
    cfg = config_from_dict(_judge())
    j = cfg.reward.judges[0]
    assert (j.name, j.mode, j.weight, j.app_name, j.logprobs, j.temperature) == ("judge", "pointwise", 1.0, "rlray-judge-judge", False, 0.0)
    assert re.findall(j.score_pattern, "x score: 3 ... Score: 7.5") == ["3", "7.5"] and "{{ response }}" in j.judge_template
    group = config_from_dict(_judge(mode="group", name="rank")).reward.judges[0]
    assert re.findall(group.score_pattern, "Response 1: 4\nresponse 2 = 9") == [("1", "4"), ("2", "9")]
    assert "{% for r in responses %}" in group.judge_template
    labelled = config_from_dict(_judge(parse={"labels": {"correct": 1.0, "incorrect": 0.0}})).reward.judges[0]
    assert re.findall(labelled.score_pattern, "Incorrect, not correct") == ["Incorrect", "correct"]
    assert cfg.resources.judge.replicas == 1 and cfg.reward.term_names == ["judge"]


@pytest.mark.parametrize("entry, message", [
    ({"template": "{{ prompt "}, r"reward.judges.0: template is not a valid Jinja template: line 1"),
    ({"prefill": "{% if x %}"}, r"reward.judges.0: prefill is not a valid Jinja template"),
    ({"system_prompt": "{{ x | nosuchfilter }}"}, r"system_prompt is not a valid Jinja template: line 1: No filter named 'nosuchfilter'"),
    ({"name": "a b"}, r"reward.judges.0: name='a b': use letters, digits"),
    ({"mode": "group", "parse": {"pattern": r"Score: (\d+)"}}, r"has 1 groups; mode group needs 2 \(the position, then the score\)"),
    ({"parse": {"pattern": "("}}, r"parse.pattern='\(' is not a regular expression"),
    ({"logprobs": True}, r"logprobs=true scores by the labels' probabilities: it needs mode pointwise and parse.labels"),
    ({"mode": "group", "logprobs": True, "parse": {"labels": {"a": 1.0}}}, r"it needs mode pointwise"),
    ({"parse": {"min_score": 5, "max_score": 5}}, r"parse.min_score=5.0 must be below parse.max_score=5.0"),
    ({"name": "env"}, r"reward.judges\[0\] is named 'env', a reserved name"),
    ({"path": None}, r"reward.judges.0.path=None"),
])
def test_bad_judges_are_named(entry, message):
    with pytest.raises(ConfigError, match=message):
        config_from_dict(_judge(**entry))


def test_judge_names_are_reward_terms():
    with pytest.raises(ConfigError, match=r"reward.functions\[0\] and reward.judges\[0\] are both named 'judge'"):
        config_from_dict({"reward": {"functions": [{"function": "gsm8k_correct", "name": "judge"}],
                                     "judges": [{"path": "x"}]}})  # fmt: skip
    cfg = config_from_dict({"reward": {"functions": [{"function": "gsm8k_correct"}], "judges": [{"path": "x", "name": "j"}]},
                            "algo": {"name": "dapo", "dynamic_sampling_metric": "j"}})  # fmt: skip
    assert cfg.reward.term_names == ["gsm8k_correct", "j"]  # DAPO may keep groups by a judge's spread
    with pytest.raises(ConfigError, match=r"reward.functions and reward.judges names \['gsm8k_correct', 'j'\]"):
        config_from_dict({"reward": {"functions": [{"function": "gsm8k_correct"}], "judges": [{"path": "x", "name": "j"}]},
                          "algo": {"name": "dapo", "dynamic_sampling_metric": "k"}})  # fmt: skip


def test_the_docs_judge_snippet_is_a_valid_reward_section():
    """The judge example of docs/judges.md (its first YAML block) loads as written."""
    from pathlib import Path

    import yaml

    text = (Path(__file__).resolve().parents[2] / "docs" / "judges.md").read_text()
    block = text.split("```yaml\n", 1)[1].split("```", 1)[0]
    cfg = config_from_dict(yaml.safe_load(block))
    j = cfg.reward.judges[0]
    assert (j.name, j.logprobs, j.prefill, j.parse.labels) == ("judge", True, "Verdict:", {"correct": 1.0, "incorrect": 0.0})
    assert "{{ answer }}" in j.judge_template and cfg.reward.term_names == ["gsm8k_correct", "judge"]
