"""Partial rollouts (``rlray.rollout.partial``): a generation continued across weight updates records each token's
version and its behaviour logprob under that version exactly; the update gate lets updates in between segments only;
and the loss of such a sample is the one computed by hand from its per-token logprobs."""

from __future__ import annotations

import math
import threading
import time

import pyarrow as pa
import pytest
import torch
from transformers import AutoModelForCausalLM

from rlray.data import PromptRow
from rlray.learner.objective import LossSpec, Normaliser, policy_objective
from rlray.rollout import Completion, RolloutEngine, SamplingSpec
from rlray.rollout.partial import UpdateGate, generate_in_segments
from rlray.run.experience import build_experience, rollout_stats, version_stats
from rlray.schema import collate

PROMPTS = [[1, 2, 3], [4, 5]]


@pytest.fixture(scope="module")
def versions(tiny_model_path) -> list[dict[str, torch.Tensor]]:
    """Returns the float32 weights of policy versions 0, 1, 2: the tiny model, then two seeded perturbations of it
    (lm_head tied to the embeddings)."""
    base = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32).state_dict()
    del base["lm_head.weight"]  # tied to the embeddings: perturbing it apart would untie them
    out = [base]
    for seed in (1, 2):
        gen = torch.Generator().manual_seed(seed)
        out.append({k: v + 0.5 * torch.randn(v.shape, generator=gen) for k, v in base.items()})
    return out


def _forward_logprobs(tiny_model_path, weights, prompt, response, temperature) -> list[float]:
    """Returns log_softmax(logits / temperature) of each response token after prompt + the tokens before it."""
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32).eval()
    assert model.load_state_dict(weights, strict=False).missing_keys == ["lm_head.weight"]  # tied
    ids = torch.tensor([prompt + response])
    with torch.inference_mode():
        logits = model(ids).logits[0, len(prompt) - 1 : -1].float() / temperature  # [T, V]
    return logits.log_softmax(-1).gather(-1, torch.tensor(response)[:, None])[:, 0].tolist()


@pytest.mark.parametrize("backend", ["hf", "vllm"])
def test_a_generation_across_two_updates_records_each_token_s_version_and_logprob(tiny_model_path, versions, backend):
    """Segments of 2 tokens, an update after segments 1 and 2 (as a push landing between them): every token's version
    is recorded exactly, and its rollout logprob is the one its version's weights give (a transformers forward)."""
    engine = RolloutEngine(tiny_model_path, backend=backend, dtype="float32", seed=0, max_model_len=64, kv_cache_gib=0.25,
                           cpu_threads="0-1")

    def update_between_segments() -> None:
        engine.update_weights(versions[engine.policy_version + 1], engine.policy_version + 1)

    sampling = SamplingSpec(n=2, max_new_tokens=6, temperature=0.9, seed=11)
    got = generate_in_segments(lambda prompts, spec, _: engine.generate(prompts, spec), PROMPTS, sampling,
                               segment_tokens=2, version=lambda: engine.policy_version, between=update_between_segments)
    engine.shutdown()
    assert [(c.prompt_index, c.sample_index) for c in got] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    for c in got:
        assert c.finish_reason == "length" and len(c.response_token_ids) == 6
        assert c.versions == [0, 0, 1, 1, 2, 2]  # two tokens per segment, one update between each
        assert c.policy_version == 0  # the oldest token's
        prompt = PROMPTS[c.prompt_index]
        under = [_forward_logprobs(tiny_model_path, w, prompt, c.response_token_ids, 0.9) for w in versions]
        own = [under[v][t] for t, v in enumerate(c.versions)]
        assert own == pytest.approx(c.rollout_logprobs, abs=1e-4)  # each token's behaviour logprob is its version's
        assert max(abs(a - b) for a, b in zip(under[0][2:], c.rollout_logprobs[2:], strict=True)) > 1e-2  # not v0's


def test_partial_off_stamps_every_token_with_the_engine_version(tiny_model_path):
    engine = RolloutEngine(tiny_model_path, backend="hf", dtype="float32", max_model_len=64)
    got = engine.generate(PROMPTS, SamplingSpec(n=1, max_new_tokens=3, temperature=1.0, seed=5))
    assert [c.versions for c in got] == [[0] * len(c.response_token_ids) for c in got]
    table = build_experience([PromptRow(f"p:{i}", "q", {}) for i in range(2)], PROMPTS, got, {"reward": [1.0, 0.0]})
    assert table.column("token_versions").to_pylist() == [[0] * len(c.response_token_ids) for c in got]
    assert table.column("policy_version").to_pylist() == [0, 0]  # every other column as before (the async tests)
    with pytest.raises(ValueError, match="Completion.versions has 1 entries for 2 response tokens"):
        Completion(0, 0, [7, 8], [-1.0, -2.0], "length", 3, versions=[3])


def test_a_generation_waits_for_the_version_pushed_before_it(tiny_model_path, versions):
    """A partial engine takes pushes on another thread: a generate call sent after the push of version 1 starts only
    once version 1 is loaded, so none of its tokens is older."""
    engine = RolloutEngine(tiny_model_path, backend="hf", dtype="float32", max_model_len=64, partial_segment_tokens=2)
    got: list[Completion] = []
    waiting = threading.Thread(target=lambda: got.extend(
        engine.generate(PROMPTS, SamplingSpec(n=1, max_new_tokens=4, temperature=1.0, seed=5), min_version=1)))
    waiting.start()
    time.sleep(0.5)
    assert waiting.is_alive() and not got  # waits for version 1
    engine.update_weights(versions[1], 1)
    waiting.join(timeout=300)
    assert [c.versions for c in got] == [[1, 1, 1, 1], [1, 1, 1, 1]]


def test_a_call_with_stop_strings_runs_whole(tiny_model_path, monkeypatch):
    """An environment's turn with stop strings is not cut into segments (a stop string split across two would be
    missed): it reaches the backend as one call (the hf backend then refuses stop strings, naming vllm)."""
    from rlray.rollout import engine as engine_module

    segmented = []
    monkeypatch.setattr(engine_module, "generate_in_segments", lambda *a, **k: segmented.append(a[2]) or [])
    engine = RolloutEngine(tiny_model_path, backend="hf", dtype="float32", max_model_len=64, partial_segment_tokens=2)
    with pytest.raises(ValueError, match="stop strings .* need rollout.backend=vllm"):
        engine.generate(PROMPTS, SamplingSpec(n=1, max_new_tokens=4, temperature=1.0, seed=5, stop=("</tool>",)))
    assert segmented == []
    engine.generate(PROMPTS, SamplingSpec(n=1, max_new_tokens=4, temperature=1.0, seed=5))
    assert [s.stop for s in segmented] == [()]  # without stop strings: segments


def test_the_gate_lets_an_update_in_between_segments_only():
    gate, events, order = UpdateGate(), {k: threading.Event() for k in ("in_segment", "end_segment")}, []

    def generation() -> None:
        with gate.generating(lambda: True, "version 0"):
            order.append("segment 1 starts")
            events["in_segment"].set()
            events["end_segment"].wait(10)
            order.append("segment 1 ends")
            gate.yield_to_updates()
            order.append("segment 2")

    def update() -> None:
        with gate.updating():
            order.append("update")

    gen = threading.Thread(target=generation)
    gen.start()
    events["in_segment"].wait(10)
    upd = threading.Thread(target=update)
    upd.start()
    time.sleep(0.2)
    assert order == ["segment 1 starts"]  # the update waits for the segment in progress
    events["end_segment"].set()
    gen.join(10)
    upd.join(10)
    assert order == ["segment 1 starts", "segment 1 ends", "update", "segment 2"]


def test_the_loss_of_a_partial_sample_equals_the_hand_computed_one():
    """One sample of 4 tokens sampled by versions 0, 0, 1, 2 (a generation across 2 updates), token_truncate
    correction (C_max 2) and PPO clip 0.2, token-mean over its 4 tokens: each token's correction weight uses its own
    behaviour logprob.

    rollout (behaviour) logprobs r = [-1.0, -2.0, -0.5, -1.5]; old (learner at the step's start) o = [-1.2, -1.0,
    -0.5, -1.6]; current logprobs l = o + [0.1, -0.3, 0.0, 0.5]; advantage A = 1 on every token.
      w_t = min(exp(o_t - r_t), 2) = [e^-0.2, min(e^1, 2) = 2, 1, e^-0.1]
      ratio_t = exp(l_t - o_t) = [e^0.1, e^-0.3, 1, e^0.5];  clip to [0.8, 1.2]: [e^0.1, 0.8, 1, 1.2]
      pg_t = max(-A ratio, -A clip) = -min(ratio, clip) = [-e^0.1, -e^-0.3, -1, -1.2]
      loss = sum_t w_t pg_t / 4
    """
    rollout = [-1.0, -2.0, -0.5, -1.5]
    sample = Completion(0, 0, [11, 12, 13, 14], rollout, "length", 0, versions=[0, 0, 1, 2])
    table = build_experience([PromptRow("p:0", "q", {})], [[1, 2, 3]], [sample], {"reward": [1.0]})
    assert table.column("token_versions").to_pylist() == [[0, 0, 1, 2]]
    assert table.column("policy_version").to_pylist() == [0]
    batch = collate(table, pad_token_id=0)
    batch.old_logprobs = torch.tensor([[-1.2, -1.0, -0.5, -1.6]])
    batch.advantages = torch.ones(1, 4)
    logprobs = batch.old_logprobs + torch.tensor([[0.1, -0.3, 0.0, 0.5]])
    spec = LossSpec(clip_eps_low=0.2, clip_eps_high=0.2, kl_coef=0.0, kl_estimator="k3", loss_agg="token-mean",
                    max_response_tokens=4, correction="token_truncate", correction_max=2.0)
    loss, _ = policy_objective(logprobs, batch, spec, Normaliser(num_tokens=4.0, num_sequences=1.0))
    w = [math.exp(-0.2), 2.0, 1.0, math.exp(-0.1)]
    pg = [-math.exp(0.1), -math.exp(-0.3), -1.0, -1.2]
    assert float(loss) == pytest.approx(sum(a * b for a, b in zip(w, pg, strict=True)) / 4, abs=1e-6)


def test_the_partial_metrics_of_a_step_by_hand():
    """3 samples of one prompt, learner at version 3: tokens of versions [0, 0, 1, 2] (across 2 updates), [1, 1], [2].
      partial_samples_frac = 1 of 3 samples spans more than one version = 1/3
      token staleness = 3 - version: [3, 3, 2, 1], [2, 2], [1]; mean = (9 + 4 + 1) / 7 tokens = 2.0; max = 3
      (the sample staleness is 3 - [0, 1, 2] = [3, 2, 1]: mean 2.0 over samples, max 3)
    """
    samples = [Completion(0, 0, [11, 12, 13, 14], [-1.0] * 4, "length", 0, versions=[0, 0, 1, 2]),
               Completion(0, 1, [15, 16], [-1.0] * 2, "stop", 1), Completion(0, 2, [17], [-1.0], "stop", 2)]
    rewards = {"reward": [1.0, 0.0, 0.5]}
    table = build_experience([PromptRow("p:0", "q", {})], [[1, 2, 3]], samples, rewards)
    assert version_stats(table, 3) == {"rollout/partial_samples_frac": 1 / 3, "rollout/token_staleness_mean": 2.0,
                                       "rollout/token_staleness_max": 3.0}
    stats = rollout_stats(table, rewards, 1, 3)  # logged with the step's other rollout/* metrics
    assert (stats["rollout/partial_samples_frac"], stats["rollout/token_staleness_mean"]) == (1 / 3, 2.0)
    assert (stats["rollout/staleness_mean"], stats["rollout/staleness_max"]) == (2.0, 3.0)
    # without partial rollouts no sample spans versions; a 3-token sample of version 1 weighs 3 tokens
    plain = build_experience([PromptRow("p:0", "q", {})], [[1, 2, 3]],
                             [Completion(0, 0, [11, 12, 13], [-1.0] * 3, "stop", 1), samples[2]], {"reward": [1.0, 0.0]})
    assert version_stats(plain, 2) == {"rollout/partial_samples_frac": 0.0, "rollout/token_staleness_mean": 0.75,
                                       "rollout/token_staleness_max": 1.0}  # (1 + 1 + 1 + 0) / 4 tokens
    # an episode's observation tokens (response_mask False) were not sampled: the first sample's 2nd and 3rd tokens
    # out, its staleness [3, 1] with [2, 2] and [1]: mean 9 / 5 = 1.8, max 3
    mask = pa.array([[True, False, False, True], [True, True], [True]], type=table.schema.field("response_mask").type)
    observed = table.set_column(table.schema.get_field_index("response_mask"), "response_mask", mask)
    assert version_stats(observed, 3) == {"rollout/partial_samples_frac": 1 / 3, "rollout/token_staleness_mean": 1.8,
                                          "rollout/token_staleness_max": 3.0}
    empty = build_experience([PromptRow("p:0", "q", {})], [[1]], [Completion(0, 0, [], [], "stop", 0)], {"reward": [0.0]})
    got = version_stats(empty, 1)
    assert got["rollout/partial_samples_frac"] == 0.0 and math.isnan(got["rollout/token_staleness_mean"])
