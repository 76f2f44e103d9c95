"""A TRL GRPO script (TRL 1.16): SmolLM2-135M-Instruct on docs/examples/my_prompts.jsonl with the reward
docs/examples/my_reward.py:mentions_capital. docs/coming_from_trl.md shows it beside its rlray config,
configs/from_trl_grpo_smollm2.yaml, and tests/test_coming_from.py checks that the two say the same."""

import sys

from datasets import load_dataset
from trl import GRPOConfig, GRPOTrainer

sys.path.insert(0, "docs/examples")
from my_reward import mentions_capital  # noqa: E402  (TRL's convention: fn(prompts, completions, **columns))

dataset = load_dataset("json", data_files="docs/examples/my_prompts.jsonl", split="train")
args = GRPOConfig(
    output_dir="outputs/from_trl_grpo",
    seed=0,
    max_steps=20,
    learning_rate=1e-5,
    num_generations=4,  # completions per prompt
    per_device_train_batch_size=8,  # completions per forward/backward on one GPU
    gradient_accumulation_steps=4,  # 8 x 4 = 32 completions per optimizer step, sampled as 8 prompts x 4
    max_completion_length=160,
    temperature=0.7,
    beta=0.01,
    epsilon=0.2,
    epsilon_high=0.28,
    loss_type="dapo",
    scale_rewards="group",
    save_steps=5,
)
trainer = GRPOTrainer(
    model="HuggingFaceTB/SmolLM2-135M-Instruct",
    reward_funcs=mentions_capital,
    args=args,
    train_dataset=dataset,
)
trainer.train()
