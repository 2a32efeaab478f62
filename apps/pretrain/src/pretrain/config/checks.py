"""The rules that span config sections, one function per concern, each rule written once.

``Config.validate`` runs :data:`CROSS_SECTION_RULES` in order; a section's own rules live in its
``__post_init__`` (``model_section``, ``parallel_section``, ``train_section``, ``sections``), and
what depends on the number of ranks in ``Config.validate_world``. Every rule is one :class:`~pretrain.errors.UsageError` line naming
the keys and what would be valid.
"""

from __future__ import annotations

from par_zero import check_optimizer_choice

from .fault_rules import fault_tolerance_rules
from .rules import _divisors, _need
from .train_section import PAR_FP8, TE_FP8
from ..errors import UsageError
from ..models import family_of


def family_rules(cfg) -> None:
    """A model family runs split over the parallel dimensions its declaration lists (``pretrain.models``)."""
    m, p = cfg.model, cfg.parallel
    family = family_of(m)
    bad = [f"{d}={getattr(p, d)}" for d in ("tp", "cp", "pp", "ep") if getattr(p, d) > 1 and d not in family.dimensions]
    _need(not bad, f"[model].attention={m.attention!r} does not run with [parallel].{', '.join(bad)}: its family runs "
                   f"split over {', '.join(family.dimensions) or 'data parallelism only'}; set the others to 1")
    _need(p.cp == 1 or p.cp_comm_type in family.cp_comm_types,
          f"[parallel].cp_comm_type={p.cp_comm_type!r} does not run with [model].attention={m.attention!r}; its family "
          f"runs {', '.join(family.cp_comm_types)}")
    family.check_layout(cfg)


def moe_rules(cfg) -> None:
    """Expert parallelism needs MoE layers whose experts it divides (and whole node groups)."""
    m, p = cfg.model, cfg.parallel
    _need(m.is_moe or p.ep == 1, f"[parallel].ep={p.ep} needs MoE layers ([model].num_experts > 0 and "
                                 f"moe_layers_start < layers)")
    if m.is_moe:
        _need(m.num_experts % p.ep == 0, f"[parallel].ep={p.ep} does not divide [model].num_experts={m.num_experts}")
        _need(not m.max_route_nodes or p.ep % m.n_groups == 0 or m.n_groups % p.ep == 0,
              f"[model].max_route_nodes needs each of the n_groups={m.n_groups} node groups of experts on whole "
              f"EP ranks: n_groups must divide [parallel].ep={p.ep} or be a multiple of it")
        expert_balance_rules(cfg)


# expert_balance = "replicate" is tested (tests/test_layouts_expert_balance.py) with the all-to-all
# and all-gather dispatchers, ep x dp, ep x tp (etp 1 and 2), pp, cp and ZeRO-0/1/2/3; torch_fsdp2
# runs with ep = 1 only (data_parallel_rules), where there is nothing to balance. "replicate+replace"
# (re-placement) is tested with both dispatchers, tp x ep with etp 1 and 2, cp, pp (1F1B) and ZeRO-0/1/2.
# Refused: ZeRO-3 / FSDP2 (the rows to move are sharded flat over the data-parallel ranks).
def expert_balance_rules(cfg) -> None:
    m, p = cfg.model, cfg.parallel
    _need(m.expert_balance == "none" or m.dispatcher != "alltoall_padded",
          f"[model].expert_balance={m.expert_balance!r} is not supported with [model].dispatcher='alltoall_padded': "
          "the padded dispatcher already computes the same padded slots on every EP rank, so there is nothing to "
          "balance; use dispatcher='alltoall' or 'allgather'")
    if m.expert_balance == "replicate+replace":  # its own limits: it moves whole expert rows with their state
        refused = {f"[parallel].zero={p.zero!r}": p.zero in ("optim_grads_params", "torch_fsdp2")}
        bad = [k for k, v in refused.items() if v]
        _need(not bad, f"[model].expert_balance='replicate+replace' is not supported with {', '.join(bad)}: it moves "
                       f"whole expert rows with their optimizer state, tested with zero no_shard/optim/optim_grads")


def tensor_parallel_rules(cfg) -> None:
    """TP splits the heads and the (padded) vocabulary."""
    m, p = cfg.model, cfg.parallel
    _need(m.heads % p.tp == 0, f"[parallel].tp={p.tp} does not divide [model].heads={m.heads}; "
                               f"use one of {_divisors(m.heads)}")
    _need(m.kv_heads % p.tp == 0 or p.tp % m.kv_heads == 0,
          f"[parallel].tp={p.tp} and [model].kv_heads={m.kv_heads}: one must divide the other "
          f"(kv heads are split over tp, or replicated when fewer than tp)")
    padded = m.padded_vocab(p.tp)
    _need(padded % p.tp == 0, f"[model].vocab_size={m.vocab_size} padded to a multiple of vocab_pad_to={m.vocab_pad_to} "
          f"is {padded} rows, which [parallel].tp={p.tp} does not divide: use vocab_pad_to = 0 (Megatron's "
          f"128 x tp) or a multiple of {p.tp}")
    _need(not p.tp_comm_overlap or m.backend == "torch",
          "[parallel].tp_comm_overlap=true runs par-tp's own ring matmuls: use [model].backend='torch' "
          "(Transformer Engine overlaps with its own userbuffers)")


def pipeline_rules(cfg) -> None:
    """The layers split over pp x chunks per rank, evenly or as the uneven stages say."""
    m, p = cfg.model, cfg.parallel
    chunks = p.pp * p.chunks_per_rank
    if p.uneven:
        _need(p.pp > 1, f"[parallel].first_stage_layers/last_stage_layers need pp >= 2 (got pp={p.pp}); leave them at 0")
        p.chunk_layers(m.layers)  # raises the one-line error when the sizes do not add up
    else:
        _need(m.layers % chunks == 0,
              f"[model].layers={m.layers} is not divisible by pp*{'vpp' if p.vpp > 1 else 'chunks'}={p.pp}*"
              f"{p.chunks_per_rank}={chunks}; or set [parallel].first_stage_layers/last_stage_layers")


def context_parallel_rules(cfg) -> None:
    """CP's all-to-all splits heads; load-balanced causal CP splits the sequence in 2 x cp chunks."""
    m, p, t = cfg.model, cfg.parallel, cfg.train
    if p.cp_comm_type in ("a2a", "a2a+p2p") and p.cp > 1:
        a2a = p.hcp[0] if p.hcp else p.cp
        for name, heads in (("heads", m.heads), ("kv_heads", m.kv_heads)):
            local = max(heads // p.tp, 1)
            _need(local % a2a == 0, f"[parallel].cp_comm_type={p.cp_comm_type!r} splits heads over {a2a} ranks, "
                                    f"which does not divide the {local} [model].{name} per tp rank")
    _need(t.seq_len % p.cp == 0 and (p.cp == 1 or t.seq_len % (2 * p.cp) == 0),
          f"[train].seq_len={t.seq_len} must be divisible by 2*cp={2 * p.cp} (load-balanced causal CP)")


def kernel_rules(cfg) -> None:
    """FP8 runs in Transformer Engine; compile needs the torch blocks and fixed masks."""
    m, p, t = cfg.model, cfg.parallel, cfg.train
    _need(t.fp8 not in TE_FP8 or m.backend == "te",
          f"[train].fp8={t.fp8!r} runs in Transformer Engine's layers: set [model].backend='te' (or fp8='off'); "
          f"par's own FP8 on the torch layers is one of {', '.join(PAR_FP8)}, scaled from each tensor's current "
          f"amax only (delayed scaling's amax history would mix ranks and micro-batches)")
    _need(t.fp8 not in PAR_FP8 or (m.backend == "torch" and not p.tp_comm_overlap and not t.compile),
          f"[train].fp8={t.fp8!r} is par's own FP8 in the torch layers' local matmuls: not with [model].backend='te' "
          f"(use fp8='delayed' or 'current' there), [parallel].tp_comm_overlap (its overlapped matmuls) or "
          f"[train].compile; turn those off")
    _need(not t.fp8_param_gather or t.fp8 in ("tensorwise", "blockwise"),
          f"[train].fp8_param_gather=true gathers one FP8 quantization of each weight for its forward and "
          f"input gradient: fp8={t.fp8!r} has none; use fp8='tensorwise' or 'blockwise' (or fp8_param_gather=false)")
    _need(not t.fp8_param_gather or p.zero == "optim_grads_params",
          f"[train].fp8_param_gather=true is ZeRO-3's parameter all-gather in FP8: [parallel].zero={p.zero!r} "
          f"gathers no parameters before use; use zero='optim_grads_params' (or fp8_param_gather=false)")
    _need(not t.compile or (m.backend == "torch" and not cfg.data.packed and not p.dynamic_cp),
          "[train].compile=true compiles the torch backend's blocks: not with [model].backend='te' nor packed "
          "documents ([data].document_mask/reset_position_ids/eod_mask_loss, [parallel].dynamic_cp: their masks "
          "follow each batch's document boundaries, which breaks the graph and recompiles); turn one off")


def data_parallel_rules(cfg) -> None:
    """torch's FSDP2 wraps plain data-parallel blocks; par-zero decides which optimizers a strategy runs."""
    m, p, t = cfg.model, cfg.parallel, cfg.train
    if p.zero == "torch_fsdp2":  # the one place this is checked
        _need(p.tp == p.pp == p.ep == 1 and not m.tie_embeddings,
              f"[parallel].zero='torch_fsdp2' runs with tp=1, pp=1, ep=1 and untied embeddings only (got tp={p.tp}, "
              f"pp={p.pp}, ep={p.ep}, tie_embeddings={str(m.tie_embeddings).lower()}); use optim_grads_params "
              f"(ZeRO-3) with them")
    try:  # the optimizer's declaration says which strategies it runs under
        check_optimizer_choice(p.zero, t.optimizer_declaration, {}, t.weight_decay)
    except ValueError as e:
        raise UsageError(f"[train].optimizer={t.optimizer!r} with [parallel].zero={p.zero!r}: {e}") from None


def data_rules(cfg) -> None:
    """The embedded data's vocabulary; what packed documents and dynamic CP run with."""
    m, p, d = cfg.model, cfg.parallel, cfg.data
    embedded_vocab = 257 if d.packed else 256  # with EOS when documents matter
    _need(d.train_sources or m.vocab_size >= embedded_vocab,
          f"[model].vocab_size={m.vocab_size} is smaller than the embedded byte-level data's {embedded_vocab}"
          f"{' (256 bytes and EOS: [data] document keys are set)' if d.packed else ''}")
    if p.dynamic_cp:
        _need(d.document_mask and not m.is_moe and "dynamic_cp" in family_of(m).supports,
              "[parallel].dynamic_cp=true needs [data].document_mask=true and a dense GQA model "
              "([model].num_experts=0, attention='gqa')")
    if d.packed:
        _need(not m.mtp_depth and m.backend != "te",
              f"[data].document_mask/reset_position_ids/eod_mask_loss do not run with "
              f"{'[model].mtp_depth > 0' if m.mtp_depth else '[model].backend=te'} yet; turn them off")


def qk_clip_rules(cfg) -> None:
    """QK-clip rescales GQA's W_q and W_k rows (blocks/qk_clip.py)."""
    m, p = cfg.model, cfg.parallel
    if cfg.train.muon_qk_clip > 0:
        _need("muon_qk_clip" in family_of(m).supports and not m.qk_norm and m.backend == "torch" and not p.dynamic_cp,
              f"[train].muon_qk_clip runs with attention='gqa', qk_norm=false (its norms undo the rescale), "
              f"backend='torch' and dynamic_cp=false (got attention={m.attention!r}, qk_norm={str(m.qk_norm).lower()}, "
              f"backend={m.backend!r}, dynamic_cp={str(p.dynamic_cp).lower()})")


def dropout_rules(cfg) -> None:
    """Dropout's masks are drawn per global sample, token and channel (blocks/dropout.py): the layouts that keep a
    block's [S, B, H] activation (and attention's whole sequence) on one rank (no tp, cp, ep), without MTP, compile
    or dynamic CP; attention dropout also with plain GQA on the torch backend and no packed documents."""
    m, p, t, d = cfg.model, cfg.parallel, cfg.train, cfg.data
    for key in ("hidden_dropout", "attention_dropout"):
        if getattr(m, key) > 0:
            bad = [f"{k}={v}" for k, v in (("tp", p.tp), ("cp", p.cp), ("ep", p.ep)) if v > 1]
            bad += [k for k, on in (("[model].mtp_depth > 0", m.mtp_depth), ("[train].compile", t.compile),
                                    ("[parallel].dynamic_cp", p.dynamic_cp)) if on]
            if key == "attention_dropout":
                bad += [k for k, on in ((f"[model].attention={m.attention!r}", "attention_dropout" not in family_of(m).supports),
                                        ("[model].backend='te'", m.backend == "te"),
                                        ("[data].document_mask", d.document_mask)) if on]
            _need(not bad, f"[model].{key}={getattr(m, key)} runs with data and pipeline parallelism only (tp, cp, ep = "
                           f"1, no MTP, compile or dynamic CP{'; GQA on the torch backend, no document_mask' if key == 'attention_dropout' else ''}), "
                           f"where its masks stay those of one rank; got {', '.join(bad)}: set {key} = 0 or drop them")


# Each error line is the one the former single Config.__post_init__ raised (the bad-input sweep checks them).
CROSS_SECTION_RULES = (family_rules, moe_rules, tensor_parallel_rules, pipeline_rules, context_parallel_rules, kernel_rules,
                       data_parallel_rules, data_rules, qk_clip_rules, dropout_rules, fault_tolerance_rules)
