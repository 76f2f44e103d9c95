"""The agent gateway end to end without Ray or engines: agents (tests/fixtures/agents.py) call a real HTTP gateway through
the real ``openai`` client, a scripted engine answers (``ScriptedSampler``), and the host records the token sequences.
On SmolLM2's real tokenizer (the tiny-random model's)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import httpx
import pytest

from rlray.envs.agents import AgentRequest
from rlray.envs.agents.agent_host import AgentBatch, AgentHost
from rlray.envs.agents.gateway import split_tool_calls
from rlray.envs.limits import EpisodeLimits
from rlray.observe.samples import mask_runs

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "agents.py"
NAMES = ["tool_agent", "rewriting_agent", "parallel_agent", "raising_agent", "hanging_agent", "busy_agent", "greedy_agent", "text_agent",
         "streaming_agent", "sync_agent", "silent_agent", "bad_return_agent"]


@pytest.fixture(scope="module")
def host(tiny_model_path):
    from tests.fixtures.agents import ScriptedSampler

    h = AgentHost({}, agents={n: f"{FIXTURE}:{n}" for n in NAMES}, model_dir=tiny_model_path, chat_template="smollm2-tools",
                  sampler_factory=ScriptedSampler, max_turns=6, max_episode_tokens=1024, step_timeout_s=60.0,
                  episode_timeout_s=120.0)
    yield h
    h.shutdown()


@pytest.fixture(scope="module")
def strict_host(tiny_model_path):
    """A host whose agents may spend only 1 s between gateway calls (a hang is caught fast)."""
    from tests.fixtures.agents import ScriptedSampler

    h = AgentHost({}, agents={n: f"{FIXTURE}:{n}" for n in NAMES}, model_dir=tiny_model_path, chat_template="smollm2-tools",
                  sampler_factory=ScriptedSampler, max_turns=6, max_episode_tokens=1024, step_timeout_s=1.0,
                  episode_timeout_s=30.0)
    yield h
    h.shutdown()


def run(host, agent, rows, *, actors=2, delay=None, max_new_tokens=64, min_version=None):
    return host.run_agents(AgentBatch([AgentRequest(f"{agent}-{time.monotonic_ns()}-{i}", agent, row, i)
                                       for i, row in enumerate(rows)], [None] * actors, delay, max_new_tokens, min_version))


def test_a_tool_calling_agent_trains_on_exactly_what_it_was_sent_and_received(host, tiny_model_path):
    from tests.fixtures.agents import ADD_TOOL, FINAL, tokenizer, tool_call_text

    tok = tokenizer()
    transcript = []
    (reply,) = run(host, "tool_agent", [{"prompt": "What is 2 + 2? calls=3", "transcript": transcript}])
    assert (reply.stop_reason, reply.reward, reply.message) == ("done", 1.0, "")
    assert (reply.calls, reply.drift, reply.tool_calls, reply.tool_errors, reply.refused) == (4, 0, 3, 0, 0)
    (seg,) = reply.segments
    (messages,) = transcript
    assert [m["role"] for m in messages] == ["user", "assistant", "tool", "assistant", "tool", "assistant", "tool", "assistant"]
    # the trained sequence decodes to the template's rendering of the agent's final conversation (what it sent), the
    # last assistant turn included (what it received), up to the newline the template writes after the final <|im_end|>
    rendered = tok.apply_chat_template(messages, tools=[ADD_TOOL], tokenize=False)
    assert tok.decode(seg.prompt_ids + seg.response_ids) + "\n" == rendered
    # the loss mask covers exactly the sampled tokens: the scripted engine's four answers, in order, with their logprobs
    answers = [tool_call_text("add", {"a": k, "b": 2}) for k in range(3)] + [FINAL]
    sampled = [tok(a, add_special_tokens=False)["input_ids"] + [tok.eos_token_id] for a in answers]
    runs = [(a, b) for a, b, on in mask_runs(seg.loss_mask) if on]
    assert [seg.response_ids[a:b] for a, b in runs] == sampled
    assert [seg.logprobs[a:b] for a, b in runs] == [[-(i + 1) / 100 for i in range(len(s))] for s in sampled]
    assert all(lp == 0.0 for lp, m in zip(seg.logprobs, seg.loss_mask, strict=True) if not m)
    assert seg.num_turns == 4 and seg.policy_versions == [7, 7, 7, 7]


def test_an_agent_s_calls_across_weight_updates_keep_each_token_s_version_and_logprob(host):
    """Partial rollouts: the scripted engine takes a weight update inside each call, after its first token (the batch
    was sent at version 4). The agent's 3 calls sample under versions 4 then 5, 5 then 6, 6 then 7; the tool results
    between them (loss mask off, logprob 0) keep the version of the token before them; each sampled token keeps its
    own behaviour logprob."""
    from tests.fixtures.agents import FINAL, tokenizer, tool_call_text

    tok = tokenizer()
    (reply,) = run(host, "tool_agent", [{"prompt": "What is 2 + 2? calls=2"}], min_version=4)
    assert (reply.stop_reason, reply.calls, reply.drift) == ("done", 3, 0)
    (seg,) = reply.segments
    answers = [tool_call_text("add", {"a": k, "b": 2}) for k in range(2)] + [FINAL]
    n0, n1, n2 = (len(tok(a, add_special_tokens=False)["input_ids"]) + 1 for a in answers)  # + EOS
    runs = mask_runs(seg.loss_mask)
    assert [(b - a, on) for a, b, on in runs][0::2] == [(n0, True), (n1, True), (n2, True)]
    o1, o2 = (b - a for a, b, _ in runs[1::2])  # the two tool results, as the template renders them
    assert seg.versions == ([4] + [5] * (n0 - 1) + [5] * o1 + [5] + [6] * (n1 - 1) + [6] * o2
                            + [6] + [7] * (n2 - 1))
    assert seg.policy_versions == [4, 5, 6] and len(seg.versions) == len(seg.response_ids)
    lp = [-(i + 1) / 100 for i in range(max(n0, n1, n2))]  # the scripted engine's logprobs, per call
    assert seg.logprobs == lp[:n0] + [0.0] * o1 + lp[:n1] + [0.0] * o2 + lp[:n2]
    (plain,) = run(host, "tool_agent", [{"prompt": "What is 2 + 2? calls=2"}])  # no partial rollouts: one version
    assert plain.segments[0].versions == [7] * len(plain.segments[0].response_ids)


def test_a_history_rewrite_cuts_segments_each_token_exact(host):
    (reply,) = run(host, "rewriting_agent", [{"prompt": "Sum up. calls=2"}])
    assert reply.stop_reason == "done" and reply.drift == 2 and len(reply.segments) == 3
    assert [s.num_turns for s in reply.segments] == [1, 1, 1]
    for seg in reply.segments:  # each segment: its own prompt, one sampled turn, nothing else
        assert seg.loss_mask == [True] * len(seg.response_ids) and seg.observation_tokens == 0


def test_parallel_calls_of_one_episode_are_answered_one_after_another_and_counted(host):
    (reply,) = run(host, "parallel_agent", [{"prompt": "Twice."}], delay=1.0)  # the second comes while the first is
    assert (reply.stop_reason, reply.reward, reply.calls) == ("done", 2.0, 2)  # answered (1 s): env/agent_parallel_calls
    assert reply.parallel_calls == 1
    assert reply.drift == 1 and [s.num_turns for s in reply.segments] == [1, 1]  # the same messages twice: 2 segments
    assert reply.segments[0].prompt_ids == reply.segments[1].prompt_ids


def test_many_concurrent_agents_share_engine_calls(host):
    from tests.fixtures.agents import ScriptedSampler

    ScriptedSampler.calls.clear()
    replies = run(host, "tool_agent", [{"prompt": f"Add {i}. calls=2"} for i in range(40)], actors=2, delay=0.02)
    assert all(r.stop_reason == "done" and r.reward == 1.0 and r.parallel_calls == 0 for r in replies)  # one at a time
    prompts = sum(n for _, n in ScriptedSampler.calls)
    assert prompts == 40 * 3
    assert len(ScriptedSampler.calls) < prompts / 4  # batched: the concurrent agents' calls go together
    assert {a for a, _ in ScriptedSampler.calls} == {0, 1}  # pinned per episode over both actors


def test_each_turn_of_agents_in_step_is_one_engine_call(host):
    """Agents that call again right after their answer wait for each other (env.agent_batching: lockstep, the default):
    8 agents x 3 calls on one actor whose calls take 1 s are 3 engine calls of 8 prompts, not a straggler call each."""
    from tests.fixtures.agents import ScriptedSampler

    ScriptedSampler.calls.clear()
    replies = run(host, "tool_agent", [{"prompt": f"Add {i}. calls=2"} for i in range(8)], actors=1, delay=1.0)
    assert all(r.stop_reason == "done" for r in replies)
    assert ScriptedSampler.calls == [(0, 8)] * 3


def test_limits_end_episodes_and_later_calls_are_refused(host):
    errors = []
    (reply,) = run(host, "greedy_agent", [{"prompt": "Go", "errors": errors}])
    assert (reply.stop_reason, reply.reward, reply.calls) == ("max_turns", 0.5, 6) and errors == ["max_turns"]
    # the episode has ended: a late call is refused with a clear error
    status, body = post(host, reply.key, "chat/completions", {"model": "policy", "messages": [{"role": "user", "content": "x"}]})
    assert status == 410 and body["error"]["code"] == "episode_ended" and "has ended (max_turns)" in body["error"]["message"]
    status, body = post(host, "no-such-episode", "chat/completions", {"messages": []})
    assert status == 404 and body["error"]["code"] == "unknown_episode"
    errors.clear()  # the conversation grows each turn: with 950 new tokens a call, a later call does not fit in 1024
    (reply,) = run(host, "greedy_agent", [{"prompt": "Go", "errors": errors}], max_new_tokens=950)
    assert (reply.stop_reason, reply.reward) == ("max_episode_tokens", 0.5) and errors == ["context_length_exceeded"]
    (seg,) = reply.segments  # it holds the refused call's prompt (the agent's last messages appended, never sampled)
    assert seg.num_turns == reply.calls >= 1 and len(seg.prompt_ids) + len(seg.response_ids) + 950 > 1024
    assert not seg.loss_mask[-1]
    errors.clear()  # a first prompt that leaves no room fails the episode, as an environment's does
    (reply,) = run(host, "greedy_agent", [{"prompt": "Go", "errors": errors}], max_new_tokens=1024)
    assert (reply.stop_reason, reply.reward, reply.segments) == ("prompt_too_long", None, [])
    assert "exceeds env.max_episode_tokens=1024" in reply.message


def post(host, key, route, body):
    got = httpx.post(f"{host.gateway_url()}/{key}/v1/{route}", json=body, timeout=10)
    return got.status_code, got.json()


@pytest.mark.parametrize(("agent", "stop", "needle"), [
    ("raising_agent", "env_error", "ValueError: the agent broke"),
    ("hanging_agent", "timeout", "env.step_timeout_s=1"),
    ("silent_agent", "env_error", "made no chat or completion call"),
    ("bad_return_agent", "env_error", "return a number, None or rlray.envs.AgentResult"),
])
def test_failing_agents_fail_their_episode_only(strict_host, agent, stop, needle):
    replies = run(strict_host, agent, [{"prompt": "Hi"}]) + run(strict_host, "tool_agent", [{"prompt": "Hi"}])
    assert replies[0].stop_reason == stop and needle in replies[0].message and replies[0].reward is None
    assert replies[1].stop_reason == "done"  # the host goes on


def test_under_lockstep_a_hung_agent_holds_its_actor_s_calls_only_until_its_time_limit(strict_host):
    """env.agent_batching: lockstep (the default): after the first call (both agents), the tool agent's second call
    waits for the hung agent, which env.step_timeout_s=1 ends; then it goes, and both episodes end as they should."""
    from tests.fixtures.agents import ScriptedSampler

    ScriptedSampler.calls.clear()
    started = time.monotonic()
    hung, tool = strict_host.run_agents(AgentBatch([
        AgentRequest(f"hung-{time.monotonic_ns()}", "hanging_agent", {"prompt": "Hi"}, 0),
        AgentRequest(f"tool-{time.monotonic_ns()}", "tool_agent", {"prompt": "Add. calls=1"}, 1)], [None], None, 64))
    assert (hung.stop_reason, tool.stop_reason, tool.reward, tool.calls) == ("timeout", "done", 1.0, 2)
    assert ScriptedSampler.calls == [(0, 2), (0, 1)] and 1.0 <= time.monotonic() - started < 20
    assert strict_host.gateway_stats().batch_wait_s >= 0.9  # the second call waited for the hung agent's time limit


def test_an_agent_past_the_episode_time_is_stopped(tiny_model_path):
    from tests.fixtures.agents import ScriptedSampler

    h = AgentHost({}, agents={"busy": f"{FIXTURE}:busy_agent"}, model_dir=tiny_model_path, chat_template="smollm2-tools",
                  sampler_factory=ScriptedSampler, max_turns=1000, max_episode_tokens=100_000, step_timeout_s=5.0,
                  episode_timeout_s=1.0)
    try:
        (reply,) = h.run_agents(AgentBatch([AgentRequest("busy-0", "busy", {"prompt": "Hi"}, 0)], [None], None, 8))
    finally:
        h.shutdown()
    assert reply.stop_reason == "episode_timeout" and reply.calls >= 2 and "env.episode_timeout_s=1" in reply.message


def test_text_completions_streaming_and_sync_agents(host):
    (text,) = run(host, "text_agent", [{"prompt": "Count."}])
    assert text.stop_reason == "done" and text.drift == 0 and text.calls == 3
    (seg,) = text.segments
    assert sum(1 for _, _, on in mask_runs(seg.loss_mask) if on) == 3
    (streamed,) = run(host, "streaming_agent", [{"prompt": "Add. calls=1"}])
    assert streamed.reward == 1.0
    (sync,) = run(host, "sync_agent", [{"prompt": "Hi"}])
    assert (sync.stop_reason, sync.reward) == ("done", 1.0)


def test_requests_the_gateway_refuses(host):
    from tests.fixtures.agents import tokenizer

    tokenizer()
    gateway = host.gateway
    limits = EpisodeLimits(4, 1024, 256, 600.0, max_new_tokens=16)
    gateway.episodes.pop("manual", None)
    ep = gateway.open("manual", 0, limits)
    try:
        status, body = post(host, "manual", "chat/completions", {"messages": [{"role": "user", "content": "x"}], "n": 2})
        assert status == 400 and body["error"]["code"] == "unsupported_n"
        status, body = post(host, "manual", "chat/completions", {"messages": "x"})
        assert status == 400 and body["error"]["code"] == "invalid_messages"
        status, body = post(host, "manual", "completions", {"prompt": {"x": 1}})
        assert status == 400 and body["error"]["code"] == "invalid_prompt"
        got = httpx.get(f"{host.gateway_url()}/manual/v1/models", timeout=10).json()
        assert [m["id"] for m in got["data"]] == ["policy"]
        assert ep.refused == 3
    finally:
        gateway.close_episode("manual", "test")
    assert json.dumps(body)  # every refusal is an OpenAI-shaped JSON error


def test_tool_calls_are_split_from_the_text_as_the_parser_reads_them():
    call = '<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>'
    assert split_tool_calls(f"Let me add.\n{call}", "hermes") == (
        "Let me add.", [{"type": "function", "function": {"name": "add", "arguments": {"a": 1}}}], 0)
    # an unparsable block: the agent gets the whole text, the good call, and the error counted
    content, calls, bad = split_tool_calls(f"{call}<tool_call>{{oops</tool_call>", "hermes")
    assert content.endswith("{oops</tool_call>") and len(calls) == 1 and bad == 1
    assert split_tool_calls("plain", "hermes") == ("plain", [], 0)


def test_a_thousand_scripted_episodes_log_zero_drift(host):
    """1,000 agents at once, 0-4 tool calls each, through the gateway and the conversation path: not one history
    rewrite, every episode one token sequence whose loss mask covers exactly its sampled turns."""
    from rlray.run.agents import agent_metrics
    from tests.fixtures.agents import tokenizer

    tokenizer()
    rows = [{"prompt": f"Task {i}. calls={i % 5}"} for i in range(1000)]
    started = time.monotonic()
    replies = run(host, "tool_agent", rows, actors=4)
    took = time.monotonic() - started
    assert [r.stop_reason for r in replies] == ["done"] * 1000 and all(r.reward == 1.0 for r in replies)
    assert sum(r.drift for r in replies) == 0 and all(len(r.segments) == 1 for r in replies)
    for i, r in enumerate(replies):
        turns = i % 5 + 1
        assert r.calls == turns and sum(1 for _, _, on in mask_runs(r.segments[0].loss_mask) if on) == turns
    from rlray.rollout import Completion
    from rlray.rollout.types import AgentInfo, EpisodeInfo

    done = [Completion(0, i, [1], [0.0], "stop", 0, episode=EpisodeInfo(
        "tool_agent", "done", r.calls, agent=AgentInfo(gateway_calls=r.calls, template_drift=r.drift,
                                                       engine_calls=r.engine_calls, engine_prompts=r.engine_prompts,
                                                       batch_wait_s=r.batch_wait_s)))
            for i, r in enumerate(replies)]
    metrics = agent_metrics(done, {"tool_agent"})
    assert metrics.pop("timing/agent_batch_wait_s") >= 0.0
    # lockstep: each of the 4 actors' engine calls carries every running episode's next call; the longest take 5
    assert metrics == {"env/template_drift": 0.0, "env/gateway_calls": 3.0 * len(done), "env/gateway_calls_mean": 3.0,
                       "env/agent_engine_calls": 20.0, "env/agent_prompts_per_engine_call": 3000 / 20,
                       "env/agent_parallel_calls": 0.0}
    assert took < 120, f"1,000 scripted episodes took {took:.0f} s"
