"""Judges in the loop without Ray (scripted judges): a synchronous step's stages 1-3 (terms, metrics, the judges'
raw outputs in the experience table and the kept samples), an episode judged on its final conversation, and
evaluation."""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

from rlray.config import config_from_dict
from rlray.data import PromptRow
from rlray.plan import resolve_plan
from rlray.reward.judges import JudgeReply, JudgeVerdict
from rlray.reward.judges.client import JudgeClient
from rlray.reward.judges.panel import JudgePanel, JudgeTerm
from rlray.reward.server import LocalRewardClient
from rlray.rollout import Completion, SamplingSpec
from rlray.rollout.types import EpisodeInfo
from rlray.run import experience
from rlray.run.evaluation import evaluate_prompts
from rlray.run.experience import StageTimer
from rlray.run.lead import FleetCounts, OnlineLead

G = 2
ROWS = [PromptRow("p0", "q0", {"answer": "1"}), PromptRow("p1", "q1", {"answer": "2"})]


class Tokenizer:
    def batch_decode(self, ids, skip_special_tokens=True):
        return [" ".join(map(str, x)) for x in ids]


class LengthJudge:
    """A judge caller: each response's score is its length in characters (group mode: by position as shown)."""

    def __init__(self):
        self.seen = []

    def identity(self, timeout_s):
        return 1, "d"

    def judge(self, request, timeout_s):
        self.seen += [item.responses for item in request.items]
        return JudgeReply(1, "d", [JudgeVerdict(tuple(float(len(r)) for r in item.responses), f"saw {list(item.responses)}")
                                   for item in request.items])  # fmt: skip


class Scorer:
    """One reward function term 'one' (1.0 for every sample)."""

    def score(self, prompts, completions, columns, completion_ids=None):
        return {"reward": [1.0] * len(completions), "one": [1.0] * len(completions)}

    def score_with_failures(self, prompts, completions, columns, completion_ids=None):
        return self.score(prompts, completions, columns, completion_ids), [""] * len(completions)

    def close(self):
        pass


def _panel(mode: str = "pointwise") -> tuple[JudgePanel, LengthJudge]:
    judge = LengthJudge()
    return JudgePanel([JudgeTerm("judge", 0.5, JudgeClient("judge", mode, judge))]), judge


def test_a_synchronous_step_is_judged_and_keeps_the_raw_outputs():
    cfg = config_from_dict({}, ["learner.prompts_per_step=2", f"rollout.samples_per_prompt={G}", "rollout.max_new_tokens=8",
                                "learner.sequences_per_minibatch=4", "learner.sequences_per_microbatch=2",
                                "reward.judges=[{path: tiny-random, mode: group}]"])  # fmt: skip
    completions = [Completion(i // G, i % G, list(range(1, 2 + i)), [-1.0] * (1 + i), "stop", 0) for i in range(4)]
    got = SimpleNamespace(rows=ROWS, prompt_ids=[[1, 2], [3]], completions=completions)
    panel, judge = _panel("group")
    lead = OnlineLead(stream=None, prompt_ids={}, skipped_long_prompts=0, eval_prompts=[], reward_columns=[],
                      reward=LocalRewardClient(Scorer(), 1), reward_kwargs={}, fleet=None, rollouts=None,
                      pipeline=SimpleNamespace(next=lambda step: got), logged=FleetCounts(), judges=panel)  # fmt: skip
    out = experience.collect_experience(lead, resolve_plan(cfg), Tokenizer(), 0, StageTimer(), policy_version=0)
    texts = ["1", "1 2", "1 2 3", "1 2 3 4"]
    assert sorted(map(sorted, judge.seen)) == [["1", "1 2"], ["1 2 3", "1 2 3 4"]]  # each group judged together
    rewards = out.table.column("reward").to_pylist()
    assert rewards == [1.0 + 0.5 * len(t) for t in texts]  # the function's 1.0 plus 0.5 x the judge's score
    assert out.metrics["reward/judge"] == sum(len(t) for t in texts) / 4 and out.metrics["reward/judge_requests"] == 2.0
    assert out.metrics["reward/judge_calls"] == 1.0 and out.metrics["reward/judge_version"] == 1.0  # one replica: one call
    outputs = out.table.column("judge_outputs").to_pylist()
    assert all(dict(o)["judge"].startswith("[shown order, sample->position: ") for o in outputs)
    samples = experience.step_samples(_DecodingTokenizer(), out.table, [0, 3], [0.1, -0.1], 1)
    assert [set(s.judge_outputs) for s in samples] == [{"judge"}, {"judge"}] and "saw [" in samples[0].judge_outputs["judge"]
    assert json.loads(out.table.column("prompt_columns").to_pylist()[0]) == {"answer": "1"}


class _DecodingTokenizer(Tokenizer):
    def decode(self, ids, skip_special_tokens=False):
        return " ".join(map(str, ids))


def test_an_episode_is_judged_on_its_whole_text_before_the_environment_term():
    panel, judge = _panel()
    episode = EpisodeInfo("guess", "done", 2, [None, 1.0], env_reward=1.0)
    completions = [Completion(0, 0, [5, 6, 7], [-1.0] * 3, "stop", 0, episode=episode), Completion(1, 0, [8], [-1.0], "stop", 0)]
    got = experience.score(LocalRewardClient(Scorer(), 1), ROWS, completions, Tokenizer(), 2.0, panel, judge_seed=0)
    assert judge.seen == [("5 6 7",), ("8",)]  # the episode's turns and observations, all of it
    assert got.values["judge"] == [5.0, 1.0] and got.values["env"] == [1.0, None]
    assert got.values["reward"] == [1.0 + 0.5 * 5.0 + 2.0 * 1.0, 1.0 + 0.5 * 1.0]
    assert got.outputs["judge"] == ["saw ['5 6 7']", "saw ['8']"]


def test_evaluation_logs_each_judge_as_an_eval_term():
    panel, _ = _panel()

    class Rollouts:
        def generate(self, prompt_ids, sampling, rows):
            return [Completion(p, 0, [1] * (p + 1), [-1.0] * (p + 1), "stop", 0) for p in range(len(prompt_ids))]

    prompts = [(row, [1, 2]) for row in ROWS]
    got = evaluate_prompts(Rollouts(), LocalRewardClient(Scorer(), 1), prompts, Tokenizer(),
                           SamplingSpec(n=1, max_new_tokens=4, temperature=0.0), judges=panel)  # fmt: skip
    # responses '1' and '1 1': judge 1 and 3; rewards 1 + 0.5 and 1 + 1.5
    assert got["eval/judge"] == 2.0 and got["eval/judge_skipped"] == 0.0 and got["eval/reward_mean"] == 2.0
    assert not math.isnan(got["eval/one"])
