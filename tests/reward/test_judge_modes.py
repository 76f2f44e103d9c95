"""Judge modes as objects (``rlray.reward.judges.modes``): the registry picks one object per judge, and a mode added
to it is used end to end (prompt, sampling, verdict) by the service and the client."""

from __future__ import annotations

import pytest

from rlray.reward.judges import (
    JUDGE_MODES,
    Group,
    JudgeItem,
    JudgeMode,
    JudgeSpec,
    LabelLogprobs,
    Pointwise,
    judge_mode,
    register_judge_mode,
    row_variables,
)
from rlray.reward.judges.client import JudgeClient, LocalJudgeCaller
from rlray.reward.judges.service import JudgeService
from rlray.rollout import Completion


def test_one_object_per_mode_picked_from_the_mode_and_logprobs():
    assert list(JUDGE_MODES) == ["pointwise", "group", "label_logprobs"]
    assert isinstance(judge_mode("pointwise"), Pointwise) and isinstance(judge_mode("group"), Group)
    assert isinstance(judge_mode("pointwise", logprobs=True), LabelLogprobs)
    assert judge_mode("group").together and not judge_mode("pointwise", logprobs=True).together
    with pytest.raises(KeyError, match="judge mode 'pairwise' is not registered; registered: pointwise, group"):
        judge_mode("pairwise")
    with pytest.raises(ValueError, match="already registered"):
        register_judge_mode(Pointwise())
    members, orders = judge_mode("group").plan(4, [0, 0, 1, 1], seed=3)
    assert members == [[0, 1], [2, 3]] and sorted(orders[0]) == [0, 1]
    assert judge_mode("pointwise").plan(2, [0, 0], seed=3) == ([[0], [1]], [[0], [0]])


class YesNo(JudgeMode):
    """A made-up mode: the response's length is a template variable, and the verdict is 'yes' (1) or 'no' (0)."""

    name = "yes_no"

    def variables(self, item):
        return {**row_variables(item), "response": item.responses[0], "length": len(item.responses[0])}

    def read(self, spec, output, completion, size, label_ids):
        word = output.strip().split()[0].lower() if output.strip() else ""
        return [{"yes": 1.0, "no": 0.0}.get(word)], output


class Replies:
    """A RolloutEngine stand-in that answers 'yes' to a judge prompt about a 2-letter response, else 'no'."""

    def __init__(self, tokenizer):
        self.tokenizer, self.seen = tokenizer, []

    def generate(self, prompt_token_ids, sampling):
        self.seen.append(sampling)
        out = []
        for i, ids in enumerate(prompt_token_ids):
            text = "yes" if "has 2 letters" in self.tokenizer.decode(ids) else "no"
            tokens = self.tokenizer(text, add_special_tokens=False)["input_ids"]
            out.append(Completion(i, 0, tokens, [0.0] * len(tokens), "stop", 0))
        return out

    def shutdown(self):
        pass


def test_a_registered_mode_scores_through_the_service_and_the_client(tiny_tokenizer):
    register_judge_mode(YesNo())
    try:
        spec = JudgeSpec(name="short", mode="yes_no", model_path="unused", template="'{{ response }}' has {{ length }} letters",
                         pattern="unused", max_new_tokens=4)  # fmt: skip
        engine = Replies(tiny_tokenizer)
        service = JudgeService(spec, 1, engine=engine, tokenizer=tiny_tokenizer)
        assert service.mode is JUDGE_MODES["yes_no"] and service.prompt_ids(JudgeItem("p", ("ab",)))[1] == ""
        client = JudgeClient("short", "yes_no", LocalJudgeCaller(service), cache_entries=0)
        got = client.score(["p", "p", "q"], ["ab", "abc", "cd"], [{}, {}, {}], groups=[0, 0, 1])
        assert got.scores == [1.0, 0.0, 1.0] and got.outputs == ["yes", "no", "yes"]
        assert engine.seen[0].max_new_tokens == 4  # the base sampling: max_new_tokens at temperature
        assert client.take_stats().requests == 3  # the base plan: one judgement per sample
    finally:
        JUDGE_MODES.pop("yes_no", None)
