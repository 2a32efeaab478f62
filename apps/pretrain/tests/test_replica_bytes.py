"""expert_balance = "replicate" in a real trainer step (ep2, forced skew): every all-to-all the step
records (CommRecorder) has the bytes the plan and the planner's formula (pretrain.sizing.replicas) give:
per MoE layer the token rows out, the replicas' weights, the rows back; backward the rows' gradients,
the replicas' gradients home, the token gradients."""

import torch

from pretrain.sizing.replicas import replica_bytes

OVERRIDES = ["model.layers=3", "model.top_k=4", "model.expert_balance=replicate", "parallel.ep=2", "train.micro_batch=4",
             "train.steps=2", "train.warmup_steps=1", "train.eval_every=0", "log.progress=false", "train.seq_len=32"]


def one_step_traffic(overrides):
    """This rank's all-to-all bytes of one step, and the plan of each MoE dispatch (forward order)."""
    import par_moe.replicate as rep
    from par_groups import CommRecorder
    from pretrain.config import load_config
    from pretrain.training.train_loop import Trainer

    trainer = Trainer(load_config("tiny-moe", overrides))
    for chunk in trainer.model.chunks.values():  # the forced skew: experts 0 and 1 in every token's top 4
        for layer in chunk.decoder_layers():
            if layer.is_moe:
                with torch.no_grad():
                    layer.mlp.router.expert_bias[:2] += 1.0
    plans, dispatch = [], rep.ReplicatingDispatcher.dispatch

    def recording(self, *args, **kwargs):
        out = dispatch(self, *args, **kwargs)
        plans.append(self.last_plan)
        return out

    rep.ReplicatingDispatcher.dispatch = recording
    try:
        with CommRecorder() as recorder:
            trainer.train_step(0)
    finally:
        rep.ReplicatingDispatcher.dispatch = dispatch
    return [r.bytes for r in recorder.records if r.op == "all_to_all"], plans, trainer.groups.rank_in("ep")


def test_replica_fetch_and_return_bytes_are_the_formula(dist_run):
    from pretrain.config import load_config

    model = load_config("tiny-moe", OVERRIDES).model
    for recorded, plans, rank in dist_run(2, one_step_traffic, OVERRIDES, timeout=300):
        assert len(plans) == 2 and all(any(p.replicas) for p in plans), "the skew makes replicas in both MoE layers"
        rows = model.hidden * 4  # fp32 token rows

        def sent(p):
            return sum(p.sent(rank, d) for d in range(p.ep)) * rows

        def got(p):
            return sum(p.sent(s, rank) for s in range(p.ep)) * rows

        forward = [b for p in plans for b in (sent(p), replica_bytes(model, 1, p.fetched(rank), 4), got(p))]
        backward = [b for p in reversed(plans) for b in (sent(p), replica_bytes(model, 1, len(p.replicas[rank]), 4), got(p))]
        print(f"ep rank {rank}: all-to-all bytes {recorded}; replicas fetched {[p.fetched(rank) for p in plans]}, "
              f"received {[len(p.replicas[rank]) for p in plans]}")
        assert recorded == forward + backward
