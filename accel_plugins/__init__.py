"""Adapters for Hugging Face Accelerate and the Hugging Face Trainer.

Nothing lives here yet: the Accelerate hooks and the HF Trainer ``optim`` integration land in a
later issue. Install their dependencies with ``pip install "lightning-optim[hf]"``.
"""
