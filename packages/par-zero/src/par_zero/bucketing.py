"""Which params share a bucket: grad-ready order (the reverse of registration), about ``bucket_mb`` each.

A param in ``alone`` (DataParallel's ``own_bucket``) gets a bucket to itself, so ranks that hold
different other params still shard it alike.
"""

from __future__ import annotations

from torch import nn


def size_buckets(params: list[nn.Parameter], bucket_bytes: int, alone=frozenset()) -> list[list[nn.Parameter]]:
    """Split params, in grad-ready order (reverse of registration), into buckets of ~bucket_bytes;
    each param in ``alone`` gets a bucket of its own."""
    buckets, cur, size = [], [], 0
    for p in reversed(params):
        if p in alone:
            buckets += ([cur] if cur else []) + [[p]]
            cur, size = [], 0
            continue
        cur.append(p)
        size += p.numel() * 4
        if size >= bucket_bytes:
            buckets.append(cur)
            cur, size = [], 0
    if cur:
        buckets.append(cur)
    return buckets


def apart(params: list[nn.Parameter], alone) -> list[list[nn.Parameter]]:
    """``params`` as one bucket, less those in ``alone``, which get one each."""
    rest = [p for p in params if p not in alone]
    return [[p] for p in params if p in alone] + ([rest] if rest else [])
