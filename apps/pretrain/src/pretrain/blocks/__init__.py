"""The building blocks every family's layers are made of, below the family registry (``pretrain.models``):
the chunk's context (its groups and par-cp's attention), RoPE and its scaling, dropout, recompute and
offload policies, QK-clip's logit tracking, and the kernel choice (torch or Transformer Engine). Nothing
here imports ``pretrain.model`` or ``pretrain.models``, so a family's folder imports them without a cycle."""
