"""``JudgeService``: a judge model that renders, generates and parses verdicts in its mode (``rlray.reward.judges``).

One per Serve replica (``rlray.reward.judges.deployment``), or in the caller's process (``rlray judge check``). The
model is a ``RolloutEngine`` (vLLM, or the transformers fallback), so a judge samples exactly as the policy does:
the chat-templated judge prompts of a chunk go to the engine in one ``generate`` call.
"""

from __future__ import annotations

import logging
import math
import time
from typing import Any, Protocol

from rlray.models import load_tokenizer
from rlray.reward.judges.modes import spec_mode
from rlray.reward.judges.records import JudgeItem, JudgeReply, JudgeRequest, JudgeSpec, JudgeVerdict
from rlray.rollout import Completion, RolloutEngine, SamplingSpec

log = logging.getLogger(__name__)


class _Engine(Protocol):
    def generate(self, prompt_token_ids: list[list[int]], sampling: SamplingSpec) -> list[Completion]: ...

    def shutdown(self) -> None: ...


def _failed(size: int, failure: str, why: str, prompt_tokens: int = 0) -> JudgeVerdict:
    return JudgeVerdict((math.nan,) * size, why, failure, prompt_tokens)


class JudgeService:
    """A versioned judge: its definition, its tokenizer and its engine.

    Args:
        spec: the judge's definition.
        version: its version, reported with every reply.
        engine: the engine to judge with (tests); None builds ``RolloutEngine`` from ``spec``.
        tokenizer: the judge's tokenizer; None loads the one of ``spec.model_path``.

    Raises:
        rlray.reward.judges.JudgeError: the tokenizer does not fit the mode (``logprobs`` with labels whose first
            tokens collide).
        KeyError: ``spec.mode`` is not a registered judge mode.
        FileNotFoundError, ValueError, ImportError: the engine cannot be built (``RolloutEngine``).
    """

    def __init__(self, spec: JudgeSpec, version: int, *, engine: _Engine | None = None, tokenizer: Any = None) -> None:
        self.spec, self.version = spec, version
        self.tokenizer = tokenizer if tokenizer is not None else load_tokenizer(spec.model_path)
        self.mode = spec_mode(spec)
        self.label_ids = self.mode.prepare(spec, self.tokenizer, f"reward.judges (name '{spec.name}')")
        self.engine = engine if engine is not None else RolloutEngine(
            spec.model_path, dtype=spec.dtype, seed=spec.seed, max_model_len=spec.max_model_len, backend=spec.backend,
            enforce_eager=spec.enforce_eager, kv_cache_gib=spec.kv_cache_gib, cpu_threads=spec.cpu_threads,
        )  # fmt: skip

    @property
    def sampling(self) -> SamplingSpec:
        """Returns the judge's SamplingSpec (its mode's: one greedy token and the labels' logprobs with ``logprobs``,
        else ``max_new_tokens`` at ``temperature`` with ``seed``)."""
        return self.mode.sampling(self.spec, self.label_ids)

    def prompt_ids(self, item: JudgeItem) -> tuple[list[int], str]:
        """Returns (the judge prompt's token ids, the rendered prefill) of ``item``: its turns through the judge
        tokenizer's chat template with the generation prompt, then the prefill.

        Raises:
            jinja2.TemplateError: a template raised on this item (or whatever its expressions raise).
        """
        messages, prefill = self.mode.render(self.spec, item)
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False) + prefill
        return self.tokenizer(text, add_special_tokens=False)["input_ids"], prefill

    def judge(self, request: JudgeRequest) -> JudgeReply:
        """Returns the verdicts of ``request.items``, in order, with this judge's version and definition.

        A request for another mode than the judge's, an item whose template raises, and one whose prompt does not
        leave ``max_new_tokens`` within ``max_model_len`` get failed verdicts ("mode", "template", "too_long"); the
        other items are generated in one engine call and parsed.
        """
        start = time.perf_counter()
        spec, items = self.spec, request.items
        verdicts: list[JudgeVerdict | None] = [None] * len(items)
        prepared: list[tuple[int, list[int], str]] = []
        room = spec.max_model_len - self.sampling.max_new_tokens
        for i, item in enumerate(items):
            if request.mode != spec.mode:
                verdicts[i] = _failed(len(item.responses), "mode", f"the judge '{spec.name}' serves mode "
                                      f"{spec.mode!r}; the caller asked for {request.mode!r}")  # fmt: skip
                continue
            try:
                ids, prefill = self.prompt_ids(item)
            except Exception as err:  # noqa: BLE001 - a template that raises on this row (undefined name, bad filter)
                verdicts[i] = _failed(len(item.responses), "template", f"{type(err).__name__}: {err}")
                continue
            if len(ids) > room:
                verdicts[i] = _failed(len(item.responses), "too_long", f"the judge prompt has {len(ids)} tokens; "
                                      f"{room} fit (max_model_len {spec.max_model_len})", len(ids))  # fmt: skip
                continue
            prepared.append((i, ids, prefill))
        if prepared:
            done = self.engine.generate([ids for _, ids, _ in prepared], self.sampling)
            for (i, ids, prefill), completion in zip(prepared, done, strict=True):
                verdicts[i] = self._verdict(items[i], ids, prefill, completion)
        return JudgeReply(self.version, spec.definition, list(verdicts), time.perf_counter() - start)

    def _verdict(self, item: JudgeItem, ids: list[int], prefill: str, completion: Completion) -> JudgeVerdict:
        """Returns the verdict of one generated judge output, read by the judge's mode."""
        output = prefill + self.tokenizer.decode(completion.response_token_ids, skip_special_tokens=True)
        tokens = {"prompt_tokens": len(ids), "output_tokens": len(completion.response_token_ids)}
        scores, output = self.mode.read(self.spec, output, completion, len(item.responses), self.label_ids)
        failure = "parse" if any(s is None for s in scores) else ""
        return JudgeVerdict(tuple(math.nan if s is None else s for s in scores), output, failure, **tokens)

    def close(self) -> None:
        """Stops the engine (and frees its memory)."""
        self.engine.shutdown()
