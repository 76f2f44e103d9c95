"""GSM8K-style prompt rows (question, answer ending in '#### N') from files, URIs or the Hugging Face hub.

Source forms accepted by ``load_prompt_rows`` (one string each, as in ``data.train_files``):

- a local file: ``data/gsm8k/train.jsonl``, ``rows.json``, ``rows.parquet`` (``.gz``/``.bz2``/``.xz``/``.zst``
  compression of JSON lines is fine);
- a URI read through fsspec: ``s3://bucket/gsm8k/train.jsonl`` (``storage_options`` go to the filesystem,
  e.g. ``{"key": ..., "secret": ..., "client_kwargs": {"endpoint_url": ...}}`` for s3fs);
- a Hugging Face dataset id: ``owner/name[:config[:split]]``, e.g. ``openai/gsm8k:main:test``. The
  split defaults to ``train``; the config to the dataset's default.

JSON Lines files (``.jsonl``, local or URI) are read by ``rlray.data.jsonl``, so a malformed line or
text that is not UTF-8 is named by ``<file>:<line>``; ``.json``, Parquet and hub ids go through
``datasets.load_dataset`` (the ``json``/``parquet`` builders with ``data_files`` for files and URIs).
Row errors name ``<file>:<line>`` for JSON Lines and ``<source> row <i> (0-based)`` otherwise.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

import datasets

from rlray.data.jsonl import DataError, read_jsonl

_BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}
_COMPRESSIONS = (".gz", ".bz2", ".xz", ".zst")
_HF_ID = re.compile(r"^(?P<repo>[\w.-]+/[\w.-]+)(?::(?P<config>[\w.-]*))?(?::(?P<split>[\w.\[\]:%-]+))?$")
ANSWER_MARKER = "####"


@dataclass(frozen=True)
class PromptRow:
    """One prompt: its id, the question text and the reference final answer.

    Attributes:
        prompt_id: ``"<file stem>:<row index>"`` (0-based), or the row's own ``id`` when it has one.
        question: the problem text shown to the model.
        answer: the reference final answer string, the text after the last '####' of the row's
            answer (e.g. ``"72"`` or ``"1,080"``; graders normalise commas and units).
    """

    prompt_id: str
    question: str
    answer: str


def load_prompt_rows(files: list[str], *, storage_options: dict | None = None) -> list[PromptRow]:
    """Returns the prompt rows of every source in ``files``, in order.

    Args:
        files: sources as described in the module docstring (local JSONL/JSON/Parquet, fsspec URIs,
            or ``owner/name[:config[:split]]`` Hugging Face ids).
        storage_options: fsspec options passed through to ``datasets.load_dataset`` (s3fs credentials
            and endpoint for ``s3://``).

    Raises:
        DataError: no sources, a local file that is missing or empty, an unknown file type, a source
            without rows, a JSON Lines line that is not UTF-8, not JSON or not an object (names
            ``file:line``), missing 'question'/'answer' columns (the message lists the columns it has),
            an empty question or a non-string answer, an answer without a '####' marker (each names the
            file and line, or the 0-based row), or a prompt id that appears twice.
    """
    if not files:
        raise DataError("no prompt files given; set data.train_files / data.eval_files")
    rows: list[PromptRow] = []
    seen: dict[str, str] = {}
    for source in files:
        for row in _rows_of(source, storage_options):
            if row.prompt_id in seen:
                raise DataError(
                    f"prompt id '{row.prompt_id}' appears twice ({seen[row.prompt_id]} and {source}); "
                    "give the files distinct names or distinct 'id' values"
                )
            seen[row.prompt_id] = source
            rows.append(row)
    return rows


def reference_answer(answer: str) -> str | None:
    """Returns the text after the last '####' in a GSM8K answer, stripped; None when absent or empty."""
    if ANSWER_MARKER not in answer:
        return None
    final = answer.rsplit(ANSWER_MARKER, 1)[1].strip()
    return final or None


def _rows_of(source: str, storage_options: dict | None) -> list[PromptRow]:
    """Returns the rows of one source, validated."""
    if _is_jsonl(source):
        records = read_jsonl(source, storage_options=storage_options)
        columns = list(dict.fromkeys(k for _, r in records for k in r))
        stem = PurePosixPath(source).name.split(".", 1)[0]
        entries = [(f"{source}:{line}", r.get("question"), r.get("answer"), r.get("id")) for line, r in records]
    else:
        dataset, stem = _load(source, storage_options)
        if len(dataset) == 0:
            raise DataError(f"{source}: has no rows")
        columns = dataset.column_names
        ids = dataset["id"] if "id" in columns else [None] * len(dataset)
        questions, answers = (dataset[c] if c in columns else [] for c in ("question", "answer"))
        entries = [(f"{source} row {i} (0-based)", q, a, r) for i, (q, a, r) in enumerate(zip(questions, answers, ids, strict=False))]
    missing = [c for c in ("question", "answer") if c not in columns]
    if missing:
        raise DataError(f"{source}: rows need columns 'question' and 'answer'; missing {missing}, it has columns {columns}")
    return [_prompt_row(where, stem, index, *entry) for index, (where, *entry) in enumerate(entries)]


def _prompt_row(where: str, stem: str, index: int, question: object, answer: object, row_id: object) -> PromptRow:
    """Returns one validated row; ``where`` names it in errors."""
    if not isinstance(question, str) or not question.strip():
        raise DataError(f"{where}: 'question' must be a non-empty string, got {question!r:.80}")
    if not isinstance(answer, str):
        raise DataError(f"{where}: 'answer' must be a string, got {answer!r:.80}")
    final = reference_answer(answer)
    if final is None:
        raise DataError(f"{where}: 'answer' must end with a '#### <final answer>' line, got {answer[-80:]!r}")
    return PromptRow(prompt_id=f"{stem}:{index}" if row_id is None else str(row_id), question=question, answer=final)


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
    kwargs.setdefault("split", "train")
    try:
        return datasets.load_dataset(path, name, **kwargs)
    except Exception as err:  # datasets raises many types (FileNotFoundError, DatasetGenerationError, ...)
        raise DataError(f"{source}: cannot load it with datasets.load_dataset: {type(err).__name__}: {err}") from err
