"""Offline data (preference pairs and SFT examples) -> prompt, chosen and rejected token ids.

The rows may take any of TRL's dataset forms (``rlray.data.pair_rows``: standard or conversational, explicit
or implicit prompt; ``messages``, prompt-completion and ``text`` rows for sft). Anthropic hh-rlhf dialogues
``{"chosen": str, "rejected": str}`` (``"\\n\\nHuman: ...\\n\\nAssistant: <final answer>"``) keep their
parsing: the turns before the final assistant turn are the prompt (shared by both sides), rendered with the
tokenizer's chat template (Human -> user, Assistant -> assistant, with the generation prompt); a message
prompt always gets the chat template, a plain-text prompt is tokenized as is. A response is its text followed
by EOS, as TRL's DPOTrainer does. An SFT example has no rejected side (an empty ``rejected_token_ids``).

Rows that cannot form a record (two hh-rlhf dialogues that differ before the final assistant turn, an empty
final assistant turn, identical chosen and rejected responses) are skipped, counted and logged (hh-rlhf
harmless-base test: 5, 4 and 0 of 2312 rows). Rows of no accepted form, lines that are not UTF-8 or JSON,
and a pair id that appears twice (two files with the same name) are errors that name the file and line
(``rlray.data.jsonl``).

The pairs become a ``pyarrow.Table`` (``PAIR_SCHEMA``); the reference policy's sequence logprobs are
computed once per pair and stored in it (``ref_*`` columns) before training.
"""

from __future__ import annotations

import logging
from collections import Counter
from pathlib import PurePosixPath

import numpy as np
import pyarrow as pa
import torch

from rlray.data.jsonl import DataError, read_jsonl
from rlray.data.pair_rows import ACCEPTED_FORMS, PreferencePair, parse_dialogue, parse_row  # noqa: F401 (re-exported)
from rlray.schema import PairBatch, pack_sequences, response_mask_from_lengths

log = logging.getLogger(__name__)

PAIR_SCHEMA = pa.schema(
    [
        pa.field("prompt_id", pa.string(), nullable=False),  # "<file stem>:<row>" (0-based)
        pa.field("prompt_token_ids", pa.list_(pa.int32()), nullable=False),  # chat-templated prompt
        pa.field("chosen_token_ids", pa.list_(pa.int32()), nullable=False),  # chosen response + EOS
        pa.field("rejected_token_ids", pa.list_(pa.int32()), nullable=False),  # rejected response + EOS
        pa.field("kl_token_ids", pa.list_(pa.int32()), nullable=False),  # KTO: the next pair's chosen response
        pa.field("label", pa.bool_()),  # an unpaired KTO row's label (chosen holds its completion); null for pairs
        pa.field("ref_chosen_logps", pa.float32()),  # reference sum of chosen token logprobs (nats), or null
        pa.field("ref_rejected_logps", pa.float32()),  # reference sum of rejected token logprobs (nats), or null
        pa.field("ref_kl_logps", pa.float32()),  # reference sum over kl_token_ids after this prompt, or null
    ]
)
REF_COLUMNS = ("ref_chosen_logps", "ref_rejected_logps", "ref_kl_logps")


def load_preference_pairs(
    files: list[str], *, method: str | None = None, max_pairs: int | None = None
) -> tuple[list[PreferencePair], int]:
    """Returns (records in file order, number of rows skipped) from JSONL files (local or fsspec URIs, .gz fine).

    Args:
        files: sources (``offline.pairs_files``).
        method: the offline method (``algo.name``): each row's form is checked against it
            (``require_preferences``); None takes every form.
        max_pairs: stop after this many records (``offline.max_pairs``); None reads everything.

    Raises:
        DataError: no files, an unreadable or empty file, a line that is not UTF-8 or not a JSON object of an
            accepted form (``rlray.data.pair_rows.parse_row``), a row of a form ``method`` does not take, or a
            pair id that appears twice; each names ``file:line``.
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
            records, reason = parse_row(row, f"{path}:{line}", f"{stem}:{line - 1}")
            if not records:
                skipped[reason] += 1
                continue
            for pair in records:
                if method is not None:
                    require_preferences(pair, method, f"{path}:{line}")
                if pair.prompt_id in seen:
                    raise DataError(
                        f"{path}:{line}: pair id '{pair.prompt_id}' appears twice ({seen[pair.prompt_id]} and {path}); "
                        "give the files distinct names"
                    )
                seen[pair.prompt_id] = path
            pairs.extend(records)
    if skipped:
        log.warning("skipped %d preference rows that cannot form a pair (%s)", sum(skipped.values()),
                    ", ".join(f"{n} {why}" for why, n in sorted(skipped.items())))
    return pairs[:max_pairs], sum(skipped.values())


def require_preferences(record: PreferencePair, method: str, where: str) -> None:
    """Checks that ``method`` takes the form of ``record`` (one parsed row's record).

    Every method takes preference pairs (sft trains on their chosen side); only kto takes unpaired rows
    (``label`` set); only sft takes SFT rows (``messages``, prompt-completion without a label, ``text``).

    Args:
        record: a record of ``rlray.data.pair_rows.parse_row``.
        method: the offline method (``algo.name``).
        where: ``"file:line"`` of the row, for the error.

    Raises:
        DataError: a row of a form ``method`` does not take; names ``where``, the form and the accepted forms.
    """
    if record.label is not None and method != "kto":
        raise DataError(f"{where}: an unpaired row ('prompt', 'completion', 'label') has no 'chosen'/'rejected' pair: "
                        f"only algo.name=kto takes it, not {method}; {ACCEPTED_FORMS}")
    if record.label is None and record.rejected is None and method != "sft":
        raise DataError(f"{where}: this row has no 'rejected' side: it is SFT data, which only algo.name=sft takes, "
                        f"not {method}; {ACCEPTED_FORMS}")


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
    KTO's mismatched completion of pair i is the chosen response of pair (i + 1) mod N. A message prompt gets
    the chat template with the generation prompt; a plain-text prompt (``prompt_text``) is tokenized as is,
    and an empty one (a ``text`` row) takes the completion's first token, which nothing predicts. An SFT
    example (rejected None) and an unpaired KTO example (label set, its completion in the chosen column) have an
    empty rejected response.
    """
    eos = tokenizer.eos_token_id
    prompts, chosen, rejected = [], [], []
    for p in pairs:
        text = p.prompt_text
        if text is None:
            text = tokenizer.apply_chat_template(list(p.messages), add_generation_prompt=True, tokenize=False)
        prompt = tokenizer(text, add_special_tokens=False)["input_ids"] if text else []
        ids = tokenizer(p.chosen, add_special_tokens=False)["input_ids"] + [eos]
        if not prompt:
            prompt, ids = ids[:1], ids[1:]
        prompts.append(prompt[-max_prompt_tokens:])
        chosen.append(ids[:max_response_tokens])
        ids = [] if p.rejected is None else tokenizer(p.rejected, add_special_tokens=False)["input_ids"] + [eos]
        rejected.append(ids[:max_response_tokens])
    n = len(pairs)
    columns = {
        "prompt_id": [p.prompt_id for p in pairs],
        "prompt_token_ids": prompts,
        "chosen_token_ids": chosen,
        "rejected_token_ids": rejected,
        "kl_token_ids": [chosen[(i + 1) % n] for i in range(n)],
        "label": [p.label for p in pairs],
    }
    arrays = [pa.array(columns[f.name], type=f.type) if f.name in columns else pa.nulls(n, f.type) for f in PAIR_SCHEMA]
    return pa.Table.from_arrays(arrays, schema=PAIR_SCHEMA)


def collate_pairs(table: pa.Table, pad_token_id: int, *, with_kl: bool = False) -> PairBatch:
    """Returns the forward layout of P pairs (``schema.PairBatch``): 2P rows, the chosen responses first, then the
    rejected ones (``schema.pack_sequences``), response_mask [2P, T] bool from lengths, and each filled reference
    column [P] float32, and the KTO example layout: labels [P] bool (the label of an unpaired row, True for a
    pair's chosen side) and paired_mask [P] bool (True where the row is a pair, so its rejected row is an example).
    With ``with_kl``, kl_inputs and kl_response_mask hold the same layout for the P (prompt, kl_token_ids) rows.
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
    label = table.column("label").to_pylist()
    return PairBatch(inputs=inputs, response_mask=response_mask_from_lengths(inputs), **refs, **kl,
                     labels=torch.tensor([x is not False for x in label]),
                     paired_mask=torch.tensor([x is None for x in label], dtype=torch.bool))  # fmt: skip
