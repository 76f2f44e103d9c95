"""Plain records that cross the rollout boundary: what to sample, and what came back; and ``RolloutSource``,
what the step, the async pipeline and evaluation sample from.

No config objects and no engine imports here, so the run, the actors and the tests can use
these records without vLLM installed.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar, runtime_checkable

FINISH_REASONS = ("stop", "length")
MAX_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # the max_lora_rank values vLLM accepts (LoRAConfig)


@dataclass
class SamplingSpec:
    """How to sample completions for one generate() call.

    Attributes:
        n: samples per prompt (the group size G).
        max_new_tokens: cap on generated tokens per completion.
        temperature: sampling temperature; 0.0 means greedy (argmax).
        top_p: nucleus mass in (0, 1]; 1.0 disables nucleus filtering.
        seed: reseeds the engine's sampling generator at the start of the call, so that the
            call's samples are a deterministic function of (seed, prompts, weights); None draws
            from the engine's generator as it stands (seeded once at engine start).
        top_k: keep the k most likely tokens; 0 disables top-k filtering.
        min_p: drop tokens whose probability is below min_p times the most likely one's; 0.0 disables it.
        stop: stop strings; generation ends after the token that completes one (finish_reason "stop",
            the stop string's tokens kept in response_token_ids).
        logprob_token_ids: token ids whose logprobs are also returned for every generated token
            (``Completion.token_id_logprobs``; a judge's label tokens), from the same distribution as
            rollout_logprobs; () asks for none.

    Raises:
        ValueError: a field out of range (the message names the field and the value).
    """

    n: int
    max_new_tokens: int
    temperature: float
    top_p: float = 1.0
    seed: int | None = None
    top_k: int = 0
    min_p: float = 0.0
    stop: tuple[str, ...] = ()
    logprob_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.n, int) or self.n < 1:
            raise ValueError(f"SamplingSpec.n={self.n!r}: need an int >= 1 (samples per prompt)")
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise ValueError(f"SamplingSpec.max_new_tokens={self.max_new_tokens!r}: need an int >= 1")
        if not self.temperature >= 0.0:
            raise ValueError(f"SamplingSpec.temperature={self.temperature!r}: need >= 0.0 (0.0 is greedy)")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"SamplingSpec.top_p={self.top_p!r}: need 0 < top_p <= 1")
        if self.seed is not None and (not isinstance(self.seed, int) or self.seed < 0):
            raise ValueError(f"SamplingSpec.seed={self.seed!r}: need None or an int >= 0")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"SamplingSpec.top_k={self.top_k!r}: need an int >= 0 (0 disables top-k)")
        if not 0.0 <= self.min_p < 1.0:
            raise ValueError(f"SamplingSpec.min_p={self.min_p!r}: need 0 <= min_p < 1 (0 disables min-p)")
        self.stop = tuple(self.stop)
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError(f"SamplingSpec.stop={self.stop!r}: need non-empty strings")
        self.logprob_token_ids = tuple(self.logprob_token_ids)
        if any(not isinstance(t, int) or t < 0 for t in self.logprob_token_ids):
            raise ValueError(f"SamplingSpec.logprob_token_ids={self.logprob_token_ids!r}: need token ids >= 0")

    @property
    def greedy(self) -> bool:
        """Returns True when sampling is argmax (temperature 0.0)."""
        return self.temperature == 0.0


@dataclass
class AgentInfo:
    """What an agent episode records besides an environment episode's fields (``EpisodeInfo.agent``;
    ``rlray.run.agents``).

    Attributes:
        segments: the episode cut where the agent rewrote history (``rlray.envs.agents.conversation``): its earlier
            token sequences, in order, each trained as a sequence of its own (the completion holding this record is
            the last one); [] otherwise.
        gateway_calls: the episode's chat or completion calls answered by the gateway.
        template_drift: the episode's history rewrites, i.e. ``len(segments)`` cuts.
        engine_calls, engine_prompts, batch_wait_s: its host batch's engine calls, their prompts and the seconds they
            waited for their batch, on one episode per batch (0 on the others; ``AgentReply``).
        parallel_calls: the episode's calls that came while another of its calls was being answered (``AgentReply``).
    """

    segments: list[Completion] = field(default_factory=list)
    gateway_calls: int = 0
    template_drift: int = 0
    engine_calls: int = 0
    engine_prompts: int = 0
    batch_wait_s: float = 0.0
    parallel_calls: int = 0


@dataclass
class EpisodeInfo:
    """What one multi-turn episode recorded besides its tokens (``rlray.run.episodes``).

    Attributes:
        environment: the environment's name (env.environments key); "" for a single-turn row.
        stop_reason: why the episode ended (``rlray.envs.episode.STOP_REASONS``).
        num_turns: assistant turns sampled.
        turn_rewards: the environment's reward after each turn (None: none given that turn).
        env_reward: the episode's environment reward (the sum of the turn rewards given, or the
            final reward), None when the environment gave none.
        failed: the episode failed (the environment raised or ran past a time limit in reset, step,
            reward_at_limit or close); it is left out of the update.
        tool_calls: tool calls parsed over the episode; tool_errors: calls that failed (malformed,
            unknown tool, bad arguments, a raising tool).
        observation_tokens: tokens of observations (loss mask off).
        observations_truncated: observation messages cut to env.max_observation_tokens.
        metrics: the environment's own per-episode numbers (summed over turns), logged as env/<name> means.
        scores: the parts of env_reward an agent reported (``AgentResult.scores``), logged as reward terms
            ``reward/<environment>/<name>`` of weight 0 (``rlray.run.episodes.add_env_reward``).
        message: the error of a failed episode, saying where it raised ("" otherwise).
        rerun: the episode was run again from its reset: a rollout actor or environment host died under its step's
            rollout, which ran again, whole (``rlray.run.rerun.RerunOnFault``).
        env_steps: ``step`` calls its environment answered or failed (one per turn the environment was asked about;
            0 for an agent episode, whose calls go through the gateway: ``AgentInfo.gateway_calls``).
        agent: what only an agent episode records (``AgentInfo``); None for an environment episode, and for the
            earlier segments of a cut agent episode.
    """

    environment: str
    stop_reason: str
    num_turns: int
    turn_rewards: list[float | None] = field(default_factory=list)
    env_reward: float | None = None
    failed: bool = False
    tool_calls: int = 0
    tool_errors: int = 0
    observation_tokens: int = 0
    observations_truncated: int = 0
    metrics: dict[str, float] = field(default_factory=dict)
    scores: dict[str, float] = field(default_factory=dict)
    message: str = ""
    rerun: bool = False
    env_steps: int = 0
    agent: AgentInfo | None = None


@dataclass
class Completion:
    """One generated response.

    Attributes:
        prompt_index: index into the prompt list given to generate().
        sample_index: 0..n-1 within that prompt.
        response_token_ids: generated token ids, INCLUDING the EOS token when
            finish_reason == "stop".
        rollout_logprobs: per generated token, the log-probability (nats) of that token under
            the behaviour policy that sampled it: log_softmax(logits / temperature), the raw
            logits for greedy (temperature 0); same length as response_token_ids. The learner
            scales its logits by the same temperature (rlray.learner.response_logprobs, as TRL
            and verl do), so the two compare like with like. Top-p: the vllm backend
            renormalises over the kept nucleus, the hf backend does not; with top_p = 1 both
            equal the learner's logprobs.
        finish_reason: "stop" (an EOS/stop token was generated) or "length" (hit max_new_tokens).
        policy_version: the engine's policy version when this was generated: the version of its first (oldest) token
            (a partial rollout, ``rollout.partial``, may take later tokens from newer versions: ``versions``).
        loss_mask: per response token, True where the token was sampled by the policy and counts in
            the loss; same length as response_token_ids. All True for a single-turn completion (the
            default); a multi-turn episode sets False on its observation tokens.
        prompt_token_ids: the prompt this completion continues when it is not the one given to
            generate() (an episode: the environment's opening prompt); None: the given prompt.
        episode: what the environment episode recorded (None for a single-turn completion).
        token_id_logprobs: per generated token, {token id: logprob (nats)} of ``SamplingSpec.logprob_token_ids``,
            from the distribution rollout_logprobs come from; empty when none were asked.
        versions: per generated token, the policy version that sampled it (the weights its rollout_logprobs come
            from); same length as response_token_ids. All ``policy_version`` (the default) unless a partial rollout
            (``rlray.rollout.partial``) continued the sequence under newer weights; never decreasing.
    """

    prompt_index: int
    sample_index: int
    response_token_ids: list[int]
    rollout_logprobs: list[float]
    finish_reason: str
    policy_version: int
    loss_mask: list[bool] = field(default_factory=list)
    prompt_token_ids: list[int] | None = None
    episode: EpisodeInfo | None = None
    token_id_logprobs: list[dict[int, float]] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.loss_mask:
            self.loss_mask = [True] * len(self.response_token_ids)
        elif len(self.loss_mask) != len(self.response_token_ids):
            raise ValueError(f"Completion.loss_mask has {len(self.loss_mask)} entries for "
                             f"{len(self.response_token_ids)} response tokens")
        if not self.versions:
            self.versions = [self.policy_version] * len(self.response_token_ids)
        elif len(self.versions) != len(self.response_token_ids):
            raise ValueError(f"Completion.versions has {len(self.versions)} entries for "
                             f"{len(self.response_token_ids)} response tokens")


def completion_to_dict(c: Completion) -> dict[str, Any]:
    """Returns ``c`` as plain JSON data (``completion_from_dict`` rebuilds it exactly: floats as Python writes them,
    NaN included); what a snapshot keeps of the rollouts in flight (``rlray.rollout.pipeline``)."""
    out = dataclasses.asdict(c)
    out["token_id_logprobs"] = [[[int(k), v] for k, v in d.items()] for d in c.token_id_logprobs]
    if c.episode is not None and c.episode.agent is not None:
        out["episode"]["agent"]["segments"] = [completion_to_dict(s) for s in c.episode.agent.segments]
    return out


def completion_from_dict(data: dict[str, Any]) -> Completion:
    """Returns the ``Completion`` that ``completion_to_dict`` wrote as ``data``.

    Raises:
        TypeError: ``data`` has a field ``Completion`` does not (or misses a required one).
    """
    data = dict(data)
    data["token_id_logprobs"] = [{int(k): v for k, v in pairs} for pairs in data.get("token_id_logprobs", [])]
    if data.get("episode") is not None:
        episode = dict(data["episode"])
        if episode.get("agent") is not None:
            agent = dict(episode["agent"])
            agent["segments"] = [completion_from_dict(s) for s in agent.get("segments", [])]
            episode["agent"] = AgentInfo(**agent)
        data["episode"] = EpisodeInfo(**episode)
    return Completion(**data)


PendingT = TypeVar("PendingT")


@runtime_checkable
class RolloutSource(Protocol[PendingT]):
    """What the step, the async pipeline (``rlray.rollout.pipeline.RolloutPipeline``) and evaluation sample from: the
    rollout fleet (``rlray.rollout.fleet.RolloutFleet``), or the episodes over it when environments are configured
    (``rlray.run.episodes.EpisodeRollout``).

    ``submit`` starts a rollout and returns its pending handle at once (``PendingT``: the fleet's
    ``PendingRollout``, the episode rollout's ``concurrent.futures.Future``); ``collect`` waits for that handle
    (once per handle); ``generate`` does both on the caller's thread. Completions come back prompt-major,
    ``sampling.n`` per prompt, ``Completion.prompt_index`` indexing the P prompts given.

    ``rows`` are always given: the P prompts' dataset rows (``rlray.data.PromptRow``), one per prompt. The episode
    rollout reads them (a row's columns name its environment and are ``reset``'s keyword arguments) and requires
    them; the fleet does not read them and also accepts None, for callers that sample raw token ids without rows
    (the episode loop's turns, benchmarks).
    """

    @property
    def version(self) -> int:
        """Returns the latest policy version pushed to the rollout engines."""
        ...

    def submit(self, prompt_ids: list[list[int]], sampling: SamplingSpec, rows: list[Any]) -> PendingT:
        """Returns the pending handle of a rollout of ``sampling.n`` completions for each of the P prompts
        ``prompt_ids`` (token ids), started without waiting; ``rows``: the P prompt rows."""
        ...

    def collect(self, pending: PendingT) -> list[Completion]:
        """Returns the completions of a submitted rollout, prompt-major, waiting for them."""
        ...

    def generate(self, prompt_ids: list[list[int]], sampling: SamplingSpec, rows: list[Any]) -> list[Completion]:
        """Returns ``collect(submit(prompt_ids, sampling, rows))``."""
        ...


ResultT = TypeVar("ResultT")


def in_background(work: Callable[[], ResultT], name: str) -> Future[ResultT]:
    """Returns a future of ``work()``, run on a new daemon thread named ``name``; the future holds what it raised.

    The ``submit`` of rollout sources whose ``generate`` blocks (the episode and agent rollouts): their ``collect``
    is ``future.result()``, which re-raises on the caller's thread.
    """
    pending: Future[ResultT] = Future()
    pending.set_running_or_notify_cancel()

    def run() -> None:
        try:
            pending.set_result(work())
        except BaseException as err:  # noqa: BLE001 - re-raised by the future's result() on the caller's thread
            pending.set_exception(err)

    threading.Thread(target=run, name=name, daemon=True).start()
    return pending


class InProcessBackend:
    """What the rollout backends that hold their model in this process share (``HFBackend``, ``ExactBackend``): no
    KV cache kept between calls, the model freed at shutdown, and a private seed stream for unseeded requests
    (``self._generator_seed``, set by the subclass, advances by one per call)."""

    _model: Any
    _generator_seed: int

    def reset_cache(self) -> None:
        """Does nothing: no KV cache is kept between calls."""

    def shutdown(self) -> None:
        """Frees the model."""
        del self._model

    def _next_seed(self) -> int:
        self._generator_seed += 1
        return self._generator_seed
