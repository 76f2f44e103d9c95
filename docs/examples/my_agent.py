"""A user's agent, written against the openai SDK: how many letters does a word have? It may call the MCP tool `spell`."""

import openai

from rlray.envs import episode_tools


async def agent(client: openai.AsyncOpenAI, row: dict) -> float:
    tools = episode_tools()  # the tools of env.mcp_servers: their OpenAI schemas, and calls to them
    messages = [{"role": "user", "content": row["prompt"]}]
    for _ in range(3):
        reply = await client.chat.completions.create(model="policy", messages=messages, tools=tools.schemas)
        message = reply.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if not message.tool_calls:
            break
        for call in message.tool_calls:
            result = await tools.call(call.function.name, call.function.arguments)
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    digits = "".join(ch for ch in message.content or "" if ch.isdigit())
    return 1.0 if digits == str(len(row["word"])) else 0.0
