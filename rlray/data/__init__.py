"""Prompt data: GSM8K-style rows, chat-template rendering, the training cursor, and dataset fetching."""

from rlray.data.fetch import FetchError, fetch_dataset
from rlray.data.gsm8k import DataError, PromptRow, load_prompt_rows
from rlray.data.prompts import PromptStream, filter_long_prompts, prepare_prompts, render_prompt

__all__ = [
    "DataError",
    "FetchError",
    "PromptRow",
    "PromptStream",
    "fetch_dataset",
    "filter_long_prompts",
    "load_prompt_rows",
    "prepare_prompts",
    "render_prompt",
]
