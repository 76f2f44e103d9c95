"""One JSONL row of offline data, in any of TRL's dataset forms -> ``PreferencePair`` records (text, not tokens).

Preference rows (dpo, ipo, kto, orpo, simpo, reward_model; sft trains on their chosen side):

- standard, explicit prompt: ``{"prompt": "The sky is", "chosen": " blue.", "rejected": " green."}``; the
  prompt is plain text, tokenized as is (no chat template), as TRL does for standard rows.
- conversational, explicit prompt: ``{"prompt": [messages], "chosen": [one assistant message],
  "rejected": [one assistant message]}``; the prompt gets the chat template with the generation prompt.
- standard, implicit prompt: ``{"chosen": str, "rejected": str}``. Anthropic hh-rlhf dialogues
  (``"\\n\\nHuman: ...\\n\\nAssistant: ..."``) are parsed into chat messages (``parse_dialogue``); other
  strings split at their longest common prefix (the prompt), a space just before the split going to the
  completions, as TRL's ``extract_prompt``.
- conversational, implicit prompt: ``{"chosen": [messages], "rejected": [messages]}``; the common leading
  messages are the prompt, and each side must then hold one assistant message.

Unpaired rows (kto only; ``PreferencePair.label`` is the label, ``chosen`` the completion, ``rejected`` None):

- ``{"prompt": str | [messages], "completion": str | [one assistant message], "label": bool}``: true for a
  desirable completion, false for an undesirable one (TRL's unpaired preference type, as KTOTrainer takes it).

SFT rows (sft only; ``PreferencePair.rejected`` is None):

- ``{"messages": [messages]}``: one record per assistant turn, its prompt the messages before it, so the
  loss covers every assistant turn and nothing else (TRL SFTTrainer's ``assistant_only_loss``).
- ``{"prompt": str | [messages], "completion": str | [one assistant message]}``: the loss on the completion
  only (SFTTrainer's default ``completion_only_loss``).
- ``{"text": str}``: the loss on every token (the prompt is empty; ``pairs_table`` gives it the first token).

A message is ``{"role": str, "content": str}``. A row that cannot form a record (different hh-rlhf prompts,
an empty or identical response, no common prompt, no assistant turn) is a counted skip; a row of no accepted
form, or with a malformed field, is a ``DataError`` naming ``file:line`` and the field. Source of the forms:
TRL 1.16 docs "Dataset formats and types" and ``trl/data_utils.py`` (``extract_prompt``, ``is_conversational``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from rlray.data.jsonl import DataError

_TURN = re.compile(r"\n\n(Human|Assistant):")
_ROLES = {"Human": "user", "Assistant": "assistant"}

ACCEPTED_FORMS = (
    "accepted rows: preference {'prompt', 'chosen', 'rejected'} (texts, or a message list and one-assistant-message "
    "lists), {'chosen', 'rejected'} (hh-rlhf dialogues, texts with a common prefix, or message lists with common "
    "leading messages); for algo.name=kto also unpaired {'prompt', 'completion', 'label': true|false}; for "
    "algo.name=sft also {'messages'}, {'prompt', 'completion'} and {'text'}; a message is {'role': str, 'content': str}"
)


@dataclass(frozen=True)
class PreferencePair:
    """One offline record in text form: a preference pair, an unpaired KTO example (label set) or an SFT example.

    Attributes:
        prompt_id: ``"<file stem>:<row index>"`` (0-based), the record's stable id; ``"...:<row>#<k>"`` for the
            k-th (0-based) assistant turn of a multi-turn ``messages`` row.
        messages: the prompt turns as chat messages ({"role": str, "content": str}); empty when ``prompt_text``
            is set.
        chosen: the preferred completion (an SFT row's completion, an unpaired row's completion).
        rejected: the other completion; None for an SFT or unpaired row.
        prompt_text: the plain-text prompt of a standard row, tokenized as is (no chat template); None when the
            prompt is ``messages``.
        label: an unpaired KTO row's label (True: desirable, False: undesirable); None for pairs and SFT rows.
    """

    prompt_id: str
    messages: tuple[dict[str, str], ...]
    chosen: str
    rejected: str | None
    prompt_text: str | None = None
    label: bool | None = None


def parse_dialogue(text: str) -> tuple[list[dict[str, str]], str]:
    """Returns (prompt messages, final assistant text) of an hh-rlhf dialogue.

    Raises:
        ValueError: no turns, text before the first turn, or a last turn that is not the Assistant's.
    """
    parts = _TURN.split(text)
    if len(parts) < 3 or parts[0].strip():
        raise ValueError("expected a dialogue of '\\n\\nHuman: ...' and '\\n\\nAssistant: ...' turns")
    turns = [(_ROLES[parts[i]], parts[i + 1].strip()) for i in range(1, len(parts), 2)]
    if turns[-1][0] != "assistant" or len(turns) < 2:
        raise ValueError("the dialogue must end with an '\\n\\nAssistant:' turn after at least one Human turn")
    return [{"role": r, "content": c} for r, c in turns[:-1]], turns[-1][1]


def parse_row(row: dict, where: str, prompt_id: str) -> tuple[list[PreferencePair], str]:
    """Returns (the row's records, "") or ([], why it was skipped) for one JSON object of any accepted form.

    Args:
        row: the JSON object.
        where: ``"file:line"`` for errors.
        prompt_id: ``"<file stem>:<row index>"``.

    Raises:
        DataError: no accepted form, or a malformed field; names ``where``, the field and the accepted forms.
    """
    if "chosen" in row or "rejected" in row:
        for key in ("chosen", "rejected"):
            if key not in row:
                raise DataError(f"{where}: need fields 'chosen' and 'rejected'; '{key}' is missing (keys {sorted(row)}); "
                                f"{ACCEPTED_FORMS}")
        pair, reason = _preference(row, where, prompt_id)
        return ([pair] if pair else []), reason
    if "messages" in row:
        return _conversation(_messages(row["messages"], where, "messages"), prompt_id)
    if "completion" in row:
        if "prompt" not in row:
            raise DataError(f"{where}: 'completion' needs a 'prompt' (keys {sorted(row)}); {ACCEPTED_FORMS}")
        label = row.get("label")  # an unpaired KTO row when present
        if "label" in row and not isinstance(label, bool):
            raise DataError(f"{where}: 'label' must be true or false (desirable or not), got {label!r:.80}; "
                            f"{ACCEPTED_FORMS}")
        if isinstance(row["prompt"], str):
            completion = _text(row["completion"], where, "completion")
            return _record(prompt_id, (), completion, None, row["prompt"], label)
        prompt = _messages(row["prompt"], where, "prompt")
        completion = _assistant(_messages(row["completion"], where, "completion"), where, "completion")
        return _record(prompt_id, tuple(prompt), completion, None, None, label)
    if "text" in row:
        return _record(prompt_id, (), _text(row["text"], where, "text"), None, "")
    raise DataError(f"{where}: no known fields (keys {sorted(row)}); {ACCEPTED_FORMS}")


def _record(prompt_id, messages, chosen, rejected, prompt_text, label=None) -> tuple[list[PreferencePair], str]:
    if not chosen or rejected == "":
        return [], "with an empty response"
    if chosen == rejected:
        return [], "with identical chosen and rejected responses"
    return [PreferencePair(prompt_id, messages, chosen, rejected, prompt_text, label)], ""


def _preference(row: dict, where: str, prompt_id: str) -> tuple[PreferencePair | None, str]:
    chosen, rejected = row["chosen"], row["rejected"]
    conversational = not isinstance(chosen, str)
    prompt = row.get("prompt")
    # TRL's maybe_extract_prompt: a prompt of the other kind than the completions is ignored (implicit prompt)
    if prompt is not None and isinstance(prompt, str) == conversational:
        prompt = None
    if conversational:
        c, r = _messages(chosen, where, "chosen"), _messages(rejected, where, "rejected")
        if prompt is None:
            n = 0
            while n < min(len(c), len(r)) and c[n] == r[n]:
                n += 1
            if n == 0:
                return None, "with no common prompt"
            prompt, c, r = c[:n], c[n:], r[n:]
        else:
            prompt = _messages(prompt, where, "prompt")
        if not c or not r:
            return None, "with an empty response"
        pairs, reason = _record(prompt_id, tuple(prompt), _assistant(c, where, "chosen"), _assistant(r, where, "rejected"),
                                None)  # fmt: skip
        return (pairs[0] if pairs else None), reason
    for key in ("chosen", "rejected"):
        _text(row[key], where, key)
    if prompt is not None:
        pairs, reason = _record(prompt_id, (), chosen, rejected, prompt)
        return (pairs[0] if pairs else None), reason
    if chosen.startswith("\n\nHuman:") or rejected.startswith("\n\nHuman:"):
        return _hh_rlhf(chosen, rejected, where, prompt_id)
    n = 0
    while n < min(len(chosen), len(rejected)) and chosen[n] == rejected[n]:
        n += 1
    if n and chosen[n - 1] == " ":  # the space before the split goes to the completions, as TRL's extract_prompt
        n -= 1
    if n == 0 and chosen != rejected:
        return None, "with no common prompt"
    pairs, reason = _record(prompt_id, (), chosen[n:], rejected[n:], chosen[:n])
    return (pairs[0] if pairs else None), reason


def _hh_rlhf(chosen: str, rejected: str, where: str, prompt_id: str) -> tuple[PreferencePair | None, str]:
    sides = {}
    for key, text in (("chosen", chosen), ("rejected", rejected)):
        try:
            sides[key] = parse_dialogue(text)
        except ValueError as err:
            raise DataError(f"{where}: '{key}': {err}; got {text[:80]!r}") from None
    (prompt, c), (other_prompt, r) = sides["chosen"], sides["rejected"]
    if prompt != other_prompt:
        return None, "with different prompts"
    if not c or not r:
        return None, "with an empty response"
    if c == r:
        return None, "with identical chosen and rejected responses"
    return PreferencePair(prompt_id, tuple(prompt), c, r), ""


def _conversation(messages: list[dict[str, str]], prompt_id: str) -> tuple[list[PreferencePair], str]:
    turns = [i for i, m in enumerate(messages) if m["role"] == "assistant" and i > 0]
    if not turns:
        return [], "with no assistant turn after a prompt"
    out = []
    for k, i in enumerate(turns):
        rid = prompt_id if len(turns) == 1 else f"{prompt_id}#{k}"
        if messages[i]["content"]:
            out.append(PreferencePair(rid, tuple(messages[:i]), messages[i]["content"], None))
    return out, ("" if out else "with an empty response")


def _text(value, where: str, key: str) -> str:
    if not isinstance(value, str):
        raise DataError(f"{where}: '{key}' must be a string here, got {type(value).__name__} {value!r:.80}; "
                        f"{ACCEPTED_FORMS}")
    return value


def _messages(value, where: str, key: str) -> list[dict[str, str]]:
    if not isinstance(value, list) or not value:
        raise DataError(f"{where}: '{key}' must be a string or a non-empty list of messages, got "
                        f"{type(value).__name__} {value!r:.80}; {ACCEPTED_FORMS}")
    for i, m in enumerate(value):
        if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
            raise DataError(f"{where}: '{key}'[{i}] must be a message {{'role': str, 'content': str}}, got {m!r:.80}; "
                            f"{ACCEPTED_FORMS}")
    return [{"role": m["role"], "content": m["content"]} for m in value]


def _assistant(messages: list[dict[str, str]], where: str, key: str) -> str:
    if len(messages) != 1 or messages[0]["role"] != "assistant":
        raise DataError(f"{where}: '{key}' must hold exactly one assistant message after the prompt, got "
                        f"{[m['role'] for m in messages]}; {ACCEPTED_FORMS}")
    return messages[0]["content"]
