"""Planted bugs: apply one single-line change to the math, run the tests named for it, restore.

    uv run python tools/mutants.py                 # every mutant, one at a time
    uv run python tools/mutants.py lr-warmup zero1-restore   # some, by name
    uv run python tools/mutants.py --list

Each mutant names the fewest tests that should catch it. A mutant is *caught* when those tests
fail (pytest exit 1), *survived* when they pass, *error* when pytest could not run them (the
mutated text was not found, collection failed, ...). The file is restored after every mutant,
also on Ctrl-C or SIGTERM (the pytest run is stopped first). Not part of the suite; the suite's
tests/test_mutants_targets.py checks that every mutant's text occurs once and its tests exist.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PLAIN = "tests/test_trainer_matches_plain_pytorch.py::test_trainer_equals_plain_pytorch"
MLA_PLAIN = "tests/test_layouts_mla_mtp.py::test_single_rank_mla_mtp_equals_plain_pytorch"
ZERO = "packages/par-zero/tests/test_matches_single_process.py::test_every_strategy_matches_single_process_training[2]"
MOE_REF = "packages/par-moe/tests/test_layer_matches_reference.py::test_single_device_layer_matches_reference"
CAPACITY = "packages/par-moe/tests/test_dispatch_and_balance.py::test_capacity_matches_reference_policy"
MEGATRON = "packages/par-moe/tests/test_matches_megatron_moe.py"  # the outside oracle: megatron-core's moe_utils
REPLACE = "apps/pretrain/tests/test_expert_replace.py::test_replacement_moves_experts_with_their_optimizer_state"


@dataclass(frozen=True)
class Mutant:
    name: str
    path: str
    old: str  # must occur exactly once in the file
    new: str
    tests: tuple[str, ...]


MUTANTS = [
    Mutant("lr-warmup", "apps/pretrain/src/pretrain/training/schedule_lr.py",
           "return lr * (step + 1) / warmup_steps", "return lr * step / warmup_steps",
           ("tests/test_trainer_matches_plain_pytorch.py::test_lr_schedule_is_torchs_warmup_then_cosine",)),
    Mutant("lr-cosine", "apps/pretrain/src/pretrain/training/schedule_lr.py",
           "progress = min(1.0, (step - warmup_steps) / span)", "progress = min(1.0, (step - warmup_steps + 1) / span)",
           (f"{PLAIN}[dense]",)),
    Mutant("accumulation", "apps/pretrain/src/pretrain/training/runners.py",
           "(loss / n).backward()", "(loss / max(1, n - 1)).backward()", (f"{PLAIN}[dense]",)),
    Mutant("clip", "packages/par-zero/src/par_zero/adamw.py",
           "return (max_norm / (norm.double() + 1e-6)).clamp(max=1.0)",
           "return (max_norm / (norm.double() + 1e-6)).clamp(max=1.0).sqrt()", (f"{PLAIN}[dense]",)),
    Mutant("decay-mask", "apps/pretrain/src/pretrain/model/build.py",
           'return param.dim() < 2 or "embed_tokens" in name', 'return param.dim() < 2 or "embed_tokensX" in name',
           (f"{PLAIN}[dense]",)),
    Mutant("dp-mean", "packages/par-zero/src/par_zero/bucket.py",
           "self.full_grad.div_(self.dp_size)", "self.full_grad.div_(1)", (f"{PLAIN}[dense-dp2]",)),
    Mutant("rope-freq", "apps/pretrain/src/pretrain/blocks/rope.py",
           ".float() / head_dim))", ".float() / (head_dim + 2)))", (f"{PLAIN}[dense]",)),
    Mutant("rope-half", "apps/pretrain/src/pretrain/blocks/rope.py",
           "rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)",
           "rotated = torch.cat([x[..., half:], -x[..., :half]], dim=-1)", (f"{PLAIN}[dense]",)),
    Mutant("rope-interleaved", "apps/pretrain/src/pretrain/blocks/rope.py",
           "x1, x2 = x[..., 0::2], x[..., 1::2]", "x2, x1 = x[..., 0::2], x[..., 1::2]", (MLA_PLAIN,)),
    Mutant("yarn-ramp", "apps/pretrain/src/pretrain/blocks/rope_scaling.py",
           "extrapolate = 1 - ramp", "extrapolate = ramp", (MLA_PLAIN,)),
    Mutant("rope-llama3", "apps/pretrain/src/pretrain/blocks/rope_scaling.py",
           "smoothed = (1 - smooth) * scaled / factor + smooth * scaled",
           "smoothed = smooth * scaled / factor + (1 - smooth) * scaled", (f"{PLAIN}[qwen3-moe]",)),
    Mutant("qk-norm", "apps/pretrain/src/pretrain/models/gqa/attention.py",
           "q, k = self.q_norm(q), self.k_norm(k)", "q, k = self.q_norm(q), self.q_norm(k)", (f"{PLAIN}[qwen3-moe]",)),
    Mutant("mla-scale", "apps/pretrain/src/pretrain/blocks/rope_scaling.py",
           'return yarn_get_mscale(s["factor"], s["mscale_all_dim"]) ** 2',
           'return yarn_get_mscale(s["factor"], s["mscale_all_dim"])', (MLA_PLAIN,)),
    Mutant("mtp-inputs", "apps/pretrain/src/pretrain/model/mtp.py",
           "tokens = F.pad(labels[..., k - 1:], (0, k - 1), value=0)",
           "tokens = F.pad(labels[..., k:], (0, k), value=0)", (MLA_PLAIN,)),
    Mutant("mtp-weight", "apps/pretrain/src/pretrain/model/mtp.py",
           "return total * (config.mtp_loss_weight / config.mtp_depth)", "return total * config.mtp_loss_weight",
           (MLA_PLAIN,)),
    Mutant("capacity-round", "packages/par-moe/src/par_moe/config.py",
           "return math.ceil(self.capacity_factor * num_tokens", "return math.floor(self.capacity_factor * num_tokens",
           (CAPACITY,)),
    Mutant("capacity-position", "packages/par-moe/src/par_moe/capacity.py",
           "kept = routed & (routed.long().cumsum(0) <= capacity)", "kept = routed & (routed.long().cumsum(0) < capacity)",
           (CAPACITY,)),
    Mutant("switch-balance", "packages/par-moe/src/par_moe/losses.py",
           "return coeff * num_experts * (f * probs.sum(0)).sum() / total_tokens",
           "return coeff * (f * probs.sum(0)).sum() / total_tokens", (MOE_REF, f"{PLAIN}[moe]")),
    Mutant("bias-update", "packages/par-moe/src/par_moe/layer.py",
           "delta = torch.sign(load.mean() - load) * self.config.bias_update_rate",
           "delta = torch.sign(load - load.mean()) * self.config.bias_update_rate", (f"{PLAIN}[moe]",)),
    Mutant("seq-aux-mean", "packages/par-moe/src/par_moe/losses.py",
           "return coeff * per_sequence.mean()", "return coeff * per_sequence.sum()",
           (f"{MEGATRON}::test_layer_losses_and_their_gradients_match_megatron",)),
    Mutant("z-loss-scale", "packages/par-moe/src/par_moe/losses.py",
           "return coeff * torch.logsumexp(logits, dim=-1).square().sum() / total_tokens",
           "return coeff * torch.logsumexp(logits, dim=-1).square().mean() / total_tokens",
           (f"{MEGATRON}::test_layer_losses_and_their_gradients_match_megatron",)),
    Mutant("bias-sign-megatron", "packages/par-moe/src/par_moe/layer.py",  # bias-update's bug, the outside oracle's test
           "delta = torch.sign(load.mean() - load) * self.config.bias_update_rate",
           "delta = -torch.sign(load.mean() - load) * self.config.bias_update_rate",
           (f"{MEGATRON}::test_bias_update_matches_megatron_get_updated_expert_bias",)),
    Mutant("router-ties", "packages/par-moe/src/par_moe/router.py",
           "return select.sort(dim=-1, descending=True, stable=True).indices[:, : c.top_k]",
           "return select.topk(c.top_k, dim=-1).indices",
           ("packages/par-moe/tests/test_dispatch_and_balance.py::test_tied_scores_go_to_the_lower_expert_index",)),
    Mutant("cp-balance", "apps/pretrain/src/pretrain/training/dynamic_cp.py",
           'max_seq_per_rank, width, balance="compute")', 'max_seq_per_rank, width, balance="tokens")',
           ("tests/test_dynamic_cp.py::test_dynamic_cp_balances_attention_work_not_tokens",)),
    Mutant("zero1-restore", "packages/par-zero/src/par_zero/bucket.py",
           "keep = self.opt_grad * self.dp_size", "keep = self.opt_grad", (ZERO,)),
    Mutant("zero2-second-reduce", "packages/par-zero/src/par_zero/bucket.py",
           "self._opt_grad.add_(out)", "self._opt_grad.copy_(out)", (ZERO,)),
    # expert re-placement (issue 51): a moved expert leaves its AdamW moments behind; its slots' global rows undeclared
    Mutant("replace-state-left-behind", "packages/par-zero/src/par_zero/move_rows.py",
           "moved, kinds = 0, tuple(dp.optimizer.state_kinds())", "moved, kinds = 0, ()", (REPLACE,)),
    Mutant("replace-rows-undeclared", "packages/par-moe/src/par_moe/experts.py",
           "place_rows_(w, experts)", "place_rows_(w, tuple(sorted(experts)))", (REPLACE,)),
    Mutant("replace-local-counts", "apps/pretrain/src/pretrain/model/replace.py",  # each rank packs by its own tokens (maps differ)
           "comm.all_reduce(load, self.load_group)", "load = load.clone()", (REPLACE,)),
]


def run_tests(tests: tuple[str, ...], timeout: int) -> tuple[str, str]:
    """(verdict, first failing test) of one pytest run of ``tests`` (its own process group)."""
    env = dict(os.environ, PAR_TEST_TIMEOUT=os.environ.get("PAR_TEST_TIMEOUT", "600"))
    cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *tests]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except BaseException:  # Ctrl-C, SIGTERM or the timeout: stop the whole pytest group, then go on out
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        raise
    failed = re.findall(r"^FAILED (\S+)", out, re.M) or re.findall(r"^ERROR (\S+)", out, re.M)
    if proc.returncode == 1:
        return "caught", failed[0] if failed else "?"
    if proc.returncode == 0:
        return "survived", ""
    return "error", f"pytest exit {proc.returncode}: " + (out.strip().splitlines() or ["no output"])[-1]


def apply_and_run(m: Mutant, timeout: int) -> tuple[str, str]:
    path = ROOT / m.path
    original = path.read_text()
    if original.count(m.old) != 1:
        return "error", f"{m.path}: the text to mutate occurs {original.count(m.old)} times, not once"
    try:
        path.write_text(original.replace(m.old, m.new))
        return run_tests(m.tests, timeout)
    finally:
        path.write_text(original)


def _sigterm(signum, frame):
    raise KeyboardInterrupt


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("names", nargs="*", help="mutants to run (default: all)")
    ap.add_argument("--list", action="store_true", help="list the mutants and their tests")
    ap.add_argument("--timeout", type=int, default=1200, help="seconds per mutant's pytest run")
    args = ap.parse_args()
    by_name = {m.name: m for m in MUTANTS}
    unknown = [n for n in args.names if n not in by_name]
    if unknown:
        print(f"error: unknown mutant(s) {unknown}; known: {', '.join(by_name)}", file=sys.stderr)
        return 2
    chosen = [by_name[n] for n in args.names] or MUTANTS
    if args.list:
        for m in chosen:
            print(f"{m.name}: {m.path}: {m.old!r} -> {m.new!r}\n    {' '.join(m.tests)}")
        return 0
    signal.signal(signal.SIGTERM, _sigterm)
    results = []
    try:
        for m in chosen:
            start = time.monotonic()
            verdict, detail = apply_and_run(m, args.timeout)
            results.append((m.name, verdict))
            print(f"{m.name:22s} {verdict:8s} {time.monotonic() - start:6.1f}s  {detail}", flush=True)
    except KeyboardInterrupt:
        print("interrupted: the mutated file is restored", file=sys.stderr)
        return 130
    caught = sum(v == "caught" for _, v in results)
    print(f"caught {caught} of {len(results)}; survived: {[n for n, v in results if v == 'survived']}; "
          f"errors: {[n for n, v in results if v == 'error']}")
    return 0 if caught == len(results) else 1


if __name__ == "__main__":
    sys.exit(main())
