"""The retry-arithmetic task as an agent behind the gateway (``benchmarks/gateway.py``): the same environment class,
its logic driven by an ``openai`` client loop instead of rlray's episode loop, so both runs train the same task.

Matches the native run (``configs/envs/retry_arith_smollm2.yaml``) turn for turn: the config's system prompt first,
then the environment's opening; at most ``MAX_TURNS`` answers; a turn that hits the token cap ends the episode (as
the stop reason ``length`` does); the reward is the sum of the environment's turn rewards.
"""

from __future__ import annotations

from typing import Any

from rlray.envs import AssistantTurn
from rlray.envs.builtin.retry_arith import RetryArithmeticEnv

SYSTEM_PROMPT = "You are a calculator. Reply with the number only, no words."  # data.system_prompt of the config
MAX_TURNS = 3  # env.max_turns of the config


async def retry_arith_agent(client: Any, row: dict) -> float:
    """Plays one retry-arithmetic episode through ``client`` (an ``openai.AsyncOpenAI``); returns its reward."""
    env = RetryArithmeticEnv()
    opened = env.reset(**row)
    messages = [{"role": "system", "content": SYSTEM_PROMPT}, *opened.prompt]
    reward = 0.0
    for turn in range(MAX_TURNS):
        choice = (await client.chat.completions.create(model="policy", messages=messages)).choices[0]
        text = choice.message.content or ""
        if choice.finish_reason == "length":
            break
        step = env.step(AssistantTurn(text, finish_reason="stop", turn_index=turn))
        reward += step.reward or 0.0
        if step.done or step.truncated:
            break
        messages += [{"role": "assistant", "content": text}, *step.observations]
    return reward


async def chat_calls_agent(client: Any, row: dict) -> float:
    """Makes ``row["calls"]`` chat calls, each extending its conversation by the answer and a new user message (the
    capacity table of ``benchmarks/gateway.py``)."""
    messages = [{"role": "user", "content": row["prompt"]}]
    for i in range(row["calls"]):
        reply = await client.chat.completions.create(model="policy", messages=messages, max_tokens=16)
        messages += [{"role": "assistant", "content": reply.choices[0].message.content}, {"role": "user", "content": f"Next {i}"}]
    return 1.0
