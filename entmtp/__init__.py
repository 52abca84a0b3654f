"""entmtp: tree-based speculative decoding with multi-token-prediction heads.

Medusa, Hydra and Hydra++ draft heads, lossless tree verification on any Hugging Face
causal LM, entropy-aware tree scheduling, a topology lab and a Gradio app.
"""

from .threads import configure_wait_policy

# before any entmtp module imports torch (OpenMP reads the policy once, when torch loads it)
configure_wait_policy()

__version__ = "0.1.0"
