"""The TRL-shaped calculator class runs one real step of TRL 1.16's GRPOTrainer(environment_factory=...) on the tiny model.

This pins that the fixture class used by test_trl_env.py is a valid TRL environment (TRL probes reset, takes the
public methods as tools, renders their schemas with a tool-capable template, and scores with get_reward), so the
adapter is tested against a class TRL itself accepts.
"""

from __future__ import annotations

import pytest

from rlray.models import load_tokenizer


@pytest.mark.slow
def test_grpo_trainer_runs_the_trl_environment(tmp_path, tiny_model_path, monkeypatch, trl_calculator_cls):
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer
    from trl.chat_template_utils import qwen3_template

    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")
    created = []

    class Counted(trl_calculator_cls):
        def __init__(self):
            super().__init__()
            self.rewards_asked = 0
            created.append(self)

        def get_reward(self) -> float:
            self.rewards_asked += 1
            return super().get_reward()

    tokenizer = load_tokenizer(tiny_model_path, chat_template="smollm2-tools")
    tokenizer.response_template = qwen3_template  # Hermes blocks after "<|im_start|>assistant\n", as smollm2-tools writes
    rows = [{"prompt": [{"role": "user", "content": f"What is {a} x {b}?"}], "a": a, "b": b} for a, b in [(2, 3), (4, 5)]]
    config = GRPOConfig(
        output_dir=str(tmp_path),
        per_device_train_batch_size=2,
        num_generations=2,
        max_completion_length=8,
        max_steps=1,
        report_to="none",
        use_vllm=False,
        use_cpu=True,
        bf16=False,
        save_strategy="no",
        logging_steps=1,
    )
    trainer = GRPOTrainer(
        model=tiny_model_path,
        args=config,
        train_dataset=Dataset.from_list(rows),
        processing_class=tokenizer,
        environment_factory=Counted,
    )
    assert [t.__name__ for t in trainer.tools] == ["multiply"]
    trainer.train()
    assert trainer.state.global_step == 1
    # 2 rollouts per step: the probe instance is reused from the pool, one more is built; each was reset and scored
    used = [env for env in created if env.resets]
    assert len(used) == 2 and all(env.rewards_asked == 1 and env.target in (6, 20) for env in used)
    logged = trainer.state.log_history[0]
    assert "rewards/Counted/mean" in logged
