"""The run's side of one judge: ``JudgeClient`` (cache, chunks, retries, shuffles); every judge of a run together is
a ``JudgePanel`` (``rlray.reward.judges.panel``: their terms added to the reward, their metrics).

**A call.** ``JudgeClient.score`` gets a batch of B samples (prompts, decoded responses, row columns and, in group
mode, each sample's group). Its mode (``rlray.reward.judges.modes``) plans the *judgements*: one per sample
(pointwise) or per group (group mode; the G responses are shown in an order drawn per group from a generator seeded
with ``seed``, and the scores are mapped back to the samples). Judgements already made for the same (prompt,
responses, row columns, judge version, judge definition) come from the run's cache (``cache_entries``, least
recently used first out); the others, each once, are split into one chunk per replica and sent at once. A chunk that
gets no reply within ``timeout_s`` (it is cancelled) or fails is sent again, up to ``attempts`` tries with a
back-off doubling from ``backoff_s``; after that its samples' scores fail (NaN) and the run goes on: they count in
``reward/failed`` and stay out of the update. Each try past ``timeout_s`` is reported through ``on_timeout`` (the run's
hang report with the replicas' stacks, ``rlray.hangs.HangWatch.timed_out``; under ``watchdog.on_hang=stop`` it raises).

**Scores.** A failed score is NaN: the output did not parse (``reward/judge_parse_failures``), or the judge did not
answer, the prompt did not fit, the template raised (``reward/judge_errors``). ``JudgePanel`` adds each judge as
a term, ``reward += weight * score``, after the scorer's terms (``rlray.reward.combine``).

**Metrics** (``JudgePanel.take_metrics``, everything since the previous call, all judges together):
``reward/judge_requests``, ``reward/judge_cache_hits``, ``reward/judge_calls``, ``reward/judge_retries``,
``reward/judge_latency_s``, ``reward/judge_parse_failures``, ``reward/judge_errors``, ``reward/judge_prompt_tokens``,
``reward/judge_output_tokens`` and ``reward/judge_version``.
"""

from __future__ import annotations

import json
import logging
import math
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Protocol

from rlray.reward.judges.modes import judge_mode
from rlray.reward.judges.records import JudgeItem, JudgeReply, JudgeRequest, JudgeVerdict

log = logging.getLogger(__name__)
IDENTITY_TIMEOUT_S = 30.0  # a replica answers who it is at once (it does not wait for its judge calls)


class JudgeCaller(Protocol):
    """What a ``JudgeClient`` sends chunks through: a Serve application (``ServeJudgeCaller``) or a local service."""

    def identity(self, timeout_s: float) -> tuple[int, str]: ...

    def judge(self, request: JudgeRequest, timeout_s: float) -> JudgeReply: ...


class LocalJudgeCaller:
    """Calls a ``JudgeService`` in this process (``rlray judge check``; tests): no timeout applies."""

    def __init__(self, service: Any) -> None:
        self.service = service

    def identity(self, timeout_s: float) -> tuple[int, str]:
        """Returns (version, definition) of the service."""
        return self.service.version, self.service.spec.definition

    def judge(self, request: JudgeRequest, timeout_s: float) -> JudgeReply:
        """Returns the service's reply to ``request``."""
        return self.service.judge(request)


@dataclass
class JudgeStats:
    """A judge's counts since they were last taken (``JudgePanel.take_metrics``).

    Attributes:
        requests: judgements asked (samples, or groups in group mode), cache hits included.
        cache_hits: judgements answered without a call (the cache, or the same judgement twice in one batch).
        calls: chunk requests sent (tries included); call_s: their wall time, summed (s).
        retries: chunk requests sent again after a timeout or an error.
        parse_failures: samples whose judge output did not parse (from the cache too); errors: samples failed otherwise.
        prompt_tokens, output_tokens: tokens the judge read and wrote for the judgements sent.
        version: the lowest judge version that answered (None: none answered).
    """

    requests: int = 0
    cache_hits: int = 0
    calls: int = 0
    call_s: float = 0.0
    retries: int = 0
    parse_failures: int = 0
    errors: int = 0
    prompt_tokens: int = 0
    output_tokens: int = 0
    version: int | None = None


@dataclass(frozen=True)
class JudgeScores:
    """A judge's scores of B samples: ``scores[i]`` (NaN failed) and ``outputs[i]``, the raw output that gave it."""

    scores: list[float]
    outputs: list[str]


def _key_part(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value, sort_keys=True, default=str)


class JudgeClient:
    """One judge, seen from the run (module docstring).

    Args:
        name: the judge's name (messages).
        mode: the mode the judge serves ("pointwise", "group"; a key of ``JUDGE_MODES``): it plans the judgements.
        caller: the judge's caller (``ServeJudgeCaller``, ``LocalJudgeCaller``).
        chunks: chunks a batch is split into (the judge's replicas).
        timeout_s: seconds one chunk request may take.
        attempts: tries per chunk.
        backoff_s: the first wait between tries (doubling).
        cache_entries: judgements kept in the cache; 0 disables it.
        on_timeout: called with (the call, seconds waited) when a chunk request gets no reply within ``timeout_s``,
            before the next try: the run's hang report (``rlray.hangs.HangWatch.timed_out``: the replicas' stacks, an
            alert); it may raise to stop the run (``HangError``: the step ends, no NaN). None: no report.
    """

    def __init__(self, name: str, mode: str, caller: JudgeCaller, *, chunks: int = 1, timeout_s: float = 120.0,
                 attempts: int = 3, backoff_s: float = 1.0, cache_entries: int = 100_000,
                 on_timeout: Callable[[str, float], object] | None = None) -> None:  # fmt: skip
        self.name, self.mode, self.caller, self.on_timeout = name, mode, caller, on_timeout
        self.judge_mode = judge_mode(mode)
        self.chunks, self.timeout_s, self.attempts, self.backoff_s = chunks, timeout_s, attempts, backoff_s
        self.cache_entries = cache_entries
        self.stats = JudgeStats()
        self._cache: OrderedDict[tuple, tuple[tuple[float, ...], str, str]] = OrderedDict()
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=max(chunks, 1), thread_name_prefix=f"judge-{name}")

    def score(self, prompts: Sequence[str | list[dict]], responses: Sequence[str], columns: Sequence[dict[str, Any]],
              groups: Sequence[int] | None = None, seed: int = 0, *, reverse: bool = False) -> JudgeScores:  # fmt: skip
        """Returns the judge's score and raw output of each of the B samples.

        Args:
            prompts, responses, columns: the B samples' prompts (as the dataset has them), decoded responses and
                prompt rows' other columns.
            groups: B group ids (group mode: the samples of a group are judged together, in the order of the
                batch); None: each sample its own group.
            seed: seeds the order each group is shown in (group mode; ``plan``).
            reverse: show each group in the reverse of the order ``seed`` draws (``rlray judge check``'s position bias;
                use a client without a cache, or the first order's verdicts come back).
        """
        members, orders = self.plan(len(responses), groups, seed)
        orders = [o[::-1] for o in orders] if reverse else orders
        identity = self._current_identity()
        keys = [(_key_part(prompts[m[0]]), tuple(responses[i] for i in m), _key_part(columns[m[0]])) for m in members]
        results = self._cached(identity, keys)
        first = {k: j for j, k in reversed(list(enumerate(keys)))}
        missing = [k for k in dict.fromkeys(keys) if results[first[k]] is None]
        items = [JudgeItem(prompts[members[first[k]][0]], tuple(k[1][p] for p in orders[first[k]]),
                           columns[members[first[k]][0]]) for k in missing]  # fmt: skip
        sent = self._send_all(items, [orders[first[k]] for k in missing], down=identity is None)
        done = dict(zip(missing, sent, strict=True))
        self._remember(done)
        scores, outputs = [math.nan] * len(responses), [""] * len(responses)
        parse_failures = errors = 0
        for m, key, cached in zip(members, keys, results, strict=True):
            values, output, failure = (*cached, "parse") if cached is not None else done[key][:3]  # the cache keeps
            for i, v in zip(m, values, strict=True):  # only verdicts, so its NaN scores are parse failures
                scores[i], outputs[i] = v, output
            bad = sum(math.isnan(v) for v in values)
            parse_failures += bad if failure == "parse" else 0
            errors += bad if failure not in ("", "parse") else 0
        with self._lock:
            self.stats.requests += len(members)
            self.stats.cache_hits += len(members) - len(missing)
            self.stats.parse_failures += parse_failures
            self.stats.errors += errors
        return JudgeScores(scores, outputs)

    def plan(self, n: int, groups: Sequence[int] | None, seed: int) -> tuple[list[list[int]], list[list[int]]]:
        """Returns (the sample indices of each judgement, in batch order, and the order each is shown in:
        ``order[k]`` is the member shown k-th) for B = ``n`` samples.

        The judge's mode decides (``JudgeMode.plan``). Pointwise: one judgement per sample. Group mode: one per group
        (in order of first appearance), shown in a permutation drawn from ``numpy.random.default_rng(seed)``, one
        group after the other.
        """
        return self.judge_mode.plan(n, groups, seed)

    def _current_identity(self) -> tuple[int, str] | None:
        """Returns the judge's (version, definition) now, or None when it does not answer."""
        try:
            return tuple(self._retrying(lambda: self.caller.identity(IDENTITY_TIMEOUT_S), "identity"))
        except _Unavailable:
            return None

    def _cached(self, identity: tuple[int, str] | None, keys: list[tuple]) -> list[tuple[tuple[float, ...], str] | None]:
        """Returns the cached (scores, output) of each key under ``identity`` (None: a miss; all miss without one)."""
        with self._lock:
            out: list[tuple[tuple[float, ...], str] | None] = []
            for key in keys:
                hit = self._cache.get((identity, *key)) if identity is not None else None
                if hit is not None:
                    self._cache.move_to_end((identity, *key))
                out.append(hit)
            return out

    def _remember(self, done: dict[tuple, tuple]) -> None:
        """Caches the judgements that got a verdict (parsed or not; not the ones the judge did not make)."""
        if not self.cache_entries:
            return
        with self._lock:
            for key, (values, output, failure, identity) in done.items():
                if failure in ("", "parse") and identity is not None:
                    self._cache[(identity, *key)] = (values, output)
                    self._cache.move_to_end((identity, *key))
            while len(self._cache) > self.cache_entries:
                self._cache.popitem(last=False)

    def _send_all(self, items: list[JudgeItem], orders: list[list[int]], down: bool) -> list[tuple]:
        """Returns each item's (scores in the batch's order, output, failure, (version, definition) or None), its
        chunk sent to a replica with the others at once; all fail at once when the judge is ``down``."""
        if not items:
            return []
        n = min(self.chunks, len(items))
        bounds = [round(c * len(items) / n) for c in range(n + 1)]
        chunks = [items[bounds[c] : bounds[c + 1]] for c in range(n)]
        replies = [None] * n if down else list(self._pool.map(self._send, chunks))
        out = []
        for chunk, reply in zip(chunks, replies, strict=True):
            if reply is None:
                out += [(JudgeVerdict((math.nan,) * len(item.responses), "no answer from the judge", "unavailable"), None)
                        for item in chunk]  # fmt: skip
            else:
                out += [(v, (reply.version, reply.definition)) for v in reply.verdicts]
        return [(*_unshuffle(v, order), identity) for (v, identity), order in zip(out, orders, strict=True)]

    def _send(self, chunk: list[JudgeItem]) -> JudgeReply | None:
        """Returns a replica's reply to one chunk, or None after ``attempts`` tries (the chunk's samples fail)."""
        try:
            reply = self._retrying(lambda: self.caller.judge(JudgeRequest(self.mode, chunk), self.timeout_s), "judge",
                                   timed=True)  # fmt: skip
        except _Unavailable:
            return None
        with self._lock:
            stats = self.stats
            stats.version = reply.version if stats.version is None else min(stats.version, reply.version)
            stats.prompt_tokens += sum(v.prompt_tokens for v in reply.verdicts)
            stats.output_tokens += sum(v.output_tokens for v in reply.verdicts)
        return reply

    def _retrying(self, call: Any, what: str, timed: bool = False) -> Any:
        """Returns ``call()``, tried up to ``attempts`` times with back-off; raises ``_Unavailable`` after the last.
        ``timed``: count each try in calls and call_s, and each try after the first in retries, and report each try
        past ``timeout_s`` (``on_timeout``)."""
        last: BaseException | None = None
        for attempt in range(self.attempts):
            t = time.perf_counter()
            try:
                result, ok = call(), True
            except Exception as err:  # noqa: BLE001 - a timeout, a dead replica, an application being redeployed
                last, result, ok = err, None, False
            if timed:
                with self._lock:
                    self.stats.calls += 1
                    self.stats.call_s += time.perf_counter() - t
                    self.stats.retries += int(attempt > 0)
                if isinstance(last, TimeoutError) and not ok and self.on_timeout is not None:
                    self.on_timeout(what, time.perf_counter() - t)  # may raise HangError: past the catch above
            if ok:
                return result
            if attempt + 1 < self.attempts:
                time.sleep(self.backoff_s * 2**attempt)
        log.warning("judge '%s': %s failed %d times, last with %s: %s; its samples fail this time (reward/judge_errors)",
                    self.name, what, self.attempts, type(last).__name__, str(last)[:300])
        raise _Unavailable(what)

    def take_stats(self) -> JudgeStats:
        """Returns the counts since the last call and starts new ones."""
        with self._lock:
            stats, self.stats = self.stats, JudgeStats()
        return stats

    def close(self) -> None:
        """Stops the client's threads."""
        self._pool.shutdown(wait=False)


class _Unavailable(Exception):
    """The judge did not answer after every try."""


def _unshuffle(verdict: JudgeVerdict, order: list[int]) -> tuple[tuple[float, ...], str, str]:
    """Returns (scores in the batch's order, output, failure) of a verdict on responses shown in ``order``
    (``order[k]``: the batch position of the response shown k-th)."""
    scores = [math.nan] * len(order)
    for shown, original in enumerate(order):
        scores[original] = verdict.scores[shown]
    if len(order) > 1 and verdict.failure in ("", "parse"):  # the judge saw the group: say in which order
        where = ", ".join(f"{original + 1}->{shown + 1}" for shown, original in enumerate(order))
        output = f"[shown order, sample->position: {where}]\n{verdict.output}"
    else:
        output = verdict.output
    return tuple(scores), output, verdict.failure
