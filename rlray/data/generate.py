"""Seeded JSONL row sets for the built-in text games, split into disjoint train / calibration / heldout items.

An item's split is fixed by a hash of its identity, not by the seed: ``sha256`` of the item key (``"37+45"`` for
RetryArithmeticEnv, ``"1-100:42"`` for GuessNumberEnv) taken mod 100 gives train for 0-79, calibration for 80-89
and heldout for 90-99. So any seeds, any sizes, the three sets never share an item. Within a split, ``seed``
picks which items and their order (``random.Random(seed)``), so a (kind, n, seed, split) always writes the same
file.

Item spaces:
- ``"retry_arith"``: ``a op b`` for a and b in 0-50 and op in + -, with a >= b for "-" (results are never
  negative): 2,601 + 1,326 = 3,927 items (3,100 train, 395 calibration, 432 heldout), each with
  ``feedback: "direction"`` (a wrong answer is told higher or lower) and ``max_attempts: 3``. The range was chosen
  on the calibration split (a task the model can learn needs a base success of 10-60%): SmolLM2-135M-Instruct,
  greedy, succeeded on 23% of 100 calibration items in 0-50, 30% in 0-30 and 35% in 0-20, and on 8.5% of 200
  two-digit items (10-99, the previous range), where 0-30 and 0-20 hold too few items for 200 held-out rows.
- ``"guess"``: low = 1, high in 10, 20, ..., 100, secret in [low, high], ``max_guesses`` = the binary-search
  bound ceil(log2(high - low + 1)) + 1: 550 items (435 train, 61 calibration, 54 heldout).
"""

from __future__ import annotations

import hashlib
import json
import math
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

SPLITS = {"train": (0, 80), "calibration": (80, 90), "heldout": (90, 100)}  # [start, end) of sha256(key) mod 100
KINDS = ("retry_arith", "guess")
RETRY_ARITH_MAX = 50  # operands of "retry_arith" items are 0..RETRY_ARITH_MAX (module docstring: chosen on calibration)


def split_of(key: str) -> str:
    """Returns the split ("train", "calibration" or "heldout") of an item key, from its sha256 mod 100."""
    bucket = int(hashlib.sha256(key.encode()).hexdigest(), 16) % 100
    return next(name for name, (lo, hi) in SPLITS.items() if lo <= bucket < hi)


def _retry_arith_items() -> Iterator[tuple[str, dict[str, Any]]]:
    """Yields (key, row) for every RetryArithmeticEnv item, in a fixed order."""
    for op in ("+", "-"):
        for a in range(RETRY_ARITH_MAX + 1):
            for b in range(RETRY_ARITH_MAX + 1):
                if op == "-" and a < b:
                    continue
                answer = a + b if op == "+" else a - b
                yield f"{a}{op}{b}", {"a": a, "op": op, "b": b, "answer": answer, "max_attempts": 3, "feedback": "direction"}


def _guess_items() -> Iterator[tuple[str, dict[str, Any]]]:
    """Yields (key, row) for every GuessNumberEnv item, in a fixed order."""
    low = 1
    for high in range(10, 101, 10):
        max_guesses = math.ceil(math.log2(high - low + 1)) + 1
        for secret in range(low, high + 1):
            yield f"{low}-{high}:{secret}", {"secret": secret, "low": low, "high": high, "max_guesses": max_guesses}


def build_rows(kind: str, n: int, seed: int, split: str) -> list[dict[str, Any]]:
    """Returns ``n`` distinct rows of ``kind`` from ``split``, chosen and ordered by ``seed`` (module docstring).

    Each row also holds ``id`` (its item key) and ``split``.

    Raises:
        ValueError: an unknown kind or split, or ``n`` larger than the split's items (the message gives the count).
    """
    if kind not in KINDS:
        raise ValueError(f"unknown kind {kind!r}; use one of {list(KINDS)}")
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; use one of {list(SPLITS)}")
    items = _retry_arith_items() if kind == "retry_arith" else _guess_items()
    pool = [{"id": key, "split": split, **row} for key, row in items if split_of(key) == split]
    if n > len(pool):
        raise ValueError(f"{kind}: n={n} rows asked but split {split!r} holds {len(pool)} items")
    return random.Random(seed).sample(pool, n)


def write_rows(kind: str, path: str | Path, n: int, seed: int, split: str) -> Path:
    """Writes ``build_rows(kind, n, seed, split)`` to ``path`` as JSONL (one JSON object a line, sorted keys), creating
    the parent folder, and returns the path.

    Raises:
        ValueError: as ``build_rows``.
    """
    rows = build_rows(kind, n, seed, split)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(row, sort_keys=True) + "\n" for row in rows), encoding="utf-8")
    return path
