"""Training data: the memory-mapped token formats (ours, Megatron's), blends, tokenizers, the
embedded default, the sampler."""

from __future__ import annotations

import dataclasses

from .blend import Blend, check_same_vocabulary
from .format import TokenDataset, check_token_ids, open_dataset
from .writer import write_dataset
from .synthetic import embedded_dataset
from .tokenizer import ByteTokenizer, HFTokenizer, get_tokenizer

__all__ = ["Batch", "Blend", "ByteTokenizer", "HFTokenizer", "TokenDataset", "TokenSampler", "build_sampler",
           "check_data_ids", "check_token_ids", "embedded_dataset", "get_tokenizer", "load_dataset", "load_eval",
           "members", "open_dataset", "write_dataset"]


def _open(prefix: str, data_cfg, vocab_size: int | None) -> TokenDataset:
    """One source: opened, its EOS from ``[data].eos`` when its files do not say, its vocabulary checked."""
    from ..errors import UsageError

    ds = open_dataset(prefix)
    if data_cfg.eos >= 0:
        if ds.eos is not None and ds.eos != data_cfg.eos:
            raise UsageError(f"[data].eos={data_cfg.eos} but dataset {ds.source}'s header says EOS {ds.eos}; "
                             f"drop [data].eos (it is for datasets whose files do not say)")
        ds = dataclasses.replace(ds, eos=data_cfg.eos)
    if vocab_size is not None and ds.vocab_size is not None and ds.vocab_size > vocab_size:
        raise UsageError(f"dataset {ds.source} has vocab_size {ds.vocab_size} > [model].vocab_size={vocab_size}")
    if ds.eos is not None and vocab_size is not None and ds.eos >= vocab_size:
        raise UsageError(f"dataset {ds.source} has EOS id {ds.eos}, outside [model].vocab_size={vocab_size}")
    return ds


def _load(sources: list, data_cfg, vocab_size: int | None, key: str, others: list = ()):
    datasets = [_open(prefix, data_cfg, vocab_size) for _, prefix in sources]
    check_same_vocabulary(list(others) + datasets, key)
    if len(datasets) == 1:
        return datasets[0]
    return Blend(datasets, [w for w, _ in sources])


def members(data) -> list:
    """The datasets of ``data``: a blend's sources, a dataset alone, or none."""
    return [] if data is None else data.datasets if isinstance(data, Blend) else [data]


def load_dataset(data_cfg, vocab_size: int | None = None):
    """The training data ``[data]`` names: a :class:`TokenDataset` (path, or "" = embedded) or a
    :class:`Blend` (blend); checks the headers fit a model of ``vocab_size``."""
    from ..errors import UsageError

    packed = data_cfg.packed
    if not data_cfg.train_sources:
        ds = embedded_dataset(seed=data_cfg.seed, eos=packed)
    else:
        ds = _load(data_cfg.train_sources, data_cfg, vocab_size, "[data].blend" if data_cfg.blend else "[data].path")
    if packed and ds.eos is None:
        raise UsageError(f"dataset {ds.source} has no EOS between documents (its header has no \"eos\"), which "
                         f"[data].document_mask/reset_position_ids/eod_mask_loss need; re-run `pretrain prepare` "
                         f"(EOS is on by default), set [data].eos for a Megatron dataset, or turn those keys off")
    return ds


def load_eval(data_cfg, vocab_size: int | None = None, train=None):
    """The separate held-out data (``[data].eval_path``/``eval_blend``), or None; it must share the
    training data's vocabulary and EOS."""
    if not data_cfg.eval_sources:
        return None
    key = "[data].eval_blend" if data_cfg.eval_blend else "[data].eval_path"
    return _load(data_cfg.eval_sources, data_cfg, vocab_size, key, others=members(train)[:1])


def check_data_ids(data, vocab_size: int) -> None:
    """:func:`check_token_ids` for every dataset of ``data`` (a dataset, a blend or None)."""
    for ds in members(data):
        check_token_ids(ds, vocab_size)


def __getattr__(name: str):
    # The sampler needs torch: imported on first use, so what tokenizes (`pretrain prepare`'s workers,
    # started clean) loads in a fraction of a second without it.
    if name in ("Batch", "TokenSampler"):
        from . import sampler

        return getattr(sampler, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def build_sampler(cfg, layout, dp_rank: int, dataset=None) -> TokenSampler:
    """The sampler for dp rank ``dp_rank`` of a resolved layout (``cfg.validate_world(world)``)."""
    from .sampler import TokenSampler

    ds = dataset if dataset is not None else load_dataset(cfg.data, cfg.model.vocab_size)
    # the embedded data (also what `plan --simulate` runs on) has its own held-out tail
    held_out = None if str(ds.source).startswith("<embedded") else load_eval(cfg.data, cfg.model.vocab_size, ds)
    weights = ds.weights if isinstance(ds, Blend) else None
    return TokenSampler(members(ds), seq_len=cfg.train.seq_len, global_batch=cfg.train.global_batch,
                        micro_batch=layout.micro_batch, dp_rank=dp_rank, dp_size=layout.dp,
                        seed=cfg.data.seed, valid_fraction=cfg.data.valid_fraction, weights=weights,
                        eval_datasets=members(held_out) or None,
                        eval_weights=held_out.weights if isinstance(held_out, Blend) else None)
