"""Partial rollouts (``rollout.partial``): a generation in flight takes a weight update at a token boundary and goes
on under the new weights, each token stamped with the policy version that sampled it.

Engine-agnostic: a request for up to N new tokens is served in segments of ``segment_tokens`` (``generate_in_segments``).
After the first segment (the P prompts, n samples each, in one call), the sequences still open (none ended with EOS,
none reached N) continue in one call per segment, each from its prompt + its tokens so far (a re-prefill: the KV
cache is recomputed under the weights of that moment; vLLM's prefix cache serves it again when no update came in
between). Between segments the engine lets a waiting weight update in (``UpdateGate``): the update runs on another
thread of the rollout actor (its ``weights`` concurrency group, ``rlray.launch.engine_actors.PartialRolloutActor``),
and a segment never runs while weights load. Each continuation's tokens carry the version it ran under
(``Completion.versions``), with the behaviour logprob of that version (``rollout_logprobs``), so the learner's rollout
correction and decoupled PPO ratio use each token's own behaviour policy (``rlray.learner.objective``).

Where a plain generation samples all N tokens in one call, the segments draw from the engine's generator once per
segment (a seeded call reseeds each segment with ``seed + j * SEGMENT_SEED_STRIDE``), so the samples differ from an
unsegmented call's even when no update comes; they stay a deterministic function of (seed, prompts, weights, the
segments the updates landed before).

Legend: P prompts, n samples per prompt, N max_new_tokens.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from rlray.rollout.types import Completion, SamplingSpec

SEGMENT_SEED_STRIDE = 1_000_033  # segment j of a seeded call samples with seed + j * stride
VERSION_WAIT_S = 600.0  # longest a generation waits for the weights of the version it was sent after


class UpdateGate:
    """Lets weight updates in between the segments of a generation, never during one (one engine, two threads).

    A generation holds the gate for each segment (``generating``) and offers it between segments
    (``yield_to_updates``); an update (``updating``) waits for the segment in progress, and a waiting update goes
    before the next segment and before a new generation starts. Without a concurrent caller (a serial actor) every
    call passes at once.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._generating = False
        self._updating = False
        self._waiting = 0

    @contextmanager
    def generating(self, ready: Callable[[], bool], what: str) -> Iterator[None]:
        """Holds the gate for a generation once ``ready()`` is True and no update is waiting or loading.

        Raises:
            TimeoutError: ``ready()`` stayed False for ``VERSION_WAIT_S`` (``what`` says what it waited for).
        """
        with self._cond:
            if not self._cond.wait_for(lambda: ready() and not (self._updating or self._waiting), VERSION_WAIT_S):
                raise TimeoutError(f"partial rollout: waited {VERSION_WAIT_S:g} s for {what}; the weight push did "
                                   "not arrive (see the rollout actor's log)")
            self._generating = True
        try:
            yield
        finally:
            with self._cond:
                self._generating = False
                self._cond.notify_all()

    def yield_to_updates(self) -> None:
        """Between two segments: lets every waiting update load, then takes the gate back (returns at once when
        none waits)."""
        with self._cond:
            if not self._waiting:
                return
            self._generating = False
            self._cond.notify_all()
            self._cond.wait_for(lambda: not (self._updating or self._waiting))
            self._generating = True

    @contextmanager
    def updating(self) -> Iterator[None]:
        """Holds the gate for a weight update, once the segment in progress (if any) has ended."""
        with self._cond:
            self._waiting += 1
            self._cond.wait_for(lambda: not (self._generating or self._updating))
            self._waiting -= 1
            self._updating = True
        try:
            yield
        finally:
            with self._cond:
                self._updating = False
                self._cond.notify_all()


Generate = Callable[[list[list[int]], SamplingSpec, int], list[Completion]]


def generate_in_segments(generate: Generate, prompt_token_ids: list[list[int]], sampling: SamplingSpec, *,
                         segment_tokens: int, version: Callable[[], int],
                         between: Callable[[], None]) -> list[Completion]:
    """Returns P * n completions, prompt-major, generated in segments of at most ``segment_tokens`` new tokens.

    Args:
        generate: a backend's ``generate(prompt_token_ids, sampling, policy_version)`` (P prompts, n samples each,
            prompt-major, every token stamped ``policy_version``).
        prompt_token_ids: P prompts.
        sampling: what to sample; ``max_new_tokens`` is N, the cap over all segments.
        segment_tokens: new tokens per segment (>= 1).
        version: returns the engine's policy version now (read before each segment, under the gate).
        between: called between two segments (the engine: ``UpdateGate.yield_to_updates``, where updates load).

    Each completion keeps its first segment's ``policy_version`` (its oldest token's), its tokens' ``versions`` and
    logprobs segment by segment, and the finish reason of its last segment ("stop" at an EOS or stop token, "length"
    at N tokens).

    Raises:
        ValueError: segment_tokens < 1.
    """
    if segment_tokens < 1:
        raise ValueError(f"generate_in_segments: segment_tokens={segment_tokens}; need >= 1 (rollout.partial_segment_tokens)")
    cap = sampling.max_new_tokens
    done = generate(prompt_token_ids, dataclasses.replace(sampling, max_new_tokens=min(segment_tokens, cap)), version())
    todo = [i for i, c in enumerate(done) if c.finish_reason == "length" and len(c.response_token_ids) < cap]
    segment = 1
    while todo:  # every open sequence has segment * segment_tokens tokens: one call continues them all
        between()
        sofar = len(done[todo[0]].response_token_ids)
        spec = dataclasses.replace(
            sampling, n=1, max_new_tokens=min(segment_tokens, cap - sofar),
            seed=None if sampling.seed is None else sampling.seed + segment * SEGMENT_SEED_STRIDE)
        prefixes = [list(prompt_token_ids[done[i].prompt_index]) + list(done[i].response_token_ids) for i in todo]
        for i, more in zip(todo, generate(prefixes, spec, version()), strict=True):
            done[i] = _extend(done[i], more)
        todo = [i for i in todo if done[i].finish_reason == "length" and len(done[i].response_token_ids) < cap]
        segment += 1
    return done


def _extend(head: Completion, more: Completion) -> Completion:
    """Returns ``head`` followed by the continuation ``more`` (its tokens, logprobs, versions; its finish reason)."""
    return Completion(
        prompt_index=head.prompt_index, sample_index=head.sample_index,
        response_token_ids=head.response_token_ids + more.response_token_ids,
        rollout_logprobs=head.rollout_logprobs + more.rollout_logprobs,
        finish_reason=more.finish_reason, policy_version=head.policy_version,
        token_id_logprobs=head.token_id_logprobs + more.token_id_logprobs,
        versions=head.versions + more.versions,
    )
