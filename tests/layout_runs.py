"""Shared by the layout tests: train N fp32 steps under a layout, the single-rank run to compare
with, and the comparison (relative error of the loss and the global grad norm at every step).

A layout test is ``dist_run(world, train_steps, config, overrides)`` compared with
``single_rank(dist_run, config, overrides)`` by ``assert_same``. The global grad norm matters: AdamW is blind
to a constant scale on a parameter's gradient, so losses alone would miss a mis-scaled reduction.
"""

from __future__ import annotations

STEPS = 20
# A smaller tiny model (4 layers, 32 tokens) keeps 20 steps of ~30 layouts inside the suite budget.
COMMON = (f"train.steps={STEPS}", "train.warmup_steps=2", "train.eval_every=0", "log.progress=false",
          "model.layers=4", "train.seq_len=32")


def train_steps(config: str | None, overrides) -> tuple[list[float], list[float]]:
    """(loss, grad norm) of every step; runs on every rank of a process group."""
    from pretrain.config import load_config
    from pretrain.train_loop import Trainer

    cfg = load_config(config, list(COMMON) + list(overrides))
    trainer = Trainer(cfg)
    results = [trainer.train_step(step) for step in range(STEPS)]
    return [r.loss for r in results], [r.grad_norm for r in results]


_SINGLE_RANK: dict = {}


def single_rank(dist_run, config: str | None, overrides: tuple[str, ...] = (), fn=train_steps):
    """``fn(config, overrides)`` on one rank (default: :func:`train_steps`), computed once per session
    on the harness's 1-rank pool."""
    key = (fn.__module__, fn.__qualname__, config, tuple(overrides))
    if key not in _SINGLE_RANK:
        _SINGLE_RANK[key] = dist_run(1, fn, config, list(overrides), timeout=600)[0]
    return _SINGLE_RANK[key]


def max_errors(result, reference) -> tuple[float, float]:
    """Largest relative error of the loss and of the grad norm over the steps."""
    (losses, norms), (ref_losses, ref_norms) = result, reference
    loss = max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses))
    norm = max(abs(a - b) / abs(b) for a, b in zip(norms, ref_norms))
    return loss, norm


def assert_same(results, reference, tolerance: float, name: str) -> None:
    """Every rank's losses and grad norms equal the reference's within ``tolerance`` (relative)."""
    for rank, result in enumerate(results):
        assert len(result[0]) == len(reference[0]) == STEPS
        loss, norm = max_errors(result, reference)
        print(f"{name}: max rel error loss {loss:.2e} grad norm {norm:.2e}")  # the evidence for the tolerance
        for step, (a, na, b, nb) in enumerate(zip(*result, *reference)):
            assert abs(a - b) <= tolerance * abs(b), f"{name} rank {rank} step {step}: loss {a} vs single-rank {b}"
            assert abs(na - nb) <= tolerance * abs(nb), \
                f"{name} rank {rank} step {step}: grad norm {na} vs single-rank {nb}"


def one_rank_first_batch(cfg):
    """A one-rank Trainer, its chunk, a dict that its parameters' gradients land in (by chunk name,
    read before the DP wrapper moves them into buckets), and step 0's micro-batches."""
    from pretrain.train_loop import Trainer

    trainer = Trainer(cfg)
    chunk = trainer.model.chunks[0]
    grads = {}
    for name, p in chunk.named_parameters():
        p.register_hook(lambda g, name=name: grads.__setitem__(name, g.clone()))
    inputs, labels = trainer.microbatches(trainer.sampler.train_batch(0))
    return trainer, chunk, grads, inputs, labels
