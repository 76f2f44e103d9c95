"""rlray: Ray-native reinforcement-learning post-training for large language models."""

from rlray import lean_imports

__version__ = "0.1.0"

lean_imports.install()  # transformers' import without scikit-learn (rlray.lean_imports; issue 39)
