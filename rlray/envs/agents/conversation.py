"""Token in, token out for agents: the token sequences behind one agent's chat-completions calls.

An agent written against a chat-completions API sends its whole conversation with every call. The gateway
(``rlray.envs.agents.gateway``) never re-tokenizes what was sampled: when a call's messages extend the previous call's
conversation (the previous messages, then the assistant message the gateway returned, then new messages), the new
prompt is the previous token sequence plus the template's new text only (``Trajectory.add_observations``: the same
rendering check environments use), so the sequence trained on is the sequence sampled. When the agent rewrites
history instead (drops, edits or reorders messages, changes its tools, or the template does not extend its previous
rendering), the episode is cut: the current token sequence is closed as a segment and a new one opens from the
call's messages. Each segment is trained on as its own sequence; the cuts are counted (``env/template_drift``).

Messages are compared in the form the chat template reads (``normalize_message``): role, text content (None and
"" alike; text parts joined) and, for an assistant, its tool calls as (name, parsed arguments). Tool-call ids,
``refusal``, ``annotations`` and other fields that the OpenAI SDK writes back are not part of the comparison.

Text completions (``/v1/completions``) follow the same rule on text: a prompt that starts with the previous
prompt and completion extends its tokens by the tokens of the rest; any other prompt opens a new segment.

Nothing here imports Ray, an engine or an HTTP server: the module is tested with a tokenizer alone.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from rlray.envs.base import Message
from rlray.envs.episode import TemplateDriftError, Trajectory, open_trajectory


class GatewayError(ValueError):
    """A call the gateway refuses; ``status`` is its HTTP status and ``code`` the OpenAI error code.

    Args:
        status: 400 (a bad request or a limit), 404 (no such episode), 410 (the episode has ended), 503 (the
            engines failed).
        code: a short machine-readable code, e.g. ``"max_turns"``, ``"episode_ended"``.
        message: what happened and what to do.
    """

    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(message)
        self.status, self.code = status, code


@dataclass
class Sampled:
    """One engine completion of one call, as the gateway records it.

    Attributes:
        token_ids: [t] sampled token ids (EOS included when the engine stopped on it).
        logprobs: [t] float nats, the engine's logprob of each sampled token.
        finish_reason: "stop" or "length".
        policy_version: the engine's policy version when the call started (its first token's).
        versions: [t] the policy version of each sampled token (``Completion.versions``: a call that continued across
            a weight update, ``rollout.partial``, holds several, never decreasing); empty: all ``policy_version``.

    Raises:
        ValueError: token_ids, logprobs and versions (when given) differ in length.
    """

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    policy_version: int
    versions: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.versions = [int(v) for v in self.versions] or [int(self.policy_version)] * len(self.token_ids)
        if not len(self.token_ids) == len(self.logprobs) == len(self.versions):
            raise ValueError(f"Sampled: {len(self.token_ids)} tokens, {len(self.logprobs)} logprobs and "
                             f"{len(self.versions)} versions")


@dataclass
class Segment:
    """One token sequence of an agent episode, trained as its own sequence.

    Attributes:
        prompt_ids: [Lp] the segment's opening prompt (the first call's messages, chat template applied).
        response_ids: [T] every token after it: sampled (loss mask on) and the agent's new messages (off).
        logprobs: [T] float nats; the engine's logprob on sampled tokens, 0.0 elsewhere.
        loss_mask: [T] bool; True exactly on sampled tokens.
        policy_versions: the engine's policy version of each turn (its first token's).
        finish_reason: the last turn's "stop" or "length".
        num_turns: sampled turns (calls answered) in the segment.
        observation_tokens: tokens of the agent's messages after the opening prompt (loss mask off).
        versions: [T] the policy version of each token (``Trajectory.versions``): a sampled token's (partial rollouts:
            a call may span weight updates), an observation token the version of the token before it.
    """

    prompt_ids: list[int]
    response_ids: list[int]
    logprobs: list[float]
    loss_mask: list[bool]
    policy_versions: list[int] = field(default_factory=list)
    finish_reason: str = "stop"
    num_turns: int = 0
    observation_tokens: int = 0
    versions: list[int] = field(default_factory=list)


def _text_content(content: Any) -> str:
    """Returns a message content as text: None is "", a list of ``{"type": "text"}`` parts is their texts joined.

    Raises:
        GatewayError: a part that is not text (images, audio), or a content of another type.
    """
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise GatewayError(400, "unsupported_content", "only text content parts ({'type': 'text', 'text': "
                                   f"...}}) are supported; got {str(part)[:120]}")
            texts.append(part["text"])
        return "".join(texts)
    raise GatewayError(400, "unsupported_content", f"message content must be a string or a list of text parts, got "
                       f"{type(content).__name__}")


def _arguments(raw: Any) -> Any:
    """Returns a tool call's arguments as the template reads them: a JSON string parsed to its value (kept as the
    string when it is not JSON), a dict as is."""
    if isinstance(raw, str):
        try:
            return json.loads(raw)
        except json.JSONDecodeError:
            return raw
    return {} if raw is None else raw


def normalize_message(message: Any) -> Message:
    """Returns an OpenAI chat message in the form the chat template reads and the gateway compares.

    ``{"role", "content"}`` with the content as text; an assistant's ``tool_calls`` as ``[{"type": "function",
    "function": {"name", "arguments": <parsed JSON>}}]`` (ids dropped); a tool message keeps its ``name`` when
    given. Role "function" (the legacy tool result) reads as "tool".

    Raises:
        GatewayError: not a dict with a string role, a non-text content, or a malformed tool call.
    """
    if not isinstance(message, dict) or not isinstance(message.get("role"), str):
        raise GatewayError(400, "invalid_messages", f"each message needs a string 'role'; got {str(message)[:120]}")
    role = "tool" if message["role"] == "function" else message["role"]
    out: Message = {"role": role, "content": _text_content(message.get("content"))}
    if role == "assistant" and message.get("tool_calls"):
        calls = []
        for call in message["tool_calls"]:
            fn = call.get("function") if isinstance(call, dict) else None
            if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                raise GatewayError(400, "invalid_messages", f"a tool call needs function.name; got {str(call)[:120]}")
            calls.append({"type": "function", "function": {"name": fn["name"], "arguments": _arguments(fn.get("arguments"))}})
        out["tool_calls"] = calls
    if role == "tool" and isinstance(message.get("name"), str):
        out["name"] = message["name"]
    return out


class AgentConversation:
    """The token sequences behind one agent episode's calls (the module docstring says how calls extend them).

    Args:
        tokenizer: the policy's tokenizer (chat template set; ``eos_token`` ends an assistant turn).
        chat_template_kwargs: extra template variables (``rollout.chat_template_kwargs``).

    Attributes:
        drift: how many times the agent rewrote history (segments cut), over the episode.
    """

    def __init__(self, tokenizer: Any, chat_template_kwargs: dict[str, Any] | None = None) -> None:
        self.tokenizer, self.kwargs = tokenizer, dict(chat_template_kwargs or {})
        self._closed: list[Trajectory] = []
        self._current: Trajectory | None = None
        self._kind = ""  # what the current segment is: "chat", "text" (a text prompt) or "ids" (token-id prompts)
        self._text = ""  # text completions: the prompt and completion text so far
        self.drift = 0

    @property
    def num_turns(self) -> int:
        """Returns the sampled turns over every segment."""
        return sum(t.num_turns for t in self._trajectories())

    def chat_prompt(self, messages: list[Message], tools: list[dict] | None) -> list[int]:
        """Returns the prompt token ids for a chat call with ``messages`` (normalized) and ``tools`` (OpenAI schemas).

        Extends the current segment when the messages extend its conversation and the tools are the same, else cuts
        (a new segment from ``messages``; ``drift`` counts it when the current one has turns).

        Raises:
            GatewayError: no messages, or the chat template cannot render them (status 400).
        """
        if not messages:
            raise GatewayError(400, "invalid_messages", "a chat call needs at least one message")
        current = self._current
        if self._extends("chat") and (current.tools or None) == (tools or None) \
                and messages[:len(current.messages)] == current.messages:
            try:  # raises before it changes anything
                current.add_observations(self.tokenizer, messages[len(current.messages):])
                return current.token_ids
            except TemplateDriftError:
                pass  # the template rewrites the rendering: cut below
        return self._open(lambda: open_trajectory(self.tokenizer, messages, tools=tools,
                                                  chat_template_kwargs=self.kwargs), "chat").token_ids

    def text_prompt(self, prompt: str | list[int]) -> list[int]:
        """Returns the prompt token ids for a text completion: the current segment's tokens plus the tokens of the
        text after its prompt and completion when ``prompt`` starts with them, else a new segment (a list of token
        ids always opens one, unless it starts with the current tokens exactly)."""
        current = self._current
        if isinstance(prompt, list):
            ids = [int(t) for t in prompt]
            if self._extends("ids") and ids[:len(current.token_ids)] == current.token_ids:
                self._append_observation(current, ids[len(current.token_ids):])
                return current.token_ids
            return self._open(lambda: Trajectory(ids, []), "ids").token_ids
        if self._extends("text") and prompt.startswith(self._text):
            rest = prompt[len(self._text):]
            self._append_observation(current, self._encode(rest) if rest else [])
            self._text = prompt
            return current.token_ids
        opened = self._open(lambda: Trajectory(self._encode(prompt), []), "text")
        self._text = prompt
        return opened.token_ids

    def record(self, sampled: Sampled, message: Message | None, text: str) -> None:
        """Appends one sampled turn to the current segment.

        Args:
            sampled: the engine's tokens, logprobs, finish reason and policy versions (per token).
            message: the assistant message the gateway returns (normalized), which the agent's next call must
                repeat to extend the segment; None for a text completion.
            text: the completion text returned (text completions: the next prompt must start with prompt + text).
        """
        current = self._current
        current.add_turn(sampled.token_ids, sampled.logprobs, sampled.finish_reason, sampled.policy_version, text,
                         sampled.versions)
        if message is not None:
            current.messages[-1] = message
        else:
            current.messages.pop()  # text completions keep no conversation
            self._text += text

    def segments(self) -> list[Segment]:
        """Returns the episode's segments with at least one sampled turn, in order (the last is the current one)."""
        out = []
        for t in self._trajectories():
            if not t.num_turns:
                continue
            observed = sum(1 for i, m in enumerate(t.loss_mask) if not m)
            out.append(Segment(list(t.prompt_ids), list(t.response_ids), list(t.logprobs), list(t.loss_mask),
                               list(t.policy_versions), t.finish_reason, t.num_turns, observed, list(t.versions)))
        return out

    def last_messages(self) -> list[Message]:
        """Returns the current chat segment's conversation (the final conversation once the episode ends)."""
        return [] if self._current is None else list(self._current.messages)

    # ---- internals --------------------------------------------------------------------------
    def _trajectories(self) -> list[Trajectory]:
        return self._closed + ([self._current] if self._current is not None else [])

    def _extends(self, kind: str) -> bool:
        """Returns True when the current segment is of ``kind`` and has a sampled turn to extend."""
        return self._current is not None and self._kind == kind and self._current.num_turns > 0

    def _open(self, build: Any, kind: str) -> Trajectory:
        """Closes the current segment (counted as drift when it has turns; dropped when it has none) and opens the one
        ``build()`` returns, of ``kind``.

        Raises:
            GatewayError: ``build`` raised (the chat template cannot render the messages).
        """
        try:
            opened = build()
        except GatewayError:
            raise
        except Exception as err:  # noqa: BLE001 - a conversation the template cannot render is the caller's error
            raise GatewayError(400, "invalid_messages", f"the chat template cannot render these messages: "
                               f"{type(err).__name__}: {err}") from err
        if self._current is not None and self._current.num_turns:
            self._closed.append(self._current)
            self.drift += 1
        self._current, self._kind, self._text = opened, kind, ""
        return opened

    @staticmethod
    def _append_observation(trajectory: Trajectory, ids: list[int]) -> None:
        trajectory.response_ids += ids
        trajectory.logprobs += [0.0] * len(ids)
        trajectory.loss_mask += [False] * len(ids)
        trajectory.versions += trajectory.versions[-1:] * len(ids)  # as Trajectory.add_observations

    def _encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])
