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
    from pretrain.training.train_loop import Trainer

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


# Rounding alone can move a step a long way: where a gradient is a small difference of large terms
# (measured on a Sapphire Rapids CPU: step 18 of the packed-documents run moves by 6.5e-6 in the grad
# norm when the single rank itself only splits its 8 sequences into micro-batches of 2 instead of
# taking them in one, while its other steps move by <= 2.5e-7). A step whose error exceeds the tolerance passes only if the
# single rank's own rounding noise at that step is at least 1/NOISE_MARGIN of it; measured, a layout
# lands at 0.8x (that packed step) and 2.0x (step 8 of the MLA + MTP tp2 x pp2 run) of that noise.
NOISE_MARGIN = 4


def noise_micro_batches(config: str | None, overrides) -> list[int]:
    """Two micro-batch sizes that divide the run's global batch (2 and 4 of 8; 2 and 3 of 6)."""
    from pretrain.config import load_config

    batch = load_config(config, list(COMMON) + list(overrides)).train.global_batch
    return [n for n in range(2, batch) if batch % n == 0][:2]


def rounding_noise(dist_run, config: str | None, overrides: tuple[str, ...] = (), fn=train_steps):
    """Per step, the largest relative change of the single rank's loss and grad norm over re-runs that
    accumulate 2 and 4 sequences per micro-batch (of 8; :func:`noise_micro_batches`): the same math,
    summed in another order. Not for MoE,
    whose balancing losses are per micro-batch (there the split changes the math)."""
    reference = single_rank(dist_run, config, overrides, fn)
    runs = [single_rank(dist_run, config, tuple(overrides) + (f"train.micro_batch={n}",), fn)
            for n in noise_micro_batches(config, overrides)]
    return tuple([max(abs(run[kind][s] - reference[kind][s]) / abs(reference[kind][s]) for run in runs)
                  for s in range(len(reference[kind]))] for kind in (0, 1))


def deferred_noise(dist_run, config: str | None, overrides=(), fn=train_steps):
    """:func:`rounding_noise` as ``assert_same``'s ``noise``: measured only if a step needs it."""
    return lambda: rounding_noise(dist_run, config, tuple(overrides), fn)


def max_errors(result, reference) -> tuple[float, float]:
    """Largest relative error of the loss and of the grad norm over the steps."""
    (losses, norms), (ref_losses, ref_norms) = result, reference
    loss = max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses))
    norm = max(abs(a - b) / abs(b) for a, b in zip(norms, ref_norms))
    return loss, norm


def fp64_noise(reference, reference_fp64) -> tuple[list[float], list[float]]:
    """Per step, how far an fp32 oracle's (losses, grad norms) lie from the same run in fp64 (relative):
    its own rounding noise, as :func:`assert_close_steps`'s ``noise``."""
    return tuple([abs(a / b - 1) for a, b in zip(reference[kind], reference_fp64[kind])] for kind in (0, 1))


def assert_close_steps(result, reference, tolerance: float, name: str, noise=None, steps: int = STEPS) -> None:
    """One rank's losses and grad norms equal the reference's at every step within ``tolerance``
    (relative), or, at a step where they do not, within NOISE_MARGIN x the reference's own rounding
    noise there (``noise()``, computed only when a step needs it: :func:`rounding_noise` for the
    single rank, :func:`fp64_noise` for an outside oracle)."""
    loss, norm = max_errors(result, reference)
    print(f"{name}: max rel error loss {loss:.2e} grad norm {norm:.2e}")  # the evidence for the tolerance
    measured = None
    for kind, what in enumerate(("loss", "grad norm")):
        got, want = result[kind], reference[kind]
        assert len(got) == len(want) == steps
        for step, (a, b) in enumerate(zip(got, want)):
            error = abs(a - b) / abs(b)
            if error <= tolerance:
                continue
            assert noise is not None, f"{name} step {step}: {what} {a} vs reference {b} ({error:.2e} > {tolerance})"
            measured = measured or noise()
            allowed = NOISE_MARGIN * measured[kind][step]
            print(f"{name} step {step}: {what} error {error:.2e}, the reference's rounding noise {measured[kind][step]:.2e}")
            assert error <= allowed, (f"{name} step {step}: {what} {a} vs reference {b} ({error:.2e} > {tolerance}, "
                                      f"and > {NOISE_MARGIN} x the reference's rounding noise {measured[kind][step]:.2e})")


def assert_same(results, reference, tolerance: float, name: str, noise=None) -> None:
    """Every rank's losses and grad norms equal the reference's (see :func:`assert_close_steps`)."""
    for rank, result in enumerate(results):
        assert_close_steps(result, reference, tolerance, f"{name} rank {rank}", noise)


def one_rank_first_batch(cfg):
    """A one-rank Trainer, its chunk, a dict that its parameters' gradients land in (by chunk name,
    read before the DP wrapper moves them into buckets), and step 0's MicroBatches."""
    from pretrain.training.train_loop import Trainer

    trainer = Trainer(cfg)
    chunk = trainer.model.chunks[0]
    grads = {}
    for name, p in chunk.named_parameters():
        p.register_hook(lambda g, name=name: grads.__setitem__(name, g.clone()))
    batch = trainer.microbatches(trainer.sampler.train_batch(0))
    return trainer, chunk, grads, batch


def worst_grad_error(grads: dict, ref_grads: dict) -> float:
    """The largest gradient error relative to its tensor's largest entry, one rank's ``grads`` (chunk
    names) against the reference model's (HF names). The embedding and head carry vocabulary padding:
    their rows past the reference's must have exactly zero gradient (the padded logits are -inf)."""
    from pretrain.model.shapes import hf_name

    worst = 0.0
    for name, g in grads.items():
        r = ref_grads[hf_name(name)]
        worst = max(worst, ((g[:r.shape[0]] - r).abs().max() / r.abs().max().clamp_min(1e-12)).item())
        pad = g[r.shape[0]:]
        assert pad.numel() == 0 or pad.abs().max().item() == 0.0, f"{name}: padded vocabulary rows got gradients"
    return worst
