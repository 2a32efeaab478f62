"""The shared dim-0 all-gather / reduce-scatter: values, gradients and counted communication."""

import pytest
import torch
import torch.distributed as dist

from par_groups import CommRecorder, all_gather_along_dim0, all_gather_dim0, reduce_scatter_along_dim0, reduce_scatter_dim0

ROWS, COLS = 3, 5  # rows per rank


def inputs(world: int):
    """Every rank's gather input, reduce-scatter input and output-gradient weights (same on all ranks)."""
    g = torch.Generator().manual_seed(world)
    xs = [torch.randn(ROWS, COLS, generator=g) for _ in range(world)]
    ys = [torch.randn(world * ROWS, COLS, generator=g) for _ in range(world)]
    w_gather = [torch.randn(world * ROWS, COLS, generator=g) for _ in range(world)]
    w_scatter = [torch.randn(ROWS, COLS, generator=g) for _ in range(world)]
    return xs, ys, w_gather, w_scatter


def reference(world: int):
    """One process: the loss sum_r <w_r, op(inputs)_r> over all ranks, its outputs and input gradients."""
    xs, ys, w_gather, w_scatter = inputs(world)
    xs = [x.clone().requires_grad_() for x in xs]
    ys = [y.clone().requires_grad_() for y in ys]
    gathered = torch.cat(xs)  # every rank sees the same concatenation
    summed = torch.stack(ys).sum(0)
    scattered = [summed[r * ROWS:(r + 1) * ROWS] for r in range(world)]
    loss = sum((gathered * w).sum() for w in w_gather) + sum((s * w).sum() for s, w in zip(scattered, w_scatter))
    loss.backward()
    return {"gathered": gathered.detach(), "scattered": [s.detach() for s in scattered],
            "x_grad": [x.grad for x in xs], "y_grad": [y.grad for y in ys]}


def run_on_ranks():
    world, rank = dist.get_world_size(), dist.get_rank()
    group = dist.group.WORLD
    xs, ys, w_gather, w_scatter = inputs(world)
    x, y = xs[rank].clone().requires_grad_(), ys[rank].clone().requires_grad_()
    with CommRecorder() as fwd:
        gathered = all_gather_along_dim0(x, group)
        scattered = reduce_scatter_along_dim0(y, group)
    loss = (gathered * w_gather[rank]).sum() + (scattered * w_scatter[rank]).sum()
    with CommRecorder() as bwd:
        loss.backward()
    plain = {"gather": all_gather_dim0(xs[rank], group), "scatter": reduce_scatter_dim0(ys[rank], group)}

    # A group of one rank: identity, nothing communicated.
    singles = [dist.new_group([r]) for r in range(world)]
    with CommRecorder() as single:
        z = xs[rank].clone().requires_grad_()
        (all_gather_along_dim0(z, singles[rank]) * 2 + reduce_scatter_along_dim0(z, singles[rank])).sum().backward()
    try:
        reduce_scatter_dim0(torch.zeros(world * ROWS + 1, COLS), group)
        error = ""
    except ValueError as e:
        error = str(e)
    record = lambda rec: [(r.op, r.group_size, r.bytes) for r in rec.records]  # noqa: E731
    return {"gathered": gathered.detach(), "scattered": scattered.detach(), "x_grad": x.grad, "y_grad": y.grad,
            "plain": plain, "fwd": record(fwd), "bwd": record(bwd), "single": record(single),
            "single_grad": z.grad, "error": error}


@pytest.mark.timeout(300)  # minutes under load on 2 cores: beyond the suite's 60 s bound
@pytest.mark.parametrize("world", [2, 4])
def test_matches_single_process_and_counts_communication(dist_run, world):
    ref = reference(world)
    full_bytes = world * ROWS * COLS * 4  # the gathered output / the unreduced reduce-scatter input, fp32
    for rank, res in enumerate(dist_run(world, run_on_ranks)):
        torch.testing.assert_close(res["gathered"], ref["gathered"], rtol=0, atol=0)
        torch.testing.assert_close(res["scattered"], ref["scattered"][rank], rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(res["x_grad"], ref["x_grad"][rank], rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(res["y_grad"], ref["y_grad"][rank], rtol=0, atol=0)
        torch.testing.assert_close(res["plain"]["gather"], ref["gathered"], rtol=0, atol=0)
        torch.testing.assert_close(res["plain"]["scatter"], ref["scattered"][rank], rtol=1e-6, atol=1e-6)
        # Each op is one collective forward and its dual backward, on the whole group.
        assert res["fwd"] == [("all_gather", world, full_bytes), ("reduce_scatter", world, full_bytes)]
        assert sorted(res["bwd"]) == [("all_gather", world, full_bytes), ("reduce_scatter", world, full_bytes)]
        assert res["single"] == []
        torch.testing.assert_close(res["single_grad"], torch.full((ROWS, COLS), 3.0))
        assert f"dim 0 of size {world * ROWS + 1} is not divisible by the group size {world}" in res["error"]


def test_conjugate_pair_runs_each_side_forward_and_the_other_on_the_gradient():
    """With a matrix A as x and its transpose as y (adjoints), the two Functions are a @ A.T and b @ A."""
    from par_groups.autograd import conjugate_pair

    g = torch.Generator().manual_seed(0)
    a_mat = torch.randn(4, 3, generator=g)
    seen = []

    def x(t, group):
        seen.append(("x", group))
        return t @ a_mat.T  # [n, 3] -> [n, 4]

    def y(t, group):
        seen.append(("y", group))
        return t @ a_mat  # [n, 4] -> [n, 3]

    first, second = conjugate_pair(x, y, ("First", "Second"))
    assert (first.__name__, second.__name__) == ("First", "Second")
    group = object()  # passed through untouched, forward and backward
    for fn, plain, shape in ((first, lambda t: t @ a_mat.T, (2, 3)), (second, lambda t: t @ a_mat, (2, 4))):
        inp, w = torch.randn(*shape, generator=g), torch.randn(2, 7 - shape[1], generator=g)
        got, ref = inp.clone().requires_grad_(), inp.clone().requires_grad_()
        out = fn.apply(got, group)
        (out * w).sum().backward()
        (plain(ref) * w).sum().backward()
        torch.testing.assert_close(out, plain(inp), rtol=0, atol=0)
        torch.testing.assert_close(got.grad, ref.grad, rtol=1e-6, atol=1e-6)
    assert seen == [("x", group), ("y", group), ("y", group), ("x", group)]
