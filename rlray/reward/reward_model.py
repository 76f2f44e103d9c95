"""A learned reward model as a reward term: a one-label sequence-classification model scores (prompt, completion).

The folder is either a snapshot written by ``algo.name=reward_model`` (``<output_dir>/final``, whose
``model/`` holds the Hugging Face files; remote snapshot URIs are downloaded) or any Hugging Face
sequence-classification checkpoint with one label. Inputs are laid out as in training
(``rlray.data.pairs``): the prompt as a user turn (a conversational prompt: its own messages) through the
tokenizer's chat template with the generation prompt, then the completion's tokens and EOS; the score is
the head's raw output at the last completion token (``rlray.models.heads.sequence_scores``).
"""

from __future__ import annotations

from pathlib import Path

import torch

from rlray.checkpoint.storage import MANIFEST, local_model_dir
from rlray.models import load_tokenizer
from rlray.models.heads import load_reward_model, sequence_scores
from rlray.schema import pack_sequences


def reward_model_dir(path: str) -> str:
    """Returns the local Hugging Face folder of a reward-model snapshot, snapshot URI or plain folder.

    Raises:
        rlray.checkpoint.storage.SnapshotError: a snapshot URI without a manifest.
        FileNotFoundError: a local path that does not exist.
    """
    if "://" in path or Path(path, MANIFEST).is_file():
        return local_model_dir(path)
    if not Path(path).is_dir():
        raise FileNotFoundError(f"reward.model_path='{path}' is not a folder or snapshot URI")
    return path


class RewardModel:
    """Scores completions with a reward model, in batches, without gradients.

    Args:
        path: snapshot folder/URI or Hugging Face folder (see ``reward_model_dir``).
        batch_size: sequences per forward.
        max_prompt_tokens: prompt tokens kept (the end) after the chat template.
        max_completion_tokens: completion tokens kept (the start), EOS included.

    Raises:
        FileNotFoundError, rlray.checkpoint.storage.SnapshotError, rlray.models.ModelError: the folder cannot be used.
    """

    def __init__(
        self, path: str, *, batch_size: int = 8, max_prompt_tokens: int = 512, max_completion_tokens: int = 512
    ) -> None:
        folder = reward_model_dir(path)
        self.tokenizer = load_tokenizer(folder)
        self.model = load_reward_model(folder).eval()
        self.batch_size = batch_size
        self.max_prompt_tokens = max_prompt_tokens
        self.max_completion_tokens = max_completion_tokens

    def token_ids(self, prompt: str | list[dict], completion: str) -> tuple[list[int], list[int]]:
        """Returns (prompt ids, completion ids + EOS) as the reward model was trained on them.

        A string prompt is one user turn; a conversational prompt (TRL's list of ``{"role", "content"}``
        messages) goes through the chat template as it is.
        """
        tok = self.tokenizer
        messages = prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
        text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        prompt_ids = tok(text, add_special_tokens=False)["input_ids"][-self.max_prompt_tokens :]
        completion_ids = tok(completion, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        return prompt_ids, completion_ids[: self.max_completion_tokens]

    @torch.no_grad()
    def score(self, prompts: list[str | list[dict]], completions: list[str]) -> list[float]:
        """Returns one float score per (prompt, completion) pair (the head's raw output)."""
        out: list[float] = []
        for start in range(0, len(completions), self.batch_size):
            ids = [self.token_ids(p, c) for p, c in zip(prompts[start : start + self.batch_size],
                                                        completions[start : start + self.batch_size], strict=True)]  # fmt: skip
            batch = pack_sequences([p for p, _ in ids], [c for _, c in ids], self.tokenizer.pad_token_id)
            out.extend(sequence_scores(self.model, batch).tolist())
        return out
