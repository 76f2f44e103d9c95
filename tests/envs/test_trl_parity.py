"""TRL parity (issue 29): one TRL ``environment_factory`` class and the same scripted assistant turns, run through TRL
1.16's own tool loop and through rlray's episode loop, give the same tool observations, the same tool calls executed
and the same reward; by default (``env.trl_parity``) and including the turn limit.

TRL's side is ``GRPOTrainer._tool_call_loop`` itself (trl/trainer/grpo_trainer.py, lines 1945-2191 in 1.16.0), run
on a trainer object without a model: its generation (``_generate_single_turn``) answers with the next scripted turn's
token ids, and TRL's own ``parse_response`` reads the tool calls out of them. What ``_generate_and_score_completions``
sets up before the loop is reproduced as that function writes it (lines 2341-2391: the per-rollout tool dicts, and
``reset``'s string appended to the prompt). rlray's side is the real ``EpisodeRollout`` loop over an
``EnvironmentHost`` in this process (its Ray calls answered in place) and a fleet that answers the same turns.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import threading

import pytest

from rlray.data import PromptRow
from rlray.envs.host import EnvironmentHost
from rlray.envs.limits import EpisodeLimits
from rlray.models import load_tokenizer
from rlray.rollout import Completion, SamplingSpec
from rlray.run import episodes
from rlray.run.episodes import EpisodeRollout


class Shop:
    """A TRL environment_factory class: a cart of prices; the reward is 1.0 when the cart adds up to the row's target."""

    def __init__(self) -> None:
        self.cart: list[int] = []
        self.calls: list[tuple] = []

    def reset(self, **kwargs) -> str | None:
        self.target, self.cart, self.calls = kwargs["target"], [], []
        return " Buy what adds up to the target."

    def add(self, item: str, price: int) -> dict:
        """Adds an item to the cart.

        Args:
            item: The item's name.
            price: Its price in cents.
        """
        self.calls.append(("add", item, price))
        if price < 0:
            raise ValueError(f"negative price {price}")
        self.cart.append(price)
        return {"item": item, "total": sum(self.cart)}

    async def total(self) -> int:
        """Returns the cart's total in cents."""
        self.calls.append(("total",))
        await asyncio.sleep(0)
        return sum(self.cart)

    def get_reward(self) -> float:
        return float(sum(self.cart) == self.target)


def call(name: str, **arguments) -> str:
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


# (assistant turns in order, TRL's max_tool_calling_iterations); rlray runs them with env.max_turns = iterations + 1
SCENARIOS = {
    "results": ([call("add", item="apple", price=3) + call("add", item="pear", price=4), call("total"), "It is 7."], 5),
    "errors": ([call("add", item="x", price=-1) + call("remove", item="x") + call("add", item="x") + call("total"),
                "I give up."], 5),
    "turn_limit": ([call("add", item="a", price=3), call("add", item="b", price=4), "unused"], 1),
    "unparsable": (['<tool_call>{"name": "add", "arguments": {"item": "a"</tool_call>', "unused"], 5),
}


@pytest.fixture(scope="module")
def tokenizer(tiny_model_path):
    from trl.chat_template_utils import qwen3_template

    tok = load_tokenizer(tiny_model_path, chat_template="smollm2-tools")
    tok.response_template = qwen3_template  # TRL's parser for Hermes blocks after "<|im_start|>assistant\n"
    return tok


@pytest.fixture(scope="module")
def async_loop():
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    yield loop
    loop.call_soon_threadsafe(loop.stop)
    thread.join(timeout=10)


def turn_ids(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]


def run_trl(tokenizer, async_loop, turns: list[str], iterations: int, row: dict) -> dict:
    """Returns what TRL's _tool_call_loop gave one rollout of ``Shop`` on ``row``: tool messages, calls, reward."""
    from trl.trainer.grpo_trainer import GRPOTrainer, parse_response

    env = Shop()
    prompt = [{"role": "user", "content": row["prompt"]}]
    observation = env.reset(**row)  # lines 2386-2397: reset's string appended to the last message
    prompt = prompt[:-1] + [{**prompt[-1], "content": prompt[-1]["content"] + observation}]
    tools = [getattr(env, name) for name, _ in inspect.getmembers(type(env), predicate=inspect.isfunction)
             if name not in ("reset", "get_reward") and not name.startswith("_")]  # lines 2369-2376
    sync_tools = {t.__name__: t for t in tools if not inspect.iscoroutinefunction(t)}  # lines 2377-2381
    async_tools = {t.__name__: t for t in tools if inspect.iscoroutinefunction(t)}
    prompt_ids = tokenizer(tokenizer.apply_chat_template(prompt, tools=tools, tokenize=False, add_generation_prompt=True),
                           add_special_tokens=False)["input_ids"]
    scripted = iter(turns[1:])

    trainer = object.__new__(GRPOTrainer)
    trainer.__dict__.update(
        _sync_tool_dicts=[sync_tools], _async_tool_dicts=[async_tools], max_tool_calling_iterations=iterations,
        async_loop=async_loop, use_vllm=False, _is_vlm=False, max_completion_length=10**6, tools=tools,
        model=type("M", (), {"config": type("C", (), {"max_position_embeddings": 10**6})()})(),
        environment_factories={None: Shop}, _env_tools={None: tools}, _batch_environments=[None], _tokenizer=tokenizer,
        processing_class=tokenizer, chat_template=None, chat_template_kwargs={},  # for TRL's _get_tool_suffix_ids
        _generate_single_turn=lambda ids, *args, **kwargs: ([turn_ids(tokenizer, next(scripted)) for _ in ids], None),
    )
    first = turn_ids(tokenizer, turns[0])
    completions = [[parse_response(tokenizer, first, prefix=prompt_ids, tools=tools)]]
    _, completions, _, _, calls, failures, _ = trainer._tool_call_loop(
        [prompt], [prompt_ids], [first], completions, None, None, None)
    messages = completions[0]
    return {"observations": [m for m in messages if m["role"] == "tool"], "calls": env.calls,
            "turns": sum(m["role"] == "assistant" for m in messages), "reward": env.get_reward(),
            "tool_calls": calls, "tool_errors": failures}


class LocalHost:
    """An EnvironmentHost in this process whose methods answer ``.remote(...)`` at once (the episode loop's Ray calls,
    with ``ray.get`` patched to pass values through); it keeps every step reply."""

    def __init__(self, host: EnvironmentHost) -> None:
        self.host, self.replies = host, []
        for name in ("reset", "step", "rewards_at_limit", "close", "ping"):
            setattr(self, name, type("M", (), {"remote": staticmethod(getattr(self, f"_{name}"))})())

    def _reset(self, requests):
        return self.host.reset(requests)

    def _step(self, requests):
        replies = self.host.step(requests)
        self.replies += replies
        return replies

    def _rewards_at_limit(self, keys):
        return self.host.rewards_at_limit(keys)

    def _close(self, keys):
        return self.host.close(keys)

    def _ping(self):
        return True


class ScriptedFleet:
    """A rollout fleet that answers each turn with the next scripted assistant turn (one episode)."""

    def __init__(self, tokenizer, turns: list[str]) -> None:
        self.tok, self.turns, self.version = tokenizer, iter(turns), 0

    def submit(self, prompt_ids, sampling, rows=None, *, actor_keys=None):
        return prompt_ids

    def collect(self, pending):
        out = []
        for i in range(len(pending)):
            ids = turn_ids(self.tok, next(self.turns))
            out.append(Completion(i, 0, ids, [-0.1] * len(ids), "stop", self.version))
        return out


def run_rlray(tokenizer, monkeypatch, tmp_path, turns: list[str], max_turns: int, row: dict, trl_parity: bool = True):
    """Returns what rlray's episode loop gave one episode of ``Shop`` on ``row``: tool messages, calls, reward."""
    (tmp_path / "shop.py").write_text("import asyncio\n\n\n" + inspect.getsource(Shop))  # the class as a user's file
    host = LocalHost(EnvironmentHost({"shop": f"{tmp_path}/shop.py:Shop"}, trl_parity=trl_parity))
    instances = []
    factory = host.host._factories["shop"]
    host.host._factories["shop"] = lambda: instances.append(factory()) or instances[-1]  # keep the instance
    monkeypatch.setattr(episodes.ray, "get", lambda value, **kwargs: value)
    limits = EpisodeLimits(max_turns, 10**6, 10**4, 600.0)
    loop = EpisodeRollout(ScriptedFleet(tokenizer, turns), [host], tokenizer, limits, env_column="environment",
                          default_env="shop", known_envs=["shop"], prepare=lambda m: m)
    done = loop.generate([[1]], SamplingSpec(n=1, max_new_tokens=64, temperature=1.0), [PromptRow("p0", row["prompt"],
                                                                                                    {"target": row["target"]})])
    episode, env = done[0].episode, instances[0].instance
    return {"observations": [o for r in host.replies for o in r.step.observations], "calls": env.calls,
            "turns": episode.num_turns, "reward": episode.env_reward, "tool_calls": episode.tool_calls,
            "tool_errors": episode.tool_errors, "stop_reason": episode.stop_reason, "failed": episode.failed}


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_trl_and_rlray_show_the_same_observations_run_the_same_calls_and_give_the_same_reward(
        scenario, tokenizer, async_loop, monkeypatch, tmp_path):
    turns, iterations = SCENARIOS[scenario]
    row = {"prompt": "Spend exactly 7 cents.", "target": 7}
    trl = run_trl(tokenizer, async_loop, turns, iterations, row)
    ours = run_rlray(tokenizer, monkeypatch, tmp_path, turns, iterations + 1, row)
    assert ours["observations"] == trl["observations"]
    assert ours["calls"] == trl["calls"]
    assert ours["reward"] == trl["reward"]
    assert ours["turns"] == trl["turns"]
    assert not ours["failed"]
    if scenario == "results":  # str(dict), and the coroutine tool's result
        assert [o["content"] for o in trl["observations"]] == ["{'item': 'apple', 'total': 3}",
                                                               "{'item': 'pear', 'total': 7}", "7"]
        assert (trl["reward"], ours["stop_reason"]) == (1.0, "done")
    if scenario == "errors":  # TRL's {'error': ...} for a raising tool, an unknown one and missing arguments
        assert [o["content"] for o in trl["observations"]] == [
            "{'error': 'negative price -1'}", "{'error': 'Tool remove not found.'}",
            "{'error': \"Shop.add() missing 1 required positional argument: 'price'\"}", "0"]
        assert (trl["tool_calls"], trl["tool_errors"]) == (ours["tool_calls"], ours["tool_errors"]) == (4, 3)
    if scenario == "turn_limit":  # the last turn's call is not run: the cart holds 3, the reward is 0
        assert trl["calls"] == [("add", "a", 3)] and trl["turns"] == 2
        assert (ours["reward"], ours["stop_reason"]) == (0.0, "max_turns")
    if scenario == "unparsable":  # plain text to TRL: the episode ends at once, scored by get_reward
        assert trl["observations"] == [] and trl["calls"] == [] and (ours["turns"], ours["stop_reason"]) == (1, "done")


def test_rlray_wording_runs_the_last_turns_calls_and_writes_json(tokenizer, monkeypatch, tmp_path):
    turns, iterations = SCENARIOS["turn_limit"]
    row = {"prompt": "Spend exactly 7 cents.", "target": 7}
    ours = run_rlray(tokenizer, monkeypatch, tmp_path, turns, iterations + 1, row, trl_parity=False)
    assert ours["calls"] == [("add", "a", 3), ("add", "b", 4)]  # env.trl_parity=false: the last turn's call runs
    assert ours["reward"] == 1.0 and ours["stop_reason"] == "max_turns"
    assert [o["content"] for o in ours["observations"]] == ['{"item": "a", "total": 3}', '{"item": "b", "total": 7}']
