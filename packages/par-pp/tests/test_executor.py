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
            executor = PipelineExecutor(schedule, chunks, None, loss_fn=loss_fn)
            losses = executor.step(inputs if 0 in chunks else None, targets if schedule.last_chunk in chunks else None)
            grads = {c: [p.grad.clone() if p.grad is not None else None for p in mod.parameters()] for c, mod in chunks.items()}
            order = [(r.action.kind, r.action.microbatch, r.action.chunk) for r in executor.records]
            planned = [(a.kind, a.microbatch, a.chunk) for a in schedule.ranks[rank]]
            out[(name, m)] = {"losses": losses, "grads": grads, "ran_as_planned": order == planned}
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
            last_rank = schedule.placement[schedule.last_chunk]
            got_losses = results[last_rank][(name, m)]["losses"]
            torch.testing.assert_close(torch.stack(got_losses), torch.stack(ref_losses), rtol=1e-6, atol=1e-6)
            embed, layers, head = model[0], list(model[1:-1]), model[-1]
            for c in range(schedule.num_chunks):
                rank = schedule.placement[c]
                ref_params = list(chunk_module(embed, layers, head, ranges, c).parameters())
                got = results[rank][(name, m)]["grads"][c]
                assert len(got) == len(ref_params)
                for g, p in zip(got, ref_params):
                    torch.testing.assert_close(g, p.grad, rtol=1e-5, atol=1e-6, msg=lambda s: f"{name} m={m} chunk {c}: {s}")
            assert all(results[r][(name, m)]["ran_as_planned"] for r in range(pp)), f"{name} m={m}"
