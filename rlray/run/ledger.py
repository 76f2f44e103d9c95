"""The prompt ledger check: did a run take every prompt of the data stream exactly once, in order?

Each online step records the ids of the prompts it took from the data stream (its own prompts, then DAPO
dynamic-sampling refills; never evaluation prompts) as the MLflow artifact ``ledger/step_<step>.json``
(``Tracker.log_ledger``, rank 0, at the step boundary). A step run again after a restart or a rollback
replaces its own file, so the ledger holds the steps that survive. ``check_ledger`` compares the ledger,
steps 1..last in order, with what the seeded ``PromptStream`` (the run's rows, ``run.seed`` and
``data.shuffle``) hands out to an uninterrupted run: every prompt of each epoch exactly once, in the
epoch's order. No Ray; ``check_run`` reads a run's ledger from MLflow first.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from rlray.data import PromptRow, PromptStream


@dataclass(frozen=True)
class LedgerReport:
    """What ``check_ledger`` found.

    Attributes:
        steps: the steps checked (1..last_step).
        consumed: prompt ids in the ledger of those steps (a prompt taken twice counts twice).
        expected: prompt ids the stream hands out over the span the ledger covers (the stream prefix up to
            the last prompt matched).
        missing_steps: steps in 1..last_step without a ledger file.
        later_steps: ledger files past last_step (a timeline a rollback or a stop abandoned); not checked.
        missing: ids the stream hands out within the span that the ledger lacks, in stream order.
        duplicates: {id: extra times taken}: taken more often than the stream hands it out.
        out_of_order: ids taken, but later than the stream's order (after prompts the stream hands out after them).
        unknown: ids that are not rows of the data at all.
        first_mismatch: index into the ledger (steps in order, flattened) where it first departs from the
            stream, or None when it never does.
    """

    steps: int
    consumed: int
    expected: int
    missing_steps: tuple[int, ...] = ()
    later_steps: tuple[int, ...] = ()
    missing: tuple[str, ...] = ()
    duplicates: dict[str, int] = field(default_factory=dict)
    out_of_order: tuple[str, ...] = ()
    unknown: tuple[str, ...] = ()
    first_mismatch: int | None = None

    @property
    def ok(self) -> bool:
        """Returns True when every prompt of the span was taken exactly once, in order, and no step lacks a ledger."""
        return not (self.missing_steps or self.missing or self.duplicates or self.out_of_order or self.unknown)

    def summary(self) -> str:
        """Returns one line: 'ledger exact: ...' or 'ledger wrong: ...' naming up to 5 ids of each kind."""

        def some(ids) -> str:
            ids = list(ids)
            return ", ".join(map(str, ids[:5])) + (f" (+{len(ids) - 5} more)" if len(ids) > 5 else "")

        head = f"{self.steps} steps took {self.consumed} prompts; the stream hands out {self.expected} over that span"
        if self.ok:
            return f"ledger exact: {head}, each once, in order"
        parts = [f"steps without a ledger: {some(self.missing_steps)}"] if self.missing_steps else []
        parts += [f"{len(self.missing)} missing: {some(self.missing)}"] if self.missing else []
        dups = [f"{k} x{v + 1}" for k, v in self.duplicates.items()]
        parts += [f"{sum(self.duplicates.values())} taken again: {some(dups)}"] if dups else []
        parts += [f"{len(self.out_of_order)} out of order: {some(self.out_of_order)}"] if self.out_of_order else []
        parts += [f"{len(self.unknown)} not in the data: {some(self.unknown)}"] if self.unknown else []
        where = f"; first departure at ledger position {self.first_mismatch}" if self.first_mismatch is not None else ""
        return f"ledger wrong: {head}; " + "; ".join(parts) + where


def check_ledger(ledger: dict[int, list[str]], rows: list[PromptRow], *, seed: int, shuffle: bool,
                 last_step: int | None = None) -> LedgerReport:
    """Returns how the ledger of steps 1..``last_step`` compares with the seeded prompt stream.

    The ledger's ids, steps in order, are walked against a fresh ``PromptStream(rows, seed, shuffle)``.
    An id equal to the stream's next one matches. An id already matched in the current epoch is a
    duplicate. An id that an earlier skip marked missing is out of order (taken late). An id the stream
    hands out later, within one epoch's length, marks the ids it skips as missing. Any other is a
    duplicate; an id that is no row of the data is unknown. ``ok`` is exact; the labels are a best
    reading of where a wrong ledger departs (a step replayed across an epoch boundary reads as a skip
    followed by late ids).

    Args:
        ledger: {1-based step: prompt ids in the order taken} (``rlray.observe.tracking.read_ledger``).
        rows: the run's training rows after long prompts were skipped, in file order (``prepare_prompts``).
        seed: ``run.seed``.
        shuffle: ``data.shuffle``.
        last_step: the run's last step (its ``rlray.final_step`` tag); None: the ledger's highest step.

    Raises:
        ValueError: ``rows`` is empty (``PromptStream``).
    """
    stream = PromptStream(rows, seed=seed, shuffle=shuffle)
    known = {r.prompt_id for r in rows}
    last = max(ledger, default=0) if last_step is None else last_step
    consumed = [pid for step in range(1, last + 1) for pid in ledger.get(step, [])]
    handed: list[str] = []  # the stream's ids, drawn as far as the walk needs

    def at(i: int) -> str:
        while len(handed) <= i:
            handed.extend(r.prompt_id for r in stream.next_batch(len(rows)))
        return handed[i]

    size, pos, matched = len(rows), 0, set()
    missing: list[str] = []
    late: list[str] = []
    unknown: list[str] = []
    dups: Counter[str] = Counter()
    first = None
    for n, pid in enumerate(consumed):
        if pid == at(pos):
            matched.add(pos)
            pos += 1
            continue
        first = n if first is None else first
        start = pos - pos % size  # the current epoch's first stream position
        here = next(k for k in range(start, start + size) if at(k) == pid) if pid in known else None
        ahead = next((j for j in range(pos + 1, pos + size) if at(j) == pid), None)
        if pid not in known:
            unknown.append(pid)
        elif here in matched:
            dups[pid] += 1
        elif pid in missing:
            missing.remove(pid)
            late.append(pid)
        elif ahead is not None:
            missing.extend(at(j) for j in range(pos, ahead))
            matched.add(ahead)
            pos = ahead + 1
        else:
            dups[pid] += 1
    return LedgerReport(
        steps=last, consumed=len(consumed), expected=pos,
        missing_steps=tuple(s for s in range(1, last + 1) if s not in ledger),
        later_steps=tuple(s for s in sorted(ledger) if s > last),
        missing=tuple(missing), duplicates=dict(dups), out_of_order=tuple(late), unknown=tuple(unknown),
        first_mismatch=first,
    )  # fmt: skip


def check_run(uri: str, run_id: str, rows: list[PromptRow], *, seed: int, shuffle: bool) -> LedgerReport:
    """Returns ``check_ledger`` of MLflow run ``run_id``'s ledger, up to its ``rlray.final_step`` tag (else its
    highest ledger step).

    Raises:
        mlflow.exceptions.MlflowException: the run does not exist, or the store is down.
    """
    from rlray.observe import tracking

    final = tracking.get_run(uri, run_id).data.tags.get("rlray.final_step")
    return check_ledger(tracking.read_ledger(uri, run_id), rows, seed=seed, shuffle=shuffle,
                        last_step=None if final is None else int(final))
