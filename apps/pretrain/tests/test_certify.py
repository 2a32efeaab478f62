"""`pretrain certify`: a correct layout certifies; a planted bug is named at its module and dimension."""

from __future__ import annotations

import time

import pytest

CONFIGS = {
    "tp2-sp": (None, ["parallel.tp=2", "model.layers=2"]),
}


def certify(dist_run, tmp_path, config, overrides, world=4, steps=2, bug=None):
    from pretrain.certify.narrow import narrowed_overrides, reference_overrides
    from pretrain.certify.ranks import run_reference
    from pretrain.certify.verdict import MARGIN, verdict_line
    from pretrain.config import load_config

    import certify_ranks

    start = time.time()
    ov = narrowed_overrides(config, overrides, world)
    cfg = load_config(config, ov)
    layout = cfg.validate_world(world)
    dist_run(1, run_reference, config, ov + reference_overrides(cfg, layout), steps, str(tmp_path), timeout=600)
    t_ref = time.time() - start
    records = dist_run(world, certify_ranks.layout_with_bug, bug, config, ov, steps, str(tmp_path), MARGIN,
                       timeout=600)[0]
    line, code = verdict_line(records, "layout")
    print(f"{line} [reference {t_ref:.1f} s, total {time.time() - start:.1f} s]")
    return records, line, code


@pytest.mark.parametrize("name", list(CONFIGS))
def test_correct_layout_certifies(dist_run, tmp_path, monkeypatch, name):
    monkeypatch.syspath_prepend(str(__import__("pathlib").Path(__file__).parent))
    config, overrides = CONFIGS[name]
    records, line, code = certify(dist_run, tmp_path, config, overrides)
    for r in records:
        print(r["tensors_compared"], r["loss"], r["reference_loss"], r["loss_fp64_noise"], r["grad_norm_fp64_noise"], r["loss_difference"], r["loss_band"], r["grad_norm_difference"], r["grad_norm_band"], r["first_divergence"])
    assert code == 0, line
