"""Judges on Ray Serve (tiny-random, hf backend, 2 replicas each): the same verdicts as in process, one chunk per
replica, group orders mapped back, parse failures counted, the cache, a hot swap under load through
``rlray serve-reward``, and a judge that is slow or down (bounded tries, failed rewards, no exception)."""

from __future__ import annotations

import math
import threading
import time

import pytest

from rlray.config import config_from_dict
from rlray.plan import resolve_plan
from rlray.reward.judges import JudgeItem, JudgeRequest
from rlray.reward.judges.service import JudgeService
from rlray.reward.server import ScoreResult

# pointwise: the labels' probabilities (exact, comparable to a local service); group: the verdict is the prefill, each
# response's length by position as shown, so lengths over max_score 9 fail to parse (known in advance)
LABEL = ("{name: judge, path: tiny-random, backend: hf, dtype: float32, logprobs: true, prefill: 'Verdict:', "
         "parse: {labels: {correct: 1.0, wrong: 0.0}}}")
RANK = ("{name: rank, path: tiny-random, backend: hf, dtype: float32, mode: group, max_new_tokens: 2, "
        "parse: {match: first, max_score: 9}, prefill: '{% for r in responses %}Response {{ loop.index }}: "
        "{{ r | length RULE }}\n{% endfor %}'}")
PROMPTS = ["What is 2+2?"] * 4 + ["What is 3+3?"] * 4
TEXTS = ["4", "four", "it is 4", "the answer is four", "6", "six", "6 or 7", "twelve halves"]
GROUPS = [0, 0, 0, 0, 1, 1, 1, 1]


def _cfg(port: int, version: int = 1, rank_rule: str = ""):
    return config_from_dict({}, ["model.path=tiny-random", f"reward.server.port={port}", "resources.judge.replicas=2",
                                 f"reward.version={version}", f"reward.judges=[{LABEL}, {RANK.replace('RULE', rank_rule)}]"])  # fmt: skip


@pytest.fixture(scope="module")
def deployed(ray_session, tmp_path_factory):
    """Deploys judges 'judge' and 'rank' (2 replicas each) on a free port; yields (config, port)."""
    from ray import serve

    from rlray.launch.judges import deploy_judges
    from rlray.rollout.weight_sync import free_port

    port = free_port()
    cfg = _cfg(port)
    created = deploy_judges(resolve_plan(cfg))
    assert created == ["rlray-judge-judge", "rlray-judge-rank"]
    yield cfg, port
    for name in created:
        serve.delete(name)


def _base(n: int) -> ScoreResult:
    return ScoreResult(1, {"reward": [0.0] * n, "length": [float(len(t)) for t in TEXTS[:n]]})


@pytest.mark.ray
def test_serve_judges_give_the_local_verdicts_one_chunk_per_replica(deployed):
    from ray import serve

    from rlray.launch.judges import deploy_judges, judge_specs
    from rlray.run import build

    cfg, _ = deployed
    deployed_at = serve.status().applications["rlray-judge-rank"].last_deployed_time_s
    assert deploy_judges(resolve_plan(cfg)) == []  # the same judges already serve: left as they are (a sweep's trials, rlray eval)
    assert serve.status().applications["rlray-judge-rank"].last_deployed_time_s == deployed_at
    panel = build.judge_panel(cfg)
    try:
        got = panel.score(_base(8), PROMPTS, TEXTS, [{}] * 8, GROUPS, seed=3)
        spec = judge_specs(resolve_plan(cfg))[0]
        local = JudgeService(spec, 1)
        try:
            expected = [v.scores[0] for v in local.judge(JudgeRequest("pointwise", [JudgeItem(p, (t,)) for p, t in
                                                                                   zip(PROMPTS, TEXTS, strict=True)])).verdicts]  # fmt: skip
        finally:
            local.close()
        assert got.values["judge"] == pytest.approx(expected, rel=1e-6) and all(0 < s < 1 for s in expected)
        rank = got.values["rank"]
        assert [s for s in rank if math.isfinite(s)] == [float(len(t)) for t in TEXTS if len(t) <= 9]
        assert [math.isnan(s) for s in rank] == [len(t) > 9 for t in TEXTS]  # out of range: failed, not zero
        assert [math.isnan(r) for r in got.values["reward"]] == [len(t) > 9 for t in TEXTS]
        assert got.outputs["rank"][0].startswith("[shown order, sample->position: ") and "Verdict:" in got.outputs["judge"][0]
        metrics = panel.take_metrics()
        # 8 pointwise judgements in 2 chunks, 2 groups in 2 chunks: one request per replica and judge
        assert (metrics["reward/judge_requests"], metrics["reward/judge_calls"], metrics["reward/judge_version"]) == (10.0, 4.0, 1.0)
        assert (metrics["reward/judge_parse_failures"], metrics["reward/judge_errors"]) == (2.0, 0.0)
        assert metrics["reward/judge_output_tokens"] == 8 * 1 + 2 * 2 and metrics["reward/judge_latency_s"] > 0
        again = panel.score(_base(8), PROMPTS, TEXTS, [{}] * 8, GROUPS, seed=3)
        assert again.outputs == got.outputs and panel.take_metrics()["reward/judge_cache_hits"] == 10.0
    finally:
        panel.close()


@pytest.mark.ray
@pytest.mark.slow  # 82 s; make test swaps a judge in a training run (tests/reward/test_judges_run.py)
def test_hot_swap_through_serve_reward_under_load(deployed, tmp_path):
    """``rlray serve-reward`` with reward.version=2 and a new rank rule (length mod 5) while two clients judge without
    a cache: no judgement fails, each is version 1's or version 2's, and once the swap returns all are version 2's."""
    from ray import serve

    from rlray.cli import main
    from rlray.reward.judges.client import JudgeClient
    from rlray.reward.judges.deployment import ServeJudgeCaller

    cfg, port = deployed
    seen, errors, stop = [], [], threading.Event()

    def hammer():
        client = JudgeClient("rank", "group", ServeJudgeCaller("rlray-judge-rank"), chunks=2, cache_entries=0)
        while not stop.is_set():
            try:
                seen.append(client.score(PROMPTS, TEXTS, [{}] * 8, GROUPS, seed=len(seen)).scores)
            except BaseException as err:  # noqa: BLE001 - any failure fails the test
                errors.append(err)
        client.close()

    threads = [threading.Thread(target=hammer) for _ in range(2)]
    for t in threads:
        t.start()
    try:
        time.sleep(1.0)
        path = tmp_path / "v2.yaml"
        path.write_text(_cfg(port, 2, "% 5").to_yaml())
        assert main(["serve-reward", str(path), "--detach"]) == 0
        after = len(seen)
        deadline = time.monotonic() + 60
        while len(seen) < after + 2 and time.monotonic() < deadline:
            time.sleep(0.2)
    finally:
        stop.set()
        for t in threads:
            t.join()
        serve.delete("rlray-reward")
    v1 = [float(len(t)) if len(t) <= 9 else None for t in TEXTS]
    v2 = [float(len(t) % 5) for t in TEXTS]
    as_list = [[None if math.isnan(s) else s for s in scores] for scores in seen]
    assert errors == [] and len(seen) > after + 1
    assert all(s in (v1[i], v2[i]) for scores in as_list for i, s in enumerate(scores))  # never a failure
    assert as_list[after:] == [v2] * (len(seen) - after) and v1 in as_list  # version 2 once the swap is done
    del cfg


@pytest.mark.ray
def test_a_slow_or_down_judge_fails_its_rewards_and_scoring_goes_on(deployed, caplog):
    from ray import serve

    from rlray.reward.judges.client import JudgeClient
    from rlray.reward.judges.deployment import ServeJudgeCaller
    from rlray.reward.judges.panel import JudgePanel, JudgeTerm

    slow = JudgeClient("judge", "pointwise", ServeJudgeCaller("rlray-judge-judge"), timeout_s=0.001, attempts=2,
                       backoff_s=0.1)  # fmt: skip
    panel = JudgePanel([JudgeTerm("judge", 1.0, slow)])
    t = time.monotonic()
    got = panel.score(_base(4), PROMPTS[:4], TEXTS[:4], [{}] * 4, GROUPS[:4])
    assert all(math.isnan(r) for r in got.values["reward"]) and time.monotonic() - t < 30
    metrics = panel.take_metrics()  # 2 tries, each cancelled after 1 ms: the 4 samples fail
    assert (metrics["reward/judge_calls"], metrics["reward/judge_retries"], metrics["reward/judge_errors"]) == (2.0, 1.0, 4.0)
    assert "judge 'judge': judge failed 2 times, last with TimeoutError" in caplog.text
    serve.delete("rlray-judge-rank")  # down: its application is gone
    down = JudgeClient("rank", "group", ServeJudgeCaller("rlray-judge-rank"), attempts=2, backoff_s=0.1)
    got = JudgePanel([JudgeTerm("rank", 1.0, down)]).score(_base(4), PROMPTS[:4], TEXTS[:4], [{}] * 4, GROUPS[:4])
    assert all(math.isnan(s) for s in got.values["rank"]) and got.outputs["rank"] == ["no answer from the judge"] * 4
    assert "judge 'rank': identity failed 2 times" in caplog.text
