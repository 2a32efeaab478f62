"""comm.reduce_scatter_tensor on gloo: an all-to-all and a local sum, against the sum computed in one
process and against gloo's own reduce-scatter (``spare_memory=True``), blocking and asynchronous,
watched or not; counted as one reduce-scatter of the input's bytes."""

import pytest
import torch
import torch.distributed as dist

from par_groups import CommRecorder, CommWatch, comm

BLOCK = 6  # elements per rank's output


def inputs(world: int, dtype=torch.float32) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(world)
    return [torch.randn(world * BLOCK, generator=g).to(dtype) for _ in range(world)]


def on_ranks():
    world, rank = dist.get_world_size(), dist.get_rank()
    x = inputs(world)[rank]
    native_calls = []
    real = dist.reduce_scatter_tensor  # spied on: the gloo path must not fall back to it
    dist.reduce_scatter_tensor = lambda *a, **k: native_calls.append(1) or real(*a, **k)
    try:
        out = {}
        with CommRecorder() as rec:
            out["blocking"] = torch.empty(BLOCK)
            assert comm.reduce_scatter_tensor(out["blocking"], x, None) is None
            out["async"] = torch.full((BLOCK,), float("nan"))
            work = comm.reduce_scatter_tensor(out["async"], x, None, async_op=True)
            work.wait()
            with CommWatch():  # the watch wraps the all-to-all's work; the sum still follows the wait
                out["watched"] = torch.full((BLOCK,), float("nan"))
                comm.reduce_scatter_tensor(out["watched"], x, None, async_op=True).wait()
            out["bf16"] = torch.empty(BLOCK, dtype=torch.bfloat16)
            comm.reduce_scatter_tensor(out["bf16"], inputs(world, torch.bfloat16)[rank], None)
        via_all_to_all = list(native_calls)
        out["native"] = torch.empty(BLOCK)
        comm.reduce_scatter_tensor(out["native"], x, None, spare_memory=True)
        try:
            comm.reduce_scatter_tensor(torch.empty(BLOCK + 1), x, None)
            error = ""
        except ValueError as e:
            error = str(e)
    finally:
        dist.reduce_scatter_tensor = real
    return out, [(r.op, r.group_size, r.bytes) for r in rec.records], via_all_to_all, len(native_calls), error


@pytest.mark.parametrize("world", [2, 4])
def test_gloo_reduce_scatter_is_the_sum_of_blocks_and_counts_one_reduce_scatter(dist_run, world):
    xs = inputs(world)
    want = torch.stack([x.double() for x in xs]).sum(0).view(world, BLOCK)
    want_bf16 = torch.stack([x.double() for x in inputs(world, torch.bfloat16)]).sum(0).view(world, BLOCK)
    for rank, (out, records, via_all_to_all, native_calls, error) in enumerate(dist_run(world, on_ranks)):
        for kind in ("blocking", "async", "watched", "native"):
            torch.testing.assert_close(out[kind].double(), want[rank], rtol=1e-6, atol=1e-6, msg=kind)
        # the local sum runs in fp32 and rounds once (gloo's own sums in bf16, step by step)
        torch.testing.assert_close(out["bf16"].double(), want_bf16[rank], rtol=2**-8, atol=0)
        assert via_all_to_all == [] and native_calls == 1  # only spare_memory=True took gloo's own
        assert records == [("reduce_scatter", world, world * BLOCK * 4)] * 3 + [("reduce_scatter", world, world * BLOCK * 2)]
        assert f"input of {world * BLOCK} elements is not {world} x the output's {BLOCK + 1}" in error
