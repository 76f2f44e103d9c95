"""The agent gateway: an OpenAI-compatible endpoint per episode, backed by the rollout engines.

One HTTP server per environment host (aiohttp, on the host's asyncio loop, bound to 127.0.0.1 unless configured)
serves every running episode under its own path: ``<base>/<episode key>/v1`` is the ``base_url`` of the
``openai`` client the episode's agent gets. Routes under it:

- ``POST /chat/completions``: messages (and OpenAI tool schemas) in, one assistant message out. Its tool calls
  are parsed from the sampled text with the template's parser (``rlray.envs.tools.parse_tool_calls``, as
  environments do) and returned in OpenAI's schema (``tool_calls`` with JSON-string arguments, finish reason
  ``tool_calls``). ``stream: true`` is answered as server-sent events: the whole message in one chunk, then the
  finish reason and ``[DONE]``.
- ``POST /completions``: a text (or token-id) prompt in, text out.
- ``GET /models``: the one model, ``policy``.

Each call's tokens go through the episode's ``AgentConversation`` (token exact; cut into segments when the agent
rewrites history; concurrent calls of one episode are answered one after another, so the second of two parallel
samples of the same messages opens a segment of its own) and its sampling through ``sample``, the host's engine call pinned to the episode's rollout
actor. Sampling follows the run (``rollout.*``: temperature, top-p, top-k, min-p), because the learner's logprobs
assume it; a request's ``max_tokens`` / ``max_completion_tokens`` can only lower ``rollout.max_new_tokens``, its
``stop`` strings are added, and its temperature and other sampling fields are ignored. ``n`` must be 1.

Refusals are OpenAI-shaped errors (``{"error": {"message", "type", "code"}}``, so the SDK raises
``openai.BadRequestError`` and friends): 400 for a bad request or a limit (``max_turns``,
``max_episode_tokens``: the episode then ends with that stop reason and later calls are refused), 404 for an
unknown episode, 410 for a call after its episode ended (the message names the stop reason), 503 when the engines
failed.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from rlray.envs.agents.conversation import AgentConversation, GatewayError, Sampled, normalize_message
from rlray.envs.base import Message
from rlray.envs.limits import EpisodeLimits
from rlray.envs.tools import parse_tool_calls

log = logging.getLogger(__name__)

MODEL_NAME = "policy"  # what GET /models lists; any model name in a request is accepted
_HERMES_BLOCK_OPEN, _HERMES_BLOCK_CLOSE = "<tool_call>", "</tool_call>"
_ENDED_KEPT = 100_000  # ended episodes remembered for the 410 answer (then 404)


@dataclass
class GatewayEpisode:
    """One episode behind the gateway: its conversation, counters and state.

    Attributes:
        key: the episode's key (its path under the gateway).
        actor_key: picks the episode's rollout actor (the same one for every call: its prefix cache).
        conversation: the episode's token sequences.
        limits: its limits (the gateway applies max_turns, max_episode_tokens and max_new_tokens).
        stop_reason: a limit that ended it ("max_turns", "max_episode_tokens"), "" while none did.
        ended: no call is answered any more (a limit, the agent returned, failed or timed out).
        calls: calls answered; refused: calls refused (errors returned to the agent).
        tool_calls, tool_errors: tool calls in the answers (parsed calls plus unparsable ones) and those that failed
            (unparsable; ``rlray.envs.agents`` adds failed MCP tool calls).
        in_call: calls being answered now; last_active: time.monotonic() when the agent last waited on the gateway.
        lock: held while a call is answered: concurrent calls of one episode are answered one after another.
        parallel_calls: calls that came while another call of the episode was being answered (an agent calling at
            once): answered in the order they reached the lock, which timing decides, so a seeded run's samples of
            such an episode can differ from run to run (``env/agent_parallel_calls``).
    """

    key: str
    actor_key: int
    conversation: AgentConversation
    limits: EpisodeLimits
    stop_reason: str = ""
    ended: bool = False
    calls: int = 0
    refused: int = 0
    tool_calls: int = 0
    tool_errors: int = 0
    in_call: int = 0
    last_active: float = field(default_factory=time.monotonic)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    parallel_calls: int = 0


SampleFn = Callable[[GatewayEpisode, list[int], int, tuple[str, ...]], Awaitable[Sampled]]


def _error(status: int, code: str, message: str) -> Any:
    from aiohttp import web

    kind = "invalid_request_error" if status < 500 else "server_error"
    return web.json_response({"error": {"message": message, "type": kind, "code": code, "param": None}}, status=status)


async def _stream(request: Any, chunks: list[dict[str, Any]]) -> Any:
    """Returns a server-sent-events response of ``chunks``, then ``[DONE]`` (the answer is whole: no token streaming)."""
    from aiohttp import web

    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await response.prepare(request)
    for chunk in chunks:
        await response.write(f"data: {json.dumps(chunk, ensure_ascii=False)}\n\n".encode())
    await response.write(b"data: [DONE]\n\n")
    await response.write_eof()
    return response


def split_tool_calls(text: str, parser: str) -> tuple[str, list[dict[str, Any]], int]:
    """Returns (content, calls, errors) of an assistant text: the text with its tool-call blocks removed (all of the
    text when a block cannot be parsed, so the agent sees what the model wrote), the parsed calls as normalized
    tool calls (``{"type": "function", "function": {"name", "arguments": dict}}``), and how many blocks failed to
    parse."""
    calls, errors = parse_tool_calls(text, parser=parser)
    content = text
    if calls and not errors:
        pieces, rest = [], text
        while _HERMES_BLOCK_OPEN in rest:
            before, _, after = rest.partition(_HERMES_BLOCK_OPEN)
            pieces.append(before)
            rest = after.partition(_HERMES_BLOCK_CLOSE)[2]
        content = ("".join(pieces) + rest).strip()
    normalized = [{"type": "function", "function": {"name": c.name, "arguments": c.arguments}} for c in calls]
    return content, normalized, len(errors)


def _wire_message(message: Message, ids: list[str]) -> dict[str, Any]:
    """Returns a normalized assistant message as OpenAI sends it: content None when empty with tool calls, arguments as
    JSON strings, one id per call."""
    calls = message.get("tool_calls") or []
    out: dict[str, Any] = {"role": "assistant", "content": message["content"] if message["content"] or not calls else None}
    if calls:
        out["tool_calls"] = [{"id": i, "type": "function", "function": {"name": c["function"]["name"], "arguments":
                              json.dumps(c["function"]["arguments"], ensure_ascii=False)}} for i, c in zip(ids, calls, strict=True)]
    return out


class Gateway:
    """The HTTP server of one environment host: routes each call to its episode (see the module docstring).

    Args:
        tokenizer: the policy's tokenizer (chat template set).
        sample: the engine call: ``await sample(episode, prompt_ids, max_new_tokens, extra_stop)`` returns a
            ``Sampled`` (the host batches calls and pins each episode to its rollout actor).
        tool_parser: the tool-call parser of the model family (``env.tool_parser``).
        chat_template_kwargs: extra template variables (``rollout.chat_template_kwargs``).
    """

    def __init__(self, tokenizer: Any, sample: SampleFn, *, tool_parser: str = "hermes",
                 chat_template_kwargs: dict[str, Any] | None = None) -> None:
        self.tokenizer, self.sample, self.parser = tokenizer, sample, tool_parser
        self.kwargs = dict(chat_template_kwargs or {})
        self.episodes: dict[str, GatewayEpisode] = {}
        self._ended: dict[str, str] = {}  # key -> why it ended, for the 410 answer
        self._runner: Any = None
        self.base_url = ""

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> str:
        """Starts serving on ``host:port`` (0: a free port) on the running loop; returns the base URL."""
        from aiohttp import web

        app = web.Application(client_max_size=64 * 2**20)
        app.router.add_post("/{key}/v1/chat/completions", self._chat)
        app.router.add_post("/{key}/v1/completions", self._completions)
        app.router.add_get("/{key}/v1/models", self._models)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, host, port, backlog=4096)
        await site.start()
        bound = site._server.sockets[0].getsockname()[1]  # aiohttp exposes the port it bound only here
        self.base_url = f"http://{host}:{bound}"
        return self.base_url

    async def close(self) -> None:
        """Stops serving."""
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    def url(self, key: str) -> str:
        """Returns the ``base_url`` of episode ``key``'s endpoint."""
        return f"{self.base_url}/{key}/v1"

    def open(self, key: str, actor_key: int, limits: EpisodeLimits) -> GatewayEpisode:
        """Returns a new episode under ``key``, its calls pinned by ``actor_key``.

        Raises:
            ValueError: ``key`` is running already.
        """
        if key in self.episodes:
            raise ValueError(f"gateway: episode {key!r} is running already")
        episode = GatewayEpisode(key, actor_key, AgentConversation(self.tokenizer, self.kwargs), limits)
        self.episodes[key] = episode
        return episode

    def close_episode(self, key: str, why: str) -> None:
        """Ends episode ``key`` (no call is answered after; ``why`` is said in the 410 answer) and forgets it."""
        episode = self.episodes.pop(key, None)
        if episode is not None:
            episode.ended = True
        self._ended[key] = why
        while len(self._ended) > _ENDED_KEPT:
            self._ended.pop(next(iter(self._ended)))

    # ---- handlers ---------------------------------------------------------------------------
    async def _chat(self, request: Any) -> Any:
        return await self._answer(request, chat=True)

    async def _completions(self, request: Any) -> Any:
        return await self._answer(request, chat=False)

    async def _models(self, request: Any) -> Any:
        from aiohttp import web

        return web.json_response({"object": "list", "data": [{"id": MODEL_NAME, "object": "model", "owned_by": "rlray"}]})

    async def _answer(self, request: Any, *, chat: bool) -> Any:
        """Returns the answer to one call of an episode (or the OpenAI-shaped error that refuses it)."""
        key = request.match_info["key"]
        episode = self.episodes.get(key)
        if episode is None:
            if key in self._ended:
                return _error(410, "episode_ended", f"episode {key} has ended ({self._ended[key]}); rlray answers no "
                              "call after an episode ends")
            return _error(404, "unknown_episode", f"no episode {key} is running on this gateway")
        if episode.ended:
            return _error(410, "episode_ended", f"episode {key} has ended ({episode.stop_reason or 'the agent finished'}); "
                          "rlray answers no call after an episode ends")
        episode.parallel_calls += episode.in_call > 0
        episode.in_call += 1
        try:
            body = await request.json()
            if not isinstance(body, dict):
                raise GatewayError(400, "invalid_request", "the request body must be a JSON object")
            async with episode.lock:  # an episode's calls one at a time: each sees the previous one recorded
                if episode.ended:
                    why = episode.stop_reason or "the agent finished"
                    raise GatewayError(410, "episode_ended", f"episode {key} has ended ({why}); rlray answers no call "
                                       "after an episode ends")
                answer = await (self._chat_call(episode, body) if chat else self._text_call(episode, body))
        except GatewayError as err:
            episode.refused += 1
            return _error(err.status, err.code, str(err))
        except json.JSONDecodeError as err:
            episode.refused += 1
            return _error(400, "invalid_json", f"the request body is not JSON: {err}")
        finally:
            episode.in_call -= 1
            episode.last_active = time.monotonic()
        if isinstance(answer, list):  # stream: the chunks as server-sent events
            return await _stream(request, answer)
        from aiohttp import web

        return web.json_response(answer)

    def _check(self, episode: GatewayEpisode, body: dict[str, Any]) -> tuple[int, tuple[str, ...]]:
        """Returns (max new tokens, extra stop strings) of a call, after its limits.

        Raises:
            GatewayError: n != 1, or the episode has used its turns (it ends: stop reason max_turns).
        """
        if body.get("n", 1) not in (1, None):
            raise GatewayError(400, "unsupported_n", f"n={body.get('n')}: the gateway samples one choice per call (n=1)")
        if episode.conversation.num_turns >= episode.limits.max_turns:
            self._limit(episode, "max_turns")
            raise GatewayError(400, "max_turns", f"episode {episode.key} used its {episode.limits.max_turns} calls "
                               "(env.max_turns); it has ended")
        cap = body.get("max_completion_tokens") or body.get("max_tokens") or episode.limits.max_new_tokens
        if not isinstance(cap, int) or cap < 1:
            raise GatewayError(400, "invalid_max_tokens", f"max_tokens={cap!r}: need an int >= 1")
        stop = body.get("stop") or ()
        stop = (stop,) if isinstance(stop, str) else tuple(s for s in stop if isinstance(s, str) and s)
        return min(cap, episode.limits.max_new_tokens), stop

    async def _sample(self, episode: GatewayEpisode, ids: list[int], max_new: int, stop: tuple[str, ...]) -> Sampled:
        """Returns the engine's completion of ``ids``, after the token limit.

        Raises:
            GatewayError: the segment would pass max_episode_tokens (the episode ends), the engines failed (503), or the
                episode ended while it waited (410).
        """
        if len(ids) + max_new > episode.limits.max_episode_tokens:
            self._limit(episode, "max_episode_tokens")
            raise GatewayError(400, "context_length_exceeded", f"the conversation has {len(ids)} tokens; with {max_new} new "
                               f"tokens it exceeds env.max_episode_tokens={episode.limits.max_episode_tokens}; the episode "
                               "has ended")
        try:
            sampled = await self.sample(episode, ids, max_new, stop)
        except asyncio.CancelledError:
            raise
        except Exception as err:  # noqa: BLE001 - the engines' failure is the call's, said to the agent
            raise GatewayError(503, "engine_error", f"the rollout engines failed: {type(err).__name__}: {err}") from err
        if episode.ended:
            raise GatewayError(410, "episode_ended", f"episode {episode.key} ended while its call was sampled")
        episode.calls += 1
        return sampled

    async def _chat_call(self, episode: GatewayEpisode, body: dict[str, Any]) -> dict[str, Any] | list[dict[str, Any]]:
        """Returns the answer to a chat call (a chat.completion, or its chunks when ``stream``).

        Raises:
            GatewayError: the call is refused (see ``_check`` and ``_sample``; unreadable messages: 400).
        """
        max_new, stop = self._check(episode, body)
        messages = body.get("messages")
        if not isinstance(messages, list):
            raise GatewayError(400, "invalid_messages", "'messages' must be a list of chat messages")
        tools = body.get("tools") or None
        ids = episode.conversation.chat_prompt([normalize_message(m) for m in messages], tools)
        sampled = await self._sample(episode, ids, max_new, stop)
        text = self._text(sampled, stop)
        content, calls, bad = split_tool_calls(text, self.parser) if tools else (text, [], 0)
        message: Message = {"role": "assistant", "content": content, **({"tool_calls": calls} if calls else {})}
        episode.conversation.record(sampled, message, text)
        episode.tool_calls += len(calls) + bad
        episode.tool_errors += bad
        turn = episode.conversation.num_turns
        wire = _wire_message(message, [f"call_{episode.key}_{turn}_{i}" for i in range(len(calls))])
        finish = "tool_calls" if calls else sampled.finish_reason
        usage = {"prompt_tokens": len(ids), "completion_tokens": len(sampled.token_ids),
                 "total_tokens": len(ids) + len(sampled.token_ids)}
        head = {"id": f"chatcmpl-{episode.key}-{turn}", "created": int(time.time()), "model": body.get("model") or MODEL_NAME}
        if body.get("stream"):
            delta = {**wire, "tool_calls": [{**c, "index": i} for i, c in enumerate(wire.get("tool_calls", []))]}
            chunks = [{**head, "object": "chat.completion.chunk", "choices": [{"index": 0, "delta": delta, "finish_reason": None}]},
                      {**head, "object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {}, "finish_reason": finish}],
                       "usage": usage}]
            return chunks
        return {**head, "object": "chat.completion", "usage": usage, "choices": [
            {"index": 0, "message": wire, "finish_reason": finish, "logprobs": None}]}

    async def _text_call(self, episode: GatewayEpisode, body: dict[str, Any]) -> dict[str, Any] | list[dict[str, Any]]:
        """Returns the answer to a text completion call (a text_completion, or its one chunk when ``stream``).

        Raises:
            GatewayError: the call is refused (see ``_check`` and ``_sample``; a prompt that is not one string or one
                list of token ids: 400).
        """
        max_new, stop = self._check(episode, body)
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]  # one prompt in a list
        if not isinstance(prompt, str) and not (isinstance(prompt, list) and all(isinstance(t, int) for t in prompt)):
            raise GatewayError(400, "invalid_prompt", "'prompt' must be a string or a list of token ids (one prompt)")
        ids = episode.conversation.text_prompt(prompt)
        sampled = await self._sample(episode, ids, max_new, stop)
        text = self._text(sampled, stop)
        episode.conversation.record(sampled, None, text)
        turn = episode.conversation.num_turns
        usage = {"prompt_tokens": len(ids), "completion_tokens": len(sampled.token_ids),
                 "total_tokens": len(ids) + len(sampled.token_ids)}
        head = {"id": f"cmpl-{episode.key}-{turn}", "created": int(time.time()), "model": body.get("model") or MODEL_NAME}
        choice = {"index": 0, "text": text, "finish_reason": sampled.finish_reason, "logprobs": None}
        answer = {**head, "object": "text_completion", "usage": usage, "choices": [choice]}
        return [answer] if body.get("stream") else answer

    def _text(self, sampled: Sampled, stop: tuple[str, ...]) -> str:
        """Returns the sampled text without special tokens and without a stop string it ended on (OpenAI's rule)."""
        text = self.tokenizer.decode(sampled.token_ids, skip_special_tokens=True)
        for s in stop:
            if sampled.finish_reason == "stop" and text.endswith(s):
                return text[: -len(s)]
        return text

    def _limit(self, episode: GatewayEpisode, reason: str) -> None:
        """Ends ``episode`` at a limit: its stop reason, no call answered after."""
        episode.stop_reason, episode.ended = reason, True
