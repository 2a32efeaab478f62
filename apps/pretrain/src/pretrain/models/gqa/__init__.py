"""Grouped-query attention: Llama 3, Mistral (no sliding window), Qwen3 (``qk_norm``), Qwen3-MoE and Mixtral."""

from .family import GQA

FAMILY = GQA()
