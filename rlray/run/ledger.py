"""The prompt ledger: which prompts a run trained on, how often, and whether it took each exactly once, in order.

Each online step records the ids of the prompts it took from the data stream (its own prompts, then DAPO
dynamic-sampling refills; never evaluation prompts) as the MLflow artifact ``ledger/step_<step>.json``
(``Tracker.log_ledger``, rank 0, at the step boundary). A step run again after a restart or a rollback
replaces its own file, so the ledger holds the steps that survive. ``check_ledger`` compares the ledger,
steps 1..last in order, with what the seeded ``PromptStream`` (the run's rows, ``run.seed`` and
``data.shuffle``) hands out to an uninterrupted run: every prompt of each epoch exactly once, in the
epoch's order. In async mode (``rollout.max_staleness`` = k > 0) step t + k takes its prompts when step t
starts, before step t's refills, and the check expects that order (``step_order``). No Ray; ``check_run``
reads a run's ledger from MLflow first.

``rlray ledger RUN_ID`` prints ``run_usage`` (prompts taken, distinct, times taken per prompt, epochs covered, steps
without a ledger); with ``--check`` also ``check_logged_run``: the check against the stream the run's own logged
config (``config/resolved.yaml``) makes.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Iterator
from dataclasses import dataclass, field

from rlray.data import PromptRow, PromptStream
from rlray.plan import ConfigError, RunPlan, plan_from_tree


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


def step_order(stream: PromptStream, counts: list[int], *, prompts_per_step: int, max_staleness: int) -> Iterator[str]:
    """Yields the prompt ids an uninterrupted run's steps take, steps in order, then the stream's further ids.

    Step t takes ``counts[t]`` ids: its ``prompts_per_step`` own prompts, then DAPO refills. Synchronous
    runs take them in the stream's order. In async mode (``max_staleness`` = k > 0, ``RolloutPipeline``)
    the own prompts of steps 0..k are taken first, and then each step t takes its refills before step
    t + k + 1 takes its own prompts. The own prompts of the steps still in flight at the end follow the
    last step's refills.
    """

    def take(n: int) -> list[str]:
        return [r.prompt_id for r in stream.next_batch(n)] if n > 0 else []

    ahead: deque[list[str]] = deque()
    for count in counts if max_staleness else ():
        while len(ahead) <= max_staleness:
            ahead.append(take(prompts_per_step))
        yield from ahead.popleft()
        yield from take(count - prompts_per_step)
    for own in ahead:
        yield from own
    while True:
        yield from take(len(stream))


def check_ledger(ledger: dict[int, list[str]], rows: list[PromptRow], *, seed: int, shuffle: bool,
                 last_step: int | None = None, prompts_per_step: int = 0, max_staleness: int = 0) -> LedgerReport:
    """Returns how the ledger of steps 1..``last_step`` compares with the seeded prompt stream.

    The ledger's ids, steps in order, are walked against what a fresh ``PromptStream(rows, seed, shuffle)``
    hands out to the steps of an uninterrupted run (``step_order``; in async mode the ledger gives each
    step's number of refills). An id equal to the stream's next one matches. An id already matched in
    the current epoch is a duplicate. An id that an earlier skip marked missing is out of order (taken
    late). An id the stream hands out later, within one epoch's length, marks the ids it skips as
    missing. Any other is a duplicate; an id that is no row of the data is unknown. ``ok`` is exact; the
    labels are a best reading of where a wrong ledger departs (a step replayed across an epoch boundary
    reads as a skip followed by late ids).

    Args:
        ledger: {1-based step: prompt ids in the order taken} (``rlray.observe.tracking.read_ledger``).
        rows: the run's training rows after long prompts were skipped, in file order (``prepare_prompts``).
        seed: ``run.seed``.
        shuffle: ``data.shuffle``.
        last_step: the run's last step (its ``rlray.final_step`` tag); None: the ledger's highest step.
        prompts_per_step: ``learner.prompts_per_step`` (needed in async mode).
        max_staleness: ``rollout.max_staleness``; 0 for synchronous runs.

    Raises:
        ValueError: ``rows`` is empty (``PromptStream``), or ``max_staleness`` > 0 without ``prompts_per_step``.
    """
    if max_staleness > 0 and prompts_per_step < 1:
        raise ValueError(f"check_ledger: max_staleness={max_staleness} needs prompts_per_step >= 1")
    stream = PromptStream(rows, seed=seed, shuffle=shuffle)
    known = {r.prompt_id for r in rows}
    last = max(ledger, default=0) if last_step is None else last_step
    consumed = [pid for step in range(1, last + 1) for pid in ledger.get(step, [])]
    order = step_order(stream, [len(ledger.get(step, [])) for step in range(1, last + 1)],
                       prompts_per_step=prompts_per_step, max_staleness=max_staleness)
    handed: list[str] = []  # the uninterrupted run's ids, drawn as far as the walk needs

    def at(i: int) -> str:
        while len(handed) <= i:
            handed.append(next(order))
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
        here = next((k for k in range(start, start + size) if at(k) == pid), None)
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


def check_run(uri: str, run_id: str, rows: list[PromptRow], *, seed: int, shuffle: bool, prompts_per_step: int = 0,
              max_staleness: int = 0) -> LedgerReport:
    """Returns ``check_ledger`` of MLflow run ``run_id``'s ledger, up to its ``rlray.final_step`` tag (else its
    highest ledger step).

    Raises:
        mlflow.exceptions.MlflowException: the run does not exist, or the store is down.
    """
    from rlray.observe import tracking

    final = tracking.get_run(uri, run_id).data.tags.get("rlray.final_step")
    return check_ledger(tracking.read_ledger(uri, run_id), rows, seed=seed, shuffle=shuffle,
                        last_step=None if final is None else int(final), prompts_per_step=prompts_per_step,
                        max_staleness=max_staleness)


@dataclass(frozen=True)
class LedgerUsage:
    """Which prompts a run trained on and how often (``ledger_usage``; printed by ``rlray ledger``).

    Attributes:
        last_step: the run's last step (its ``rlray.final_step`` tag, else its highest ledger step); steps
            1..last_step count.
        steps_of: {prompt id: the steps that took it, once per time taken, ascending}, prompts in the order first
            taken.
        missing_steps: steps in 1..last_step without a ledger file.
        later_steps: ledger files past last_step (a timeline a rollback or a stop abandoned); not counted.
    """

    last_step: int
    steps_of: dict[str, list[int]] = field(default_factory=dict)
    missing_steps: tuple[int, ...] = ()
    later_steps: tuple[int, ...] = ()

    @property
    def taken(self) -> int:
        """Returns the prompts taken over steps 1..last_step (a prompt taken twice counts twice)."""
        return sum(len(steps) for steps in self.steps_of.values())

    @property
    def repeats(self) -> dict[int, int]:
        """Returns {times taken: number of prompts taken that often}, times ascending."""
        return dict(sorted(Counter(len(steps) for steps in self.steps_of.values()).items()))

    def lines(self, *, data_rows: int | None = None, per_prompt: bool = False) -> list[str]:
        """Returns the report as lines of text: steps, prompts taken and distinct, times taken, epochs covered.

        Epochs covered are the prompts taken over ``data_rows`` (the rows the run streams, when known), else over
        the distinct prompts taken. ``per_prompt`` adds one line per prompt: its id, times taken and steps.
        """
        with_ledger = self.last_step - len(self.missing_steps)
        out = [f"steps with a ledger: {with_ledger} of {self.last_step}"
               + (f"; without: {_some(self.missing_steps)}" if self.missing_steps else "")]
        if self.later_steps:
            out.append(f"ledger files after step {self.last_step}, not counted: {_some(self.later_steps)}")
        out.append(f"prompts taken: {self.taken} ({len(self.steps_of)} distinct)")
        out.append("times taken: " + ", ".join(f"{k}x: {n} prompt{'s' * (n != 1)}" for k, n in self.repeats.items()))
        per = (data_rows, "rows of the data") if data_rows is not None else (len(self.steps_of), "distinct prompts")
        if per[0]:
            out.append(f"epochs covered: {self.taken / per[0]:.2f} ({self.taken} taken / {per[0]} {per[1]})")
        if per_prompt:
            out += [f"  {pid}  {len(steps)}x  steps {', '.join(map(str, steps))}" for pid, steps in self.steps_of.items()]
        return out


def _some(values) -> str:
    """Returns up to 10 values joined by ', ', with '(+N more)' for the rest."""
    values = list(values)
    return ", ".join(map(str, values[:10])) + (f" (+{len(values) - 10} more)" if len(values) > 10 else "")


def ledger_usage(ledger: dict[int, list[str]], *, last_step: int | None = None) -> LedgerUsage:
    """Returns which prompts steps 1..``last_step`` of ``ledger`` took, and how often.

    Args:
        ledger: {1-based step: prompt ids in the order taken} (``rlray.observe.tracking.read_ledger``).
        last_step: the run's last step (its ``rlray.final_step`` tag); None: the ledger's highest step.
    """
    last = max(ledger, default=0) if last_step is None else last_step
    steps_of: dict[str, list[int]] = {}
    for step in range(1, last + 1):
        for pid in ledger.get(step, []):
            steps_of.setdefault(pid, []).append(step)
    return LedgerUsage(last, steps_of, missing_steps=tuple(s for s in range(1, last + 1) if s not in ledger),
                       later_steps=tuple(s for s in sorted(ledger) if s > last))


def run_usage(uri: str, run_id: str) -> LedgerUsage:
    """Returns ``ledger_usage`` of MLflow run ``run_id``'s ledger, up to its ``rlray.final_step`` tag (else its highest
    ledger step); ``last_step`` 0 when the run has no ledger (an offline run, or one that ended before its first step).

    Raises:
        mlflow.exceptions.MlflowException: the run does not exist, or the store is down.
    """
    from rlray.observe import tracking

    final = tracking.get_run(uri, run_id).data.tags.get("rlray.final_step")
    return ledger_usage(tracking.read_ledger(uri, run_id), last_step=None if final is None else int(final))


def logged_plan(uri: str, run_id: str) -> RunPlan:
    """Returns the plan of the config run ``run_id`` ran with: its artifact ``config/resolved.yaml``
    (``Tracker.log_config``), validated (``rlray.plan.plan_from_tree``)."""
    return plan_from_tree(logged_tree(uri, run_id))


def logged_tree(uri: str, run_id: str) -> dict:
    """Returns the config tree run ``run_id`` ran with: its artifact ``config/resolved.yaml`` as plain data.

    Raises:
        ConfigError: the run has no readable ``config/resolved.yaml``, or it no longer validates (names the keys).
    """
    import yaml

    from rlray.observe import tracking

    try:
        text = tracking.read_artifact_text(uri, run_id, "config/resolved.yaml")
    except Exception as err:  # mlflow's or the artifact store's error: the message names the run and file
        raise ConfigError(f"run {run_id}: its config/resolved.yaml cannot be read from {uri} ({err})") from err
    return yaml.safe_load(text) or {}


def training_rows(plan: RunPlan) -> list[PromptRow]:
    """Returns the rows a run of ``cfg`` streams: ``data.train_files`` rendered with ``model.path``'s tokenizer, long
    prompts skipped (``data.long_prompts``), as an online run's rank 0 makes them when it starts (the same calls).

    Raises:
        rlray.models.ModelError: the model or its tokenizer cannot be loaded.
        rlray.data.DataError: a data file is missing or has a bad row.
    """
    cfg = plan.settings
    from rlray.models import load_tokenizer, resolve_model_path
    from rlray.run.build import training_prompts

    tokenizer = load_tokenizer(resolve_model_path(cfg.model.path, revision=cfg.model.revision), cfg.model.chat_template)
    return training_prompts(cfg, tokenizer)[1]


def check_logged_run(uri: str, run_id: str) -> tuple[LedgerReport, int]:
    """Returns (``check_run`` of run ``run_id`` against the seeded stream of its own logged config, the number of rows
    that stream hands out per epoch): seed, shuffle, prompts per step and max staleness are the run's.

    Raises:
        ConfigError: the run's config/resolved.yaml cannot be read or no longer validates.
        rlray.models.ModelError, rlray.data.DataError: the run's model or data files cannot be loaded here.
        mlflow.exceptions.MlflowException: the run does not exist, or the store is down.
    """
    plan = logged_plan(uri, run_id)
    rows, cfg = training_rows(plan), plan.settings
    report = check_run(uri, run_id, rows, seed=cfg.run.seed, shuffle=cfg.data.shuffle,
                       prompts_per_step=cfg.learner.prompts_per_step, max_staleness=cfg.rollout.max_staleness)
    return report, len(rows)
