"""A reward function in TRL's convention, for the "your own data" example (README.md, docs/prompts-and-rewards.md)."""


def mentions_capital(prompts, completions, capital, **kwargs):
    """Returns 1.0 for a completion that names the row's `capital` column, else 0.0 (one value per completion)."""
    texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]  # conversational rows: messages
    return [1.0 if cap.lower() in text.lower() else 0.0 for text, cap in zip(texts, capital, strict=True)]
