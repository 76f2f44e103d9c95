"""No silent hang for the reward and judge calls, without Ray: a Serve replica that sleeps 600 s is met by the
client's own timeout (``reward.server.client_timeout_s``, ``reward.judges[i].timeout_s``), each try past it is
reported (an ``rlray: hang`` line and an alert with the replicas' stacks, ``HangWatch.timed_out``), then the existing
action runs: retries, then failed (NaN) judge scores or ``RewardServerUnavailableError``; under
``watchdog.on_hang=stop`` the first report raises ``HangError`` and the step stays in flight. A user reward function
and the reward server's scorer process killed at their own timeouts are reported with the stacks taken from the stuck
process before the kill (``HangWatch.killed``), then the run goes on, or stops under ``watchdog.on_hang=stop``."""

from __future__ import annotations

import math
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from rlray.config import config_from_dict
from rlray.hangs import ActorProcess, Hang, HangError, HangWatch
from rlray.reward.judges.client import JudgeClient
from rlray.reward.server import (
    RewardServerUnavailableError,
    RewardTimeoutError,
    ScoreReply,
    ScorerSandbox,
    ServeRewardClient,
)
from rlray.run.build import local_reward_client, serve_timeouts

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"

REPLICA_STACKS = 'Thread 0x01 (most recent call first):\n  File "judge.py", line 9 in injected_hang\n'
NODE = "ab" * 28


class HandleChain:
    """The call chain of a Serve DeploymentHandle, ``handle.score.remote(body).result(timeout_s=...)``, ending in the
    subclass's ``result``."""

    @property
    def score(self):
        return self

    def remote(self, body):
        return self


class HungReplica(HandleChain):
    """A Serve application whose one replica never answers: each request runs ``injected_hang`` (600 s, released
    at teardown) and the caller waits on it at most ``timeout_s``, as ``DeploymentResponse.result`` does."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="replica")
        self.requests = 0

    def injected_hang(self) -> None:
        self.release.wait(600.0)

    def call(self, timeout_s: float):
        self.requests += 1
        return self.pool.submit(self.injected_hang).result(timeout=timeout_s)  # TimeoutError past timeout_s

    # JudgeCaller
    def identity(self, timeout_s: float):
        return 1, "def0"

    def judge(self, request, timeout_s: float):
        return self.call(timeout_s)

    def result(self, timeout_s: float):
        return self.call(timeout_s)

    def stacks(self, app_name: str, timeout_s: float) -> list[tuple[ActorProcess, str]]:
        return [(ActorProcess(f"SERVE_REPLICA::{app_name}#Judge#x1", 4242, NODE), REPLICA_STACKS)]

    def close(self) -> None:
        self.release.set()
        self.pool.shutdown(wait=True)


@pytest.fixture
def replica():
    replica = HungReplica()
    yield replica
    replica.close()


def judge_client(replica: HungReplica, watch: HangWatch, attempts: int = 2) -> JudgeClient:
    then = f"retrying (reward.judges[0].attempts={attempts} tries in all; then its samples' rewards fail, NaN, ...)"
    return JudgeClient("j", "pointwise", replica, timeout_s=0.5, attempts=attempts, backoff_s=0.0, cache_entries=0,
                       on_timeout=serve_timeouts(watch, "rlray-judge-j", "judge 'j'", "reward.judges[0].timeout_s",
                                                 0.5, then))


def test_a_hung_judge_call_is_reported_each_try_with_the_replica_stacks_then_its_samples_fail(replica, caplog):
    alerts: list[str] = []
    watch = HangWatch("restart", alert=alerts.append, replica_stacks=replica.stacks)
    client = judge_client(replica, watch)
    t0 = time.monotonic()
    got = client.score(["p0", "p1"], ["a", "bb"], [{}, {}])
    elapsed = time.monotonic() - t0
    assert all(math.isnan(s) for s in got.scores) and replica.requests == 2
    assert elapsed < 2 * 0.5 + 3.0  # two tries of 0.5 s each, then the report: no wait on the 600 s sleep
    assert watch.hangs == 2 and watch.restarts == 0 and len(alerts) == 2
    head = alerts[0].splitlines()[0]
    assert head.startswith("hang: judge 'j' (SERVE_REPLICA::rlray-judge-j#Judge#x1) (pid 4242, node abababababab) "
                           "has run judge for 0.")
    assert head.endswith("s, past reward.judges[0].timeout_s=0.5 s; retrying (reward.judges[0].attempts=2 tries in "
                         "all; then its samples' rewards fail, NaN, ...)")
    assert alerts[0].endswith("stacks of pid 4242:\n" + REPLICA_STACKS.rstrip())
    assert sum(r.message.startswith("rlray: hang: judge 'j'") for r in caplog.records) == 2
    stats = client.take_stats()
    assert (stats.calls, stats.retries, stats.errors) == (2, 1, 2)


def test_under_stop_a_hung_judge_call_stops_the_step_at_the_first_report(replica):
    alerts: list[str] = []
    watch = HangWatch("stop", alert=alerts.append, replica_stacks=replica.stacks)
    with pytest.raises(HangError, match=r"judge 'j' .* has run judge for 0\.\d s, past reward\.judges\[0\]\.timeout_s"
                                        r"=0\.5 s; stopping the run[\s\S]*in injected_hang"):
        judge_client(replica, watch, attempts=3).score(["p0"], ["a"], [{}])
    assert replica.requests == 1 and len(alerts) == 1 and watch.hangs == 1


def reward_client(replica: HungReplica, watch: HangWatch) -> ServeRewardClient:
    return ServeRewardClient("rlray-reward", attempts=2, timeout_s=0.5, backoff_s=0.0, handle=replica,
                             on_timeout=serve_timeouts(watch, "rlray-reward", "reward server 'rlray-reward'",
                                                       "reward.server.client_timeout_s", 0.5, "retrying (...)"))


def test_a_hung_reward_request_is_reported_each_try_then_the_server_counts_as_unavailable(replica):
    alerts: list[str] = []
    watch = HangWatch("restart", alert=alerts.append, replica_stacks=replica.stacks)
    t0 = time.monotonic()
    with pytest.raises(RewardServerUnavailableError, match="did not answer: score failed 2 times"):
        reward_client(replica, watch).score(["p"], ["c"], [{}])
    assert time.monotonic() - t0 < 2 * 0.5 + 3.0 and replica.requests == 2
    assert len(alerts) == 2 and all("past reward.server.client_timeout_s=0.5 s; retrying (...)" in a for a in alerts)
    assert alerts[1].startswith("hang: reward server 'rlray-reward' (SERVE_REPLICA::rlray-reward#Judge#x1) (pid 4242")
    assert "has run score for 0." in alerts[1] and alerts[1].endswith("in injected_hang")


def test_under_stop_a_hung_reward_request_is_not_retried(replica):
    watch = HangWatch("stop", replica_stacks=replica.stacks)
    with pytest.raises(HangError, match=r"reward server 'rlray-reward' .* stopping the run"):
        reward_client(replica, watch).score(["p"], ["c"], [{}])
    assert replica.requests == 1 and watch.hangs == 1


def test_the_report_of_an_application_names_each_replica_or_says_none_is_known():
    two = [(ActorProcess("SERVE_REPLICA::app#D#a", 11, NODE), "Thread A\n"),
           (ActorProcess("SERVE_REPLICA::app#D#b", 12, ""), "Thread B\n")]
    hang = HangWatch(replica_stacks=lambda app, t: two).timed_out("app", "judge 'x'", "judge", 3.0, 2.0, "k", "then")
    assert hang.process == ActorProcess("app", 0, "") and hang.then == "then"
    assert hang.stacks == ("replica SERVE_REPLICA::app#D#a (pid 11, node abababababab):\nThread A\n"
                           "replica SERVE_REPLICA::app#D#b (pid 12, node ?):\nThread B")
    none = HangWatch(replica_stacks=lambda app, t: []).timed_out("app", "judge 'x'", "judge", 3.0, 2.0, "k", "then")
    assert none.stacks == "(no stacks: the GCS knows no live replica of app)"
    assert none.headline() == "hang: judge 'x' (pid ?, node ?) has run judge for 3.0 s, past k=2 s; then"


def flaky_client(action: str, alerts: list[str]):
    """A run's in-process reward client (``build.local_reward_client``) over faulty_rewards.flaky (sleeps 60 s on a
    completion holding HANG) under reward.functions[0].timeout_s=1 s, reporting to a ``HangWatch`` of ``action``."""
    cfg = config_from_dict({"reward": {"functions": [{"function": f"{FIXTURES}/faulty_rewards.py:flaky",
                                                      "timeout_s": 1.0}]}})
    watch = HangWatch(action, alert=alerts.append)
    return local_reward_client(cfg, None, watch), watch


def test_a_user_function_killed_at_its_timeout_is_reported_with_its_stacks_then_its_samples_fail(caplog):
    alerts: list[str] = []
    client, watch = flaky_client("restart", alerts)
    try:
        t0 = time.monotonic()
        got = client.score(["p", "p"], ["ok", "HANG"], [{}, {}])
        assert time.monotonic() - t0 < 1.0 + 10.0  # the timeout, the stacks and a fresh process; not the 60 s sleep
        assert all(math.isnan(v) for v in got.values["reward"])  # the whole call fails (scorer module docstring)
        assert got.failures[1] == "reward function 'flaky': reward function flaky: a call took longer than 1 s; the " \
                                  "process was killed"
        assert (watch.hangs, watch.restarts, len(alerts)) == (1, 1, 1)
        head, stacks = alerts[0].split("\n", 1)
        assert re.fullmatch(r"hang: reward function 'flaky' \(pid \d+, node \?\) has run score of 2 completions for "
                            r"1\.0 s, past reward\.functions\[0\]\.timeout_s=1 s; its process was killed and "
                            r"restarted; the 2 samples of the call fail \(NaN, reward/failed\) and the run goes on", head)
        # taken from the stuck process before the kill: the sleep inside flaky, called by the sandbox's serving loop
        assert re.search(r'File ".*faulty_rewards\.py", line 13 in flaky\n', stacks), stacks
        assert any(r.message.startswith("rlray: hang: reward function 'flaky'") for r in caplog.records)
        assert client.score(["p"], ["ok"], [{}]).values["reward"] == [0.2]  # a fresh process serves on
    finally:
        client.close()


def test_under_stop_a_user_function_killed_at_its_timeout_stops_the_step():
    alerts: list[str] = []
    client, watch = flaky_client("stop", alerts)
    try:
        with pytest.raises(HangError, match=r"reward function 'flaky' .* past reward\.functions\[0\]\.timeout_s=1 s; "
                                            r"stopping the run[\s\S]*line 13 in flaky"):
            client.score(["p"], ["HANG"], [{}])
        assert (watch.hangs, len(alerts)) == (1, 1)
    finally:
        client.close()


class RaisingHandle(HandleChain):
    """A DeploymentHandle whose ``score`` replies ``reply`` or raises ``error`` (as the replica's ``RewardTimeoutError``
    reaches the caller)."""

    def __init__(self, reply: dict | None = None, error: BaseException | None = None) -> None:
        self.reply, self.error = reply, error

    def result(self, timeout_s: float):
        if self.error is not None:
            raise self.error
        return self.reply


@pytest.mark.parametrize("action", ["restart", "stop"])
def test_the_scorer_process_killed_at_reward_server_timeout_s_is_reported_with_its_stacks(action):
    functions = [{"function": f"{FIXTURES}/server_rewards.py:misbehaving", "timeout_s": 30.0}]
    sandbox = ScorerSandbox({"functions": functions}, timeout_s=2.0)
    try:
        with pytest.raises(RewardTimeoutError, match=r"reward\.server\.timeout_s=2 s") as err:
            sandbox.score(["p"], ["HANG"], [{}])
    finally:
        sandbox.close()
    hang = err.value.hang
    assert (hang.who, hang.key, hang.deadline_s, hang.process.name) == (
        "reward scorer", "reward.server.timeout_s", 2.0, "rlray-reward scorer")
    # the scorer process waits on the user function's own process: its frames name the scorer's call
    assert "in score_with_failures" in hang.stacks and "in score" in hang.stacks
    assert "stacks of pid" in str(err.value)  # the error itself carries them (a caller without a watch)
    alerts: list[str] = []
    watch = HangWatch(action, alert=alerts.append)
    client = ServeRewardClient(attempts=3, timeout_s=5.0, backoff_s=0.0, handle=RaisingHandle(error=err.value),
                               on_hang=watch.killed)
    with pytest.raises(HangError if action == "stop" else RewardTimeoutError):
        client.score(["p"], ["HANG"], [{}])
    assert watch.hangs == 1 and len(alerts) == 1 and "in score_with_failures" in alerts[0]
    assert alerts[0].startswith("hang: reward scorer (pid ")
    assert ("stopping the run" in alerts[0]) == (action == "stop")


def test_a_reply_carries_the_user_functions_killed_in_the_replica_to_the_runs_watch():
    hang = Hang("reward function 'f'", "score of 1 completions", 1.0, 1.0, "reward.functions[0].timeout_s",
                ActorProcess("rlray-reward function f", 77, ""), 'File "f.py", line 3 in injected_hang\n', "restart",
                "its process was killed and restarted")
    reply = {"version": 2, "scores": {"reward": [math.nan]}, "failures": ["timed out"], "hangs": [hang]}
    assert ScoreReply.model_validate_json(ScoreReply.model_validate(reply).model_dump_json()).hangs == [hang]  # HTTP
    alerts: list[str] = []
    watch = HangWatch("restart", alert=alerts.append)
    got = ServeRewardClient(handle=RaisingHandle(reply=reply), on_hang=watch.killed).score(["p"], ["c"], [{}])
    assert got.hangs == [hang] and watch.hangs == 1
    assert alerts == [f"{hang.headline()}\nstacks of pid 77:\nFile \"f.py\", line 3 in injected_hang"]
