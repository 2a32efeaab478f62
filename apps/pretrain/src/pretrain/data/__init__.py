"""Training data: the memory-mapped token format, tokenizers, the embedded default, the sampler."""

from __future__ import annotations

from .format import TokenDataset, check_token_ids, open_dataset, write_dataset
from .sampler import Batch, TokenSampler
from .synthetic import embedded_dataset
from .tokenizer import ByteTokenizer, HFTokenizer, get_tokenizer

__all__ = ["Batch", "ByteTokenizer", "HFTokenizer", "TokenDataset", "TokenSampler", "build_sampler", "check_token_ids", "embedded_dataset",
           "get_tokenizer", "load_dataset", "open_dataset", "write_dataset"]


def load_dataset(data_cfg, vocab_size: int | None = None) -> TokenDataset:
    """The dataset ``[data]`` names ("" = embedded); checks its ids fit a model of ``vocab_size``."""
    from ..errors import UsageError

    packed = data_cfg.packed
    ds = embedded_dataset(seed=data_cfg.seed, eos=packed) if not data_cfg.path else open_dataset(data_cfg.path)
    if vocab_size is not None and ds.vocab_size > vocab_size:
        raise UsageError(f"dataset {ds.source} has vocab_size {ds.vocab_size} > [model].vocab_size={vocab_size}")
    if packed and ds.eos is None:
        raise UsageError(f"dataset {ds.source} has no EOS between documents (its header has no \"eos\"), which "
                         f"[data].document_mask/reset_position_ids/eod_mask_loss need; re-run `pretrain prepare` "
                         f"(EOS is on by default) or turn those keys off")
    return ds


def build_sampler(cfg, layout, dp_rank: int, dataset: TokenDataset | None = None) -> TokenSampler:
    """The sampler for dp rank ``dp_rank`` of a resolved layout (``cfg.validate_world(world)``)."""
    ds = dataset if dataset is not None else load_dataset(cfg.data, cfg.model.vocab_size)
    return TokenSampler(ds, seq_len=cfg.train.seq_len, global_batch=cfg.train.global_batch,
                        micro_batch=layout.micro_batch, dp_rank=dp_rank, dp_size=layout.dp,
                        seed=cfg.train.seed, valid_fraction=cfg.data.valid_fraction)
