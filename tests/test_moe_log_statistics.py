"""The MoE imbalance a step logs is over the whole step: every micro-batch's routed pairs per expert
summed, per layer, then the largest layer's max / mean (not the last micro-batch's)."""

import torch

OVERRIDES = ["train.steps=2", "train.warmup_steps=1", "train.eval_every=0", "log.progress=false",
             "model.layers=3", "train.micro_batch=2", "model.bias_update_rate=0.001"]  # 4 micro-batches a step


def logged_and_recorded_imbalance():
    from par_moe import MoELayer
    from pretrain.config import load_config
    from pretrain.training.train_loop import Trainer

    trainer = Trainer(load_config("tiny-moe", OVERRIDES))
    counts: dict = {}  # layer -> [routed pairs per expert of each training forward]
    for module in trainer.model.module.modules():
        if isinstance(module, MoELayer):
            module.register_forward_hook(
                lambda m, args, out: counts.setdefault(m, []).append(m.last_metrics["tokens_per_expert"].double()))
    out = []
    for step in range(2):
        counts.clear()
        logged = trainer.train_step(step).moe["imbalance"]
        step_loads = [torch.stack(c).sum(0) for c in counts.values()]
        whole = max(float(load.max() / load.mean()) for load in step_loads)
        last = max(float(c[-1].max() / c[-1].mean()) for c in counts.values())
        out.append((logged, whole, last, [len(c) for c in counts.values()]))
    return out


def test_logged_moe_imbalance_is_the_whole_steps(dist_run):
    for logged, whole, last, forwards in dist_run(1, logged_and_recorded_imbalance)[0]:
        assert forwards and all(n == 4 for n in forwards), forwards  # every layer saw the 4 micro-batches
        assert abs(logged / whole - 1) < 1e-6, (logged, whole)
        assert abs(last / whole - 1) > 1e-3, (last, whole)  # the last micro-batch alone differs
