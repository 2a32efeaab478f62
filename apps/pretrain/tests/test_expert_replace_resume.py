"""expert_balance = "replicate+replace" across checkpoints (ep2 x edp2 ZeRO-1 with a synchronous and an
asynchronous save, cp2 x ep2, tp2 x ep2 with etp2, the all-gather dispatcher, pp2 x ep2; forced skew,
replace_every=5).

A resume from step 7 (saved between the re-placements of steps 5 and 10) continues the uninterrupted
20-step run bitwise: every loss and grad norm, and every parameter and optimizer state at the end.
The checkpoint is keyed by the global expert index: loaded under ep4 (its own placement, contiguous)
and on one rank, every tensor is the one the saving run held.
"""

import pytest
import torch

from test_expert_replace import global_state, skew

STEPS, SAVED = 20, 7
OVERRIDES = ["model.layers=3", "model.top_k=4", "model.expert_balance=replicate+replace", "model.replace_every=5",
             "parallel.ep=2", "parallel.zero=optim", f"train.steps={STEPS}", "train.warmup_steps=2",
             "train.eval_every=0", "log.progress=false", "train.seq_len=32"]


def run(overrides, root: str, resume: bool, background: bool = False):
    """Steps, from the start (saving after step SAVED) or resumed from that save: (loss, grad norm) per step,
    the re-placement records, and the global state at the save (uninterrupted) and at the end. ``background``:
    the save is an async one (CheckpointSaver), finished at the end."""
    from pretrain.checkpoint import CheckpointSaver

    from pretrain.config import load_config
    from pretrain.training.train_loop import Trainer

    trainer = Trainer(load_config("tiny-moe", overrides))
    start, at_save, saver = 0, None, CheckpointSaver(background)
    if resume:
        start = trainer.load_checkpoint(f"{root}/step_{SAVED}")
        assert start == SAVED
    else:
        skew(trainer)  # a resume loads it (the router's bias is saved)
    steps, records = [], []
    for step in range(start, STEPS):
        result = trainer.train_step(step)
        steps.append((result.loss, result.grad_norm))
        records += [result.placement] if result.placement else []
        if step + 1 == SAVED and not resume:
            saver.save(trainer.checkpointed(), root, SAVED, keep=1)
            at_save = global_state(trainer)
    saver.close()
    return steps, records, at_save, global_state(trainer)


def loaded(overrides, root: str):
    """The global state right after loading the step-SAVED checkpoint under ``overrides``."""
    from pretrain.config import load_config
    from pretrain.training.train_loop import Trainer

    trainer = Trainer(load_config("tiny-moe", overrides))
    assert trainer.load_checkpoint(f"{root}/step_{SAVED}") == SAVED
    return global_state(trainer)


# the layout saved and resumed under (on 4 ranks; ep2 x edp2 ZeRO-1 is OVERRIDES itself), and the save's kind
LAYOUTS = {"ep2-sync-save": ([], False), "ep2-async-save": ([], True),
           "cp2-ep2-sync-save": (["parallel.cp=2"], False),
           "tp2-etp2-ep2-sync-save": (["parallel.tp=2", "parallel.etp=2"], False),
           "ep2-allgather-sync-save": (["model.dispatcher=allgather"], False),
           "pp2-ep2-sync-save": (["parallel.pp=2", "model.layers=4"], False)}


# ep2 (sync and async saves) and pp2 (each stage's maps) make the proof; cp, etp and the all-gather
# dispatcher repeat it through other groups of the same re-placement
AGAIN = ("cp2-ep2-sync-save", "tp2-etp2-ep2-sync-save", "ep2-allgather-sync-save")


@pytest.mark.timeout(300)  # minutes under load on 2 cores: beyond the suite's 60 s bound
@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.extended) if n in AGAIN else n for n in LAYOUTS])
def test_resume_across_a_replacement_is_bitwise_the_uninterrupted_run(dist_run, tmp_path, name):
    root, (extra, background) = str(tmp_path), LAYOUTS[name]
    steps, records, at_save, final = dist_run(4, run, OVERRIDES + extra, root, False, background, timeout=600)[0]
    assert [r["step"] for r in records] == [5, 10, 15, 20] and records[0]["experts_moved"] > 0, records
    resumed_steps, resumed_records, _, resumed_final = dist_run(4, run, OVERRIDES + extra, root, True, timeout=600)[0]
    assert resumed_steps == steps[SAVED:], "the resumed losses and grad norms differ from the uninterrupted run's"
    assert resumed_records == records[1:], (resumed_records, records)
    assert final.keys() == resumed_final.keys()
    differ = [k for k in final if not torch.equal(final[k], resumed_final[k])]
    assert not differ, f"after {STEPS} steps the resumed run differs in {differ[:4]}"
    print(f"re-placements {records}; resumed from step {SAVED}: {len(resumed_steps)} steps bitwise equal")

    # any placement loads under any other layout: ep4 (contiguous placement) and one rank
    model = OVERRIDES + [o for o in extra if o.startswith("model.")]  # the same model, on other layouts
    ep4 = [o.replace("parallel.ep=2", "parallel.ep=4") for o in model]
    single = [o for o in model if not o.startswith(("parallel.", "model.expert_balance"))]
    for name, overrides, world in (("ep4", ep4, 4), ("one rank", single, 1)):
        state = dist_run(world, loaded, overrides, root, timeout=600)[0]
        differ = [k for k in at_save if not torch.equal(at_save[k], state[k])]
        assert state.keys() == at_save.keys() and not differ, f"{name}: loaded {differ[:4]} differently"
