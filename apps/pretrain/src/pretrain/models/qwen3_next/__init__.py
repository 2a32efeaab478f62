"""Qwen3-Next: Gated DeltaNet (linear attention) layers with a gated full-attention layer every
``full_attention_interval`` layers."""

from .family import Qwen3Next

FAMILY = Qwen3Next()
