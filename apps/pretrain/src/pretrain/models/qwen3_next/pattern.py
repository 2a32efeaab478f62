"""Which layers of a Qwen3-Next model are full attention (the rest are Gated DeltaNet)."""


def is_full_attention(m, i: int) -> bool:
    """Layer ``i`` is full attention every ``full_attention_interval`` layers (transformers' layer_types)."""
    return (i + 1) % m.full_attention_interval == 0
