"""DeepSeek's multi-head latent attention lives with its family (``pretrain.models.deepseek.mla``);
its names stay importable from here."""

from ..models.deepseek.mla import LATENT_NORM_EPS, ContextMLACore, TPMLAttention, softmax_scale

__all__ = ["LATENT_NORM_EPS", "ContextMLACore", "TPMLAttention", "softmax_scale"]
