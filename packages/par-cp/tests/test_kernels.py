"""Each kernel, block by block, against the dense float64 reference; the LSE merge rule."""

import pytest
import torch

from par_cp import BlockMask, ContextParallelAttention, block_backward, block_forward, merge_partial
from par_cp.reference import reference_attention


def _rel(a, b):
    return ((a.double() - b.double()).abs().max() / b.double().abs().max()).item()


@pytest.mark.parametrize("backend", ["torch", "sdpa"])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("docs", [None, (0, 5, 20, 21, 32), [(0, 5, 20, 21, 32), (0, 11, 32)]],
                         ids=["one-doc", "packed", "varlen"])
@pytest.mark.parametrize("heads", [(4, 4), (4, 2)], ids=["mha", "gqa"])
def test_local_attention_matches_reference(backend, causal, docs, heads):
    torch.manual_seed(0)
    q = torch.randn(32, 2, heads[0], 8, requires_grad=True)
    k = torch.randn(32, 2, heads[1], 8, requires_grad=True)
    v = torch.randn(32, 2, heads[1], 8, requires_grad=True)
    out = ContextParallelAttention("p2p", None, causal=causal, backend=backend)(q, k, v, cu_seqlens=docs)
    per_seq = docs if isinstance(docs, list) else [docs, docs]  # the reference runs each sequence alone
    ref = torch.cat([reference_attention(q[:, b:b + 1], k[:, b:b + 1], v[:, b:b + 1], causal, per_seq[b])
                     for b in range(2)], dim=1)
    grad = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), grad)
    want = torch.autograd.grad(ref, (q, k, v), grad.double())
    assert _rel(out, ref) <= 1e-5
    for a, b in zip(got, want):
        assert _rel(a, b) <= 1e-5


def test_blocks_merge_to_full_attention_and_gradients_add_up():
    """Queries 16..31 against keys split in two blocks (one fully visible, one diagonal) merged
    with the LSE rule equal the queries against all keys; blockwise gradients sum to the full one."""
    torch.manual_seed(1)
    q, k, v = (torch.randn(32, 1, 2, 8, dtype=torch.float32) for _ in range(3))
    scale = 8 ** -0.5
    qs = q[16:]
    masks = [BlockMask(16, 32, 0, 16, True), BlockMask(16, 32, 16, 32, True)]
    out = lse = None
    for m in masks:
        o, l = block_forward(qs, k[m.k_start:m.k_end], v[m.k_start:m.k_end], m, scale, "torch")
        out, lse = merge_partial(out, lse, o, l)
    full, full_lse = block_forward(qs, k, v, BlockMask(16, 32, 0, 32, True), scale, "torch")
    assert _rel(out, full) <= 1e-6 and _rel(lse, full_lse) <= 1e-6
    dout = torch.randn_like(out)
    dq_full, dk_full, _ = block_backward(dout, qs, k, v, full, full_lse, BlockMask(16, 32, 0, 32, True), scale, "torch")
    parts = [block_backward(dout, qs, k[m.k_start:m.k_end], v[m.k_start:m.k_end], out, lse, m, scale, "torch") for m in masks]
    assert _rel(parts[0][0] + parts[1][0], dq_full) <= 1e-6
    assert _rel(torch.cat([parts[0][1], parts[1][1]]), dk_full) <= 1e-6


def test_block_mask_skips_hidden_blocks_and_clips_keys():
    assert BlockMask(0, 8, 8, 16, causal=True).is_empty()
    assert not BlockMask(0, 8, 8, 16, causal=False).is_empty()
    assert BlockMask(8, 16, 0, 8, causal=False, docs=(0, 8, 16)).is_empty()  # different documents
    clipped = BlockMask(8, 12, 0, 32, causal=True, docs=(0, 6, 32)).clipped()
    assert (clipped.k_start, clipped.k_end) == (6, 12)


def test_dense_sdpa_path_matches_reference_and_is_chosen_only_on_a_gpu():
    """cp=1 on a GPU skips the block path: torch SDPA with native GQA (checked here on the CPU, fp32)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from par_cp.kernels.dense import dense_kernel, sdpa_attention
    from par_cp.reference import reference_attention

    g = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(24, 2, 4, 8, generator=g), torch.randn(24, 2, 2, 8, generator=g), torch.randn(24, 2, 2, 8, generator=g)
    out = sdpa_attention(q, k, v, True, 8 ** -0.5)
    assert (out.double() - reference_attention(q, k, v, causal=True)).abs().max() < 1e-6
    assert dense_kernel(q, "auto") is None  # the CPU keeps the block kernels
    with FakeTensorMode():
        qc = torch.empty(24, 2, 4, 8, device="cuda", dtype=torch.bfloat16)
        assert dense_kernel(qc, "torch") is None and dense_kernel(qc, "sdpa") == "sdpa"
        assert dense_kernel(qc, "auto") in ("sdpa", "flash")


def test_cuda_block_kernel_takes_our_arguments_on_fake_cuda():
    """On CUDA without flash-attn a block runs torch's private flash SDPA ops (they return the LSE
    the merge needs). Their signatures are torch's to change: on fake CUDA tensors the calls of
    this torch must parse and give sequence-first fp32 grads on the inputs' device, GQA folded."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from par_cp.kernels import choose_kernel
    from par_cp.kernels.flash import _flash
    from par_cp.kernels.sdpa import sdpa_backward, sdpa_forward

    mask = BlockMask(0, 64, 0, 64, causal=True)
    with FakeTensorMode():
        q = torch.randn(64, 2, 8, 32, device="cuda", dtype=torch.bfloat16)
        k, v = (torch.randn(64, 2, 2, 32, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        assert choose_kernel("auto", q, mask) == ("flash" if _flash() is not None else "sdpa")
        assert choose_kernel("sdpa", q.float(), mask) == "torch"  # torch's CUDA flash kernel: fp16/bf16 only
        out, lse = sdpa_forward(q, k, v, mask, 32 ** -0.5)
        assert out.shape == q.shape and lse.shape == (2, 8, 64) and lse.dtype == torch.float32
        dq, dk, dv = sdpa_backward(torch.randn_like(out), q, k, v, out, lse, mask, 32 ** -0.5)
        assert dq.shape == q.shape and dk.shape == dv.shape == k.shape
        assert all(t.device.type == "cuda" and t.dtype == torch.float32 for t in (dq, dk, dv))


def test_flash_varlen_index_of_two_documents_over_a_batch_of_two():
    """flash-attn's varlen call takes each document piece of each sequence as one sequence:
    token indices batch-major, int32 cu_seqlens, and the longest piece (worked out by hand)."""
    from par_cp.kernels.flash import _varlen_index

    mask = BlockMask(0, 8, 0, 8, causal=True, docs=(0, 3, 8))
    q_idx, k_idx, cu_q, cu_k, max_q, max_k = _varlen_index(mask, 2, torch.device("cpu"))
    assert q_idx.tolist() == k_idx.tolist() == list(range(16))
    assert cu_q.tolist() == cu_k.tolist() == [0, 3, 8, 11, 16] and cu_q.dtype == torch.int32
    assert (max_q, max_k) == (5, 5)
    # a later query block sees the earlier keys of its document only: keys 3..5 for queries 5..7
    later = BlockMask(5, 8, 0, 6, causal=False, docs=(0, 3, 8))
    q_idx, k_idx, cu_q, cu_k, max_q, max_k = _varlen_index(later, 1, torch.device("cpu"))
    assert q_idx.tolist() == [0, 1, 2] and k_idx.tolist() == [3, 4, 5] and cu_k.tolist() == [0, 3]
