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
