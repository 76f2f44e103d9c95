"""No silent hang for the reward and judge calls, without Ray: a Serve replica that sleeps 600 s is met by the
client's own timeout (``reward.server.client_timeout_s``, ``reward.judges[i].timeout_s``), each try past it is
reported (an ``rlray: hang`` line and an alert with the replicas' stacks, ``HangWatch.timed_out``), then the existing
action runs: retries, then failed (NaN) judge scores or ``RewardServerUnavailableError``; under
``watchdog.on_hang=stop`` the first report raises ``HangError`` and the step stays in flight."""

from __future__ import annotations

import math
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from rlray.hangs import ActorProcess, HangError, HangWatch
from rlray.reward.judges.client import JudgeClient
from rlray.reward.server import RewardServerUnavailableError, ServeRewardClient
from rlray.run.build import serve_timeouts

REPLICA_STACKS = 'Thread 0x01 (most recent call first):\n  File "judge.py", line 9 in injected_hang\n'
NODE = "ab" * 28


class HungReplica:
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

    # a DeploymentHandle: handle.score.remote(body).result(timeout_s=...)
    @property
    def score(self):
        return self

    def remote(self, body):
        return self

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
