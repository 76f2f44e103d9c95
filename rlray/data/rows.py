"""Prompt rows in TRL's dataset formats, from files, URIs or the Hugging Face hub.

A row's prompt is one column, ``data.prompt_column`` (``"prompt"`` by default; OpenRLHF calls it
``input_key``), in either of TRL's two prompt formats:

- standard: a string, e.g. ``{"prompt": "What is 2+2?"}``. It becomes the user turn of the chat
  template (``rlray.data.prompts.render_prompt``);
- conversational: a list of messages, e.g. ``{"prompt": [{"role": "system", "content": "Be brief."},
  {"role": "user", "content": "What is 2+2?"}]}``. Roles are system, user, assistant and tool; a final
  assistant message is a prefill that the model continues.

Any dataset maps onto this by naming its prompt column: GSM8K's ``{"question", "answer"}`` rows load
with ``prompt_column="question"``. Every other column of a row (the ``answer``, a ``solution``, test
cases, metadata, an ``id``) is kept in ``PromptRow.columns`` with the values exactly as the file had
them, for reward functions to read; the data layer does not interpret them. ``columns_json`` is the
form in which they ride in the experience table.

Source forms accepted by ``load_prompt_rows`` (one string each, as in ``data.train_files``):

- a local file: ``data/gsm8k/train.jsonl``, ``rows.json``, ``rows.parquet`` (``.gz``/``.bz2``/``.xz``/``.zst``
  compression of JSON lines is fine);
- a URI read through fsspec: ``s3://bucket/gsm8k/train.jsonl`` (``storage_options`` go to the filesystem,
  e.g. ``{"key": ..., "secret": ..., "client_kwargs": {"endpoint_url": ...}}`` for s3fs);
- a Hugging Face dataset id: ``owner/name[:config[:split]]``, e.g. ``openai/gsm8k:main:test``. The
  split defaults to ``train``; the config to the dataset's default;
- reasoning-gym generators: ``reasoning-gym:leg_counting?size=500&seed=1`` (``rlray.data.rgym``: a mix, splits,
  generator options).

JSON Lines files (``.jsonl``, local or URI) are read by ``rlray.data.jsonl``, so a malformed line or
text that is not UTF-8 is named by ``<file>:<line>``, and rows may have different column sets (a row's
``columns`` are its own other keys). ``.json``, Parquet and hub ids go through ``datasets.load_dataset``
(the ``json``/``parquet`` builders with ``data_files`` for files and URIs) and are read row by row, so
nested values (lists, structs) come back as Python lists and dicts. Row errors name ``<file>:<line>``
for JSON Lines and ``<source> row <i> (0-based)`` otherwise.

Source: TRL's dataset formats, https://huggingface.co/docs/trl/dataset_formats ("prompt-only", standard
and conversational).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING, Any

from rlray.data.jsonl import DataError, read_jsonl
from rlray.data.rgym import is_reasoning_gym, reasoning_gym_records

if TYPE_CHECKING:
    import datasets

_BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}
_COMPRESSIONS = (".gz", ".bz2", ".xz", ".zst")
_HF_ID = re.compile(r"^(?P<repo>[\w.-]+/[\w.-]+)(?::(?P<config>[\w.-]*))?(?::(?P<split>[\w.\[\]:%-]+))?$")
ROLES = ("system", "user", "assistant", "tool")


@dataclass(frozen=True)
class PromptRow:
    """One prompt: its id, the prompt in a TRL format, and the row's other columns.

    Frozen, but ``columns`` is a plain dict (it pickles for Ray and ``json.dumps`` reads it): treat it as
    read-only. Rows are not hashable (the prompt may be a list); key maps by ``prompt_id``.

    Attributes:
        prompt_id: ``"<file stem>:<row index>"`` (0-based), or ``str`` of the row's own ``id`` when it has one.
        prompt: the ``data.prompt_column`` value: a non-empty string (standard format) or a non-empty list of
            ``{"role", "content"}`` messages (conversational format), as the file had it.
        columns: every other column of the row (including ``id`` when present), in the file's order, values
            untouched (str, numbers, bool, None, lists, nested dicts; from Parquet also bytes or datetimes).
    """

    prompt_id: str
    prompt: str | list[dict[str, Any]]
    columns: dict[str, Any]

    @property
    def is_conversational(self) -> bool:
        """Returns True when the prompt is a list of messages (TRL's conversational format)."""
        return isinstance(self.prompt, list)


def load_prompt_rows(
    files: list[str], *, prompt_column: str = "prompt", storage_options: dict | None = None
) -> list[PromptRow]:
    """Returns the prompt rows of every source in ``files``, in order.

    Args:
        files: sources as described in the module docstring (local JSONL/JSON/Parquet, fsspec URIs,
            or ``owner/name[:config[:split]]`` Hugging Face ids).
        prompt_column: the column that holds the prompt (``data.prompt_column``), e.g. ``"question"`` for GSM8K.
        storage_options: fsspec options passed through to ``datasets.load_dataset`` (s3fs credentials
            and endpoint for ``s3://``).

    Raises:
        DataError: no sources, a local file that is missing or empty, an unknown file type, a source
            without rows, a JSON Lines line that is not UTF-8, not JSON or not an object (names
            ``file:line``); a source without ``prompt_column`` (names the column, ``data.prompt_column``
            and the columns the source has); a row without it, or whose prompt is neither a non-empty
            string nor a non-empty list of messages with a known string 'role' and a string 'content'
            (names ``file:line`` or the 0-based row, and the message index); an 'id' that is neither a string nor
            an integer; or a prompt id that appears twice.
    """
    if not files:
        raise DataError("no prompt files given; set data.train_files / data.eval_files")
    rows: list[PromptRow] = []
    seen: dict[str, str] = {}
    for source in files:
        for row in _rows_of(source, prompt_column, storage_options):
            if row.prompt_id in seen:
                raise DataError(
                    f"prompt id '{row.prompt_id}' appears twice ({seen[row.prompt_id]} and {source}); "
                    "give the files distinct names or distinct 'id' values"
                )
            seen[row.prompt_id] = source
            rows.append(row)
    return rows


def columns_json(row: PromptRow) -> str:
    """Returns the row's ``columns`` as the text of one JSON object, in the file's column order.

    This is the form in which the extra columns ride in the Arrow experience table: one string per row,
    so a column whose type varies by row (an int here, a list there) cannot break the table's schema.
    ``json.loads`` gives the columns back. Non-ASCII text is kept as is (``ensure_ascii=False``); a value
    JSON cannot hold (bytes or a datetime from Parquet) becomes its ``str()``.
    """
    return json.dumps(row.columns, ensure_ascii=False, default=str)


def _rows_of(source: str, prompt_column: str, storage_options: dict | None) -> list[PromptRow]:
    """Returns the rows of one source, validated."""
    if is_reasoning_gym(source):
        records = reasoning_gym_records(source, prompt_column)
        return [_prompt_row(where, where, record, prompt_column) for where, record in records]
    if _is_jsonl(source):
        records = read_jsonl(source, storage_options=storage_options)
        columns = list(dict.fromkeys(k for _, r in records for k in r))
        stem = PurePosixPath(source).name.split(".", 1)[0]
        entries: Iterator[tuple[str, dict[str, Any]]] = ((f"{source}:{line}", r) for line, r in records)
    else:
        dataset, stem = _load(source, storage_options)
        if len(dataset) == 0:
            raise DataError(f"{source}: has no rows")
        columns = list(dataset.column_names)
        entries = ((f"{source} row {i} (0-based)", r) for i, r in enumerate(dataset))
    if prompt_column not in columns:
        raise DataError(
            f"{source}: no prompt column '{prompt_column}' (data.prompt_column); it has columns {columns}; "
            "set data.prompt_column to the column that holds the prompt"
        )
    return [_prompt_row(where, f"{stem}:{index}", record, prompt_column) for index, (where, record) in enumerate(entries)]


def _prompt_row(where: str, default_id: str, record: dict[str, Any], prompt_column: str) -> PromptRow:
    """Returns one validated row; ``where`` names it in errors."""
    if prompt_column not in record:
        raise DataError(
            f"{where}: this row has no prompt column '{prompt_column}' (data.prompt_column); "
            f"it has columns {list(record)}"
        )
    prompt = record[prompt_column]
    problem = _prompt_problem(prompt)
    if problem:
        raise DataError(f"{where}: prompt column '{prompt_column}' {problem}")
    columns = {k: v for k, v in record.items() if k != prompt_column}
    row_id = record.get("id")
    if row_id is not None and (isinstance(row_id, bool) or not isinstance(row_id, (str, int))):
        raise DataError(f"{where}: column 'id' must be a string or an integer (the prompt id), got "
                        f"{type(row_id).__name__} {row_id!r:.80}")
    return PromptRow(prompt_id=default_id if row_id is None else str(row_id), prompt=prompt, columns=columns)


def _prompt_problem(prompt: object) -> str | None:
    """Returns what is wrong with a prompt value (words after "prompt column 'x' "), or None when it is valid."""
    if isinstance(prompt, str):
        return None if prompt.strip() else f"is an empty string ({prompt!r})"
    if not isinstance(prompt, list):
        return (
            "must be a non-empty string (standard format) or a non-empty list of {'role', 'content'} messages "
            f"(conversational format), got {type(prompt).__name__} {prompt!r:.80}"
        )
    if not prompt:
        return "is an empty list of messages"
    for i, message in enumerate(prompt):
        if not isinstance(message, dict):
            return f"message {i} (0-based) must be a {{'role', 'content'}} object, got {type(message).__name__} {message!r:.80}"
        for key in ("role", "content"):
            if key not in message:
                return f"message {i} (0-based) has no '{key}'; it has keys {list(message)}"
        role, content = message["role"], message["content"]
        if role not in ROLES:
            return f"message {i} (0-based) has role {role!r:.40}; roles must be one of {'/'.join(ROLES)}"
        if not isinstance(content, str):
            return f"message {i} (0-based) ({role}) 'content' must be a string, got {type(content).__name__} {content!r:.80}"
    if not any(m["role"] == "user" for m in prompt):
        return f"has no 'user' message (roles: {[m['role'] for m in prompt]})"
    return None


def _is_jsonl(source: str) -> bool:
    """Returns True for a ``.jsonl`` path or URI (optionally compressed)."""
    suffixes = PurePosixPath(source).suffixes
    if suffixes and suffixes[-1] in _COMPRESSIONS:
        suffixes = suffixes[:-1]
    return bool(suffixes) and suffixes[-1].lower() == ".jsonl"


def _load(source: str, storage_options: dict | None) -> tuple[datasets.Dataset, str]:
    """Returns (the dataset of one source, its stem for prompt ids)."""
    is_uri = "://" in source
    suffixes = PurePosixPath(source).suffixes
    if suffixes and suffixes[-1] in _COMPRESSIONS:
        suffixes = suffixes[:-1]
    builder = _BUILDERS.get(suffixes[-1].lower()) if suffixes else None
    hf = None if is_uri or builder else _HF_ID.match(source)
    if hf and not Path(source).exists():
        repo, split = hf["repo"], hf["split"] or "train"
        stem = f"{repo.rsplit('/', 1)[1]}-{split}"
        return _call_load(source, repo, hf["config"] or None, split=split, storage_options=storage_options), stem
    if builder is None:
        raise DataError(
            f"{source}: unknown data source; use a .jsonl/.json/.parquet file or URI, "
            "or a Hugging Face id 'owner/name[:config[:split]]'"
        )
    if not is_uri:
        path = Path(source)
        if not path.is_file():
            raise DataError(f"{source}: file not found")
        if path.stat().st_size == 0:
            raise DataError(f"{source}: file is empty")
    stem = PurePosixPath(source).name.split(".", 1)[0]
    data_files = source if is_uri else str(Path(source).resolve())
    return _call_load(source, builder, None, data_files=data_files, storage_options=storage_options), stem


def _call_load(source: str, path: str, name: str | None, **kwargs) -> datasets.Dataset:
    """Returns ``datasets.load_dataset(path, name, **kwargs)`` as one split; errors name ``source``."""
    import datasets  # here, not at import: JSON Lines files never need it, and it costs ~0.5-1 s of CPU (pandas)

    kwargs.setdefault("split", "train")
    try:
        return datasets.load_dataset(path, name, **kwargs)
    except Exception as err:  # datasets raises many types (FileNotFoundError, DatasetGenerationError, ...)
        cause = err
        while cause.__cause__ is not None:  # DatasetGenerationError wraps the parser's error, which names the row
            cause = cause.__cause__
        why = f"{type(err).__name__}: {err}" + (f" ({type(cause).__name__}: {cause})" if cause is not err else "")
        raise DataError(f"{source}: cannot load it with datasets.load_dataset: {why}") from err
