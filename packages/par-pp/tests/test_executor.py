"""The executor trains the same model as one device: every schedule, p = 2 and 4, losses and
every gradient equal a single-process forward/backward over the same microbatches (fp32)."""

import pytest
import torch
import torch.distributed as dist
from torch import nn

from par_pp import PipelineExecutor, build_schedule, chunks_on_rank, split_layers

H, V, S, B = 8, 11, 3, 2  # hidden, vocab, sequence, batch per microbatch
CASES = [("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("zb-h1", 1), ("zb-v", 2), ("dualpipev", 2)]


def build_model(num_layers, seed=0):
    """Embedding, num_layers Linear+Tanh blocks, output head: the single-device model."""
    g = torch.Generator().manual_seed(seed)
    embed = nn.Embedding(V, H)
    layers = [nn.Sequential(nn.Linear(H, H), nn.Tanh()) for _ in range(num_layers)]
    head = nn.Linear(H, V, bias=False)
    with torch.no_grad():
        for p in [*embed.parameters(), *(q for layer in layers for q in layer.parameters()), *head.parameters()]:
            p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    return embed, layers, head


def make_data(microbatches, seed=1):
    g = torch.Generator().manual_seed(seed)
    inputs = [torch.randint(0, V, (S, B), generator=g) for _ in range(microbatches)]
    targets = [torch.randint(0, V, (S, B), generator=g) for _ in range(microbatches)]
    return inputs, targets


def loss_fn(logits, target):
    return nn.functional.cross_entropy(logits.reshape(-1, V), target.reshape(-1))


def chunk_module(embed, layers, head, ranges, c, tied=False):
    parts = [embed] if c == 0 else []
    parts += [layers[i] for i in ranges[c]]
    if c == len(ranges) - 1:
        parts.append(head)
    return nn.Sequential(*parts)


def num_layers_for(pp, vpp):
    return 2 * pp * vpp + 1  # uneven: one chunk gets an extra layer


def run_all_schedules(pp, microbatch_counts):
    """One job: every schedule and microbatch count; per case this rank's losses and grads."""
    rank = dist.get_rank()
    out = {}
    for name, vpp in CASES:
        for m in microbatch_counts:
            schedule = build_schedule(name, pp, m, vpp)
            embed, layers, head = build_model(num_layers_for(pp, schedule.vpp))
            ranges = split_layers(len(layers), schedule.num_chunks)
            chunks = {c: chunk_module(embed, layers, head, ranges, c) for c in chunks_on_rank(schedule, rank)}
            inputs, targets = make_data(m)
            # the most microbatches with declared message shapes (the trainer's way: no headers,
            # several receives posted ahead per stream), the others with shape headers
            shape = ((S, B, H), torch.float32) if m == microbatch_counts[-1] else None
            executor = PipelineExecutor(schedule, chunks, None, loss_fn=loss_fn, message_shape=shape)
            losses = executor.step(inputs if 0 in chunks else None, targets if schedule.last_chunk in chunks else None)
            grads = {c: [p.grad.clone() if p.grad is not None else None for p in mod.parameters()] for c, mod in chunks.items()}
            order = [(r.action.kind, r.action.microbatch, r.action.chunk) for r in executor.records]
            planned = [(a.kind, a.microbatch, a.chunk) for a in schedule.ranks[rank]]
            # forward only (eval): the schedule's F actions; logits of every microbatch on the last chunk's rank
            logits = executor.forward(inputs if 0 in chunks else None, m)
            out[(name, m)] = {"losses": losses, "grads": grads, "ran_as_planned": order == planned, "logits": logits}
    return out


def reference(pp, vpp, m):
    """Plain single-process training step: mean loss over microbatches, backward, grads."""
    embed, layers, head = build_model(num_layers_for(pp, vpp))
    model = nn.Sequential(embed, *layers, head)
    inputs, targets = make_data(m)
    losses = [loss_fn(model(x), t) for x, t in zip(inputs, targets)]
    (sum(losses) / m).backward()
    return [l.detach() for l in losses], model


@pytest.mark.parametrize("pp", [2, 4])
def test_every_schedule_matches_single_device_losses_and_grads(dist_run, pp):
    counts = [1, pp, 2 * pp + 1]
    results = dist_run(pp, run_all_schedules, pp, counts, timeout=240)
    for name, vpp in CASES:
        for m in counts:
            schedule = build_schedule(name, pp, m, vpp)
            ref_losses, model = reference(pp, schedule.vpp, m)
            ranges = split_layers(num_layers_for(pp, schedule.vpp), schedule.num_chunks)
            last_rank = schedule.chunk_ranks[schedule.last_chunk]
            got_losses = results[last_rank][(name, m)]["losses"]
            torch.testing.assert_close(torch.stack(got_losses), torch.stack(ref_losses), rtol=1e-6, atol=1e-6)
            with torch.no_grad():  # the forward-only walk gives the single-device logits
                ref_logits = torch.stack([model(x) for x in make_data(m)[0]])
            torch.testing.assert_close(torch.stack(results[last_rank][(name, m)]["logits"]), ref_logits, rtol=1e-6, atol=1e-6)
            assert all(results[r][(name, m)]["logits"] == [] for r in range(pp) if r != last_rank)
            embed, layers, head = model[0], list(model[1:-1]), model[-1]
            for c in range(schedule.num_chunks):
                rank = schedule.chunk_ranks[c]
                ref_params = list(chunk_module(embed, layers, head, ranges, c).parameters())
                got = results[rank][(name, m)]["grads"][c]
                assert len(got) == len(ref_params)
                for g, p in zip(got, ref_params):
                    torch.testing.assert_close(g, p.grad, rtol=1e-5, atol=1e-6, msg=lambda s: f"{name} m={m} chunk {c}: {s}")
            assert all(results[r][(name, m)]["ran_as_planned"] for r in range(pp)), f"{name} m={m}"


def tied_embedding_step(pp, name, vpp, m):
    """Tied input/output embedding plus a per-microbatch extra input passed via forward_fn."""
    from par_groups.comm import CommRecorder

    rank = dist.get_rank()
    schedule = build_schedule(name, pp, m, vpp)
    embed, layers, head = build_model(num_layers_for(pp, schedule.vpp))
    ranges = split_layers(len(layers), schedule.num_chunks)
    first_rank, last_rank = schedule.chunk_ranks[0], schedule.chunk_ranks[schedule.last_chunk]
    if first_rank == last_rank:
        head.weight = embed.weight  # one Parameter shared by both chunks on this rank
        embedding_group, tied = None, [embed.weight] if rank == first_rank else []
    else:
        with torch.no_grad():
            head.weight.copy_(embed.weight)
        embedding_group = dist.new_group([first_rank, last_rank])
        tied = [embed.weight] if rank == first_rank else [head.weight] if rank == last_rank else []
    chunks = {c: chunk_module(embed, layers, head, ranges, c) for c in chunks_on_rank(schedule, rank)}
    shifts = [torch.full((H,), 0.1 * (i + 1)) for i in range(m)]

    def forward_fn(c, module, x, mb):
        return module(x) + shifts[mb] if c == 0 else module(x)

    inputs, targets = make_data(m)
    ex = PipelineExecutor(schedule, chunks, None, loss_fn=loss_fn, tied_params=tied, embedding_group=embedding_group if rank in (first_rank, last_rank) else None, forward_fn=forward_fn)
    with CommRecorder() as rec:
        losses = ex.step(inputs, targets)
    tied_grads = [p.grad.clone() for p in tied]
    return {"losses": losses, "tied": tied_grads, "all_reduces": rec.count("all_reduce"), "sends": rec.count("send"), "send_bytes": rec.total_bytes("send")}


@pytest.mark.parametrize("name,vpp", [("1f1b", 1), ("zb-v", 2)])
def test_tied_embedding_grads_and_extra_inputs_match_single_device(dist_run, name, vpp):
    pp, m = 2, 3
    results = dist_run(pp, tied_embedding_step, pp, name, vpp, m)
    schedule = build_schedule(name, pp, m, vpp)
    embed, layers, head = build_model(num_layers_for(pp, schedule.vpp))
    head.weight = embed.weight
    inputs, targets = make_data(m)
    shifts = [torch.full((H,), 0.1 * (i + 1)) for i in range(m)]
    body = nn.Sequential(*layers[: len(split_layers(len(layers), schedule.num_chunks)[0])])
    rest = nn.Sequential(*layers[len(body) :], head)
    # Chunk 0 is embed + its layers; the shift is added to chunk 0's output.
    ref = [loss_fn(rest(body(embed(x)) + s), t) for x, t, s in zip(inputs, targets, shifts)]
    (sum(ref) / m).backward()
    last_rank = schedule.chunk_ranks[schedule.last_chunk]
    torch.testing.assert_close(torch.stack(results[last_rank]["losses"]), torch.stack([l.detach() for l in ref]))
    for r in {schedule.chunk_ranks[0], last_rank}:
        torch.testing.assert_close(results[r]["tied"][0], embed.weight.grad, rtol=1e-5, atol=1e-6)
    if name == "1f1b":
        # One all-reduce of the tied grad; per microbatch one activation and one grad message,
        # each a header (10 int64) plus an [S, B, H] fp32 payload.
        assert [res["all_reduces"] for res in results] == [1, 1]
        assert [res["sends"] for res in results] == [2 * m, 2 * m]
        assert results[0]["send_bytes"] == m * (10 * 8 + S * B * H * 4)
