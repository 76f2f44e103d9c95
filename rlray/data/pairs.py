"""Preference pairs for the offline methods: hh-rlhf-style dialogues -> prompt, chosen and rejected token ids.

A source row is ``{"chosen": str, "rejected": str}``, each a whole dialogue in Anthropic hh-rlhf form,
``"\\n\\nHuman: ...\\n\\nAssistant: ...\\n\\nHuman: ...\\n\\nAssistant: <final answer>"``. The turns before
the final assistant turn are the prompt (shared by both sides); the final assistant turns are the two
responses. The prompt is rendered with the tokenizer's chat template (Human -> user, Assistant ->
assistant, with the generation prompt); a response is its text followed by EOS, as TRL's DPOTrainer does.

Rows whose two dialogues differ before the final assistant turn, whose final assistant turn is empty, or
whose chosen and rejected responses are identical (no preference to learn) cannot form a pair and are
skipped, counted and logged (hh-rlhf harmless-base test: 5, 4 and 0 of 2312 rows). Rows that are not such
dialogues at all, lines that are not UTF-8 or JSON, and a pair id that appears twice (two files with the
same name) are errors that name the file and line (``rlray.data.jsonl``).

The pairs become a ``pyarrow.Table`` (``PAIR_SCHEMA``); the reference policy's sequence logprobs are
computed once per pair and stored in it (``ref_*`` columns) before training.
"""

from __future__ import annotations

import logging
import re
from collections import Counter
from dataclasses import dataclass
from pathlib import PurePosixPath

import numpy as np
import pyarrow as pa
import torch

from rlray.data.jsonl import DataError, read_jsonl
from rlray.schema import PairBatch, pack_sequences, response_mask_from_lengths

log = logging.getLogger(__name__)

_TURN = re.compile(r"\n\n(Human|Assistant):")
_ROLES = {"Human": "user", "Assistant": "assistant"}

PAIR_SCHEMA = pa.schema(
    [
        pa.field("prompt_id", pa.string(), nullable=False),  # "<file stem>:<row>" (0-based)
        pa.field("prompt_token_ids", pa.list_(pa.int32()), nullable=False),  # chat-templated prompt
        pa.field("chosen_token_ids", pa.list_(pa.int32()), nullable=False),  # chosen response + EOS
        pa.field("rejected_token_ids", pa.list_(pa.int32()), nullable=False),  # rejected response + EOS
        pa.field("kl_token_ids", pa.list_(pa.int32()), nullable=False),  # KTO: the next pair's chosen response
        pa.field("ref_chosen_logps", pa.float32()),  # reference sum of chosen token logprobs (nats), or null
        pa.field("ref_rejected_logps", pa.float32()),  # reference sum of rejected token logprobs (nats), or null
        pa.field("ref_kl_logps", pa.float32()),  # reference sum over kl_token_ids after this prompt, or null
    ]
)
REF_COLUMNS = ("ref_chosen_logps", "ref_rejected_logps", "ref_kl_logps")


@dataclass(frozen=True)
class PreferencePair:
    """One preference pair in text form.

    Attributes:
        prompt_id: ``"<file stem>:<row index>"`` (0-based), the pair's stable id.
        messages: the prompt turns as chat messages ({"role": "user"|"assistant", "content": str}).
        chosen: the preferred final assistant turn.
        rejected: the other final assistant turn.
    """

    prompt_id: str
    messages: tuple[dict[str, str], ...]
    chosen: str
    rejected: str


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


def load_preference_pairs(files: list[str], *, max_pairs: int | None = None) -> tuple[list[PreferencePair], int]:
    """Returns (pairs in file order, number of rows skipped) from JSONL files (local or fsspec URIs, .gz fine).

    Args:
        files: sources (``offline.pairs_files``).
        max_pairs: stop after this many pairs (``offline.max_pairs``); None reads everything.

    Raises:
        DataError: no files, an unreadable or empty file, a line that is not UTF-8 or not a JSON object with
            string 'chosen' and 'rejected', a side that is not an hh-rlhf dialogue (each names ``file:line``),
            or a pair id that appears twice.
    """
    if not files:
        raise DataError("no preference files given; set offline.pairs_files")
    pairs: list[PreferencePair] = []
    seen: dict[str, str] = {}
    skipped: Counter[str] = Counter()
    for path in files:
        if max_pairs is not None and len(pairs) >= max_pairs:
            break
        stem = PurePosixPath(path).name.split(".", 1)[0]
        for line, row in read_jsonl(path):
            if max_pairs is not None and len(pairs) >= max_pairs:
                break
            pair, reason = _parse_row(row, f"{path}:{line}", f"{stem}:{line - 1}")
            if pair is None:
                skipped[reason] += 1
                continue
            if pair.prompt_id in seen:
                raise DataError(
                    f"{path}:{line}: pair id '{pair.prompt_id}' appears twice ({seen[pair.prompt_id]} and {path}); "
                    "give the files distinct names"
                )
            seen[pair.prompt_id] = path
            pairs.append(pair)
    if skipped:
        log.warning("skipped %d preference rows that cannot form a pair (%s)", sum(skipped.values()),
                    ", ".join(f"{n} {why}" for why, n in sorted(skipped.items())))
    return pairs, sum(skipped.values())


def _parse_row(row: dict, where: str, prompt_id: str) -> tuple[PreferencePair | None, str]:
    """Returns (the pair, "") or (None, why it was skipped); raises DataError naming ``where``."""
    for key in ("chosen", "rejected"):
        if key not in row:
            raise DataError(f"{where}: need string fields 'chosen' and 'rejected'; '{key}' is missing (keys {sorted(row)})")
        if not isinstance(row[key], str):
            raise DataError(f"{where}: '{key}' must be a string (an hh-rlhf dialogue), got {type(row[key]).__name__} "
                            f"{row[key]!r:.80}")
    sides = {}
    for key in ("chosen", "rejected"):
        try:
            sides[key] = parse_dialogue(row[key])
        except ValueError as err:
            raise DataError(f"{where}: '{key}': {err}; got {row[key][:80]!r}") from None
    (prompt, chosen), (other_prompt, rejected) = sides["chosen"], sides["rejected"]
    if prompt != other_prompt:
        return None, "with different prompts"
    if not chosen or not rejected:
        return None, "with an empty response"
    if chosen == rejected:
        return None, "with identical chosen and rejected responses"
    return PreferencePair(prompt_id, tuple(prompt), chosen, rejected), ""


def split_pairs(
    pairs: list[PreferencePair], *, eval_fraction: float, seed: int
) -> tuple[list[PreferencePair], list[PreferencePair]]:
    """Returns (train, eval): round(N * eval_fraction) pairs drawn by ``np.random.default_rng(seed)`` go to eval.

    Both keep file order. The split depends only on (N, eval_fraction, seed).

    Raises:
        DataError: fewer than 2 pairs, or no training pair left.
    """
    n = len(pairs)
    n_eval = int(round(n * eval_fraction))
    if n < 2 or n_eval >= n:
        raise DataError(f"{n} preference pair(s) with offline.eval_fraction={eval_fraction} leave no training pair")
    held = set(np.random.default_rng(seed).permutation(n)[:n_eval].tolist())
    return [p for i, p in enumerate(pairs) if i not in held], [p for i, p in enumerate(pairs) if i in held]


def pairs_table(pairs: list[PreferencePair], tokenizer, *, max_prompt_tokens: int, max_response_tokens: int) -> pa.Table:
    """Returns the ``PAIR_SCHEMA`` table of ``pairs`` with token ids (reference columns null).

    The prompt keeps its last ``max_prompt_tokens`` tokens (TRL's keep-end truncation: the latest turns
    matter most); each response keeps its first ``max_response_tokens`` tokens (EOS is lost when cut).
    KTO's mismatched completion of pair i is the chosen response of pair (i + 1) mod N.
    """
    eos = tokenizer.eos_token_id
    prompts, chosen, rejected = [], [], []
    for p in pairs:
        text = tokenizer.apply_chat_template(list(p.messages), add_generation_prompt=True, tokenize=False)
        prompts.append(tokenizer(text, add_special_tokens=False)["input_ids"][-max_prompt_tokens:])
        for side, out in ((p.chosen, chosen), (p.rejected, rejected)):
            ids = tokenizer(side, add_special_tokens=False)["input_ids"] + [eos]
            out.append(ids[:max_response_tokens])
    n = len(pairs)
    columns = {
        "prompt_id": [p.prompt_id for p in pairs],
        "prompt_token_ids": prompts,
        "chosen_token_ids": chosen,
        "rejected_token_ids": rejected,
        "kl_token_ids": [chosen[(i + 1) % n] for i in range(n)],
    }
    arrays = [pa.array(columns[f.name], type=f.type) if f.name in columns else pa.nulls(n, f.type) for f in PAIR_SCHEMA]
    return pa.Table.from_arrays(arrays, schema=PAIR_SCHEMA)


def collate_pairs(table: pa.Table, pad_token_id: int, *, with_kl: bool = False) -> PairBatch:
    """Returns the forward layout of P pairs (``schema.PairBatch``): 2P rows, the chosen responses first, then the
    rejected ones (``schema.pack_sequences``), response_mask [2P, T] bool from lengths, and each filled reference
    column [P] float32. With ``with_kl``, kl_inputs and kl_response_mask hold the same layout for the P
    (prompt, kl_token_ids) rows.
    """
    prompts = table.column("prompt_token_ids").to_pylist()
    responses = table.column("chosen_token_ids").to_pylist() + table.column("rejected_token_ids").to_pylist()
    inputs = pack_sequences(prompts + prompts, responses, pad_token_id)
    refs = {}
    for name in REF_COLUMNS:
        col = table.column(name)
        if col.null_count == 0:
            refs[name] = torch.tensor(col.to_pylist(), dtype=torch.float32)
    kl = {}
    if with_kl:
        kl_inputs = pack_sequences(prompts, table.column("kl_token_ids").to_pylist(), pad_token_id)
        kl = {"kl_inputs": kl_inputs, "kl_response_mask": response_mask_from_lengths(kl_inputs)}
    return PairBatch(inputs=inputs, response_mask=response_mask_from_lengths(inputs), **refs, **kl)
