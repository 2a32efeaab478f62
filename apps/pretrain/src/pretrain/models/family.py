"""What a model family declares, once: the base every ``models/<family>/`` folder's ``FAMILY`` fills in.

A family is the attention of a decoder layer and what follows from it; the rest of a layer (norms,
dense SwiGLU or MoE MLP, MTP modules, embedding and head) is common to every family. The app asks
the family of a config (``pretrain.models.family_of``) instead of comparing names:

* config: the ``[model]`` keys only it reads (:attr:`Family.keys`) and their checks (:meth:`check`);
* shapes and placements: its attention tensors' full shapes by HF name (:meth:`attention_shapes`; a MoE
  layer's own extra tensors: :meth:`moe_shapes`, built by :meth:`build_moe`),
  which of them tensor parallelism splits (:attr:`tp_split`), the modules built from them
  (:meth:`build_attention`) and their state-dict names where they differ (:attr:`renames`); initial weights, checkpoints and parameter counts read the shapes;
* sizing: the attention's FLOP widths and core FLOPs (:meth:`value_width`, :meth:`core_flops_per_token`),
  activation bytes (:meth:`saved_bytes`, :meth:`backward_bytes`, :meth:`ring_widths`, :meth:`junction_bytes`), its experts' (:attr:`expert_act_widths`);
* certify: how its widths narrow (:meth:`narrowing`) and how many layers keep every kind (:meth:`layer_period`);
* Hugging Face: the ``model_type`` values it reads and writes, config keys and tensor names both
  ways (:meth:`model_config_from_hf`, :meth:`hf_config`, :meth:`from_hf_names`, :meth:`to_hf_names`);
* layouts: the parallel dimensions (:attr:`dimensions`) and optional features (:attr:`supports`)
  it runs; a layout needing one it lacks is one ``error:`` line naming ``[model].attention``.
"""

from __future__ import annotations

from ..errors import UsageError

# The optional features a family may run, and the parallel dimensions it may be split over (dp / ZeRO: always).
FEATURES = ("dynamic_cp", "attention_dropout", "muon_qk_clip", "te_norm_fusion", "mla_up_proj")
DIMENSIONS = ("tp", "cp", "pp", "ep")


def need(ok: bool, message: str) -> None:
    if not ok:
        raise UsageError(message)


class Family:
    attention: str = ""  # the [model].attention value that selects it
    keys: tuple[str, ...] = ()  # [model] keys only this family reads
    supports: frozenset[str] = frozenset()  # of FEATURES
    dimensions: tuple[str, ...] = DIMENSIONS  # the parallel dimensions its layers run split over
    cp_comm_types: tuple[str, ...] = ("p2p", "a2a", "allgather", "a2a+p2p")  # the [parallel].cp_comm_type values it runs
    tp_split: tuple[str, ...] = ()  # attention tensors (last two name parts) split over tp by heads
    kv_split: tuple[str, ...] = ()  # ... by KV heads when tp divides them (else one KV head a rank)
    renames: dict[str, str] = {}  # its modules' state-dict names (below "layers.<i>.") that differ from the HF names
    hf_architectures: dict[str, str] = {}  # transformers model_type -> architecture it reads and writes
    # F-wide rows a routed pair's expert activation keeps for backward (the planner's MoE bytes): par-moe's
    # SwiGLU keeps gate, up, silu(gate) and the product w_down reads
    expert_act_widths: int = 4

    def check(self, m) -> None:
        """The ``[model]`` keys' rules under this family (one UsageError line)."""

    def check_layout(self, cfg) -> None:
        """What this family's modules need of the whole run config (``[parallel]``, ``[data]``): one UsageError line."""

    def qk_head_dim(self, m) -> int:
        """Query/key width of one head."""
        raise NotImplementedError

    def value_width(self, m) -> int:
        """Value width of one head (attention's second matmul)."""
        raise NotImplementedError

    def attention_shapes(self, m, prefix: str) -> dict[str, tuple[int, ...]]:
        """Full shapes of one layer's attention tensors, HF names under ``prefix`` (``model.layers.{i}.self_attn.``)."""
        raise NotImplementedError

    def build_attention(self, config, context, index: int):
        """This rank's attention module of layer ``index`` (``blocks.context.ChunkContext``)."""
        raise NotImplementedError

    def moe_shapes(self, m, prefix: str) -> dict[str, tuple[int, ...]]:
        """Full shapes of a MoE layer's own tensors besides the common router and experts (HF names under
        ``prefix``, ``model.layers.{i}.mlp.``); they are built by :meth:`build_moe`."""
        return {}

    def build_moe(self, moe_config, *args, **kwargs):
        """This rank's MoE layer (``par_moe.MoELayer``'s arguments)."""
        from par_moe import MoELayer

        return MoELayer(moe_config, *args, **kwargs)

    def core_flops_per_token(self, m, seq_len: int) -> float:
        """Per token, every layer together, forward + backward: the attention's matmuls between activations
        (its weights' are counted from the shapes): causal softmax attention's scores over the query/key width
        and values over the value width, half of the full square."""
        return 3.0 * m.layers * seq_len * m.heads * (m.qk_head_dim + self.value_width(m))

    def saved_bytes(self, m, layout, recompute: str, pb: int) -> float:
        """Per token: what the attention keeps for backward (``sizing.activations``)."""
        raise NotImplementedError

    def backward_bytes(self, m, layout, i: int, recomputed: bool, pb: int) -> float:
        """Per token: what layer ``i``'s attention holds in its backward beyond its kept set
        (``saved_bytes``; ``selective``'s where ``recomputed``), once the MLP's saved set is freed: a
        recomputed core's rerun and the backward's working set. 0: small beside the MLP's working set
        (``sizing.activations``; the ring's under context parallelism is counted there)."""
        return 0.0

    def ring_widths(self, m, layout) -> tuple[float, float]:
        """Per token on one tp rank: the (q, kv) widths context parallelism moves."""
        raise NotImplementedError

    def junction_bytes(self, m, layout, pb: int, share: int) -> float:
        """Per token: the projections' output gradients a split backward records for its W."""
        raise NotImplementedError

    def tp_split_widths(self, m, tp: int) -> list[tuple[str, int]]:
        """(what, full width) of each attention feature dim that ``tp`` ranks split (a tile-scaled FP8
        recipe's tiles must not straddle them)."""
        raise NotImplementedError

    def recurrent_state(self, m, layout, micro_batch: int, pb: int = 4, cp_comm_type: str = "p2p") -> dict:
        """``plan``'s figures of the layers that carry a recurrent state along the sequence (its bytes, what
        context parallelism of ``cp_comm_type`` passes between ranks; ``pb``: bytes of the compute dtype);
        empty for a family without such layers."""
        return {}

    def narrowing(self, m, head_width: int) -> list[str]:
        """``--set`` items that narrow the attention to about ``head_width`` channels a head (certify)."""
        return []

    def layer_kind(self, m, i: int) -> int:
        """Which of its kinds of attention layer ``i`` has (sizing counts one layer of each kind); one kind: 0."""
        return 0

    def layer_period(self, m) -> int:
        """Layers in one repeat of its pattern of layer kinds: certify keeps at least one whole repeat."""
        return 1

    def model_config_from_hf(self, hf: dict, where: str) -> dict:
        """Our ``[model]`` keys for a transformers ``config.json`` (what it cannot read: one UsageError line)."""
        raise NotImplementedError

    def hf_config(self, m) -> dict:
        raise NotImplementedError

    def from_hf_names(self, state: dict, m, hf: dict) -> tuple[object, dict]:
        """(the config, the state under our names) of a released state dict."""
        raise NotImplementedError

    def to_hf_names(self, state: dict, m) -> dict:
        raise NotImplementedError
