"""'torch_fsdp2' checkpoints are pieces like every other strategy's: a run resumes bitwise, and a
checkpoint moves between torch's fully_shard and par-zero's ZeRO-3 both ways with the losses of
the uninterrupted run (torch's AdamW and ours: the same arithmetic, reductions in another order)."""

STEPS, SAVE_AT = 4, 2
COMMON = [f"train.steps={STEPS}", "train.warmup_steps=1", "train.eval_every=0", "log.progress=false", "model.layers=2"]
FSDP2, ZERO3 = ["parallel.zero=torch_fsdp2"], ["parallel.zero=optim_grads_params"]


def job(root):
    from pretrain.checkpoint import latest_checkpoint
    from pretrain.checkpoint.full_model import read_full_tensors
    from pretrain.config import load_config
    from pretrain.training.train_loop import Trainer

    def trainer(layout):
        return Trainer(load_config(None, COMMON + layout))

    t = trainer(FSDP2)
    out = {"reference": [t.train_step(s).loss for s in range(STEPS)]}
    t = trainer(FSDP2)
    for s in range(SAVE_AT):
        t.train_step(s)
    t.save_checkpoint(f"{root}/fsdp2", SAVE_AT)
    for name, layout, src in (("fsdp2-again", FSDP2, "fsdp2"), ("zero3", ZERO3, "fsdp2"), ("back", FSDP2, "zero3")):
        t = trainer(layout)
        start = t.load_checkpoint(latest_checkpoint(f"{root}/{src}"))
        t.save_checkpoint(f"{root}/{name}", start)  # what it holds after the load
        for prefix in ("model/", "optim/exp_avg/", "optim/exp_avg_sq/"):
            a, b = (read_full_tensors(latest_checkpoint(f"{root}/{d}"), prefix) for d in (src, name))
            out[name, prefix] = sorted(a) == sorted(b) and len(a) > 0 and all(a[k].equal(b[k]) for k in a)
        out[name, "losses"] = [t.train_step(s).loss for s in range(start, STEPS)]
    return out


def test_fsdp2_checkpoint_resumes_bitwise_and_moves_to_zero3_and_back(dist_run, tmp_path):
    out = dist_run(2, job, str(tmp_path), timeout=600)[0]
    ref = out.pop("reference")[SAVE_AT:]
    assert out.pop(("fsdp2-again", "losses")) == ref  # bitwise: same layout, same optimizer
    for name in ("zero3", "back"):
        losses = out.pop((name, "losses"))
        worst = max(abs(a - b) / abs(b) for a, b in zip(losses, ref))
        print(f"{name}: worst relative loss error {worst:.2e}")
        assert worst <= 1e-6, (name, losses, ref)
    assert all(out.values()), out  # every tensor and moment survived each move bitwise
