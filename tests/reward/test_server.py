"""The reward server: sandbox timeouts, the Serve application over a handle and HTTP, and hot swap."""

from __future__ import annotations

import json
import math
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from rlray.config import load_config
from rlray.reward import RewardFunctionError, RewardScorer
from rlray.reward.server import RewardServerError, RewardTimeoutError, ScoreReply, ScoreRequest, ScorerSandbox

REPO = Path(__file__).resolve().parents[2]
LENGTH_FN = f"{REPO}/tests/fixtures/rewards.py:completion_length"
FLAKY_FN = f"{REPO}/tests/fixtures/faulty_rewards.py:flaky"
PROMPTS = ["What is 2 + 3?", [{"role": "user", "content": "What is 10 - 4?"}], "Name a prime."]  # one conversational
COMPLETIONS = ["2 + 3 = 5\n#### 5", "It is 7", "#### 7"]
COLUMNS = [{"answer": "#### 5"}, {"answer": "#### 6", "level": 1}, {"answer": "#### 7"}]  # GSM8K-style solutions


def _functions(format_weight: float) -> str:
    """Returns reward.functions as YAML flow text: length, flaky, GSM8K correctness and format."""
    return (f"[{{function: '{LENGTH_FN}', weight: 1.0}}, {{function: '{FLAKY_FN}', weight: 1.0}}, "
            f"{{function: gsm8k_correct, weight: 1.0}}, {{function: gsm8k_format, weight: {format_weight}}}]")  # fmt: skip


def test_a_proxy_slower_than_serve_start_s_wait_is_a_warning_and_the_run_goes_on(monkeypatch, caplog):
    """serve.start waits 60 s for its HTTP proxy, then raises TimeoutError (seen with four test suites on 2 cores);
    start_serve then connects to the running controller (a second serve.start), since the run uses handles."""
    from ray import serve

    from rlray.reward.server import start_serve

    calls = []

    def fake_start(**kwargs):
        calls.append(kwargs)
        if len(calls) == 1:
            raise TimeoutError("HTTP proxies not available after 60s.")

    monkeypatch.setattr(serve, "start", fake_start)
    monkeypatch.delenv("RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S", raising=False)
    with caplog.at_level("WARNING", logger="rlray.reward.server"):
        start_serve(host="127.0.0.1", port=8123)
    assert calls == [{"http_options": {"host": "127.0.0.1", "port": 8123}, "controller_options": {
        "runtime_env": {"env_vars": {"RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S": "60"}}}},
                     {"http_options": {"host": "127.0.0.1", "port": 8123}}]
    assert "HTTP proxy is not up yet (HTTP proxies not available after 60s.)" in caplog.text


def test_score_request_checks_lengths():
    with pytest.raises(ValueError, match=r"prompts \(1\), completions \(2\), columns \(2\) and completion_ids \(None\)"):
        ScoreRequest(prompts=["a"], completions=["b", "c"], columns=[{}, {}])
    with pytest.raises(ValueError, match=r"completion_ids \(1\) must have the same length"):
        ScoreRequest(prompts=["a", "b"], completions=["b", "c"], columns=[{}, {}], completion_ids=[[1]])
    request = ScoreRequest.model_validate_json(json.dumps({"prompts": PROMPTS, "completions": COMPLETIONS, "columns": COLUMNS}))
    assert (request.prompts, request.columns, request.completion_ids) == (PROMPTS, COLUMNS, None)  # messages stay messages


def test_score_reply_json_keeps_failed_and_skipped_apart():
    reply = ScoreReply(version=2, scores={"reward": [1.5, math.nan, 0.25], "flaky": [0.5, math.nan, None]})
    text = reply.model_dump_json()
    assert json.loads(text) == {"version": 2, "scores": {"reward": [1.5, "NaN", 0.25], "flaky": [0.5, "NaN", None]},
                                "failures": [], "hangs": []}
    back = ScoreReply.model_validate_json(text).scores
    assert back["reward"][0] == 1.5 and math.isnan(back["reward"][1]) and back["flaky"][2] is None


def test_sandbox_times_out_restarts_and_keeps_serving():
    fn = f"{REPO}/tests/fixtures/server_rewards.py:misbehaving"
    functions = [{"function": "gsm8k_correct", "weight": 1.0}, {"function": "gsm8k_format", "weight": 0.2},
                 {"function": fn, "weight": 0.5}]  # fmt: skip
    sandbox = ScorerSandbox({"functions": functions, "columns": ["answer", "level"]}, timeout_s=3.0)
    try:
        got = sandbox.score(PROMPTS, COMPLETIONS, COLUMNS)
        # 1.0 * correct + 0.2 * format + 0.5 * misbehaving(=1): [1 + 0.2 + 0.5, 0 + 0 + 0.5, 1 + 0.2 + 0.5]
        assert got["reward"] == [1.0 + 0.2 + 0.5, 0.0 + 0.0 + 0.5, 1.0 + 0.2 + 0.5]
        t = time.monotonic()
        with pytest.raises(RewardTimeoutError, match=r"reward.server.timeout_s=3 s"):
            sandbox.score(["p"], ["HANG"], [{"answer": "#### 1"}])
        assert time.monotonic() - t < 30  # killed at the timeout, not after the 60 s sleep
        with pytest.raises(RewardFunctionError, match="misbehaving'\\) returned 0 values for 1 completions"):
            sandbox.score(["p"], ["BAD"], [{"answer": "#### 1"}])
        assert sandbox.score(PROMPTS, COMPLETIONS, COLUMNS)["reward"] == got["reward"]
    finally:
        sandbox.close()


def test_sandbox_reports_a_scorer_that_cannot_be_built():
    with pytest.raises(RewardServerError, match="could not be built: RewardFunctionError"):
        ScorerSandbox({"functions": [{"function": "no_such_module:fn"}]}, 5.0)


# --------------------------------------------------------------------------------------------
# The Serve application (one per module)
# --------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def server(ray_session, tmp_path_factory):
    """Deploys rlray-reward (version 1: length, flaky and the GSM8K terms) with HTTP on a free loopback port; yields (config path, port)."""
    from ray import serve

    from rlray.cli import main
    from rlray.rollout.weight_sync import free_port

    port = free_port()
    path = tmp_path_factory.mktemp("reward") / "reward.yaml"
    path.write_text(
        "reward:\n"
        f"  functions: {_functions(0.2)}\n"
        f"  server: {{enabled: true, port: {port}, max_batch_size: 8}}\n"
    )
    serve.shutdown()  # HTTP options are cluster-wide and fixed at Serve's first start
    assert main(["serve-reward", str(path), "--detach"]) == 0
    yield path, port
    serve.delete("rlray-reward")


def _local(cfg_overrides: list[str], path: Path) -> dict:
    from rlray.run.build import scorer_kwargs

    scorer = RewardScorer(**scorer_kwargs(load_config(path, cfg_overrides)))
    try:
        return scorer.score(PROMPTS, COMPLETIONS, COLUMNS)
    finally:
        scorer.close()


def _post(port: int, body: dict) -> tuple[int, dict]:
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}/score", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


@pytest.mark.ray
def test_handle_and_http_give_the_local_scores(server):
    from rlray.reward.server import ServeRewardClient

    path, port = server
    expected = _local([], path)
    got = ServeRewardClient().score(PROMPTS, COMPLETIONS, COLUMNS)
    assert got.version == 1
    assert got.values == expected  # the same scorer, pickled floats: exact
    status, reply = _post(port, {"prompts": PROMPTS, "completions": COMPLETIONS, "columns": COLUMNS})
    assert status == 200 and reply["version"] == 1
    assert reply["scores"] == expected  # JSON round-trips Python floats exactly
    # flaky fails "NAN" (NaN, written "NaN") and skips "NONE" (None, written null); the reward of a failed sample is NaN
    status, reply = _post(port, {"prompts": ["p", "p"], "completions": ["NAN", "NONE"], "columns": [{"answer": "1"}, {}]})
    assert status == 200 and reply["scores"]["flaky"] == ["NaN", None] and reply["scores"]["reward"][0] == "NaN"
    assert reply["scores"]["reward"][1] == 0.04 + 0.0 + 0.2 * 0.0  # length 4/100; no answer column: correct skipped
    handle = ServeRewardClient().score(["p", "p"], ["NAN", "NONE"], [{"answer": "1"}, {}]).values
    assert math.isnan(handle["flaky"][0]) and handle["flaky"][1] is None and handle["gsm8k_correct"] == [0.0, None]
    status, reply = _post(port, {"prompts": ["a"], "completions": ["b", "c"], "columns": [{}]})
    assert status == 422 and "must have the same length" in json.dumps(reply)


@pytest.mark.ray
def test_serve_gives_its_proxy_a_minute_to_start(server):
    """CI (stop 49): on a loaded machine Serve's controller killed a proxy that had not started in its default 5 s,
    and serve.start failed (ActorDiedError). rlray.reward.server.start_serve starts the controller with 60 s."""
    from ray._private.state import actors  # GCS's table: the tests' Ray has no dashboard for ray.util.state

    (pid,) = [a["Pid"] for a in actors().values() if a["ActorClassName"] == "ServeController" and a["State"] == "ALIVE"]
    environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    assert b"RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S=60" in environ


@pytest.mark.ray
def test_a_hang_report_finds_the_live_replica_and_its_stacks(server):
    """rlray.hangs.serve_stacks finds a Serve application's replicas by Ray Serve's actor names (SERVE_REPLICA::<app>#)
    and reads each one's Python stacks: the reward replica enables the dump on SIGUSR2 when it starts."""
    from rlray.hangs import serve_stacks

    (where, stacks), = serve_stacks("rlray-reward", timeout_s=30.0)
    assert where.name.startswith("SERVE_REPLICA::rlray-reward#") and where.pid > 0
    assert "most recent call first" in stacks and "(no stacks" not in stacks, stacks  # faulthandler's own words
    assert serve_stacks("rlray-no-such-app") == []


@pytest.mark.ray
def test_a_user_function_killed_in_the_replica_reaches_the_runs_watch_with_its_stacks(server):
    """flaky sleeps 60 s on HANG, past its timeout_s (10 s) inside the replica's scorer process: the reply carries the
    report, with the stacks taken from the function's process before the kill, and the client hands it to the watch."""
    from rlray.hangs import HangWatch
    from rlray.reward.server import ServeRewardClient

    alerts: list[str] = []
    watch = HangWatch("restart", alert=alerts.append)
    got = ServeRewardClient(on_hang=watch.killed).score(["p"], ["HANG"], [{"answer": "1"}])
    assert math.isnan(got.values["flaky"][0]) and len(got.hangs) == 1 and watch.hangs == 1
    assert alerts[0].startswith("hang: reward function 'flaky' (pid ") and "reward.functions[1].timeout_s=10 s" in alerts[0]
    assert "in flaky" in alerts[0]  # faulthandler's line of the sleeping frame, from the killed process


@pytest.mark.ray
def test_hot_swap_serves_every_request(server):
    """Redeploys version 2 (gsm8k_format weight 0.7) through the CLI while 3 clients score; no request fails."""
    from rlray.cli import main
    from rlray.reward.server import ServeRewardClient

    path, _ = server
    client = ServeRewardClient()
    seen: list[tuple[float, int, list[float]]] = []
    errors: list[BaseException] = []
    stop = threading.Event()

    def hammer():
        while not stop.is_set():
            try:
                got = client.score(PROMPTS, COMPLETIONS, COLUMNS)
                seen.append((time.monotonic(), got.version, got.values["reward"]))
            except BaseException as err:  # noqa: BLE001 - any failure fails the test
                errors.append(err)

    threads = [threading.Thread(target=hammer) for _ in range(3)]
    for t in threads:
        t.start()
    try:
        time.sleep(1.0)
        assert main(["serve-reward", str(path), "reward.version=2", f"reward.functions={_functions(0.7)}", "--detach"]) == 0
        deadline = time.monotonic() + 60
        while not any(v == 2 for _, v, _ in seen) and time.monotonic() < deadline:
            time.sleep(0.2)
        time.sleep(0.5)
    finally:
        stop.set()
        for t in threads:
            t.join()
    assert errors == []
    versions = [v for _, v, _ in sorted(seen)]
    assert versions[0] == 1 and versions[-1] == 2
    assert versions == sorted(versions)  # one replica: once swapped, never back
    v1 = _local([], path)["reward"]
    v2 = _local([f"reward.functions={_functions(0.7)}"], path)["reward"]
    assert v1 != pytest.approx(v2)
    assert all(r == pytest.approx(v1 if v == 1 else v2) for _, v, r in seen)


@pytest.mark.ray
def test_a_killed_replica_is_restarted_and_scoring_goes_on(server):
    """ray.kill of the replica actor while a client scores in a loop: Serve starts a new replica, the client
    retries (tenacity back-off) and every request gets its scores."""
    import ray
    from ray._private.state import actors as list_actors

    from rlray.reward.server import ServeRewardClient

    def replicas() -> dict[str, str]:
        return {a["ActorID"]: a["Name"] for a in list_actors().values()
                if a["State"] == "ALIVE" and a["ActorClassName"].startswith("ServeReplica:rlray-reward")}  # fmt: skip

    before = replicas()
    assert len(before) == 1
    client = ServeRewardClient(attempts=10, timeout_s=30.0, backoff_s=0.5)
    answers, errors, stop = [], [], threading.Event()

    def score_loop():
        while not stop.is_set():
            try:
                answers.append((time.monotonic(), client.score(PROMPTS, COMPLETIONS, COLUMNS).values["reward"]))
            except BaseException as err:  # noqa: BLE001 - any failure fails the test
                errors.append(err)

    thread = threading.Thread(target=score_loop)
    thread.start()
    time.sleep(1.0)
    killed_at = time.monotonic()
    ray.kill(ray.get_actor(next(iter(before.values())), namespace="serve"), no_restart=True)
    deadline = time.monotonic() + 120
    while not (replicas().keys() - before.keys()) and time.monotonic() < deadline:
        time.sleep(0.5)
    after = [t for t, _ in answers if t > killed_at]
    while len(after) < 3 and time.monotonic() < deadline:
        time.sleep(0.5)
        after = [t for t, _ in answers if t > killed_at]
    stop.set()
    thread.join(timeout=120)
    assert errors == []
    assert len(replicas().keys() - before.keys()) == 1  # a new replica, started by Serve
    assert len(after) >= 3 and all(len(r) == len(PROMPTS) for _, r in answers)
