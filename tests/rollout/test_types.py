"""SamplingSpec validation and seeds; the rollout package imports without starting vLLM."""

from __future__ import annotations

import subprocess
import sys

import pytest

from rlray.rollout import SamplingSpec


@pytest.mark.parametrize(
    "kwargs,field",
    [
        ({"n": 0}, "n"),
        ({"max_new_tokens": 0}, "max_new_tokens"),
        ({"temperature": -0.1}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"seed": -1}, "seed"),
    ],
)
def test_sampling_spec_rejects_out_of_range(kwargs: dict, field: str):
    base = {"n": 2, "max_new_tokens": 8, "temperature": 1.0}
    with pytest.raises(ValueError, match=f"SamplingSpec.{field}="):
        SamplingSpec(**{**base, **kwargs})


def test_import_does_not_import_vllm():
    code = "import sys, rlray.rollout; print('vllm' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


# --------------------------------------------------------------------------------------------
# RolloutSource: the fleet and the episode rollout answer the same calls
# --------------------------------------------------------------------------------------------
def _conformance(cls: type) -> list[str]:
    """Returns how ``cls``'s submit/collect/generate break ``RolloutSource``'s signatures ([] when they agree): every
    parameter of the protocol, by name and kind, in order; any further parameter of ``cls`` has a default."""
    import inspect

    from rlray.rollout import RolloutSource

    def params(fn) -> list[inspect.Parameter]:
        return list(inspect.signature(fn).parameters.values())[1:]  # without self

    problems = []
    for name in ("submit", "collect", "generate"):
        want, got = params(getattr(RolloutSource, name)), params(getattr(cls, name))
        shape = [f"{p.name}:{p.kind.name}" for p in got[: len(want)]]
        if shape != [f"{p.name}:{p.kind.name}" for p in want]:
            problems.append(f"{cls.__name__}.{name}: {shape}")
        problems += [f"{cls.__name__}.{name}: {p.name} has no default" for p in got[len(want):]
                     if p.default is inspect.Parameter.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    return problems


def test_the_fleet_and_the_episode_rollout_are_rollout_sources():
    import inspect

    from rlray.envs.limits import EpisodeLimits
    from rlray.rollout import RolloutSource
    from rlray.rollout.fleet import RolloutFleet
    from rlray.run.episodes import EpisodeRollout

    fleet = RolloutFleet([object()])  # no call reaches the actor
    episodes = EpisodeRollout(fleet, [object()], None, EpisodeLimits(2, 64, 8, 10.0), env_column="environment",
                              default_env=None, known_envs=[], prepare=lambda m: m)
    assert isinstance(fleet, RolloutSource) and isinstance(episodes, RolloutSource)
    fleet.version = 7
    assert episodes.version == 7  # the episodes' version is their fleet's
    assert _conformance(RolloutFleet) == [] and _conformance(EpisodeRollout) == []
    # rows: the episode rollout requires them; the fleet, which does not read them, also takes None
    assert inspect.signature(EpisodeRollout.submit).parameters["rows"].default is inspect.Parameter.empty
    assert inspect.signature(RolloutFleet.generate).parameters["rows"].default is None

    class Drifted:  # the signatures the protocol replaced: rows missing, a required extra
        version = 0

        def submit(self, prompt_ids, sampling, *, actor_keys): ...

        def collect(self, pending): ...

        def generate(self, prompt_ids, sampling, rows, seed): ...

    assert _conformance(Drifted) == [
        "Drifted.submit: ['prompt_ids:POSITIONAL_OR_KEYWORD', 'sampling:POSITIONAL_OR_KEYWORD', 'actor_keys:KEYWORD_ONLY']",
        "Drifted.generate: seed has no default"]
    assert not isinstance(object(), RolloutSource)


def test_a_completion_goes_through_json_and_back_exactly():
    """What a snapshot keeps of the rollouts in flight: an agent episode with an earlier segment, per-token id
    logprobs (int keys), a NaN reward and floats that only their repr writes exactly."""
    import json
    import math

    from rlray.rollout import Completion
    from rlray.rollout.types import AgentInfo, EpisodeInfo, completion_from_dict, completion_to_dict

    segment = Completion(0, 1, [5, 6], [-0.1, -0.2], "stop", 3, [True, False], prompt_token_ids=[1],
                         episode=EpisodeInfo("adder", "template_drift", 1, [None]))
    info = EpisodeInfo("adder", "done", 2, [None, float("nan")], env_reward=1 / 3, tool_calls=1, metrics={"m": 0.1 + 0.2},
                       scores={"s": 2.0}, agent=AgentInfo([segment], gateway_calls=2, template_drift=1))
    c = Completion(0, 1, [7, 8, 9], [-1e-300, -0.7, -2 / 3], "length", 4, [True, False, True], prompt_token_ids=[1, 2],
                   episode=info, token_id_logprobs=[{3: -0.5}, {}, {11: -1 / 7, 2: 0.0}])
    back = completion_from_dict(json.loads(json.dumps(completion_to_dict(c))))
    assert math.isnan(back.episode.turn_rewards[1])
    back.episode.turn_rewards[1] = c.episode.turn_rewards[1] = None  # NaN != NaN: compared above
    assert back == c
    assert back.episode.agent.segments[0] == segment and back.token_id_logprobs[2] == {11: -1 / 7, 2: 0.0}
    single = Completion(2, 0, [4], [-0.3], "stop", 0)
    assert completion_from_dict(json.loads(json.dumps(completion_to_dict(single)))) == single
