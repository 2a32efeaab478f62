"""The ``[model]`` section: a Llama-3-style decoder, MoE (DeepSeek-style) and MLA options."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from functools import cached_property

from .rules import MAX_SIZES, _at_most, _choice, _need, _positive
from ..blocks.rope_scaling import check_rope_scaling
from ..models import ATTENTIONS, family_of

BACKENDS = ("torch", "te")  # who computes the layers' matmuls and attention: PyTorch or Transformer Engine
ATTENTION_BACKENDS = ("auto", "flash", "sdpa", "torch")  # the attention kernel (auto: flash-attn, else SDPA, else pure PyTorch)
RECOMPUTE = ("none", "selective", "full")
SCORE_FUNCS = ("softmax", "sigmoid")
DISPATCHERS = ("alltoall", "allgather", "alltoall_padded")
EXPERT_BALANCES = ("none", "replicate", "replicate+replace")
GROUP_SCORES = ("top2", "top_k_per_group")


def _validate_route_nodes(m) -> None:
    M = m.max_route_nodes
    _need(m.n_groups > 1, f"[model].max_route_nodes={M} needs n_groups > 1: the nodes the experts are spread over, "
                          f"one expert group per node (DeepSeek-V3: n_groups = 8, max_route_nodes = 4)")
    _need(M <= m.n_groups, f"[model].max_route_nodes={M} must be in 1..n_groups={m.n_groups}")
    _need(m.group_score != "top_k_per_group" or m.top_k % M == 0,
          f"[model].max_route_nodes={M} must divide top_k={m.top_k} (with group_score='top_k_per_group' a node is "
          f"scored by the sum of its top top_k/max_route_nodes experts)")
    _need(m.topk_groups in (1, M), f"[model].max_route_nodes={M} and topk_groups={m.topk_groups} set the same "
                                   f"limit; set only max_route_nodes")


def _check_recompute(m) -> None:
    from ..blocks.recompute_policy import MODULES, parse_item

    if isinstance(m.recompute, str):
        _choice("[model].recompute", m.recompute, RECOMPUTE)
        return
    object.__setattr__(m, "recompute", tuple(m.recompute))  # a list once read from JSON
    last = m.layers + m.mtp_depth - 1
    for text in m.recompute:
        item = parse_item(text) if isinstance(text, str) else None
        _need(item is not None, f"[model].recompute item {text!r} is not module[@first[-last]] with a module of "
                                f"{', '.join(MODULES)}, e.g. \"mlp\" or \"full@0-7\"")
        name, first, end = item
        _need(first <= last and (end is None or end <= last),
              f"[model].recompute item {text!r} names layers past the model's 0..{last}")
        _need(name != "mla_up_proj" or "mla_up_proj" in family_of(m).supports,
              f"[model].recompute item {text!r} needs a latent attention (attention={m.attention!r} has no up-projections)")
        _need(name not in ("moe", "moe_act") or m.num_experts > 0,
              f"[model].recompute item {text!r} needs MoE layers (num_experts > 0)")


def _check_offload(m) -> None:
    from ..blocks.offload_policy import MODULES, parse_item

    object.__setattr__(m, "offload", tuple(m.offload))  # a list once read from JSON
    for text in m.offload:
        item = parse_item(text) if isinstance(text, str) else None
        _need(item is not None, f"[model].offload item {text!r} is not module[@first[-last]] with a module of "
                                f"{', '.join(MODULES)}, or layers:N (N >= 1), e.g. \"mlp\" or \"layers:2\"")
        name, first, end = item
        _need(name == "layers" or (first < m.layers + m.mtp_depth and (end is None or end < m.layers + m.mtp_depth)),
              f"[model].offload item {text!r} names layers past the model's 0..{m.layers + m.mtp_depth - 1}")


@dataclass(frozen=True)
class ModelConfig:
    """A Llama-3-style decoder; MoE layers (DeepSeek-style) from ``moe_layers_start`` on when num_experts > 0."""

    flavor: str = ""  # a shipped config's [model] to start from (config/flavors.py), e.g. "llama3-8b", torchtitan's "8B"
    vocab_size: int = 256
    # Megatron's --make-vocab-size-divisible-by: the embedding and head get rows up to a multiple of
    # 128 x tp (0, the default) or of this fixed number (a multiple of tp); the padded logits are
    # masked out of the loss and checkpoints / exports hold vocab_size rows (see model/vocab.py)
    vocab_pad_to: int = 0
    hidden: int = 64
    layers: int = 8
    heads: int = 8
    kv_heads: int = 4
    ffn_hidden: int = 128
    kv_channels: int = 0  # the width of one attention head (Megatron's --kv-channels, HF head_dim); 0 = hidden/heads
    qk_norm: bool = False  # RMSNorm over each query and key head before RoPE (Qwen3's q_norm / k_norm)
    rope_theta: float = 10000.0
    # RoPE scaling with transformers' keys, e.g. {rope_type = "llama3", factor = 8.0, low_freq_factor = 1.0,
    # high_freq_factor = 4.0, original_max_position_embeddings = 8192}; {} = plain RoPE (blocks/rope_scaling.py)
    rope_scaling: dict = field(default_factory=dict)
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    init_std: float = 0.02
    # Megatron's --hidden-dropout on each block's attention and MLP outputs, its mask a hash of the element's
    # global sample, token and channel (blocks/dropout.py), so it trains as one rank would; 0 = off
    hidden_dropout: float = 0.0
    # Megatron's --attention-dropout on the attention probabilities, masks drawn the same way; it writes the
    # attention out (S x S probabilities per head), not the fused kernels; 0 = off
    attention_dropout: float = 0.0
    # none | selective | full, or a list of modules, each for every layer or a range of them:
    # ["core_attn", "mlp@0-15", "full@16-31"] (blocks/recompute.py)
    recompute: str | tuple[str, ...] = "none"
    # modules whose saved activations wait in host memory for their backward: attn, mlp, moe, layernorm,
    # layer, each for every layer or "name@first-last", or "layers:N" (the first N of each chunk) (model/offload.py)
    offload: tuple[str, ...] = ()
    moe_layers_start: int = 0
    num_experts: int = 0
    # Qwen3-MoE's layer pattern: layer i has experts iff (i + 1) % decoder_sparse_step == 0 and i is not in
    # mlp_only_layers (and i >= moe_layers_start)
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    top_k: int = 2
    moe_ffn_hidden: int = 0  # 0 = ffn_hidden
    shared_experts: int = 0
    score_func: str = "softmax"
    n_groups: int = 1
    topk_groups: int = 1
    # a group's score: the sum of its top 2 scores (DeepSeek-V3's code, transformers) or of its top
    # top_k/topk_groups (top_k_per_group: the DeepSeek-V3 paper's node score)
    group_score: str = "top2"
    # Node-limited routing (DeepSeek-V3): the n_groups expert groups are nodes (one group per node of
    # the EP group) and a token's experts span at most this many; sets topk_groups. 0 = off.
    max_route_nodes: int = 0
    routed_scaling: float = 1.0
    aux_loss_coeff: float = 0.0
    seq_aux_loss_coeff: float = 0.0  # sequence-wise balancing loss (DeepSeek-V3); layout-independent
    z_loss_coeff: float = 0.0
    bias_update_rate: float = 0.0
    capacity_factor: float = 0.0  # 0 = no token dropping
    dispatcher: str = "alltoall"
    # "replicate": every EP rank computes at most ceil(pairs / ep) (token, expert) pairs, hot experts'
    # excess on replicas fetched from their home ranks (par_moe.balance); at most this many per rank
    expert_balance: str = "none"
    max_replicas_per_rank: int = 2
    # replicas stay in their home rank's NVLink domain ([topology] / NVML), each domain balanced alone;
    # true lets the rest cross to other domains. Off by default as MoonEP (one NVLink domain) and
    # DeepSeek's node-limited routing keep expert traffic off the slower inter-node network; with one
    # domain (one node, a CPU run) it changes nothing
    replicate_across_domains: bool = False
    # "replicate+replace": also re-place experts onto EP ranks by their load every this many steps
    # (pretrain.model.replace), moving their weights and optimizer state
    replace_every: int = 100
    # divide the chosen experts' scores by their sum (HF's norm_topk_prob); unset: with sigmoid scores only
    norm_topk_prob: bool | None = None
    # the model family, named by its attention (pretrain.models): gqa (Llama, Qwen3, Mixtral, Qwen3-MoE), mla
    # (DeepSeek-V2/V3's multi-head latent attention, with the five keys below) or qwen3_next (Gated DeltaNet hybrid)
    attention: str = "gqa"
    q_lora_rank: int = 0  # 0 = a full-rank q_proj
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    # [model].attention qwen3_next (the Qwen3-Next hybrid): a gated full-attention layer every this many layers, the
    # rest Gated DeltaNet (linear attention; pretrain/models/qwen3_next) with these heads, widths and conv taps
    full_attention_interval: int = 4
    linear_key_heads: int = 4
    linear_value_heads: int = 8
    linear_key_dim: int = 16
    linear_value_dim: int = 16
    conv_kernel: int = 4
    partial_rotary_factor: float = 1.0  # the share of each full-attention head's channels RoPE turns
    # Multi-token prediction (DeepSeek-V3): mtp_depth sequential modules, loss added with this weight
    mtp_depth: int = 0
    mtp_loss_weight: float = 0.1
    backend: str = "torch"  # te = Transformer Engine layers and attention (CUDA, optional)
    attention_backend: str = "auto"  # auto | flash | sdpa | torch: the attention kernel

    def __hash__(self) -> int:  # the planner caches by config; rope_scaling is the one dict field
        cached = self.__dict__.get("_hash")
        if cached is None:  # once per object: the planner's search hashes the same config 10^5 times
            cached = hash(tuple(sorted(self.rope_scaling.items())) + tuple(
                getattr(self, f.name) for f in fields(self) if f.name != "rope_scaling"))
            self.__dict__["_hash"] = cached  # beside the fields, as functools.cached_property stores
        return cached

    def __getstate__(self) -> dict:  # the fields only: a string's hash differs in another process
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def __post_init__(self) -> None:
        _choice("[model].backend", self.backend, BACKENDS)
        _choice("[model].attention_backend", self.attention_backend, ATTENTION_BACKENDS)
        _positive("model", self, "vocab_size", "hidden", "layers", "heads", "kv_heads", "ffn_hidden", "decoder_sparse_step")
        _positive("model", self, "kv_channels", allow_zero=True)
        _at_most("model", self, MAX_SIZES)
        object.__setattr__(self, "mlp_only_layers", tuple(self.mlp_only_layers))  # a list once read from JSON
        _need(all(0 <= i < self.layers for i in self.mlp_only_layers),
              f"[model].mlp_only_layers={list(self.mlp_only_layers)} must be layer indices in 0..{self.layers - 1}")
        check_rope_scaling(self.rope_scaling)
        _choice("[model].group_score", self.group_score, GROUP_SCORES)
        _positive("model", self, "vocab_pad_to", "moe_layers_start", "num_experts", "moe_ffn_hidden", "shared_experts", "mtp_depth",
                  allow_zero=True)
        _choice("[model].attention", self.attention, ATTENTIONS)
        _need(self.heads % self.kv_heads == 0,
              f"[model].kv_heads={self.kv_heads} does not divide heads={self.heads} (grouped-query attention)")
        family_of(self).check(self)  # the attention's own keys (models/<family>/)
        for name in ("mtp_loss_weight", "aux_loss_coeff", "seq_aux_loss_coeff", "z_loss_coeff", "bias_update_rate"):
            _need(getattr(self, name) >= 0, f"[model].{name}={getattr(self, name)} must be >= 0")
        _need(self.routed_scaling > 0, f"[model].routed_scaling={self.routed_scaling} must be > 0")
        _need(self.init_std > 0 and self.norm_eps > 0 and self.rope_theta > 0,
              "[model].init_std, norm_eps and rope_theta must be > 0")
        _need(0 <= self.hidden_dropout < 1, f"[model].hidden_dropout={self.hidden_dropout} must be in [0, 1)")
        _need(0 <= self.attention_dropout < 1, f"[model].attention_dropout={self.attention_dropout} must be in [0, 1)")
        _check_recompute(self)
        _check_offload(self)
        _choice("[model].score_func", self.score_func, SCORE_FUNCS)
        _choice("[model].dispatcher", self.dispatcher, DISPATCHERS)
        _choice("[model].expert_balance", self.expert_balance, EXPERT_BALANCES)
        _need(self.max_replicas_per_rank >= 1, f"[model].max_replicas_per_rank={self.max_replicas_per_rank} must be >= 1")
        _need(self.replace_every >= 1, f"[model].replace_every={self.replace_every} must be >= 1 (steps between "
                                       f"re-placements of expert_balance='replicate+replace')")
        _positive("model", self, "max_route_nodes", allow_zero=True)
        if self.num_experts and self.max_route_nodes:
            _validate_route_nodes(self)
            object.__setattr__(self, "topk_groups", self.max_route_nodes)  # the same rule, under its node name
        if self.num_experts:
            _need(1 <= self.top_k <= self.num_experts,
                  f"[model].top_k={self.top_k} must be in 1..num_experts={self.num_experts}")
            _need(self.n_groups >= 1 and self.num_experts % self.n_groups == 0,
                  f"[model].n_groups={self.n_groups} does not divide num_experts={self.num_experts}")
            _need(1 <= self.topk_groups <= self.n_groups,
                  f"[model].topk_groups={self.topk_groups} must be in 1..n_groups={self.n_groups}")
            per_group = self.num_experts // self.n_groups
            _need(self.top_k <= self.topk_groups * per_group,
                  f"[model].top_k={self.top_k} exceeds the {self.topk_groups * per_group} experts in topk_groups="
                  f"{self.topk_groups} groups of {per_group}")
            _need(self.n_groups == 1 or self.group_score != "top_k_per_group" or self.top_k % self.topk_groups == 0,
                  f"[model].topk_groups={self.topk_groups} must divide top_k={self.top_k} (a group is scored by the "
                  f"sum of its top top_k/topk_groups experts)")
            _need(self.capacity_factor >= 0, f"[model].capacity_factor={self.capacity_factor} must be >= 0 (0 = no drop)")

    def padded_vocab(self, tp: int) -> int:
        """Rows of the embedding and output head under ``tp``: vocab_size rounded up to a multiple of
        128 x tp (vocab_pad_to = 0, Megatron's default) or of vocab_pad_to."""
        multiple = self.vocab_pad_to or 128 * tp
        return -(-self.vocab_size // multiple) * multiple

    @property
    def head_dim(self) -> int:
        return self.kv_channels or self.hidden // self.heads

    @property
    def normalize_topk(self) -> bool:
        """Whether the chosen experts' weights are divided by their sum (``norm_topk_prob``, unset: sigmoid only)."""
        return self.score_func == "sigmoid" if self.norm_topk_prob is None else self.norm_topk_prob

    @property
    def qk_head_dim(self) -> int:
        """Query/key width per head, as the attention family says."""
        return family_of(self).qk_head_dim(self)

    @property
    def expert_ffn_hidden(self) -> int:
        return self.moe_ffn_hidden or self.ffn_hidden

    @property
    def is_moe(self) -> bool:
        return self.num_moe_layers > 0

    @cached_property  # the planner asks per candidate layout and stage
    def num_moe_layers(self) -> int:
        return sum(self.is_moe_layer(i) for i in range(self.layers))

    def is_moe_layer(self, index: int) -> bool:
        """Layer ``index`` (0-based) has routed experts: the first ``moe_layers_start`` layers stay dense, and
        so do ``mlp_only_layers`` and those not on the ``decoder_sparse_step`` pattern (MTP layers: always)."""
        if not self.num_experts or index < self.moe_layers_start:
            return False
        return index >= self.layers or (index not in self.mlp_only_layers and (index + 1) % self.decoder_sparse_step == 0)
