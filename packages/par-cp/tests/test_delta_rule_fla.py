"""par's gated delta rule against flash-linear-attention's own PyTorch references (an outside oracle).

fla-core (a test dependency; the CUDA kernels come with the app's `gpu` extra) ships
``naive_recurrent_gated_delta_rule`` and ``naive_chunk_gated_delta_rule``: ``[B, T, H, D]`` tensors, ``g`` the
log decay, ``beta`` the write strength, ``scale`` applied to the queries. (a) par's CPU chunked rule, over the
whole sequence and composed piece by piece as the context-parallel state pass does, equals fla's recurrence in
fp32, the output and the final state, from a random initial state. (b) The CUDA dispatch, with fla's chunked
reference standing in for its kernel and its arguments bound against the real kernel's signature, equals par's
CPU rule: so the transposes, ``scale``, the meaning of ``g`` and ``beta``, the initial and the final state it
passes to fla are fla's convention.

``fla.ops`` imports every op it has (seconds of CPU), so the tests load the reference file alone and read the
kernel's signature from its source.
"""

import ast
import importlib.util
import inspect
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

fla = pytest.importorskip("fla")
GDR = Path(fla.__path__[0], "ops", "gated_delta_rule")

B, H, T, DK, DV = 2, 3, 40, 8, 6  # T: two chunks of 16 and a ragged one; H != T so a missed transpose shows
TOL = 1e-5  # relative to the largest value, fp32 against fp32


def _inputs(seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = F.normalize(torch.randn(B, H, T, DK, generator=gen), dim=-1) * DK ** -0.5
    k = F.normalize(torch.randn(B, H, T, DK, generator=gen), dim=-1)
    v = torch.randn(B, H, T, DV, generator=gen)
    g = -F.softplus(torch.randn(B, H, T, generator=gen))  # log decays in (-inf, 0)
    beta = torch.rand(B, H, T, generator=gen)
    return (q, k, v, g, beta), torch.randn(B, H, DK, DV, generator=gen)


def _rel(a, b):
    return ((a.double() - b.double()).abs().max() / b.double().abs().max()).item()


def _naive():
    """``fla/ops/gated_delta_rule/naive.py`` (torch and einops only)."""
    spec = importlib.util.spec_from_file_location("fla_gated_delta_rule_naive", GDR / "naive.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _kernel_signature():
    """The parameters of fla's CUDA entry point ``chunk_gated_delta_rule`` (``chunk.py``), its ``**kwargs`` too."""
    tree = ast.parse((GDR / "chunk.py").read_text())
    fn = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "chunk_gated_delta_rule")
    kind, args = inspect.Parameter.POSITIONAL_OR_KEYWORD, fn.args
    defaults = [inspect.Parameter.empty] * (len(args.args) - len(args.defaults)) + [0] * len(args.defaults)
    params = [inspect.Parameter(a.arg, kind, default=d) for a, d in zip(args.args, defaults)]
    params += [inspect.Parameter(a.arg, inspect.Parameter.KEYWORD_ONLY, default=0) for a in args.kwonlyargs]
    if args.kwarg:
        params.append(inspect.Parameter(args.kwarg.arg, inspect.Parameter.VAR_KEYWORD))
    return inspect.Signature(params)


def _fla_recurrent(q, k, v, g, beta, s0):
    """fla's token-by-token reference, in par's ``[B, H, T, D]`` layout; q comes scaled, so scale 1."""
    q, k, v, g, beta = (x.transpose(1, 2) for x in (q, k, v, g, beta))
    o, s = _naive().naive_recurrent_gated_delta_rule(q, k, v, beta=beta, g=g, scale=1.0, initial_state=s0,
                                                     output_final_state=True)  # its order: beta before g
    return o.transpose(1, 2), s


def test_cpu_chunked_rule_equals_fla_recurrence():
    from par_cp.delta_rule import affine_delta_rule, chunked_delta_rule
    from par_cp.state_passing import _compose

    tensors, s0 = _inputs()
    ref, ref_s = _fla_recurrent(*tensors, s0)
    out, s = chunked_delta_rule(*tensors, s0, chunk=16)
    assert _rel(out, ref) <= TOL and _rel(s, ref_s) <= TOL, (_rel(out, ref), _rel(s, ref_s))
    # the pieces of a context-parallel run (uneven, a ragged chunk inside), each from zero, composed in order
    outs, s_in = [], s0
    for a, e in ((0, 13), (13, 29), (29, T)):
        o_loc, q_in, s_loc, trans = affine_delta_rule(*(x[:, :, a:e] for x in tensors), chunk=8)
        outs.append(o_loc + q_in @ s_in)
        s_in = _compose(s_loc, trans, s_in)
    assert _rel(torch.cat(outs, 2), ref) <= TOL and _rel(s_in, ref_s) <= TOL


def test_cuda_dispatch_passes_fla_convention(monkeypatch):
    """The CUDA branch of ``chunked_delta_rule`` on CPU tensors, fla's chunked reference as its kernel."""
    import par_cp.delta_rule as dr

    kernel, reference = _kernel_signature(), _naive().naive_chunk_gated_delta_rule
    assert list(kernel.parameters)[:9] == [*inspect.signature(reference).parameters][:5] + [
        "scale", "initial_state", "output_final_state", "use_qk_l2norm_in_kernel"]  # the source was read right
    calls = []

    def stand_in(*args, **kwargs):
        bound = kernel.bind(*args, **kwargs)  # the call must fit the real kernel's signature
        a = {n: bound.arguments[n] for n in ("q", "k", "v", "g", "beta", "scale", "initial_state", "output_final_state")
             if n in bound.arguments}
        assert set(bound.arguments) <= set(a), bound.arguments.keys()  # nothing the reference would ignore
        calls.append(a)
        return reference(**a, chunk_size=16)

    tensors, s0 = _inputs(1)
    ref, ref_s = dr.chunked_delta_rule(*tensors, s0, chunk=16)  # par's CPU rule
    ref_o, ref_q, ref_sl, ref_a = dr.affine_delta_rule(*tensors, chunk=16)
    monkeypatch.setattr(dr, "_fla", lambda q: stand_in)
    out, s = dr.chunked_delta_rule(*tensors, s0)
    assert len(calls) == 1 and calls[0]["q"].shape == (B, T, H, DK)
    assert _rel(out, ref) <= TOL and _rel(s, ref_s) <= TOL, (_rel(out, ref), _rel(s, ref_s))
    for got, want in zip(dr.affine_delta_rule(*tensors), (ref_o, ref_q, ref_sl, ref_a)):  # the widened state
        assert _rel(got, want) <= TOL, _rel(got, want)
