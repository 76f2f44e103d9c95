"""Judges without Ray: templates, the parse rules, label logprobs, and ``JudgeService`` over a scripted engine and
over the real tiny-random model (hf backend)."""

from __future__ import annotations

import math
import re

import jinja2
import pytest
import torch

from rlray.config import JudgeConfig
from rlray.reward.judges import (
    JudgeError,
    JudgeItem,
    JudgeRequest,
    JudgeSpec,
    label_token_ids,
    parse_group,
    parse_score,
    prompt_text,
    render_turns,
    soft_score,
    template_variables,
)
from rlray.reward.judges.service import JudgeService
from rlray.rollout import Completion


def spec_of(**judge) -> JudgeSpec:
    """Returns the JudgeSpec of a reward.judges entry (path tiny-random unless given), as the run plan holds it (rlray.plan.resolve.resolve_judge)."""
    j = JudgeConfig.model_validate({"path": "tiny-random", **judge})
    return JudgeSpec(name=j.name, mode=j.mode, model_path=j.path, template=j.judge_template, pattern=j.score_pattern,
                     system_prompt=j.system_prompt, prefill=j.prefill, labels=tuple(j.parse.labels.items()),
                     min_score=j.parse.min_score, max_score=j.parse.max_score, match=j.parse.match, logprobs=j.logprobs,
                     max_new_tokens=j.max_new_tokens, temperature=j.temperature, backend="hf", dtype="float32",
                     max_model_len=j.max_model_len)  # fmt: skip


class ScriptedEngine:
    """A RolloutEngine stand-in whose answer to each judge prompt is ``reply(prompt text)`` (greedy, no logprobs)."""

    def __init__(self, tokenizer, reply):
        self.tokenizer, self.reply, self.calls = tokenizer, reply, []

    def generate(self, prompt_token_ids, sampling):
        self.calls.append(len(prompt_token_ids))
        out = []
        for i, ids in enumerate(prompt_token_ids):
            text = self.tokenizer.decode(ids)
            tokens = self.tokenizer(self.reply(text), add_special_tokens=False)["input_ids"][: sampling.max_new_tokens]
            out.append(Completion(i, 0, tokens, [0.0] * len(tokens), "stop", 0))
        return out

    def shutdown(self):
        pass


# --------------------------------------------------------------------------------------------
# Templates and parsing
# --------------------------------------------------------------------------------------------
def test_templates_see_the_prompt_the_response_and_the_rows_columns():
    spec = spec_of(template="Q: {{ prompt }} | A: {{ response }} | ref: {{ answer }} | {{ columns['answer'] }}",
                   system_prompt="grade {{ columns | length }} column(s)", prefill="Verdict on {{ answer }}:")
    messages, prefill = render_turns(spec, JudgeItem("2+2?", ("4",), {"answer": "#### 4"}))
    assert messages == [{"role": "system", "content": "grade 1 column(s)"},
                        {"role": "user", "content": "Q: 2+2? | A: 4 | ref: #### 4 | #### 4"}]
    assert prefill == "Verdict on #### 4:"
    chat = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "2+2?"}]
    assert prompt_text(chat) == "system: be brief\n\nuser: 2+2?" and prompt_text(chat[1:]) == "2+2?"
    group = spec_of(mode="group")  # the built-in group template numbers the responses as shown
    text = render_turns(group, JudgeItem("2+2?", ("four", "4"), {}))[0][0]["content"]
    assert "Response 1:\nfour" in text and "Response 2:\n4" in text and "Below are 2 responses" in text
    with pytest.raises(jinja2.UndefinedError, match="'answer' is undefined"):
        render_turns(spec, JudgeItem("2+2?", ("4",), {}))
    assert template_variables(spec.template) == {"prompt", "response", "answer", "columns"}


def test_a_column_named_like_a_variable_stays_under_columns():
    spec = spec_of(template="{{ response }} / {{ columns['response'] }}")
    assert render_turns(spec, JudgeItem("p", ("mine",), {"response": "the data's"}))[0][0]["content"] == "mine / the data's"


@pytest.mark.parametrize("output, expected", [
    ("Reasoning... Score: 7", 7.0),
    ("score=3.5 then Score: 9", 9.0),  # the last match counts
    ("Score: 11", None),  # outside [0, 10]
    ("no score here", None),
    ("Score: -1", None),
])
def test_pointwise_numbers_in_range(output, expected):
    assert parse_score(output, spec_of()) == expected


def test_labels_first_match_and_group_positions():
    labels = spec_of(parse={"labels": {"correct": 1.0, "incorrect": 0.0}})
    assert parse_score("The answer is Incorrect.", labels) == 0.0  # case-insensitive, whole word: not 'correct'
    assert parse_score("correct? no: incorrect", labels) == 0.0
    first = spec_of(parse={"labels": {"correct": 1.0, "incorrect": 0.0}, "match": "first"})
    assert parse_score("correct? no: incorrect", first) == 1.0
    group = spec_of(mode="group")
    out = "Response 2: 8\nResponse 1: 3\nResponse 3: 42\nResponse 9: 1\nResponse 2: 5"
    assert parse_group(out, group, 4) == [3.0, 5.0, None, None]  # last per position; 42 out of range; 9 and 4 missing
    assert parse_group(out, spec_of(mode="group", parse={"match": "first"}), 2) == [3.0, 8.0]
    grouped_labels = spec_of(mode="group", parse={"labels": {"good": 1.0, "bad": 0.0}})
    assert parse_group("response 1 - bad, Response 2: GOOD", grouped_labels, 2) == [0.0, 1.0]


def test_soft_score_is_the_labels_expected_number():
    label_ids = {"yes": (5, 6), "no": (7,)}
    labels = (("yes", 1.0), ("no", 0.0))
    # p(yes) = e^-1 + e^-2, p(no) = e^-1: score = p(yes) / (p(yes) + p(no))
    expected = (math.exp(-1) + math.exp(-2)) / (2 * math.exp(-1) + math.exp(-2))
    score, probs = soft_score({5: -1.0, 6: -2.0, 7: -1.0, 9: -0.1}, label_ids, labels)
    assert score == pytest.approx(expected, abs=1e-12) and probs["no"] == pytest.approx(1 - expected, abs=1e-12)
    assert soft_score({9: -0.1}, label_ids, labels)[0] is None  # no label has any probability: no score
    assert soft_score({5: -math.inf, 7: -math.inf}, label_ids, labels)[0] is None


def test_label_tokens_must_differ(tiny_tokenizer):
    ids = label_token_ids(tiny_tokenizer, (("correct", 1.0), ("wrong", 0.0)), "reward.judges[0]")
    assert set(ids) == {"correct", "wrong"} and not set(ids["correct"]) & set(ids["wrong"])
    assert ids["correct"][0] == tiny_tokenizer("correct", add_special_tokens=False)["input_ids"][0]
    with pytest.raises(JudgeError, match=r"reward.judges\[0\]: labels 'yes' and 'yes!' start with the same token"):
        label_token_ids(tiny_tokenizer, (("yes", 1.0), ("yes!", 0.0)), "reward.judges[0]")


# --------------------------------------------------------------------------------------------
# JudgeService
# --------------------------------------------------------------------------------------------
def test_service_judges_a_chunk_in_one_engine_call(tiny_tokenizer):
    def reply(prompt):  # the last response's length as the score (or nonsense for the 'unsure' one)
        response = re.findall(r"Response:\n(.*?)\n", prompt)[-1]
        return "I cannot tell" if response == "unsure" else f"Score: {len(response)}"

    engine = ScriptedEngine(tiny_tokenizer, reply)
    service = JudgeService(spec_of(max_model_len=160, max_new_tokens=8), 3, engine=engine, tokenizer=tiny_tokenizer)
    items = [JudgeItem("2+2?", ("4",)), JudgeItem("2+2?", ("unsure",)), JudgeItem("x" * 2000, ("long",)),
             JudgeItem("3+3?", ("six!!",))]
    got = service.judge(JudgeRequest("pointwise", items))
    assert (got.version, got.definition) == (3, service.spec.definition) and engine.calls == [3]  # one call, 3 fitting
    assert [v.scores for v in got.verdicts][::3] == [(1.0,), (5.0,)]
    assert [v.failure for v in got.verdicts] == ["", "parse", "too_long", ""]
    assert math.isnan(got.verdicts[1].scores[0]) and got.verdicts[1].output == "I cannot tell"
    assert got.verdicts[2].prompt_tokens > 150 and "max_model_len 160" in got.verdicts[2].output
    assert got.verdicts[0].output == "Score: 1" and got.verdicts[0].output_tokens == len(tiny_tokenizer("Score: 1")["input_ids"])
    wrong = service.judge(JudgeRequest("group", items[:1])).verdicts[0]
    assert wrong.failure == "mode" and "serves mode 'pointwise'" in wrong.output


def test_service_prefill_is_part_of_the_prompt_and_of_the_output(tiny_tokenizer):
    seen = []
    engine = ScriptedEngine(tiny_tokenizer, lambda prompt: seen.append(prompt) or " 4")
    spec = spec_of(prefill="Score:", parse={"match": "first"})
    got = JudgeService(spec, 1, engine=engine, tokenizer=tiny_tokenizer).judge(JudgeRequest("pointwise", [JudgeItem("q", ("a",))]))
    assert seen[0].endswith("<|im_start|>assistant\nScore:")  # the chat template's generation prompt, then the prefill
    assert got.verdicts[0].output == "Score: 4" and got.verdicts[0].scores == (4.0,)


def test_service_template_errors_fail_only_their_item(tiny_tokenizer):
    engine = ScriptedEngine(tiny_tokenizer, lambda prompt: "Score: 2")
    service = JudgeService(spec_of(template="{{ response }} vs {{ answer }}"), 1, engine=engine, tokenizer=tiny_tokenizer)
    got = service.judge(JudgeRequest("pointwise", [JudgeItem("q", ("a",), {"answer": "b"}), JudgeItem("q", ("a",), {})]))
    assert got.verdicts[0].scores == (2.0,) and got.verdicts[1].failure == "template"
    assert "'answer' is undefined" in got.verdicts[1].output


def test_label_logprobs_match_a_transformers_forward(tiny_model_path, tiny_tokenizer):
    """logprobs mode on the real tiny-random model (hf backend): the soft score equals the labels' probabilities of
    the first token that a plain transformers forward of the same judge prompt gives."""
    from transformers import AutoModelForCausalLM

    spec = spec_of(path=tiny_model_path, parse={"labels": {"correct": 1.0, "wrong": 0.0}}, logprobs=True, prefill="Verdict:")
    service = JudgeService(spec, 1)
    try:
        items = [JudgeItem("What is 2+2?", ("4",)), JudgeItem("What is 3+3?", ("seven",))]
        got = service.judge(JudgeRequest("pointwise", items))
        model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32).eval()
        for item, verdict in zip(items, got.verdicts, strict=True):
            ids, _ = service.prompt_ids(item)
            with torch.no_grad():
                logprobs = model(torch.tensor([ids])).logits[0, -1].float().log_softmax(-1)
            mass = {label: sum(math.exp(logprobs[t].item()) for t in service.label_ids[label]) for label in ("correct", "wrong")}
            assert verdict.failure == "" and verdict.output_tokens == 1
            assert verdict.scores[0] == pytest.approx(mass["correct"] / (mass["correct"] + mass["wrong"]), rel=1e-4)
            assert verdict.output.startswith("Verdict:") and "[p: correct 0." in verdict.output
    finally:
        service.close()
