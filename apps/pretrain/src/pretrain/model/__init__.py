"""The model: its family's layers (``pretrain.models``) and the shared blocks (``pretrain.blocks``) assembled
into chunks, their parallel composition, shapes, initial state, FP8, offload and compile."""
