"""Token in, token out: one episode's token sequence, built turn by turn.

An episode is ONE token sequence: the opening prompt, then for each turn the sampled tokens (loss mask
on, the engine's logprobs) followed by the observation tokens (loss mask off, logprob 0.0, never in a
loss, a normaliser, an entropy or a KL). Earlier turns are never re-tokenized from text: the sampled
tokens are kept exactly as the engine produced them, and only the NEW text that the chat template adds
for the observations is tokenized and appended.

How the observation tokens are found (the approach of verl's agent loop and SkyRL's generator, written
here from their description): the conversation is rendered twice with the chat template, before and
after the observation messages (the second with the generation prompt); the second rendering must
extend the first as a text prefix, and the extension is tokenized alone. The sampled turn ends with the
end-of-turn token (EOS, e.g. ``<|im_end|>``); whatever the template writes after that token to close the
assistant turn (ChatML: a newline) is prepended to the extension. A turn that stopped on a stop string
or hit the token cap has no end-of-turn token; one is inserted as an observation token. When the
template does not extend the previous rendering (it rewrites earlier turns, e.g. drops reasoning), the
episode ends with stop reason ``template_drift`` instead of training on drifted tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from rlray.envs.base import Message

STOP_REASONS = (
    "done",  # the environment ended the episode (an answer, the game over)
    "env_truncated",  # the environment cut it short (its own limit)
    "single_turn",  # a row without an environment: one completion
    "max_turns",  # env.max_turns assistant turns were sampled
    "length",  # a turn hit rollout.max_new_tokens
    "max_episode_tokens",  # the next turn would not fit in env.max_episode_tokens
    "prompt_too_long",  # the opening prompt leaves no room for a first turn (failed)
    "template_drift",  # the chat template does not extend the previous tokens
    "env_error",  # the environment raised (the episode failed)
    "timeout",  # a reset or step call ran past env.step_timeout_s (failed)
    "episode_timeout",  # the episode ran past env.episode_timeout_s (failed)
    "actor_died",  # the environment actor died twice (failed)
)
FAILED_STOP_REASONS = frozenset({"env_error", "timeout", "episode_timeout", "actor_died", "prompt_too_long"})


class TemplateDriftError(ValueError):
    """The chat template's rendering with the new observations does not extend the previous rendering."""


@dataclass
class Trajectory:
    """One episode's token sequence and its per-token loss mask and logprobs.

    Attributes:
        prompt_ids: [Lp] the opening prompt's token ids (chat template, generation prompt).
        response_ids: [T] every token after the prompt: sampled and observation tokens.
        logprobs: [T] float nats; the engine's logprob for sampled tokens, 0.0 for observation tokens.
        loss_mask: [T] bool; True on sampled tokens, False on observation tokens.
        messages: the conversation as text (assistant turns as decoded), used only to render the
            template for the next observations.
        turn_spans: (start, end) of each assistant turn's sampled tokens within response_ids.
        turn_rewards: the reward the environment gave after each turn (None: none given).
        policy_versions: the engine's policy version of each turn (its first token's; async: turns may differ).
        versions: [T] the policy version of each token: a sampled token's (partial rollouts: a turn may span an
            update), an observation token the version of the token before it (never decreasing).
        stop_reason: why the episode ended (``STOP_REASONS``); "" while it runs.
        finish_reason: the last turn's engine finish reason ("stop" or "length").
        observations_truncated: observation messages cut to env.max_observation_tokens.
    """

    prompt_ids: list[int]
    messages: list[Message]
    tools: list[dict] | None = None
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    response_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    loss_mask: list[bool] = field(default_factory=list)
    turn_spans: list[tuple[int, int]] = field(default_factory=list)
    turn_rewards: list[float | None] = field(default_factory=list)
    policy_versions: list[int] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    stop_reason: str = ""
    finish_reason: str = "stop"
    observations_truncated: int = 0

    @property
    def token_ids(self) -> list[int]:
        """Returns prompt_ids + response_ids: what the engine continues from at the next turn."""
        return self.prompt_ids + self.response_ids

    @property
    def num_turns(self) -> int:
        """Returns the number of assistant turns sampled so far."""
        return len(self.turn_spans)

    @property
    def done(self) -> bool:
        """Returns True once the episode has a stop reason."""
        return bool(self.stop_reason)

    @property
    def failed(self) -> bool:
        """Returns True when the episode failed (its stop reason is in ``FAILED_STOP_REASONS``)."""
        return self.stop_reason in FAILED_STOP_REASONS

    @property
    def env_reward(self) -> float | None:
        """Returns the sum of the turn rewards given, or None when no turn gave one."""
        given = [r for r in self.turn_rewards if r is not None]
        return float(sum(given)) if given else None

    def add_turn(self, token_ids: list[int], logprobs: list[float], finish_reason: str, policy_version: int,
                 text: str, versions: list[int] | None = None) -> None:
        """Appends one sampled assistant turn (loss mask on) and its decoded text.

        Args:
            token_ids: [t] sampled token ids, the end-of-turn token included when the engine stopped on it.
            logprobs: [t] the engine's logprobs of those tokens (nats).
            finish_reason: the engine's "stop" or "length".
            policy_version: the engine's policy version for this turn (its first token's).
            text: the turn decoded without special tokens (the assistant message for the template).
            versions: [t] the policy version of each token (``Completion.versions``); None: all ``policy_version``.

        Raises:
            ValueError: token_ids, logprobs and versions differ in length.
        """
        versions = [int(policy_version)] * len(token_ids) if versions is None else [int(v) for v in versions]
        if not len(token_ids) == len(logprobs) == len(versions):
            raise ValueError(f"add_turn: {len(token_ids)} tokens but {len(logprobs)} logprobs and {len(versions)} versions")
        start = len(self.response_ids)
        self.response_ids += list(token_ids)
        self.logprobs += [float(x) for x in logprobs]
        self.loss_mask += [True] * len(token_ids)
        self.versions += versions
        self.turn_spans.append((start, len(self.response_ids)))
        self.policy_versions.append(int(policy_version))
        self.finish_reason = finish_reason
        self.messages.append({"role": "assistant", "content": text})

    def add_observations(self, tokenizer: Any, observations: list[Message]) -> int:
        """Appends the observation messages' tokens (loss mask off) and the next generation prompt.

        Args:
            tokenizer: the policy's tokenizer (chat template set; ``eos_token`` ends an assistant turn).
            observations: messages after the last assistant turn (role "tool" or "user").

        Returns:
            The number of tokens appended.

        Raises:
            TemplateDriftError: the template's rendering with the observations does not extend the
                rendering without them, or the assistant turn does not end with the EOS token's text.
        """
        before = self._render(tokenizer, self.messages, add_generation_prompt=False)
        after = self._render(tokenizer, self.messages + list(observations), add_generation_prompt=True)
        if not after.startswith(before):
            raise TemplateDriftError("the chat template rewrites earlier turns when observations are added")
        eos_text = tokenizer.eos_token
        end = before.rfind(eos_text) if eos_text else -1
        if end < 0:
            raise TemplateDriftError(f"the chat template does not end an assistant turn with the EOS token {eos_text!r}")
        closing = before[end + len(eos_text):]
        ids: list[int] = []
        if not self.response_ids or self.response_ids[-1] != tokenizer.eos_token_id:
            ids.append(int(tokenizer.eos_token_id))  # a turn cut by a stop string or the cap: close it
        ids += list(tokenizer(closing + after[len(before):], add_special_tokens=False)["input_ids"])
        self.response_ids += ids
        self.logprobs += [0.0] * len(ids)
        self.loss_mask += [False] * len(ids)
        self.versions += self.versions[-1:] * len(ids)  # masked out: the version before them, never decreasing
        self.messages += [dict(m) for m in observations]
        return len(ids)

    def _render(self, tokenizer: Any, messages: list[Message], *, add_generation_prompt: bool) -> str:
        return tokenizer.apply_chat_template(messages, tools=self.tools or None, tokenize=False,
                                             add_generation_prompt=add_generation_prompt, **self.chat_template_kwargs)


def open_trajectory(tokenizer: Any, prompt: list[Message], *, tools: list[dict] | None = None,
                    chat_template_kwargs: dict[str, Any] | None = None) -> Trajectory:
    """Returns a new trajectory whose prompt is ``prompt`` rendered with the chat template and its generation prompt.

    The text is tokenized with ``add_special_tokens=False`` (the template writes any BOS), as
    ``rlray.data.render_prompt`` does for single-turn prompts.

    Args:
        tokenizer: the policy's tokenizer.
        prompt: the opening messages (``EnvReset.prompt`` after data.instruction / data.system_prompt).
        tools: the tools' JSON schemas for the template (None: no tools).
        chat_template_kwargs: extra template variables (``rollout.chat_template_kwargs``).

    Raises:
        ValueError: an empty prompt.
    """
    if not prompt:
        raise ValueError("open_trajectory: the episode's opening prompt has no messages")
    kwargs = dict(chat_template_kwargs or {})
    text = tokenizer.apply_chat_template(list(prompt), tools=tools or None, tokenize=False, add_generation_prompt=True,
                                         **kwargs)
    ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
    return Trajectory(ids, [dict(m) for m in prompt], tools or None, kwargs)


def truncate_observations(tokenizer: Any, observations: list[Message], max_tokens: int) -> tuple[list[Message], int]:
    """Returns the observations with each message's content cut to ``max_tokens`` tokens, and how many were cut.

    A cut content ends with " [truncated]" so the model can tell. Only the string content is cut; the
    template's own tokens around it are not counted.

    Args:
        max_tokens: the cap per observation message, in tokens (env.max_observation_tokens).
    """
    out, cut = [], 0
    for m in observations:
        content = m.get("content")
        if isinstance(content, str):
            ids = tokenizer(content, add_special_tokens=False)["input_ids"]
            if len(ids) > max_tokens:
                m = {**m, "content": tokenizer.decode(ids[:max_tokens]) + " [truncated]"}
                cut += 1
        out.append(m)
    return out, cut
