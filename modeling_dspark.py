"""DSpark draft model: a parallel DFlash backbone, a low-rank Markov head and a confidence head.

One decoding round (see README, "How DSpark works"):
1. the target's outputs at `config.target_layer_ids` for every committed token are projected to context
   features `ctx = hidden_norm(fc(concat))`, and each draft layer caches K = RoPE(k_norm(k_proj(ctx))),
   V = v_proj(ctx) for them (`DSparkContextCache`);
2. the block `[anchor, mask x (S - 1)]` (S = block_size), embedded with the TARGET's embedding at positions
   p .. p + S - 1, attends bidirectionally to itself and to all cached context before the anchor;
3. the final-normed hidden row k predicts the token at p + k + 1 through the TARGET's LM head plus the
   Markov bias w2(w1[prev_k]) with prev_0 = anchor, prev_{k+1} = d_{k+1};
4. the confidence head scores c_k = sigmoid(proj([h_k ; w1[prev_k]]) / T_k), the probability that d_{k+1}
   survives verification given all drafts before it did.

The draft owns no embedding and no LM head: callers pass the target's modules.
"""

import json
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedModel
from transformers.activations import ACT2FN
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from .configuration_dspark import CONFIG_KEYS, DSparkConfig
from .generation_utils import execution_device, install_generate_route
from .kernels import MarkovBlockSample, markov_block_sample

# Loss weights of the DSpark training recipe (SpecForge defaults).
CE_WEIGHT, L1_WEIGHT, CONFIDENCE_WEIGHT = 0.1, 0.9, 1.0
POSITION_DECAY_GAMMA = 4.0


class DSparkRMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states.to(input_dtype)


def rotary_cos_sin(position_ids: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype):
    """cos, sin [B, T, head_dim] of the rotate-half RoPE at `position_ids` [B, T]."""
    even_dims = torch.arange(0, head_dim, 2, device=position_ids.device, dtype=torch.float32)
    inv_freq = 1.0 / (theta ** (even_dims / head_dim))
    freqs = position_ids[..., None].float() * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, heads, T, d] rotated by cos/sin [B, T, d]."""
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat((-x2, x1), dim=-1)
    return x * cos[:, None] + rotated * sin[:, None]


def eager_attention_forward(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
    """Plain attention with grouped KV heads and a boolean mask [B, 1, Q, K] (True = attend)."""
    key = key.repeat_interleave(module.num_key_value_groups, dim=1)
    value = value.repeat_interleave(module.num_key_value_groups, dim=1)
    scores = torch.matmul(query, key.transpose(2, 3)) * scaling
    if attention_mask is not None:
        scores = scores.masked_fill(~attention_mask, torch.finfo(scores.dtype).min)
    weights = F.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    weights = F.dropout(weights, p=dropout, training=module.training)
    return torch.matmul(weights, value).transpose(1, 2).contiguous(), weights


class DSparkContextCache:
    """Context K/V of every draft layer for the committed tokens of each row.

    Per layer, keys/values are [B, kv_heads, capacity, head_dim]; row b holds its first `lengths[b]`
    slots, in commit order and compacted (padding and holes are never stored), with RoPE already applied
    at each token's true position. Block K/V are never stored here.
    """

    def __init__(self, num_layers: int):
        self.keys: list[torch.Tensor | None] = [None] * num_layers
        self.values: list[torch.Tensor | None] = [None] * num_layers
        self.lengths: torch.Tensor | None = None  # [B] int64

    def get_seq_length(self) -> int:
        return 0 if self.lengths is None else int(self.lengths.max())

    def append(self, layer_idx: int, keys: torch.Tensor, values: torch.Tensor, valid: torch.Tensor) -> None:
        """Write the `valid` [B, T] tokens of keys/values [B, kv_heads, T, d] after each row's last slot.

        Every layer must be appended with the same `valid` before `commit(valid)` advances the lengths.
        """
        batch_size, num_heads, _, head_dim = keys.shape
        lengths = self.lengths if self.lengths is not None else valid.new_zeros(batch_size, dtype=torch.long)
        slots = lengths[:, None] + valid.long().cumsum(-1) - 1  # [B, T]
        needed = int((lengths + valid.sum(-1)).max())
        row_idx, token_idx = valid.nonzero(as_tuple=True)
        for store, new in ((self.keys, keys), (self.values, values)):
            buffer = store[layer_idx]
            capacity = 0 if buffer is None else buffer.shape[2]
            if needed > capacity:  # grow geometrically: appends are amortised O(tokens)
                grown = new.new_zeros(batch_size, num_heads, max(needed, 2 * capacity), head_dim)
                if buffer is not None:
                    grown[:, :, :capacity] = buffer
                store[layer_idx] = buffer = grown
            buffer[row_idx, :, slots[row_idx, token_idx]] = new[row_idx, :, token_idx].to(buffer.dtype)

    def commit(self, valid: torch.Tensor) -> None:
        """Advance each row's length by its number of valid tokens, after all layers were appended."""
        added = valid.long().sum(-1)
        self.lengths = added if self.lengths is None else self.lengths + added

    def crop(self, num_tokens: int | torch.Tensor) -> None:
        """Forget the last `num_tokens` (an int, or [B] per row) committed tokens of each row."""
        self.lengths = (self.lengths - num_tokens).clamp(min=0)

    def select_rows(self, rows: torch.Tensor) -> None:
        """Keep only `rows` [B'] of the batch (finished rows leave)."""
        self.keys = [None if keys is None else keys[rows] for keys in self.keys]
        self.values = [None if values is None else values[rows] for values in self.values]
        self.lengths = self.lengths[rows]

    def layer(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys/values [B, kv_heads, max_length, d] of one layer (slots past a row's length are stale)."""
        length = self.get_seq_length()
        return self.keys[layer_idx][:, :, :length], self.values[layer_idx][:, :, :length]

    def key_padding_mask(self) -> torch.Tensor:
        """[B, max_length] True where a slot holds a committed token of that row."""
        slots = torch.arange(self.get_seq_length(), device=self.lengths.device)
        return slots[None, :] < self.lengths[:, None]


class DSparkAttention(nn.Module):
    def __init__(self, config: DSparkConfig, layer_idx: int):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.head_dim = config.head_dim
        self.num_key_value_groups = config.num_attention_heads // config.num_key_value_heads
        self.scaling = self.head_dim**-0.5
        self.is_causal = False
        q_size = config.num_attention_heads * self.head_dim
        kv_size = config.num_key_value_heads * self.head_dim
        self.q_proj = nn.Linear(config.hidden_size, q_size, bias=config.attention_bias)
        self.k_proj = nn.Linear(config.hidden_size, kv_size, bias=config.attention_bias)
        self.v_proj = nn.Linear(config.hidden_size, kv_size, bias=config.attention_bias)
        self.o_proj = nn.Linear(q_size, config.hidden_size, bias=config.attention_bias)
        self.q_norm = DSparkRMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.k_norm = DSparkRMSNorm(self.head_dim, eps=config.rms_norm_eps)

    def key_value(self, hidden_states: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """K = RoPE(k_norm(k_proj(x))), V = v_proj(x), each [B, kv_heads, T, d], for x [B, T, H]."""
        shape = (*hidden_states.shape[:-1], -1, self.head_dim)
        keys = self.k_norm(self.k_proj(hidden_states).view(shape)).transpose(1, 2)
        values = self.v_proj(hidden_states).view(shape).transpose(1, 2)
        return apply_rotary(keys, cos, sin), values

    def forward(
        self,
        hidden_states: torch.Tensor,  # [B, Q, H] block rows after input_layernorm
        position_embeddings: tuple[torch.Tensor, torch.Tensor],  # cos, sin [B, Q, d]
        context_cache: DSparkContextCache,
        attention_mask: torch.Tensor,  # [B, 1, Q, C + Q] bool
    ) -> torch.Tensor:
        cos, sin = position_embeddings
        shape = (*hidden_states.shape[:-1], -1, self.head_dim)
        queries = apply_rotary(self.q_norm(self.q_proj(hidden_states).view(shape)).transpose(1, 2), cos, sin)
        block_keys, block_values = self.key_value(hidden_states, cos, sin)
        context_keys, context_values = context_cache.layer(self.layer_idx)
        keys = torch.cat([context_keys, block_keys], dim=2)
        values = torch.cat([context_values, block_values], dim=2)

        attention_interface: Callable = eager_attention_forward
        if self.config._attn_implementation != "eager":
            attention_interface = ALL_ATTENTION_FUNCTIONS[self.config._attn_implementation]
        attn_output, _ = attention_interface(
            self,
            queries,
            keys,
            values,
            attention_mask,
            dropout=self.config.attention_dropout if self.training else 0.0,
            scaling=self.scaling,
            is_causal=False,
        )
        return self.o_proj(attn_output.reshape(*hidden_states.shape[:-1], -1))


class DSparkMLP(nn.Module):
    def __init__(self, config: DSparkConfig):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)
        self.act_fn = ACT2FN[config.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class DSparkDecoderLayer(GradientCheckpointingLayer):
    def __init__(self, config: DSparkConfig, layer_idx: int):
        super().__init__()
        self.self_attn = DSparkAttention(config, layer_idx)
        self.mlp = DSparkMLP(config)
        self.input_layernorm = DSparkRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = DSparkRMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, hidden_states, position_embeddings, context_cache, attention_mask) -> torch.Tensor:
        hidden_states = hidden_states + self.self_attn(
            self.input_layernorm(hidden_states), position_embeddings, context_cache, attention_mask
        )
        return hidden_states + self.mlp(self.post_attention_layernorm(hidden_states))


class DSparkMarkovHead(nn.Module):
    """Vanilla low-rank Markov head: bias(prev) = markov_w2(markov_w1[prev]), a rank-r bigram correction."""

    def __init__(self, config: DSparkConfig):
        super().__init__()
        self.markov_w1 = nn.Embedding(config.vocab_size, config.markov_rank)
        self.markov_w2 = nn.Linear(config.markov_rank, config.vocab_size, bias=False)

    def forward(self, prev_ids: torch.Tensor) -> torch.Tensor:
        return self.markov_w2(self.markov_w1(prev_ids))


class DSparkConfidenceHead(nn.Module):
    """Logit of the conditional acceptance probability of a draft position: proj([h_k ; w1[prev_k]])."""

    def __init__(self, config: DSparkConfig):
        super().__init__()
        self.proj = nn.Linear(config.confidence_input_size, 1)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.proj(features).squeeze(-1)


@dataclass
class DSparkLossOutput:
    """The DSpark training loss and its weighted parts (each normalised by the position-weight sum)."""

    loss: torch.Tensor
    cross_entropy: torch.Tensor
    l1: torch.Tensor
    confidence_bce: torch.Tensor
    accuracy: torch.Tensor  # top-1 agreement of the corrected draft logits with the labels
    num_positions: torch.Tensor


class DSparkPreTrainedModel(PreTrainedModel):
    config_class = DSparkConfig
    config: DSparkConfig
    base_model_prefix = ""
    supports_gradient_checkpointing = True
    _no_split_modules = ["DSparkDecoderLayer"]
    _supports_sdpa = True
    _supports_flash_attn = False  # arbitrary (context + bidirectional block) masks
    _supports_flex_attn = False
    # SpecForge checkpoints may carry these modules of the target; the draft borrows the target's.
    _keys_to_ignore_on_load_unexpected = [r"^(model\.)?(embed_tokens|lm_head|rotary_emb)\."]


class DSparkDraftModel(DSparkPreTrainedModel):
    """The DSpark draft. Weight names match the Hub checkpoint (no prefix), e.g. `layers.0.self_attn.q_proj.weight`."""

    def __init__(self, config: DSparkConfig):
        super().__init__(config)
        num_features = len(config.target_layer_ids)
        self.fc = nn.Linear(num_features * config.hidden_size, config.hidden_size, bias=False)
        self.hidden_norm = DSparkRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.layers = nn.ModuleList(DSparkDecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = DSparkRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.markov_head = DSparkMarkovHead(config) if config.has_markov_head else None
        self.confidence_head = DSparkConfidenceHead(config) if config.enable_confidence_head else None
        self.post_init()

    # ------------------------------------------------------------------ context
    def new_context_cache(self) -> DSparkContextCache:
        return DSparkContextCache(self.config.num_hidden_layers)

    def append_context(
        self,
        context_cache: DSparkContextCache,
        target_features: torch.Tensor,  # [B, T, n_features * H] target layer outputs, concatenated
        position_ids: torch.Tensor,  # [B, T]
        valid: torch.Tensor | None = None,  # [B, T] bool, tokens to commit (default: all)
    ) -> None:
        """Project target features of newly committed tokens into every layer's context K/V."""
        expected = self.fc.in_features
        if target_features.shape[-1] != expected:
            raise ValueError(
                f"DSpark: target features have width {target_features.shape[-1]}, the draft expects {expected} "
                f"({len(self.config.target_layer_ids)} layers x hidden_size {self.config.hidden_size}). "
                "Capture the outputs of `config.target_layer_ids` of the target this draft was trained for."
            )
        if valid is None:
            valid = torch.ones(target_features.shape[:2], dtype=torch.bool, device=target_features.device)
        context = self.hidden_norm(self.fc(target_features.to(self.fc.weight.dtype)))
        cos, sin = rotary_cos_sin(position_ids, self.config.head_dim, self.config.rope_theta, context.dtype)
        for layer in self.layers:
            keys, values = layer.self_attn.key_value(context, cos, sin)
            context_cache.append(layer.self_attn.layer_idx, keys, values, valid)
        context_cache.commit(valid)

    # ------------------------------------------------------------------ backbone
    def forward(
        self,
        inputs_embeds: torch.Tensor,  # [B, Q, H] block embeddings (target embedding of anchor + masks)
        position_ids: torch.Tensor,  # [B, Q]
        context_cache: DSparkContextCache,
        attention_mask: torch.Tensor | None = None,  # [B, 1, Q, C + Q] bool; default: one block per row
    ) -> torch.Tensor:
        """Final-normed hidden rows [B, Q, H] of the block(s).

        By default every row attends to all of its cached context and to all Q block rows (one block per
        row, inference). Training passes a mask with many blocks per row (see `block_attention_mask`).
        """
        if attention_mask is None:
            context_visible = context_cache.key_padding_mask()  # [B, C]
            block_visible = context_visible.new_ones(inputs_embeds.shape[:2])
            attention_mask = torch.cat([context_visible, block_visible], dim=-1)[:, None, None, :]
            attention_mask = attention_mask.expand(-1, 1, inputs_embeds.shape[1], -1)
        hidden_states = inputs_embeds.to(self.fc.weight.dtype)
        position_embeddings = rotary_cos_sin(
            position_ids, self.config.head_dim, self.config.rope_theta, hidden_states.dtype
        )
        for layer in self.layers:
            hidden_states = layer(hidden_states, position_embeddings, context_cache, attention_mask)
        return self.norm(hidden_states)

    def block_inputs(self, anchor_ids: torch.Tensor, anchor_positions: torch.Tensor, embed_tokens: nn.Module):
        """Embeddings [B, S, H] and positions [B, S] of the block [anchor, mask x (S - 1)] of each row."""
        block_size = self.config.block_size
        block_ids = anchor_ids.new_full((anchor_ids.shape[0], block_size), self.config.mask_token_id)
        block_ids[:, 0] = anchor_ids
        offsets = torch.arange(block_size, device=anchor_positions.device)
        return embed_tokens(block_ids.to(execution_device(embed_tokens))), anchor_positions[:, None] + offsets

    # ------------------------------------------------------------------ heads
    def confidence_logits(self, hidden_rows: torch.Tensor, prev_ids: torch.Tensor) -> torch.Tensor:
        """Raw confidence logits [..] of hidden rows [.., H] whose previous tokens are `prev_ids` [..]."""
        features = hidden_rows
        if self.config.confidence_head_with_markov:
            features = torch.cat([hidden_rows, self.markov_head.markov_w1(prev_ids).to(hidden_rows.dtype)], dim=-1)
        return self.confidence_head(features)

    def first_confidences(self, hidden_rows: torch.Tensor, anchor_ids: torch.Tensor) -> torch.Tensor:
        """c_1 [B] of each row's block from its hidden rows [B, S, H] and anchors [B], without the LM head: the
        first confidence reads the first hidden row and the anchor only, so a decoder can rule out every draft
        of a round before paying for the block's logits. Computed as `draft_block` computes it (float32)."""
        logits, markov_weight = self._confidence_projection(hidden_rows[:, 0])
        if markov_weight is not None:
            logits = logits + self.markov_head.markov_w1(anchor_ids).float() @ markov_weight
        temperatures = self.confidence_temperatures()
        return torch.sigmoid(logits if temperatures is None else logits / temperatures[0])

    def _confidence_projection(self, hidden_rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The confidence logit's parts in float32, as the Markov kernels take them: proj_h . h + bias [..] of hidden
        rows [.., H], and the weight [r] of w1[prev] (None when the head does not read it)."""
        weight = self.confidence_head.proj.weight[0].float()
        base = hidden_rows.float() @ weight[: self.config.hidden_size] + self.confidence_head.proj.bias.float()
        return base, (weight[self.config.hidden_size :] if self.config.confidence_head_with_markov else None)

    def confidence_temperatures(self) -> torch.Tensor | None:
        temperatures = self.config.confidence_temperatures
        return None if temperatures is None else torch.tensor(temperatures, device=self.fc.weight.device)

    @torch.no_grad()
    def draft_block(
        self,
        hidden_rows: torch.Tensor,  # [B, S, H] output of `forward`
        anchor_ids: torch.Tensor,  # [B]
        lm_head: nn.Module,
        temperature: float = 0.0,
        seeds: torch.Tensor | None = None,  # [B] int64, needed when temperature > 0
    ) -> MarkovBlockSample:
        """Draft tokens d_1..d_S, the exact logits q they were drawn from, and the confidences c_k."""
        base_logits = lm_head(hidden_rows.to(execution_device(lm_head), _module_dtype(lm_head, hidden_rows.dtype)))
        base_logits = base_logits[..., : self.config.vocab_size].to(self.fc.weight.device)
        confidence_base = confidence_markov_weight = None
        if self.confidence_head is not None:
            confidence_base, confidence_markov_weight = self._confidence_projection(hidden_rows)
        markov = self.markov_head
        return markov_block_sample(
            base_logits,
            anchor_ids.to(base_logits.device),
            None if markov is None else markov.markov_w1.weight,
            None if markov is None else markov.markov_w2.weight,
            temperature=temperature,
            seeds=seeds,
            confidence_base=confidence_base,
            confidence_markov_weight=confidence_markov_weight,
            confidence_temperatures=self.confidence_temperatures(),
        )

    # ------------------------------------------------------------------ training
    def block_attention_mask(self, anchor_positions: torch.Tensor, context_length: int) -> torch.Tensor:
        """Training mask [B, 1, N * S, T + N * S] for N blocks per row at `anchor_positions` [B, N].

        Block rows of anchor a see context tokens strictly before a, and every row of their own block.
        """
        block_size = self.config.block_size
        batch_size, num_anchors = anchor_positions.shape
        device = anchor_positions.device
        query_anchor = anchor_positions.repeat_interleave(block_size, dim=1)  # [B, Q]
        context_visible = torch.arange(context_length, device=device)[None, None, :] < query_anchor[:, :, None]
        block_of = torch.arange(num_anchors * block_size, device=device) // block_size
        block_visible = (block_of[:, None] == block_of[None, :]).expand(batch_size, -1, -1)
        return torch.cat([context_visible, block_visible], dim=-1)[:, None]

    def compute_loss(
        self,
        input_ids: torch.Tensor,  # [B, T]
        loss_mask: torch.Tensor,  # [B, T] 1 where a token is supervised (a response token)
        target_features: torch.Tensor,  # [B, T, n_features * H] target layer outputs at each position
        target_logits: torch.Tensor,  # [B, T, V] target logits; row j predicts token j + 1
        embed_tokens: nn.Module,
        lm_head: nn.Module,
        num_anchors: int = 512,
        generator: torch.Generator | None = None,
    ) -> DSparkLossOutput:
        """The DSpark online-distillation loss (SpecForge recipe) for a batch of sequences.

        Per row, up to `num_anchors` anchors are drawn among positions whose token and next token are both
        supervised; each anchor makes one block whose row k is labelled with the token at anchor + k + 1.
        A position counts only while every earlier position of its block is valid. Per position, weighted
        by exp(-k / 4) and normalised by the weight sum:
            0.1 * CE(corrected logits, label) + 0.9 * ||softmax(draft) - softmax(target)||_1
            + 1.0 * BCE(confidence logit, 1 - L1 / 2)   (target detached)
        """
        batch_size, seq_len = input_ids.shape
        block_size = self.config.block_size
        device = input_ids.device
        loss_mask = loss_mask.bool()

        # Anchors: token and next token supervised; a random subset (without replacement) per row.
        anchor_ok = torch.zeros_like(loss_mask)
        anchor_ok[:, :-1] = loss_mask[:, :-1] & loss_mask[:, 1:]
        num_anchors = max(1, min(num_anchors, int(anchor_ok.sum(-1).max())))
        scores = torch.rand(batch_size, seq_len, generator=generator, device=device).masked_fill(~anchor_ok, -1.0)
        anchor_scores, anchor_positions = scores.topk(num_anchors, dim=-1)  # [B, N]
        anchor_valid = anchor_scores >= 0

        # Labels and validity of every block row.
        offsets = torch.arange(block_size, device=device)
        label_positions = anchor_positions[..., None] + offsets + 1  # [B, N, S]
        in_range = label_positions < seq_len
        label_positions = label_positions.clamp(max=seq_len - 1)
        rows = torch.arange(batch_size, device=device)[:, None, None]
        labels = input_ids[rows, label_positions]
        valid = in_range & loss_mask[rows, label_positions] & anchor_valid[..., None]
        valid = valid.long().cumprod(dim=-1).bool()
        prev_ids = torch.cat([input_ids[rows[..., 0], anchor_positions][..., None], labels[..., :-1]], dim=-1)

        # Draft forward: all blocks of a row at once over the row's full context.
        context_cache = self.new_context_cache()
        positions = torch.arange(seq_len, device=device).expand(batch_size, -1)
        self.append_context(context_cache, target_features.detach(), positions)
        block_ids = torch.full_like(prev_ids, self.config.mask_token_id)
        block_ids[..., 0] = prev_ids[..., 0]
        block_positions = anchor_positions[..., None] + offsets
        with torch.no_grad():
            block_embeds = embed_tokens(block_ids.flatten(1))
        hidden = self(
            block_embeds,
            block_positions.flatten(1),
            context_cache,
            self.block_attention_mask(anchor_positions, seq_len),
        ).view(batch_size, num_anchors, block_size, -1)

        frozen_lm_head = {name: p.detach() for name, p in lm_head.named_parameters()}  # gradients reach the draft only
        logits = torch.func.functional_call(lm_head, frozen_lm_head, (hidden.to(_module_dtype(lm_head, hidden.dtype)),))
        markov_logits = self.markov_head(prev_ids) if self.markov_head is not None else None
        target_rows = target_logits[rows, label_positions - 1, : self.config.vocab_size].detach()  # [B, N, S, V]
        cross_entropy, l1, correct = self.distillation_terms(
            logits[..., : self.config.vocab_size], markov_logits, target_rows, labels
        )

        weights = torch.exp(-offsets.float() / POSITION_DECAY_GAMMA) * valid  # [B, N, S]
        weight_sum = weights.sum().clamp(min=1e-6)

        def weighted(values: torch.Tensor) -> torch.Tensor:
            return (values * weights).sum() / weight_sum

        ce_term, l1_term = weighted(cross_entropy), weighted(l1)
        loss = CE_WEIGHT * ce_term + L1_WEIGHT * l1_term
        confidence_term = torch.zeros((), device=device)
        if self.confidence_head is not None:
            confidence_target = (1.0 - 0.5 * l1).detach().clamp(0.0, 1.0)
            confidence_logit = self.confidence_logits(hidden, prev_ids).float()
            bce = F.binary_cross_entropy_with_logits(confidence_logit, confidence_target, reduction="none")
            confidence_term = weighted(bce)
            loss = loss + CONFIDENCE_WEIGHT * confidence_term
        accuracy = weighted(correct.float())
        return DSparkLossOutput(loss, ce_term, l1_term, confidence_term, accuracy, valid.sum())

    @staticmethod
    def distillation_terms(
        logits: torch.Tensor,  # [..., V] the draft's LM-head logits
        markov_logits: torch.Tensor | None,  # [..., V] the Markov head's correction, or None
        target_logits: torch.Tensor,  # [..., V] the target's logits for the same positions
        labels: torch.Tensor,  # [...]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Per block position: cross-entropy of the label, L1 distance between the draft's and the target's
        distributions, and whether the draft's top token is the label (all in float32).

        These are the vocabulary-wide passes of the loss, most of a training step's time on a CPU. They are kept
        in one pure function so that training can compile them into a few fused loops
        (`tools/train_draft.py --compile`)."""
        logits = logits.float()
        if markov_logits is not None:
            logits = logits + markov_logits.float()
        log_probs = torch.log_softmax(logits, dim=-1)
        target_probs = torch.softmax(target_logits.float(), dim=-1)
        cross_entropy = -log_probs.gather(-1, labels[..., None]).squeeze(-1)
        l1 = (log_probs.exp() - target_probs).abs().sum(-1)
        return cross_entropy, l1, logits.argmax(-1) == labels

    # ------------------------------------------------------------------ loading
    @classmethod
    def normalize_state_dict(cls, state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Map SpecForge / DeepSpec checkpoint names to the Hub names (no prefix).

        Strips a leading `model.`; maps SpecForge's legacy `logit_head.` container onto the heads
        (`logit_head.markov_w1.weight` -> `markov_head.markov_w1.weight`, `logit_head.proj.*` ->
        `confidence_head.proj.*`) and drops the target's modules (`embed_tokens`, `lm_head`, `rotary_emb`).
        Two names for one tensor (`fc.weight` and `model.fc.weight`) are an error: which one is meant is unknown.
        """
        normalized, sources = {}, {}
        for source, tensor in state_dict.items():
            name = source.removeprefix("model.")
            if name.startswith("logit_head."):
                name = name.removeprefix("logit_head.")
                if name.startswith("markov_w"):
                    name = "markov_head." + name
                elif name.startswith("proj."):
                    name = "confidence_head." + name
            if name.split(".")[0] in ("embed_tokens", "lm_head", "rotary_emb"):
                continue
            if name in sources:
                raise ValueError(
                    f"DSpark: the checkpoint holds {name!r} twice, as {sources[name]!r} and as {source!r}. Keep one "
                    "name layout (Hub names have no `model.` prefix) and remove the other tensor."
                )
            normalized[name], sources[name] = tensor, source
        return normalized

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *model_args, **kwargs):
        """`PreTrainedModel.from_pretrained`, plus: SpecForge/DeepSpec names (`model.`, `logit_head.`) are
        normalised, and these are errors, never a silent random initialisation or a silently broken draft: a
        missing tensor, a tensor the config does not build (an extra layer, an unused head), one tensor under two
        name layouts, a non-floating-point tensor (read from the headers), and NaN / inf in any loaded weight
        (`has_nonfinite`: one cheap pass over the loaded weights, which also catches values a smaller `dtype`
        cannot hold)."""
        output_loading_info = kwargs.pop("output_loading_info", False)
        state_dict = kwargs.pop("state_dict", None)
        checkpoint = pretrained_model_name_or_path
        if state_dict is None and checkpoint is not None:
            files = _safetensors_files(checkpoint, kwargs)
            _refuse_non_float(checkpoint, _stored_non_float(files))
            state_dict = _noncanonical_checkpoint(files)
        elif state_dict is not None:
            _refuse_non_float(checkpoint, {n: str(t.dtype) for n, t in state_dict.items() if not t.is_floating_point()})
        if state_dict is not None:  # transformers takes either a path or a state dict
            if checkpoint is not None and "config" not in kwargs:  # with the config values given at load time
                overrides = {key: kwargs.pop(key) for key in list(kwargs) if key in CONFIG_KEYS}
                kwargs["config"] = cls.config_class.from_pretrained(checkpoint, **_hub_lookup(kwargs), **overrides)
            pretrained_model_name_or_path, state_dict = None, cls.normalize_state_dict(state_dict)
        model, loading_info = super().from_pretrained(
            pretrained_model_name_or_path, *model_args, state_dict=state_dict, output_loading_info=True, **kwargs
        )
        missing = sorted(loading_info["missing_keys"])
        if missing:
            raise ValueError(
                f"DSpark: the checkpoint at {str(checkpoint)!r} lacks {len(missing)} tensor(s) of the draft, e.g. "
                f"{missing[:6]}. Check that config.json belongs to these weights (num_hidden_layers, markov_rank, "
                "enable_confidence_head) or convert the checkpoint with tools/convert_checkpoint.py."
            )
        unexpected = sorted(loading_info["unexpected_keys"])  # the target's modules are ignored, not listed
        if unexpected:
            config = model.config
            raise ValueError(
                f"DSpark: the checkpoint at {str(checkpoint)!r} has {len(unexpected)} tensor(s) the config does not "
                f"build, e.g. {unexpected[:4]} (config: num_hidden_layers={config.num_hidden_layers}, markov_rank="
                f"{config.markov_rank}, enable_confidence_head={config.enable_confidence_head}). Fix config.json so "
                "that no weights are silently dropped."
            )
        loaded = ((name, param) for name, param in model.named_parameters() if param.device.type != "meta")
        nonfinite = [name for name, param in loaded if has_nonfinite(param)]
        if nonfinite:
            raise ValueError(
                f"DSpark: the checkpoint at {str(checkpoint)!r}, loaded as {model.dtype}, has NaN or inf values in "
                f"{len(nonfinite)} tensor(s), e.g. {nonfinite[:4]}; such a draft never gets a token accepted. "
                "Re-export the weights (tools/verify_checkpoint.py --values lists them), or load in a dtype whose "
                "range holds them."
            )
        return (model, loading_info) if output_loading_info else model


def _hub_lookup(kwargs: dict) -> dict:
    return {k: kwargs[k] for k in ("cache_dir", "revision", "token", "local_files_only", "subfolder") if k in kwargs}


def _safetensors_files(path, hub_kwargs: dict) -> list[str]:
    """The local paths of a checkpoint's safetensors file(s) (downloaded when `path` is a Hub id); [] if none."""
    from transformers.utils import cached_file

    lookup = _hub_lookup(hub_kwargs)
    single = cached_file(path, "model.safetensors", _raise_exceptions_for_missing_entries=False, **lookup)
    if single is not None:
        return [single]
    index = cached_file(path, "model.safetensors.index.json", _raise_exceptions_for_missing_entries=False, **lookup)
    if index is None:
        return []
    with open(index) as f:
        shard_names = sorted(set(json.load(f)["weight_map"].values()))
    return [cached_file(path, name, **lookup) for name in shard_names]


def _stored_non_float(files: list[str]) -> dict[str, str]:
    """Name -> safetensors dtype of every tensor stored in a non-floating-point dtype (I32, U8, BOOL, ...),
    read from the headers only (the floating-point names are F16, F32, F64, BF16 and F8_*)."""
    from safetensors import safe_open

    non_float = {}
    for file in files:
        with safe_open(file, framework="pt") as f:
            dtypes = {name: f.get_slice(name).get_dtype() for name in f.keys()}
        non_float.update({name: dtype for name, dtype in dtypes.items() if not dtype.startswith(("F", "BF"))})
    return non_float


def _refuse_non_float(checkpoint, non_float: dict[str, str]) -> None:
    """Draft weights are floating point; an integer tensor would be cast silently into a meaningless weight."""
    if non_float:
        raise ValueError(
            f"DSpark: the checkpoint at {str(checkpoint)!r} stores {len(non_float)} tensor(s) in a non-floating-point "
            f"dtype, e.g. {dict(list(non_float.items())[:4])}. Draft weights are bfloat16, float16 or float32: "
            "re-export them from the trained model."
        )


def _noncanonical_checkpoint(files: list[str]) -> dict[str, torch.Tensor] | None:
    """All tensors of a checkpoint whose names need normalising (`model.` / `logit_head.`), else None."""
    from safetensors import safe_open

    names = []
    for file in files:
        with safe_open(file, framework="pt") as f:
            names.extend(f.keys())
    if not any(name.startswith(("model.", "logit_head.")) for name in names):
        return None
    state_dict = {}
    for file in files:
        with safe_open(file, framework="pt") as f:
            state_dict.update({name: f.get_tensor(name) for name in f.keys()})
    return state_dict


def has_nonfinite(tensor: torch.Tensor) -> bool:
    """Whether a floating-point tensor holds NaN or +-inf. One NaN-propagating `aminmax` pass with no tensor-sized
    temporary: about 0.5 s for the Kimi K3 draft's 2.2 G bf16 values on two CPU cores, milliseconds on a GPU."""
    if tensor.numel() == 0:
        return False
    if tensor.element_size() == 1:  # aminmax has no float8 kernels
        tensor = tensor.float()
    low, high = torch.aminmax(tensor.detach())
    return not bool(torch.isfinite(low) & torch.isfinite(high))


def _module_dtype(module: nn.Module, default: torch.dtype) -> torch.dtype:
    """dtype of a (possibly offloaded) module's weights, never reading a meta tensor's device."""
    weight = getattr(module, "weight", None)
    return weight.dtype if isinstance(weight, torch.Tensor) else default


# `save_pretrained` writes the `auto_map` that lets `AutoModel.from_pretrained(..., trust_remote_code=True)` find us.
DSparkConfig.register_for_auto_class()
DSparkDraftModel.register_for_auto_class("AutoModel")
# `target.generate(..., assistant_model=draft)` runs DSpark speculative decoding (see generation_utils).
install_generate_route()

__all__ = ["DSparkDraftModel", "DSparkPreTrainedModel", "DSparkContextCache"]
