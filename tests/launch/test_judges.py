"""Judges from the driver's side without Ray: the preflight's checks (``check_judges``), and ``rlray judge check`` in
this process on tiny-random (hf backend) with a label-logprob judge and a group judge."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rlray.cli import main
from rlray.config import Config, config_from_dict
from rlray.launch.judges import check_judges
from rlray.launch.preflight import preflight
from rlray.models import ModelError
from rlray.plan import resolve_plan
from rlray.reward.judges import JudgeError

REPO = Path(__file__).resolve().parents[2]
ROWS = [{"question": "What is 2 + 3?", "answer": "2 + 3 = 5\n#### 5"}, {"question": "What is 4 * 4?", "answer": "#### 16"},
        {"question": "What is 9 - 2?", "answer": "#### 7"}]  # fmt: skip
# A group judge whose verdict is written by its prefill: each response's length mod 10, by position as shown. The
# random model's continuation is never read (the first match counts), so the scores are known: a test of the order
# shuffled per group and mapped back.
LENGTH_JUDGE = ("{name: rank, path: tiny-random, backend: hf, dtype: float32, mode: group, max_new_tokens: 2, "
                "parse: {match: first}, prefill: '{% for r in responses %}Response {{ loop.index }}: "
                "{{ r | length % 10 }}\n{% endfor %}'}")  # fmt: skip
LABEL_JUDGE = ("{name: judge, path: tiny-random, backend: hf, dtype: float32, logprobs: true, prefill: 'Verdict:', "
               "parse: {labels: {correct: 1.0, wrong: 0.0}}, template: 'Q: {{ prompt }} Ref: {{ answer }} A: {{ response }}'}")


@pytest.fixture
def cfg_of(tmp_path):
    """Returns cfg_of(*overrides) -> a GRPO config on tiny-random (hf backend) with 3 GSM8K-like rows and no reward
    function but the judges the overrides give."""
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ROWS))

    def make(*overrides: str) -> Config:
        return config_from_dict({}, [
            "model.path=tiny-random", "model.dtype=float32", "data.prompt_column=question", "rollout.backend=hf",
            f"data.train_files=[{tmp_path}/train.jsonl]", "eval.num_problems=0", f"run.output_dir={tmp_path}/out",
            f"tracking.mlflow_uri=sqlite:///{tmp_path}/m.db", "rollout.max_new_tokens=12", *overrides])  # fmt: skip

    return make


def test_a_judge_alone_is_a_reward_and_passes_the_preflight(cfg_of, tiny_model_path):
    assert preflight(resolve_plan(cfg_of(f"reward.judges=[{LABEL_JUDGE}]"))) == tiny_model_path


@pytest.mark.parametrize("judge, error, message", [
    ("{path: tiny-random, template: '{{ response }} vs {{ solution }}'}", JudgeError,
     r"reward.judges\[0\].template reads \['solution'\], which the data's rows lack \(columns: \['answer'\]"),
    ("{path: tiny-random, prefill: '{{ answer.nosuchmethod() }}'}", JudgeError,
     r"reward.judges\[0\]: its templates raise on the first row \(train:0\): UndefinedError: 'str object' has no attribute"),
    ("{path: tiny-random, template: '{{ 1 / 0 }}'}", JudgeError, r"train:0\): ZeroDivisionError"),
    ("{path: no/such/folder}", ModelError, r"reward.judges\[0\].path='no/such/folder'"),
    ("{path: tiny-random, max_model_len: 64}", JudgeError,
     r"reward.judges\[0\]: the judge prompt of the first row \(train:0\) has \d+ tokens before any response; 0 fit"),
    ("{path: tiny-random, logprobs: true, parse: {labels: {good: 1, 'good!': 0}}}", JudgeError,
     r"reward.judges\[0\]: labels 'good' and 'good!' start with the same token"),
])
def test_the_preflight_names_the_judge_key(cfg_of, judge, error, message):
    cfg = cfg_of(f"reward.judges=[{judge}]")
    with pytest.raises(error, match=message):
        check_judges(resolve_plan(cfg), _rows(cfg))


def _rows(cfg: Config):
    from rlray.data import load_prompt_rows

    return load_prompt_rows(cfg.data.train_files, prompt_column="question")


def test_rlray_judge_check_reports_agreement_spread_and_position_bias(cfg_of, tmp_path, capsys):
    config = tmp_path / "judged.yaml"
    config.write_text(cfg_of(f"reward.judges=[{LABEL_JUDGE}, {LENGTH_JUDGE}]",
                             "reward.functions=[{function: gsm8k_correct}, {function: gsm8k_format}]").to_yaml())
    assert main(["judge", "check", str(config), "rollout.samples_per_prompt=3", "learner.sequences_per_minibatch=24",
                 "learner.sequences_per_microbatch=4", "--rows", "2"]) == 0
    out = capsys.readouterr().out
    assert "rlray judge check: 6 responses to 2 rows; references: gsm8k_correct, gsm8k_format" in out
    assert "judge 'judge' (pointwise): 6 responses judged" in out and "parse failures: 0 (0.0%)" in out
    assert "vs gsm8k_correct: accuracy" in out and "position bias: n/a (pointwise" in out
    assert "judge 'rank' (group): 6 responses judged" in out and "within a group: mean std" in out
    # the length judge scores a response the same whatever its position: no change between the two orders
    assert "position bias over 2 groups judged in two orders: mean |change| 0.000, shown first vs last +0.000" in out
    assert main(["judge", "check", str(config), "--rows", "2", "--json", "--label-column", "answer"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["references"] == ["gsm8k_correct", "gsm8k_format", "answer"] and doc["responses"] == 8
    judge, rank = doc["reports"]
    assert judge["parse_failures"] == 0 and 0.0 <= judge["spread"]["low"] <= judge["spread"]["high"] <= 1.0
    assert [a["reference"] for a in judge["agreements"]] == ["gsm8k_correct", "gsm8k_format", "answer"]
    assert judge["agreements"][2]["samples"] == 0  # 'answer' holds no numbers: no reference values
    assert rank["position"]["mean_abs_change"] == 0.0 and rank["example"].startswith("[shown order, sample->position:")
    assert main(["judge", "check", str(config), "--rows", "0"]) == 2
    assert main(["judge", "check", str(config), "--rows", "1", "--response-column", "nope"]) == 2
    assert "rlray: column 'nope' is missing from rows ['train:0']" in capsys.readouterr().err


def test_judge_check_needs_a_judge(cfg_of):
    from rlray.launch.judge_check import judge_check

    with pytest.raises(JudgeError, match="the config has no reward.judges to check"):
        judge_check(resolve_plan(cfg_of()), 2)
