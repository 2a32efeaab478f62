"""Any torch.optim class on the unsharded strategies: 2-rank DDP (and torch_fsdp2) train like one
process running the same torch.optim class on the full batch, the weight-decay mask included; its
state saves and loads as pieces and resumes bitwise; the sharded strategies refuse it in one line.

The reference is plain torch (the class, two param groups, torch's clipping) on one process.
"""

import pytest
import torch
import torch.distributed as dist
from par_zero.testing import OPT, STEPS, reference_params, tiny_model, train_parallel

from par_zero import DataParallelConfig, data_parallel, load_pieces, save_pieces

BUCKET_MB = 300 / 2**20
LR, WD = OPT["lr"], OPT["weight_decay"]
# (name, class, its arguments): momentum state (SGD), state made at construction plus a step scalar (Adagrad)
CASES = [("sgd-nesterov", torch.optim.SGD, {"momentum": 0.9, "nesterov": True}),
         ("adagrad", torch.optim.Adagrad, {"lr_decay": 0.01})]


def _reference(world, cls, args, mask=True, steps=STEPS):
    return reference_params(world, optimizer=lambda g: cls(g, lr=LR, weight_decay=WD, foreach=False, **args),
                            mask=mask, steps=steps)


def _max_err(got, ref) -> float:
    assert set(got) == set(ref)
    return max((got[k] - ref[k]).abs().max().item() for k in ref)


def _dp(strategy, cls, args):
    return data_parallel(tiny_model(), None, strategy, bucket_mb=BUCKET_MB, lr=LR, weight_decay=WD,
                         optimizer=cls, optimizer_args=args)


def train_and_resume(world: int, path: str) -> dict:
    rank, out = dist.get_rank(), {}
    for name, cls, args in CASES:
        ref = _reference(world, cls, args)
        out[f"{name}/unmasked-ref"] = _max_err(ref, _reference(world, cls, args, mask=False))
        for strategy in ("no_shard", "torch_fsdp2"):
            dp = _dp(strategy, cls, args)
            train_parallel(dp, world, rank)
            out[f"{name}/{strategy}"] = _max_err(dp.full_parameters(), ref)
            if strategy == "no_shard":
                uninterrupted = dp.full_parameters()
        # save after 2 steps, load into a fresh wrapper, 3 more steps: bitwise the uninterrupted run
        dp = _dp("no_shard", cls, args)
        train_parallel(dp, world, rank, steps=2)
        kinds, scalars = dp.optimizer.state_kinds(), dp.optimizer.scalar_state()
        save_pieces(dp.state_dict(), f"{path}/{name}")
        fresh = _dp("no_shard", cls, args)
        sd = fresh.state_dict(kinds, scalars)
        load_pieces(sd, f"{path}/{name}")
        fresh.load_state_dict(sd)
        out[f"{name}/kinds"] = (kinds, scalars, fresh.optimizer.state_kinds(), fresh.optimizer.scalar_state())
        train_parallel(fresh, world, rank, steps=STEPS - 2, start=2)
        out[f"{name}/resume"] = _max_err(fresh.full_parameters(), uninterrupted)
    return out


def test_torch_optimizers_on_ddp_and_fsdp2_train_like_one_process_and_resume_bitwise(dist_run, tmp_path):
    res = dist_run(2, train_and_resume, 2, str(tmp_path), timeout=600)[0]
    for name, _, _ in CASES:
        assert res[f"{name}/unmasked-ref"] > 1e-4, res  # decaying norms and biases too would be caught
        for strategy in ("no_shard", "torch_fsdp2"):
            assert res[f"{name}/{strategy}"] <= 1e-6, (name, strategy, res)
        assert res[f"{name}/resume"] == 0.0, res  # bitwise
        kinds, scalars, loaded_kinds, loaded_scalars = res[f"{name}/kinds"]
        assert kinds and kinds == loaded_kinds and scalars == loaded_scalars, res[f"{name}/kinds"]


def test_sharded_strategies_refuse_another_optimizer_in_one_line():
    for strategy in ("optim", "optim_grads", "optim_grads_params"):
        with pytest.raises(ValueError, match=rf"optimizer='SGD' needs strategy 'no_shard' or 'torch_fsdp2'; "
                                             rf"strategy='{strategy}' shards"):
            DataParallelConfig(strategy, optimizer="SGD")
    with pytest.raises(ValueError, match=r"optimizer='Nope' is not a torch.optim optimizer class; use one of .*SGD"):
        DataParallelConfig("no_shard", optimizer="Nope")
    with pytest.raises(ValueError, match=r"optimizer SGD with \{'momentum': -1\}: ValueError: Invalid momentum"):
        DataParallelConfig("no_shard", optimizer="SGD", optimizer_args={"momentum": -1})
    with pytest.raises(ValueError, match=r"optimizer LBFGS with \{\}: TypeError"):  # needs a closure
        DataParallelConfig("no_shard", optimizer="LBFGS")
    with pytest.raises(ValueError, match="state 'row_var' not shaped like its param"):
        DataParallelConfig("no_shard", optimizer="Adafactor")
