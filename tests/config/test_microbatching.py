"""learner.tokens_per_microbatch, learner.sequence_packing and learner.share_prefixes: defaults, YAML's on/off words,
and what they become on the learner (``rlray.run.build.micro_batching``)."""

import pytest

from rlray.config import ConfigError, config_from_dict
from rlray.learner.batching import MicroBatching
from rlray.run.build import micro_batching, update_spec


def test_defaults_pack_where_the_model_can_share_prompts_and_cut_by_sequences():
    cfg = config_from_dict({})
    assert micro_batching(cfg) == MicroBatching(sequences=8, tokens=None, packing="auto", share_prefixes=True)
    assert update_spec(cfg, 1).batching == micro_batching(cfg)


@pytest.mark.parametrize(("text", "mode"), [("on", "on"), ("off", "off"), ("auto", "auto"), ("true", "on")])
def test_yaml_words_on_and_off_are_the_modes(text, mode):
    # YAML 1.1 reads on/off as booleans; the field takes them as the modes they name
    assert config_from_dict({}, [f"learner.sequence_packing={text}"]).learner.sequence_packing == mode


def test_a_token_budget_frees_the_microbatch_from_dividing_the_minibatch():
    with pytest.raises(ConfigError, match="sequences_per_microbatch=3 x 1 learner worker"):
        config_from_dict({}, ["learner.sequences_per_microbatch=3"])
    cfg = config_from_dict({}, ["learner.sequences_per_microbatch=3", "learner.tokens_per_microbatch=4096",
                                "learner.share_prefixes=false"])
    assert micro_batching(cfg) == MicroBatching(sequences=3, tokens=4096, packing="auto", share_prefixes=False)
    with pytest.raises(ConfigError, match="tokens_per_microbatch"):
        config_from_dict({}, ["learner.tokens_per_microbatch=8"])
