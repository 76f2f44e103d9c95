"""Prompt rendering (the chat template over a standard or conversational prompt) and the data cursor ``PromptStream``."""

from __future__ import annotations

import hashlib
import logging
from pathlib import Path
from typing import Any

import numpy as np
from transformers import PreTrainedTokenizerBase

from rlray.data.jsonl import DataError
from rlray.data.prompt_cache import tokenize_cached
from rlray.data.rows import PromptRow

log = logging.getLogger(__name__)


def render_prompt(
    tokenizer: PreTrainedTokenizerBase,
    prompt: str | list[dict[str, Any]],
    *,
    instruction: str,
    system_prompt: str | None,
) -> list[int]:
    """Returns the prompt token ids: the chat template over the prompt's messages, ready for generation.

    A standard prompt (a string) becomes ``[system?, user]``: the user turn is ``prompt + "\\n\\n" +
    instruction`` (``data.instruction``), or ``prompt`` alone when the instruction is empty. A
    conversational prompt (a list of ``{"role", "content"}`` messages) is copied; ``system_prompt`` is
    put first unless the first message already is a system message (the row's own wins), and
    ``"\\n\\n" + instruction`` is appended to the content of the last user message when the instruction
    is non-empty. When the last message is an assistant message (a prefill) the template renders it
    open, for the model to continue (``continue_final_message=True``; transformers drops whitespace at
    the end of the prefill), else it adds the generation prompt.

    The template is rendered to text and then tokenized with ``add_special_tokens=False``, so a BOS
    that the template writes is not doubled (the same as TRL's GRPOTrainer). A template that adds its
    own default system turn (SmolLM2's does) keeps it when no system message is given.

    Args:
        tokenizer: a tokenizer with a chat template (see ``rlray.models.load_tokenizer``).
        prompt: ``PromptRow.prompt``: a non-empty string, or a list of messages as ``load_prompt_rows``
            validates them; it is not modified.
        instruction: text appended to the (last) user turn after a blank line; "" for none.
        system_prompt: the system turn (``data.system_prompt``), or None for the row's or the template's default.

    Raises:
        ValueError: a conversational prompt without a user message and a non-empty ``instruction``.
    """
    text = prompt_text(tokenizer, prompt, instruction=instruction, system_prompt=system_prompt)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def prompt_text(
    tokenizer: PreTrainedTokenizerBase, prompt: str | list[dict[str, Any]], *, instruction: str, system_prompt: str | None
) -> str:
    """Returns the text ``render_prompt`` tokenizes: the chat template over the prompt's messages (``prompt_messages``),
    with the generation prompt, or the final assistant message left open (a prefill).

    Raises:
        ValueError: a conversational prompt without a user message and a non-empty ``instruction``.
    """
    messages = prompt_messages(prompt, instruction=instruction, system_prompt=system_prompt)
    prefill = messages[-1]["role"] == "assistant"
    return tokenizer.apply_chat_template(
        messages, add_generation_prompt=not prefill, continue_final_message=prefill, tokenize=False
    )


def prompt_messages(prompt: str | list[dict[str, Any]], *, instruction: str, system_prompt: str | None) -> list[dict[str, Any]]:
    """Returns the messages of a prompt with data.instruction and data.system_prompt applied (``render_prompt``'s rules).

    Also used for an episode's opening messages (``EnvReset.prompt``).

    Raises:
        ValueError: a conversational prompt without a user message and a non-empty ``instruction``.
    """
    if isinstance(prompt, str):
        messages = [] if system_prompt is None else [{"role": "system", "content": system_prompt}]
        messages.append({"role": "user", "content": f"{prompt}\n\n{instruction}" if instruction else prompt})
        return messages
    messages = [dict(m) for m in prompt]
    if system_prompt is not None and (not messages or messages[0]["role"] != "system"):
        messages.insert(0, {"role": "system", "content": system_prompt})
    if instruction:
        users = [i for i, m in enumerate(messages) if m["role"] == "user"]
        if not users:
            raise ValueError("render_prompt: the conversation has no 'user' message to append data.instruction to")
        messages[users[-1]]["content"] = f"{messages[users[-1]]['content']}\n\n{instruction}"
    return messages


def prepare_prompts(
    rows: list[PromptRow],
    tokenizer: PreTrainedTokenizerBase,
    *,
    max_prompt_tokens: int,
    instruction: str,
    system_prompt: str | None,
    long_prompts: str = "skip",
    cache: Path | None = None,
) -> tuple[list[PromptRow], list[list[int]], int]:
    """Returns (kept rows, their prompt token ids, number skipped): ``render_prompt`` then ``filter_long_prompts``.

    With ``cache`` (a folder: ``rlray.cache.cache_dir() / "prompts"``) the token ids of the rendered prompts are read
    from an earlier call's entry when the tokenizer and every rendered text are the same, else computed and stored
    (``rlray.data.prompt_cache.tokenize_cached``); the ids are the same either way.

    Args:
        rows: prompt rows (``load_prompt_rows``).
        tokenizer: a tokenizer with a chat template.
        max_prompt_tokens: the longest prompt kept, in tokens after the chat template (``data.max_prompt_tokens``).
        instruction: text appended to each prompt's (last) user turn (``data.instruction``); "" for none.
        system_prompt: the system turn (``data.system_prompt``), or None.
        long_prompts: ``data.long_prompts``: "skip" drops longer prompts (logged with the count and the first
            ids), "error" raises.
        cache: the prompt token cache's folder, or None to tokenize every prompt.

    Raises:
        DataError: ``long_prompts="error"`` and a prompt is longer than ``max_prompt_tokens`` (names the
            first one's id, its length and the two ways out); or every prompt was skipped.
    """
    texts = [prompt_text(tokenizer, r.prompt, instruction=instruction, system_prompt=system_prompt) for r in rows]
    ids = tokenize_cached(tokenizer, texts, cache)
    long = [(r.prompt_id, len(i)) for r, i in zip(rows, ids, strict=True) if len(i) > max_prompt_tokens]
    if long and long_prompts == "error":
        raise DataError(
            f"prompt '{long[0][0]}' has {long[0][1]} tokens after the chat template, more than "
            f"data.max_prompt_tokens={max_prompt_tokens} ({len(long)} of {len(rows)} prompts are); raise "
            "data.max_prompt_tokens or set data.long_prompts=skip"
        )
    kept = filter_long_prompts(rows, ids, max_prompt_tokens)
    if long:
        log.warning("skipped %d of %d prompts longer than data.max_prompt_tokens=%d (first: %s)", len(long), len(rows),
                    max_prompt_tokens, ", ".join(f"'{p}' {n} tokens" for p, n in long[:3]))
    if rows and not kept[0]:
        raise DataError(
            f"every one of the {len(rows)} prompts is longer than data.max_prompt_tokens={max_prompt_tokens}; raise it"
        )
    return kept


def filter_long_prompts(
    rows: list[PromptRow], token_ids: list[list[int]], max_prompt_tokens: int
) -> tuple[list[PromptRow], list[list[int]], int]:
    """Returns (kept rows, their token ids, number skipped): prompts longer than ``max_prompt_tokens`` are dropped.

    Args:
        rows: prompt rows.
        token_ids: the rendered prompt of each row (``render_prompt``), same order and length as ``rows``.
        max_prompt_tokens: the longest prompt kept, in tokens after the chat template (``data.max_prompt_tokens``).

    Raises:
        ValueError: ``rows`` and ``token_ids`` differ in length.
    """
    if len(rows) != len(token_ids):
        raise ValueError(f"filter_long_prompts: {len(rows)} rows but {len(token_ids)} token id lists")
    kept = [(row, ids) for row, ids in zip(rows, token_ids, strict=True) if len(ids) <= max_prompt_tokens]
    return [row for row, _ in kept], [ids for _, ids in kept], len(rows) - len(kept)


class PromptStream:
    """The training data cursor: an endless, seeded stream of prompt rows, epoch after epoch.

    Epoch ``e`` visits every row once, in a permutation drawn from ``np.random.default_rng([seed, e])``
    when ``shuffle`` is True, else in file order. The cursor (``epoch``, ``position`` within the
    epoch) is all the state, so ``state_dict``/``load_state_dict`` resume exactly.

    Attributes:
        epoch: index of the current epoch (0-based).
        position: rows of the current epoch already handed out.
    """

    def __init__(self, rows: list[PromptRow], *, seed: int, shuffle: bool) -> None:
        """Builds a stream at epoch 0, position 0.

        Raises:
            ValueError: ``rows`` is empty.
        """
        if not rows:
            raise ValueError("PromptStream needs at least one prompt row; check data.train_files")
        self._rows = list(rows)
        self._seed = seed
        self._shuffle = shuffle
        self._fingerprint = hashlib.sha256("\n".join(r.prompt_id for r in rows).encode()).hexdigest()[:16]
        self.epoch = 0
        self.position = 0
        self._order = self._epoch_order(0)

    def __len__(self) -> int:
        """Returns the number of rows in one epoch."""
        return len(self._rows)

    def next_batch(self, n: int) -> list[PromptRow]:
        """Returns the next ``n`` rows, continuing into the next epoch (freshly shuffled) when one ends.

        Raises:
            ValueError: ``n`` < 1.
        """
        if n < 1:
            raise ValueError(f"next_batch: n must be >= 1, got {n}")
        batch: list[PromptRow] = []
        while len(batch) < n:
            take = min(n - len(batch), len(self._rows) - self.position)
            batch.extend(self._rows[i] for i in self._order[self.position : self.position + take])
            self.position += take
            if self.position == len(self._rows):
                self.epoch += 1
                self.position = 0
                self._order = self._epoch_order(self.epoch)
        return batch

    def state_dict(self) -> dict[str, Any]:
        """Returns the cursor as plain JSON-able values (epoch, position, seed, shuffle, rows fingerprint)."""
        return {
            "epoch": self.epoch,
            "position": self.position,
            "seed": self._seed,
            "shuffle": self._shuffle,
            "num_rows": len(self._rows),
            "rows_fingerprint": self._fingerprint,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restores the cursor saved by ``state_dict``.

        Raises:
            ValueError: the state was saved over different rows (count or prompt-id fingerprint), with a
                different seed or shuffle setting, or has a position outside the epoch.
        """
        expected = {
            "num_rows": len(self._rows),
            "rows_fingerprint": self._fingerprint,
            "seed": self._seed,
            "shuffle": self._shuffle,
        }
        for key, value in expected.items():
            if state.get(key) != value:
                raise ValueError(
                    f"PromptStream state {key}={state.get(key)!r} does not match this stream ({value!r}); "
                    "resume with the same data files, run.seed and data.shuffle"
                )
        if not 0 <= int(state["position"]) < len(self._rows) or int(state["epoch"]) < 0:
            raise ValueError(f"PromptStream state has epoch={state['epoch']}, position={state['position']} out of range")
        self.epoch = int(state["epoch"])
        self.position = int(state["position"])
        self._order = self._epoch_order(self.epoch)

    def _epoch_order(self, epoch: int) -> list[int]:
        """Returns the row order of ``epoch``."""
        if not self._shuffle:
            return list(range(len(self._rows)))
        return np.random.default_rng([self._seed, epoch]).permutation(len(self._rows)).tolist()
