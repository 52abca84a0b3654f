"""entmtp: tree-based speculative decoding with multi-token-prediction heads.

Medusa, Hydra and Hydra++ draft heads, lossless tree verification on any Hugging Face
causal LM, entropy-aware tree scheduling, a topology lab and a Gradio app.
"""

__version__ = "0.1.0"
