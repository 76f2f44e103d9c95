"""A scripted OpenAI-compatible chat server for the verifiers bridge tests (runs in .venvs/verifiers: aiohttp).

``POST /<mode>/v1/chat/completions`` answers "What is a + b? ..." by ``mode``: ``right`` "<answer>a+b</answer>",
``wrong`` "<answer>a+b+1</answer>", ``twice`` the right answer tagged twice, ``bare`` "a+b" untagged. Streams
(server-sent events) when the request says ``stream``, as verifiers' harness asks. Prints ``fake-openai on <port>``.
"""

import json
import re
import sys
import time

from aiohttp import web


def reply_of(mode: str, prompt: str) -> str:
    a, b = map(int, re.search(r"What is (-?\d+) \+ (-?\d+)", prompt).groups())
    return {"right": f"<answer>{a + b}</answer>", "wrong": f"<answer>{a + b + 1}</answer>",
            "twice": f"<answer>{a + b}</answer> <answer>{a + b}</answer>", "bare": str(a + b)}[mode]


async def chat(request: web.Request) -> web.StreamResponse:
    body = await request.json()
    prompt = next(m["content"] for m in body["messages"] if m["role"] == "user")
    text = reply_of(request.match_info["mode"], prompt if isinstance(prompt, str) else prompt[0]["text"])
    base = {"id": "fake", "created": int(time.time()), "model": body.get("model", "policy")}
    if not body.get("stream"):
        return web.json_response({**base, "object": "chat.completion", "choices": [
            {"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": text}}]})
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await response.prepare(request)
    for chunk in ({"choices": [{"index": 0, "delta": {"role": "assistant", "content": text}, "finish_reason": None}]},
                  {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]},
                  {"choices": [], "usage": {"prompt_tokens": 20, "completion_tokens": 5, "total_tokens": 25}}):
        await response.write(f"data: {json.dumps({**base, 'object': 'chat.completion.chunk', **chunk})}\n\n".encode())
    await response.write(b"data: [DONE]\n\n")
    await response.write_eof()
    return response


async def main() -> None:
    app = web.Application()
    app.add_routes([web.post("/{mode}/v1/chat/completions", chat)])
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    print(f"fake-openai on {site._server.sockets[0].getsockname()[1]}", flush=True)
    while True:
        await __import__("asyncio").sleep(3600)


if __name__ == "__main__":
    __import__("asyncio").run(main()) if len(sys.argv) == 1 else print(reply_of(sys.argv[1], sys.argv[2]))
