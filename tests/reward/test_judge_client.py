"""The judge client and panel without Ray: the cache, one chunk per replica, group shuffles mapped back, bounded
retries and time-outs (failed scores, counted), and the judges' terms added to the scorer's."""

from __future__ import annotations

import logging
import math
import threading

import pytest

from rlray.reward.judges import JudgeReply, JudgeVerdict
from rlray.reward.judges.client import JudgeClient
from rlray.reward.judges.panel import JudgePanel, JudgeTerm, add_judge_terms
from rlray.reward.server import ScoreResult


class ScriptedJudge:
    """A judge caller: scores each response by its length (pointwise ``Score: n``; group: per position as shown),
    'junk' fails to parse; ``outages`` exceptions are raised by the next judge calls, one each."""

    def __init__(self, version=1, outages=(), identity_down=False):
        self.version, self.outages, self.identity_down = version, list(outages), identity_down
        self.requests, self.lock = [], threading.Lock()

    def identity(self, timeout_s):
        if self.identity_down:
            raise ConnectionError("no replica")
        return self.version, "def0"

    def judge(self, request, timeout_s):
        with self.lock:
            self.requests.append(request)
            if self.outages:
                raise self.outages.pop(0)
        verdicts = []
        for item in request.items:
            scores = tuple(math.nan if r == "junk" else float(len(r)) for r in item.responses)
            lines = "\n".join(f"Response {k + 1}: {len(r)}" for k, r in enumerate(item.responses))
            verdicts.append(JudgeVerdict(scores, lines, "parse" if "junk" in item.responses else "", 10, 2))
        return JudgeReply(self.version, "def0", verdicts, 0.01)


PROMPTS = ["p0", "p0", "p1", "p1"]
COLUMNS = [{"answer": "1"}, {"answer": "1"}, {"answer": "2"}, {"answer": "2"}]


def test_pointwise_cache_and_dedupe():
    judge = ScriptedJudge()
    client = JudgeClient("j", "pointwise", judge, chunks=2, backoff_s=0.0)
    got = client.score(PROMPTS, ["a", "a", "bbb", "junk"], COLUMNS)
    assert got.scores[:3] == [1.0, 1.0, 3.0] and math.isnan(got.scores[3])
    assert sorted(len(r.items) for r in judge.requests) == [1, 2]  # 3 distinct judgements (p0/a twice), over 2 chunks
    stats = client.take_stats()
    assert (stats.requests, stats.cache_hits, stats.calls, stats.parse_failures, stats.errors) == (4, 1, 2, 1, 0)
    assert (stats.prompt_tokens, stats.output_tokens, stats.version) == (30, 6, 1)
    again = client.score(PROMPTS, ["a", "a", "bbb", "junk"], COLUMNS)
    assert len(judge.requests) == 2 and again.scores[:3] == got.scores[:3] and again.outputs == got.outputs
    stats = client.take_stats()
    assert (stats.requests, stats.cache_hits, stats.calls, stats.parse_failures) == (4, 4, 0, 1)  # its sample fails again
    # the same response to another row (other columns) is another judgement; a new judge version misses the cache
    client.score(["p0"], ["a"], [{"answer": "other"}])
    judge.version = 2
    client.score(PROMPTS[:1], ["a"], COLUMNS[:1])
    assert len(judge.requests) == 4 and client.take_stats().version == 1  # the lowest version that answered
    none = JudgeClient("j", "pointwise", ScriptedJudge(), cache_entries=0)
    none.score(["p"], ["a"], [{}])
    none.score(["p"], ["a"], [{}])
    assert none.take_stats().calls == 2


def test_group_mode_shuffles_per_call_and_maps_the_scores_back():
    judge = ScriptedJudge()
    client = JudgeClient("g", "group", judge, backoff_s=0.0)
    responses = ["a", "bb", "ccc", "dddd", "x", "yy", "zzz", "wwww"]
    groups = [0, 0, 0, 0, 1, 1, 1, 1]
    got = client.score(["p"] * 4 + ["q"] * 4, responses, [{}] * 8, groups, seed=5)
    assert got.scores == [1.0, 2.0, 3.0, 4.0, 1.0, 2.0, 3.0, 4.0]  # each sample gets its own score, whatever the order
    shown = [item.responses for item in judge.requests[0].items]
    members, orders = client.plan(8, groups, 5)
    assert members == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert shown == [tuple(responses[m[k]] for k in o) for m, o in zip(members, orders, strict=True)]
    assert shown[0] != tuple(responses[:4]) or shown[1] != tuple(responses[4:])  # shuffled (seed 5)
    assert client.plan(8, groups, 6)[1] != orders  # another seed, another order
    assert got.outputs[0] == got.outputs[3] and got.outputs[0].startswith("[shown order, sample->position: ")
    reverse = JudgeClient("g", "group", ScriptedJudge(), cache_entries=0)
    reverse.score(["p"] * 4 + ["q"] * 4, responses, [{}] * 8, groups, seed=5, reverse=True)
    assert [i.responses for i in reverse.caller.requests[0].items] == [s[::-1] for s in shown]
    assert client.take_stats().requests == 2  # one judgement per group


def test_a_slow_or_down_judge_fails_its_samples_after_bounded_tries(caplog):
    flaky = ScriptedJudge(outages=[TimeoutError("past 1 s"), ConnectionError("replica died")])
    client = JudgeClient("j", "pointwise", flaky, attempts=3, backoff_s=0.0)
    assert client.score(["p"], ["ab"], [{}]).scores == [2.0]  # the third try answers
    stats = client.take_stats()
    assert (stats.calls, stats.retries, stats.errors) == (3, 2, 0)
    down = ScriptedJudge(outages=[TimeoutError("past 1 s")] * 3)
    client = JudgeClient("j", "pointwise", down, attempts=3, backoff_s=0.0)
    with caplog.at_level(logging.WARNING, logger="rlray.reward.judges.client"):
        got = client.score(["p", "p"], ["ab", "c"], [{}, {}])
    assert all(math.isnan(s) for s in got.scores) and got.outputs == ["no answer from the judge"] * 2
    stats = client.take_stats()
    assert (stats.calls, stats.retries, stats.errors, stats.parse_failures) == (3, 2, 2, 0)
    assert "judge 'j': judge failed 3 times, last with TimeoutError: past 1 s" in caplog.text
    assert client.score(["p"], ["ab"], [{}]).scores == [2.0]  # not cached: asked again once the judge is back
    unknown = JudgeClient("j", "pointwise", ScriptedJudge(identity_down=True), attempts=2, backoff_s=0.0)
    assert math.isnan(unknown.score(["p"], ["ab"], [{}]).scores[0])
    assert unknown.caller.requests == [] and unknown.take_stats().errors == 1  # no judge call while it cannot say who it is


def test_judge_terms_add_to_the_scorers_reward():
    values = {"reward": [1.2, math.nan, math.nan, 0.0], "gsm8k_correct": [1.0, None, math.nan, 0.0],
              "gsm8k_format": [1.0, None, 1.0, 0.0]}
    got = add_judge_terms(values, [("j", 0.5, [2.0, 4.0, 1.0, math.nan]), ("k", 2.0, [1.0, 1.0, 1.0, 1.0])])
    # 1.2 + 0.5*2 + 2*1; every function skipped sample 1: 0 + 0.5*4 + 2*1; a failed function or judge: NaN
    assert got["reward"][:2] == [1.2 + 1.0 + 2.0, 0.0 + 2.0 + 2.0] and math.isnan(got["reward"][2])
    assert math.isnan(got["reward"][3]) and got["j"][:3] == [2.0, 4.0, 1.0] and got["gsm8k_correct"] == values["gsm8k_correct"]
    assert add_judge_terms({"reward": [0.0]}, [("j", 3.0, [0.5])])["reward"] == [1.5]  # a scorer without terms


def test_panel_scores_every_judge_and_sums_their_metrics():
    point, group = ScriptedJudge(version=2), ScriptedJudge(version=3)
    panel = JudgePanel([JudgeTerm("j", 1.0, JudgeClient("j", "pointwise", point)),
                        JudgeTerm("g", 0.1, JudgeClient("g", "group", group))])  # fmt: skip
    result = ScoreResult(7, {"reward": [1.0, 0.0, 1.0, 0.0], "gsm8k_correct": [1.0, 0.0, 1.0, 0.0]})
    got = panel.score(result, PROMPTS, ["a", "bb", "ccc", "junk"], COLUMNS, [0, 0, 1, 1], seed=1)
    assert got.version == 7 and got.values["j"][:3] == [1.0, 2.0, 3.0] and math.isnan(got.values["j"][3])
    assert got.values["g"][:3] == [1.0, 2.0, 3.0] and math.isnan(got.values["g"][3])
    assert got.values["reward"][:3] == [1.0 + 1.0 + 0.1, 0.0 + 2.0 + 0.2, 1.0 + 3.0 + 0.3]
    assert set(got.outputs) == {"j", "g"} and got.outputs["j"][1] == "Response 1: 2"
    metrics = panel.take_metrics()
    assert metrics == {"reward/judge_requests": 6.0, "reward/judge_cache_hits": 0.0, "reward/judge_calls": 2.0,
                       "reward/judge_retries": 0.0, "reward/judge_parse_failures": 2.0, "reward/judge_errors": 0.0,
                       "reward/judge_prompt_tokens": 60.0, "reward/judge_output_tokens": 12.0,
                       "reward/judge_latency_s": pytest.approx(metrics["reward/judge_latency_s"]), "reward/judge_version": 2.0}
    assert panel.take_metrics()["reward/judge_calls"] == 0.0 and "reward/judge_latency_s" not in panel.take_metrics()
    panel.close()
