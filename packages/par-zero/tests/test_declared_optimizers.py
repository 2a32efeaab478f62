"""A new element-wise optimizer is one declaration: SGD with momentum and Lion train under ZeRO-1/2/3
on 2 ranks like one process running ``torch.optim.SGD`` / the Lion written below on the
full batch (weight-decay mask, clipping, accumulation), save and resume bitwise, load under another
strategy, and hold exactly the state their declaration names."""

import pytest
import torch
import torch.distributed as dist
from par_zero.testing import OPT, STEPS, reference_params, tiny_model, train_parallel

from par_zero import SGD, DataParallelConfig, Lion, data_parallel, declare_optimizer, load_pieces, save_pieces

BUCKET_MB = 300 / 2**20
LR, WD = OPT["lr"], OPT["weight_decay"]
STRATEGIES = ("optim", "optim_grads", "optim_grads_params")  # DDP: tests/test_trainer_matches_plain_pytorch.py


class ReferenceLion(torch.optim.Optimizer):
    """Lion as its paper's pseudo-code: decoupled decay, the sign of the interpolated momentum, then the momentum."""

    def __init__(self, params, lr, betas=(0.9, 0.99), weight_decay=0.0):
        super().__init__(params, {"lr": lr, "betas": betas, "weight_decay": weight_decay})

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            (b1, b2), lr = group["betas"], group["lr"]
            for p in group["params"]:
                m = self.state[p].setdefault("exp_avg", torch.zeros_like(p))
                p.mul_(1 - lr * group["weight_decay"])
                p.add_(torch.sign(b1 * m + (1 - b1) * p.grad), alpha=-lr)
                m.mul_(b2).add_(p.grad, alpha=1 - b2)


# name: (declaration, the single-process reference's optimizer over param groups)
CASES = {
    "sgd-dampening": (SGD(momentum=0.9, dampening=0.1),
                      lambda g: torch.optim.SGD(g, lr=LR, momentum=0.9, dampening=0.1, weight_decay=WD, foreach=False)),
    "sgd-nesterov": (SGD(momentum=0.8, nesterov=True),
                               lambda g: torch.optim.SGD(g, lr=LR, momentum=0.8, nesterov=True, weight_decay=WD,
                                                         foreach=False)),
    "lion": (Lion(betas=(0.9, 0.95)), lambda g: ReferenceLion(g, lr=LR, betas=(0.9, 0.95), weight_decay=WD)),
}


def _max_err(got, ref) -> float:
    assert set(got) == set(ref)
    return max((got[k] - ref[k]).abs().max().item() for k in ref)


def _dp(strategy, decl):
    return data_parallel(tiny_model(), None, strategy, bucket_mb=BUCKET_MB, lr=LR, weight_decay=WD, optimizer=decl)


def train_and_resume(world: int, path: str) -> dict:
    rank, out = dist.get_rank(), {}
    for name, (decl, reference) in CASES.items():
        ref = reference_params(world, optimizer=reference)
        for strategy in STRATEGIES:
            dp = _dp(strategy, decl)
            train_parallel(dp, world, rank)
            out[f"{name}/{strategy}"] = _max_err(dp.full_parameters(), ref)
            held = sum(t.numel() * t.element_size() for t in dp.optimizer.state_tensors())
            out[f"{name}/{strategy}/state"] = (held, sum(b.opt_hi - b.opt_lo for b in dp.buckets), dp.optimizer.state_kinds())
        # ZeRO-2 saved after 2 steps, loaded by ZeRO-2 (bitwise the uninterrupted run) and by ZeRO-3
        dp = _dp("optim_grads", decl)
        train_parallel(dp, world, rank, steps=2)
        save_pieces(dp.state_dict(), f"{path}/{name}")
        train_parallel(dp, world, rank, steps=STEPS - 2, start=2)
        uninterrupted = dp.full_parameters()
        for strategy in ("optim_grads", "optim_grads_params"):
            fresh = _dp(strategy, decl)
            sd = fresh.state_dict()
            load_pieces(sd, f"{path}/{name}")
            fresh.load_state_dict(sd)
            train_parallel(fresh, world, rank, steps=STEPS - 2, start=2)
            out[f"{name}/resume-{strategy}"] = _max_err(fresh.full_parameters(), uninterrupted)
    return out


@pytest.fixture(scope="module")
def results(dist_run, tmp_path_factory):
    return dist_run(2, train_and_resume, 2, str(tmp_path_factory.mktemp("ck")), timeout=600)[0]


@pytest.mark.timeout(300)  # alone, it starts the harness's ranks
@pytest.mark.parametrize("name", list(CASES))
def test_declared_elementwise_optimizer_trains_like_torch_under_every_zero_stage(results, name):
    decl = CASES[name][0]
    for strategy in STRATEGIES:
        assert results[f"{name}/{strategy}"] <= 1e-6, (name, strategy, results)
        held, elements, kinds = results[f"{name}/{strategy}/state"]
        assert kinds == decl.kinds() and held == elements * decl.state_bytes(), (strategy, held, elements, kinds)
    assert results[f"{name}/resume-optim_grads"] == 0.0, results  # bitwise
    assert results[f"{name}/resume-optim_grads_params"] <= 1e-6, results


def test_declarations_state_and_bad_options_in_one_line():
    assert (SGD(momentum=0.9).state_bytes(), SGD().state_bytes(), SGD().kinds(), Lion().kinds()) == \
        (4, 0, (), ("exp_avg",))
    assert declare_optimizer("sgd", {"momentum": 0.9}) == SGD(momentum=0.9)
    assert declare_optimizer("lion", {"betas": [0.9, 0.95]}) == Lion(betas=(0.9, 0.95))
    assert declare_optimizer("Adagrad").state_bytes() == 4  # a torch.optim class: what one step keeps
    for strategy in ("no_shard",) + STRATEGIES:
        assert DataParallelConfig(strategy, optimizer=Lion()).declaration == Lion()
    for name, args, message in [("sgd", {"momentum": -1}, "optimizer SGD with {'momentum': -1}: ValueError: Invalid momentum"),
                                ("sgd", {"maximize": True}, "SGD takes momentum, dampening, nesterov; not maximize"),
                                ("lion", {"betas": [0.9, 1.5]}, "Lion betas=[0.9, 1.5] must be two numbers in [0, 1)"),
                                ("lion", {"beta1": 0.9}, "Lion takes betas; not beta1")]:
        with pytest.raises(ValueError) as e:
            declare_optimizer(name, args)
        assert str(e.value).startswith(message) and "\n" not in str(e.value), str(e.value)
    with pytest.raises(ValueError, match="optimizer='Lion' is par-zero's own, over its buckets: .* not 'torch_fsdp2'"):
        DataParallelConfig("torch_fsdp2", optimizer=Lion())
