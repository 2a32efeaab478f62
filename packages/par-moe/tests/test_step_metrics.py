"""MoELayer.step_metrics: the routing statistics of every training forward of a step (its micro-batches),
not the last forward's; reset when read; evaluation forwards not counted."""

import torch

from par_moe import MoEConfig, MoELayer

H = 16


def micro_batches(n: int, tokens: int):
    """Micro-batches that favour different experts (each shifted along its own direction)."""
    g = torch.Generator().manual_seed(0)
    return [torch.randn(tokens, H, generator=g) + 3 * torch.randn(1, H, generator=g) for _ in range(n)]


def test_step_metrics_cover_every_micro_batch_of_the_step():
    config = MoEConfig(hidden=H, ffn_hidden=8, num_experts=8, top_k=2, capacity_factor=1.0,
                       aux_loss_coeff=0.01, seq_aux_loss_coeff=0.001, z_loss_coeff=0.001)
    torch.manual_seed(1)
    layer = MoELayer(config)
    per_forward = []
    for x in micro_batches(3, tokens=24):
        layer(x)
        per_forward.append(dict(layer.last_metrics))
    layer.eval()
    layer(micro_batches(1, tokens=24)[0] * 5)  # an evaluation forward: not the step's
    layer.train()

    stats = layer.step_metrics()
    load = sum(m["tokens_per_expert"] for m in per_forward).double()
    torch.testing.assert_close(stats["tokens_per_expert"], load, rtol=0, atol=0)
    torch.testing.assert_close(stats["imbalance"], (load.max() / load.mean()).float(), rtol=1e-6, atol=1e-6)
    assert abs(float(stats["imbalance"]) - float(per_forward[-1]["imbalance"])) > 1e-3  # not the last one's
    for name in ("dropped_fraction", "aux_loss", "seq_aux_loss", "z_loss"):  # equal micro-batches: the mean
        mean = torch.stack([m[name] for m in per_forward]).mean()
        torch.testing.assert_close(stats[name], mean.float(), rtol=1e-6, atol=1e-9, msg=name)
    assert float(stats["dropped_fraction"]) > 0 and float(stats["aux_loss"]) > 0

    assert layer.step_metrics() == {}  # read: reset
    layer(micro_batches(1, tokens=24)[0])
    torch.testing.assert_close(layer.step_metrics()["tokens_per_expert"], layer.last_metrics["tokens_per_expert"].double())
