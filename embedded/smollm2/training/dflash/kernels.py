"""Hot paths of a DSpark round outside the backbone: fused Triton kernels and their PyTorch references.

- `markov_block_sample`: the Markov chain over a drafted block (DSPARK step 5) fused with the confidence
  head (step 6): draft tokens, the exact draft logits q was sampled from, and per-position confidences.
- `verify_block`: lossless verification of a block against the target's processed logits (step 8).

Each public function dispatches to a Triton kernel for CUDA tensors and to the PyTorch reference
(`*_reference`) otherwise. `backend=` ("auto" | "triton" | "reference") or the environment variable
DSPARK_KERNELS forces one; "triton" on CPU tensors needs TRITON_INTERPRET=1 set before triton is imported.

Sampling draws its randomness from `counter_uniform`, a counter-based hash of (seed, row, column), so
that every implementation produces the same tokens for the same seed (up to floating-point near-ties:
the kernels sum the Markov GEMV in another order and compute log/exp with other libraries). The uniforms
have 24 bits, so Gumbel noise lies in [-2.85, 17.33]: Gumbel-max never draws a token whose logit is more
than 20.2 below the largest, i.e. of probability below e^-20.2 = 1.7e-9 times the top token's. Sampling is
exact up to that truncation of the far tail (below any test's resolution, and far below bf16 rounding).
"""

import os
from contextlib import nullcontext
from dataclasses import dataclass

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # the references need only torch
    triton = None

_MASK32 = 0xFFFFFFFF
# Argmax keys pack (value, index) into one int64 whose order is (value, then LOWER index): see `_argmax_key`.
_INDEX_COMPLEMENT = 0x7FFFFFFF
_EMPTY_KEY = -(2**63)


# ----------------------------------------------------------------------------------------------- randomness
def counter_uniform(seeds: torch.Tensor, rows: torch.Tensor, columns: torch.Tensor) -> torch.Tensor:
    """Uniforms in (0, 1) from a 32-bit integer hash of (seed, row, column), broadcast together.

    seeds, rows, columns: int64 tensors (broadcastable). Returns float32 of the broadcast shape.
    The hash is `lowbias32` (Wellons) over a linear mix of the three counters.
    """
    x = (seeds * 0x9E3779B1 + rows * 0x85EBCA77 + columns * 0xC2B2AE3D) & _MASK32
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _MASK32
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & _MASK32
    x = x ^ (x >> 16)
    return ((x >> 8).to(torch.float32) + 0.5) * (1.0 / (1 << 24))


def gumbel_noise(seeds: torch.Tensor, position: int, vocab_size: int) -> torch.Tensor:
    """Gumbel(0, 1) noise [B, V] for one block position of each row."""
    columns = torch.arange(vocab_size, device=seeds.device)
    uniforms = counter_uniform(seeds[:, None], torch.full_like(seeds[:, None], position), columns[None, :])
    return -torch.log(-torch.log(uniforms))


# ----------------------------------------------------------------------------------------------- references
@dataclass
class MarkovBlockSample:
    """One drafted block.

    tokens:      [B, S] draft tokens d_1..d_S (row k predicts the token after block position k).
    logits:      [B, S, V] float32 logits the tokens were drawn from, already divided by the temperature:
                 the draft distribution q = softmax(logits) (unscaled for greedy drafting).
    confidences: [B, S] c_k, probability that d_{k+1} is accepted given all before it were; None
                 without a confidence head.
    """

    tokens: torch.Tensor
    logits: torch.Tensor
    confidences: torch.Tensor | None


def markov_block_sample_reference(
    base_logits: torch.Tensor,
    anchor_ids: torch.Tensor,
    markov_w1: torch.Tensor | None,
    markov_w2: torch.Tensor | None,
    temperature: float = 0.0,
    seeds: torch.Tensor | None = None,
    confidence_base: torch.Tensor | None = None,
    confidence_markov_weight: torch.Tensor | None = None,
    confidence_temperatures: torch.Tensor | None = None,
) -> MarkovBlockSample:
    """PyTorch reference of `markov_block_sample` (same arguments): float32 math, one step at a time."""
    batch_size, block_size, vocab_size = base_logits.shape
    if temperature > 0 and seeds is None:
        raise ValueError("markov_block_sample: sampling (temperature > 0) needs `seeds`.")
    logits = base_logits.float().clone()
    tokens = torch.empty(batch_size, block_size, dtype=torch.long, device=base_logits.device)
    confidence_logits = None if confidence_base is None else confidence_base.float().clone()
    markov_w2 = None if markov_w2 is None else markov_w2.float()
    prev = anchor_ids
    for k in range(block_size):
        if markov_w1 is not None:
            prev_embedding = markov_w1[prev].float()  # [B, r]
            logits[:, k] += prev_embedding @ markov_w2.T
            if confidence_logits is not None and confidence_markov_weight is not None:
                confidence_logits[:, k] += prev_embedding @ confidence_markov_weight.float()
        if temperature > 0:
            logits[:, k] /= temperature
            prev = torch.argmax(logits[:, k] + gumbel_noise(seeds, k, vocab_size), dim=-1)
        else:
            prev = torch.argmax(logits[:, k], dim=-1)
        tokens[:, k] = prev
    confidences = None
    if confidence_logits is not None:
        if confidence_temperatures is not None:
            confidence_logits = confidence_logits / confidence_temperatures.float()
        confidences = torch.sigmoid(confidence_logits)
    return MarkovBlockSample(tokens, logits, confidences)


def verify_block_reference(
    target_scores: torch.Tensor,
    draft_tokens: torch.Tensor,
    draft_logits: torch.Tensor | None,
    num_drafts: torch.Tensor,
    seeds: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """PyTorch reference of `verify_block` (same arguments)."""
    batch_size, block_size = draft_tokens.shape
    positions = torch.arange(block_size, device=draft_tokens.device)
    in_window = positions[None, :] < num_drafts[:, None]
    rows = torch.arange(batch_size, device=draft_tokens.device)
    if draft_logits is None:
        target_tokens = target_scores.argmax(dim=-1)  # [B, S + 1]
        accepted = (draft_tokens == target_tokens[:, :-1]) & in_window
        num_accepted = accepted.long().cumprod(dim=-1).sum(dim=-1)
        return num_accepted, target_tokens[rows, num_accepted]

    if seeds is None:
        raise ValueError("verify_block: sampled verification needs `seeds`.")
    vocab_size = target_scores.shape[-1]
    p = torch.softmax(target_scores.float(), dim=-1)  # [B, S + 1, V]
    q = torch.softmax(draft_logits.float(), dim=-1)  # [B, S, V]
    p_draft = p[:, :-1].gather(-1, draft_tokens[..., None]).squeeze(-1)
    q_draft = q.gather(-1, draft_tokens[..., None]).squeeze(-1)
    # Uniforms live in column V of the counter space: no token column collides with them.
    uniforms = counter_uniform(seeds[:, None], positions[None, :], torch.tensor(vocab_size, device=seeds.device))
    accepted = (uniforms * q_draft < p_draft) & in_window
    num_accepted = accepted.long().cumprod(dim=-1).sum(dim=-1)

    # Row n's next token: residual max(0, p - q) after a rejection, p itself after the whole window.
    p_next = p[rows, num_accepted]  # [B, V]
    rejected = num_accepted < num_drafts
    q_next = q[rows, num_accepted.clamp(max=block_size - 1)] * rejected[:, None]
    residual = (p_next - q_next).clamp(min=0)
    residual = torch.where(residual.sum(-1, keepdim=True) > 0, residual, p_next)  # p == q: never rejects
    columns = torch.arange(vocab_size, device=seeds.device)
    noise_uniforms = counter_uniform(seeds[:, None], (block_size + 1 + num_accepted)[:, None], columns[None, :])
    next_tokens = torch.argmax(torch.log(residual) - torch.log(-torch.log(noise_uniforms)), dim=-1)
    return num_accepted, next_tokens


# ----------------------------------------------------------------------------------------------- Triton kernels
if triton is not None:
    _ORDERED_NEG_INF = tl.constexpr(-2139095041)  # high word of the argmax key of -inf (0xFF800000 ^ 0x7FFFFFFF)

    @triton.jit
    def _counter_uniform(seed, row, column):
        """`counter_uniform` bit for bit: the hash runs in uint32, whose products wrap mod 2^32."""
        x = seed.to(tl.uint32) * 0x9E3779B1 + row.to(tl.uint32) * 0x85EBCA77 + column.to(tl.uint32) * 0xC2B2AE3D
        x = x ^ (x >> 16)
        x = x * 0x7FEB352D
        x = x ^ (x >> 15)
        x = x * 0x846CA68B
        x = x ^ (x >> 16)
        return ((x >> 8).to(tl.float32) + 0.5) * (1.0 / 16777216)

    @triton.jit
    def _gumbel(seed, row, column):
        return -tl.log(-tl.log(_counter_uniform(seed, row, column)))

    @triton.jit
    def _argmax_key(scores, first_column):
        """Max over the last axis of `scores`, packed with its column as an int64 key.

        The high word is the float's bits made order-preserving as a signed int32, the low word
        0x7FFFFFFF - column: the max key is the max value at its LOWEST column (torch's tie rule), so
        partial argmaxes merge with a plain integer max (`tl.maximum`, `tl.atomic_max`).
        """
        value, column = tl.max(scores, axis=-1, return_indices=True)
        bits = value.to(tl.int32, bitcast=True)
        ordered = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
        return (ordered.to(tl.int64) << 32) | (0x7FFFFFFF - (first_column + column)).to(tl.int64)

    @triton.jit
    def _key_index(key):
        return 0x7FFFFFFF - (key & 0xFFFFFFFF)

    @triton.jit
    def _markov_step_kernel(
        base_ptr,  # [B, S, V] base logits, unit stride over V
        stride_base_b,
        stride_base_s,
        logits_ptr,  # [B, S, V] float32 out, contiguous
        keys_ptr,  # [B, S] int64 argmax keys, filled with _EMPTY_KEY
        anchor_ptr,  # [B] int64
        w1_ptr,  # [Vm, r] contiguous
        w2_ptr,  # [Vm, r] contiguous
        seeds_ptr,  # [B] int64
        conf_base_ptr,  # [B, S] float32
        conf_weight_ptr,  # [r]
        conf_temperature_ptr,  # [S]
        conf_out_ptr,  # [B, S] float32
        batch_size,
        block_size,
        vocab_size,
        rank,
        temperature,
        first_step,
        HAS_MARKOV: tl.constexpr,
        SAMPLE: tl.constexpr,
        HAS_CONFIDENCE: tl.constexpr,
        CONFIDENCE_MARKOV: tl.constexpr,
        CONFIDENCE_TEMPERATURES: tl.constexpr,
        DOT_FP32: tl.constexpr,
        BLOCK_B: tl.constexpr,
        BLOCK_V: tl.constexpr,
        BLOCK_R: tl.constexpr,
    ):
        """One chain step (or, without Markov head, independent steps) for BLOCK_B rows x BLOCK_V tokens.

        Grid (row blocks, vocab tiles, steps): prev_k is decoded from the keys of step k - 1, the Markov
        bias of the tile is a [BLOCK_B, r] x [r, BLOCK_V] dot, the corrected logits (/T) are stored, and
        the tile's argmax (of logits + Gumbel noise when sampling) is merged into the step's key with an
        atomic max. The tile-0 program also writes the step's confidence.
        """
        pid_b = tl.program_id(0)
        pid_v = tl.program_id(1)
        step = first_step + tl.program_id(2)
        rows = pid_b * BLOCK_B + tl.arange(0, BLOCK_B)
        row_mask = rows < batch_size
        cols = pid_v * BLOCK_V + tl.arange(0, BLOCK_V)
        col_mask = cols < vocab_size
        mask = row_mask[:, None] & col_mask[None, :]
        rows64 = rows.to(tl.int64)

        base = tl.load(base_ptr + rows64[:, None] * stride_base_b + step * stride_base_s + cols[None, :], mask=mask)
        logits = base.to(tl.float32)
        if HAS_MARKOV:
            anchor = tl.load(anchor_ptr + rows, mask=row_mask, other=0)
            prev_key = tl.load(keys_ptr + rows64 * block_size + tl.maximum(step - 1, 0), mask=row_mask, other=0)
            prev = tl.where(step == 0, anchor, _key_index(prev_key))  # [BLOCK_B]
            bias = tl.zeros([BLOCK_B, BLOCK_V], dtype=tl.float32)
            for r0 in range(0, rank, BLOCK_R):
                ranks = r0 + tl.arange(0, BLOCK_R)
                rank_mask = ranks < rank
                prev_embedding = tl.load(  # [BLOCK_B, BLOCK_R]
                    w1_ptr + prev[:, None] * rank + ranks[None, :],
                    mask=row_mask[:, None] & rank_mask[None, :],
                    other=0.0,
                )
                w2_tile = tl.load(  # [BLOCK_R, BLOCK_V]
                    w2_ptr + cols[None, :].to(tl.int64) * rank + ranks[:, None],
                    mask=rank_mask[:, None] & col_mask[None, :],
                    other=0.0,
                )
                if BLOCK_B == 1:  # a GEMV on the CUDA cores
                    bias += tl.sum(prev_embedding.to(tl.float32)[:, :, None] * w2_tile.to(tl.float32)[None], axis=1)
                elif DOT_FP32:
                    bias = tl.dot(prev_embedding.to(tl.float32), w2_tile.to(tl.float32), bias, input_precision="ieee")
                else:
                    bias = tl.dot(prev_embedding, w2_tile, bias)
            logits += bias
        if SAMPLE:
            logits = tl.math.div_rn(logits, temperature)  # IEEE division, as torch (`/` is approximate on GPUs)
        logits_offsets = (rows64[:, None] * block_size + step) * vocab_size + cols[None, :]
        tl.store(logits_ptr + logits_offsets, logits, mask=mask)

        scores = logits
        if SAMPLE:
            seeds = tl.load(seeds_ptr + rows, mask=row_mask, other=0)
            scores += _gumbel(seeds[:, None], step, cols[None, :])
        scores = tl.where(mask, scores, float("-inf"))
        key = _argmax_key(scores, pid_v * BLOCK_V)
        tl.atomic_max(keys_ptr + rows64 * block_size + step, key, mask=row_mask, sem="relaxed")

        if HAS_CONFIDENCE:
            if pid_v == 0:
                confidence = tl.load(conf_base_ptr + rows64 * block_size + step, mask=row_mask, other=0.0)
                if CONFIDENCE_MARKOV:
                    for r0 in range(0, rank, BLOCK_R):
                        ranks = r0 + tl.arange(0, BLOCK_R)
                        rank_mask = ranks < rank
                        prev_embedding = tl.load(
                            w1_ptr + prev[:, None] * rank + ranks[None, :],
                            mask=row_mask[:, None] & rank_mask[None, :],
                            other=0.0,
                        )
                        weight = tl.load(conf_weight_ptr + ranks, mask=rank_mask, other=0.0)
                        confidence += tl.sum(prev_embedding.to(tl.float32) * weight.to(tl.float32)[None, :], axis=1)
                if CONFIDENCE_TEMPERATURES:
                    confidence = tl.math.div_rn(confidence, tl.load(conf_temperature_ptr + step).to(tl.float32))
                tl.store(conf_out_ptr + rows64 * block_size + step, tl.sigmoid(confidence), mask=row_mask)

    @triton.jit
    def _verify_stats_kernel(
        target_ptr,  # [B, S + 1, V] processed target logits, unit stride over V
        stride_target_b,
        stride_target_s,
        draft_ptr,  # [B, S, V] draft logits, unit stride over V (unused when GREEDY)
        stride_draft_b,
        stride_draft_s,
        keys_ptr,  # GREEDY: [B, S + 1, NS] int64 argmax keys of the target rows per split
        stats_ptr,  # SAMPLED: [B, S + 1, NS, 4] float32 (target max, target sum exp, draft max, draft sum exp)
        result_ptr,  # SAMPLED: [B, 3] int64 (residual key, bonus key, finished programs), reset here
        block_size,
        vocab_size,
        split_size,
        num_splits,
        GREEDY: tl.constexpr,
        BLOCK_V: tl.constexpr,
    ):
        """Per (row, verify position, vocab split): the target argmax (greedy) or the log-sum-exp parts
        (max, sum of exp(x - max)) of the target row and of the draft row (sampled). Grid (B, S + 1, NS)."""
        b = tl.program_id(0)
        k = tl.program_id(1)
        split = tl.program_id(2)
        start = split * split_size
        columns = tl.arange(0, BLOCK_V)
        target_row = target_ptr + b.to(tl.int64) * stride_target_b + k * stride_target_s
        draft_row = draft_ptr + b.to(tl.int64) * stride_draft_b + k * stride_draft_s
        stat = (b * (block_size + 1) + k) * num_splits + split
        if GREEDY:
            key = tl.full([], -(2**63), tl.int64)
            for v0 in range(start, start + split_size, BLOCK_V):
                x = tl.load(target_row + v0 + columns, mask=v0 + columns < vocab_size, other=float("-inf"))
                key = tl.maximum(key, _argmax_key(x.to(tl.float32), v0))
            tl.store(keys_ptr + stat, key)
        else:
            p_max, p_sum = _logsumexp_parts(target_row, start, split_size, vocab_size, BLOCK_V)
            tl.store(stats_ptr + stat * 4, p_max)
            tl.store(stats_ptr + stat * 4 + 1, p_sum)
            if k < block_size:
                q_max, q_sum = _logsumexp_parts(draft_row, start, split_size, vocab_size, BLOCK_V)
                tl.store(stats_ptr + stat * 4 + 2, q_max)
                tl.store(stats_ptr + stat * 4 + 3, q_sum)
            if (k == 0) & (split == 0):
                tl.store(result_ptr + b * 3, -(2**63))
                tl.store(result_ptr + b * 3 + 1, -(2**63))
                tl.store(result_ptr + b * 3 + 2, 0)

    @triton.jit
    def _logsumexp_parts(row_ptr, start, split_size, vocab_size, BLOCK_V: tl.constexpr):
        """(m, s) with log-sum-exp = m + log(s) over row[start : start + split_size]; -inf entries allowed."""
        columns = tl.arange(0, BLOCK_V)
        running_max = tl.full([], float("-inf"), tl.float32)
        running_sum = tl.full([], 0.0, tl.float32)
        for v0 in range(start, start + split_size, BLOCK_V):
            x = tl.load(row_ptr + v0 + columns, mask=v0 + columns < vocab_size, other=float("-inf")).to(tl.float32)
            new_max = tl.maximum(running_max, tl.max(x))
            shift = tl.where(new_max == float("-inf"), 0.0, new_max)  # an all -inf prefix adds nothing
            running_sum = running_sum * tl.exp(running_max - shift) + tl.sum(tl.exp(x - shift))
            running_max = new_max
        return running_max, running_sum

    @triton.jit
    def _verify_kernel(
        target_ptr,
        stride_target_b,
        stride_target_s,
        draft_ptr,
        stride_draft_b,
        stride_draft_s,
        draft_tokens_ptr,  # [B, S] int64, contiguous
        num_drafts_ptr,  # [B] int64
        seeds_ptr,  # [B] int64
        keys_ptr,  # from `_verify_stats_kernel`
        stats_ptr,
        result_ptr,
        num_accepted_ptr,  # [B] int64 out
        next_tokens_ptr,  # [B] int64 out
        block_size,
        vocab_size,
        split_size,
        num_splits,
        GREEDY: tl.constexpr,
        BLOCK_S: tl.constexpr,  # >= S + 1
        BLOCK_NS: tl.constexpr,  # >= NS
        BLOCK_V: tl.constexpr,
    ):
        """Accept/reject every position of row b, then pick its next token. Grid (B, 1) greedy, (B, NS) sampled.

        Sampled: every program finds n = num_accepted, samples the residual of row n over its vocab split
        by Gumbel-max (and the bonus from p, the fallback when the residual is empty), merges its argmax
        keys atomically, and the last program of the row to finish writes the result.
        """
        b = tl.program_id(0)
        split = tl.program_id(1)
        positions = tl.arange(0, BLOCK_S)
        splits = tl.arange(0, BLOCK_NS)
        stat = (b * (block_size + 1) + positions[:, None]) * num_splits + splits[None, :]  # [BLOCK_S, BLOCK_NS]
        stat_mask = (positions[:, None] <= block_size) & (splits[None, :] < num_splits)
        is_draft = positions < block_size
        draft_tokens = tl.load(draft_tokens_ptr + b * block_size + positions, mask=is_draft, other=0)
        in_window = positions < tl.load(num_drafts_ptr + b)
        if GREEDY:
            keys = tl.load(keys_ptr + stat, mask=stat_mask, other=-(2**63))
            target_tokens = _key_index(tl.max(keys, axis=1))  # [BLOCK_S]
            accepted = (draft_tokens == target_tokens) & in_window
        else:
            p_lse = _merge_logsumexp(stats_ptr + stat * 4, stat_mask)
            q_lse = _merge_logsumexp(stats_ptr + stat * 4 + 2, stat_mask & is_draft[:, None])
            target_rows = target_ptr + b.to(tl.int64) * stride_target_b + positions * stride_target_s
            draft_rows = draft_ptr + b.to(tl.int64) * stride_draft_b + positions * stride_draft_s
            p_draft = tl.exp(tl.load(target_rows + draft_tokens, mask=is_draft, other=0.0).to(tl.float32) - p_lse)
            q_draft = tl.exp(tl.load(draft_rows + draft_tokens, mask=is_draft, other=0.0).to(tl.float32) - q_lse)
            seed = tl.load(seeds_ptr + b)
            accepted = (_counter_uniform(seed, positions, vocab_size) * q_draft < p_draft) & in_window
        num_accepted = tl.min(tl.where(accepted | ~is_draft, block_size, positions))

        if GREEDY:
            tl.store(num_accepted_ptr + b, num_accepted)
            tl.store(next_tokens_ptr + b, tl.sum(tl.where(positions == num_accepted, target_tokens, 0)))
        else:
            rejected = num_accepted < tl.load(num_drafts_ptr + b)
            draft_position = tl.minimum(num_accepted, block_size - 1)  # q is unused (zero) unless rejected
            p_lse_next = tl.sum(tl.where(positions == num_accepted, p_lse, 0.0))
            q_lse_next = tl.sum(tl.where(positions == draft_position, q_lse, 0.0))
            target_row = target_ptr + b.to(tl.int64) * stride_target_b + num_accepted * stride_target_s
            draft_row = draft_ptr + b.to(tl.int64) * stride_draft_b + draft_position * stride_draft_s
            residual_key = tl.full([], -(2**63), tl.int64)
            bonus_key = tl.full([], -(2**63), tl.int64)
            columns = tl.arange(0, BLOCK_V)
            for v0 in range(split * split_size, (split + 1) * split_size, BLOCK_V):
                in_vocab = v0 + columns < vocab_size
                p = tl.exp(tl.load(target_row + v0 + columns, mask=in_vocab, other=float("-inf")) - p_lse_next)
                q = tl.load(draft_row + v0 + columns, mask=in_vocab, other=0.0)
                q = tl.where(rejected, tl.exp(q - q_lse_next), 0.0)
                noise = _gumbel(seed, block_size + 1 + num_accepted, v0 + columns)
                residual_key = tl.maximum(residual_key, _argmax_key(tl.log(tl.maximum(p - q, 0.0)) + noise, v0))
                bonus_key = tl.maximum(bonus_key, _argmax_key(tl.log(p) + noise, v0))
            tl.atomic_max(result_ptr + b * 3, residual_key)
            tl.atomic_max(result_ptr + b * 3 + 1, bonus_key)
            if tl.atomic_add(result_ptr + b * 3 + 2, 1) == num_splits - 1:  # acq_rel: the other keys are in
                residual_key = tl.atomic_max(result_ptr + b * 3, residual_key)
                bonus_key = tl.atomic_max(result_ptr + b * 3 + 1, bonus_key)
                residual_empty = (residual_key >> 32) == _ORDERED_NEG_INF
                tl.store(num_accepted_ptr + b, num_accepted)
                tl.store(next_tokens_ptr + b, _key_index(tl.where(residual_empty, bonus_key, residual_key)))

    @triton.jit
    def _merge_logsumexp(parts_ptr, mask):
        """log-sum-exp per position [BLOCK_S] from the per-split parts (max, sum) at parts_ptr [BLOCK_S, NS]."""
        maxes = tl.load(parts_ptr, mask=mask, other=float("-inf"))
        sums = tl.load(parts_ptr + 1, mask=mask, other=0.0)
        row_max = tl.max(maxes, axis=1)
        shift = tl.where(row_max == float("-inf"), 0.0, row_max)
        scaled = tl.where(maxes == float("-inf"), 0.0, sums * tl.exp(maxes - shift[:, None]))
        return shift + tl.log(tl.sum(scaled, axis=1))


# ----------------------------------------------------------------------------------------------- dispatch
# Whether triton was imported under TRITON_INTERPRET=1: its kernels then run on CPU tensors.
_INTERPRETED = triton is not None and not isinstance(_markov_step_kernel, triton.runtime.JITFunction)


def _use_triton(backend: str | None, tensor: torch.Tensor) -> bool:
    """Whether to run the Triton kernel for `tensor`'s device (see the module docstring)."""
    backend = backend or os.environ.get("DSPARK_KERNELS", "auto")
    if backend not in ("auto", "triton", "reference"):
        raise ValueError(f"DSpark kernels: backend must be auto, triton or reference, got {backend!r}.")
    if backend == "reference":
        return False
    if backend == "auto":
        return triton is not None and tensor.is_cuda
    if triton is None:
        raise RuntimeError("DSpark kernels: backend 'triton' needs the triton package.")
    if not tensor.is_cuda and not _INTERPRETED:
        raise RuntimeError("DSpark kernels: Triton on CPU tensors needs TRITON_INTERPRET=1 before triton is imported.")
    return True


def _device_guard(tensor: torch.Tensor):
    return torch.cuda.device(tensor.device) if tensor.is_cuda else nullcontext()


def _num_programs_target(tensor: torch.Tensor) -> int:
    """Programs that fill the device: a few per SM (a small number under the interpreter)."""
    if tensor.is_cuda:
        return 4 * torch.cuda.get_device_properties(tensor.device).multi_processor_count
    return 16


# Tiling of `_markov_step_kernel`: a program owns BLOCK_V tokens of 1, 16 or 32 rows and reads its [BLOCK_V, r] slice
# of markov_w2 in BLOCK_R-wide chunks (benchmarks/bench_kernels.py --sweep times alternatives).
MARKOV_TILING = {"BLOCK_V": 128, "BLOCK_R": 64, "num_warps": 4, "num_stages": 3}


def markov_block_sample(
    base_logits: torch.Tensor,
    anchor_ids: torch.Tensor,
    markov_w1: torch.Tensor | None,
    markov_w2: torch.Tensor | None,
    temperature: float = 0.0,
    seeds: torch.Tensor | None = None,
    confidence_base: torch.Tensor | None = None,
    confidence_markov_weight: torch.Tensor | None = None,
    confidence_temperatures: torch.Tensor | None = None,
    backend: str | None = None,
) -> MarkovBlockSample:
    """Run the Markov chain over a block.

    base_logits: [B, S, V] lm_head(h_k) of the draft's hidden rows.
    anchor_ids: [B] the last committed token of each row (prev_0).
    markov_w1, markov_w2: [V, r] Markov tables; None for a draft without Markov head.
    temperature: 0 drafts greedily (argmax, ties to the lowest index); > 0 samples from
        softmax(logits / temperature) by Gumbel-max with noise from `counter_uniform(seeds, k, v)`.
    seeds: [B] int64, required when sampling.
    confidence_base: [B, S] the hidden part of the confidence logit, proj_h . h_k + bias; None without head.
    confidence_markov_weight: [r] the Markov part of the confidence projection (None if the head has none).
    confidence_temperatures: [S] per-position calibration temperatures T_k (None means ones).
    backend: "auto" (Triton for CUDA tensors), "triton" or "reference"; default $DSPARK_KERNELS or "auto".

    The Triton path launches one kernel per step (a single one without Markov head); each reads
    markov_w2 once for the whole batch and never materialises the bias beyond the output logits.
    """
    arguments = (base_logits, anchor_ids, markov_w1, markov_w2, temperature, seeds)
    confidence = (confidence_base, confidence_markov_weight, confidence_temperatures)
    if not _use_triton(backend, base_logits):
        return markov_block_sample_reference(*arguments, *confidence)
    if temperature > 0 and seeds is None:
        raise ValueError("markov_block_sample: sampling (temperature > 0) needs `seeds`.")
    with _device_guard(base_logits):
        return _markov_block_sample_triton(*arguments, *confidence)


def _markov_block_sample_triton(
    base_logits, anchor_ids, markov_w1, markov_w2, temperature, seeds, confidence_base, confidence_markov_weight,
    confidence_temperatures,
) -> MarkovBlockSample:
    batch_size, block_size, vocab_size = base_logits.shape
    device = base_logits.device
    if base_logits.stride(-1) != 1:
        base_logits = base_logits.contiguous()
    has_markov = markov_w1 is not None
    has_confidence = confidence_base is not None
    confidence_markov = has_confidence and has_markov and confidence_markov_weight is not None
    logits = torch.empty(batch_size, block_size, vocab_size, dtype=torch.float32, device=device)
    keys = torch.full((batch_size, block_size), _EMPTY_KEY, dtype=torch.int64, device=device)
    confidences = torch.empty(batch_size, block_size, dtype=torch.float32, device=device) if has_confidence else None
    placeholder = logits  # for pointer arguments a configuration does not read
    w1 = markov_w1.contiguous() if has_markov else placeholder
    w2 = markov_w2.contiguous() if has_markov else placeholder
    rank = w1.shape[1] if has_markov else 1
    tensors = (
        base_logits, base_logits.stride(0), base_logits.stride(1), logits, keys, anchor_ids.long().contiguous(), w1, w2,
        seeds.long().contiguous() if seeds is not None else keys,
        confidence_base.float().contiguous() if has_confidence else placeholder,
        confidence_markov_weight.contiguous() if confidence_markov else placeholder,
        confidence_temperatures.contiguous() if confidence_temperatures is not None else placeholder,
        confidences if has_confidence else placeholder,
    )  # fmt: skip
    flags = {
        "HAS_MARKOV": has_markov,
        "SAMPLE": temperature > 0,
        "HAS_CONFIDENCE": has_confidence,
        "CONFIDENCE_MARKOV": confidence_markov,
        "CONFIDENCE_TEMPERATURES": confidence_temperatures is not None,
        # Half-precision tables use the tensor cores (exact products, float32 sums); the interpreter's tl.dot
        # mishandles bfloat16, so it upcasts (exactly) like mixed or float32 tables.
        "DOT_FP32": _INTERPRETED or not (w1.dtype == w2.dtype and w1.dtype in (torch.bfloat16, torch.float16)),
        # Batch 1 takes a GEMV (no rows padded for the tensor cores, no Gumbel noise drawn for them); larger
        # batches tl.dot, which needs >= 16 rows.
        "BLOCK_B": 1 if batch_size == 1 else 16 if batch_size <= 16 else 32,
    }
    grid = (triton.cdiv(batch_size, flags["BLOCK_B"]), triton.cdiv(vocab_size, MARKOV_TILING["BLOCK_V"]))
    # With a Markov head step k needs d_k: one launch per step. Without, all steps in one launch.
    launches = [(k, 1) for k in range(block_size)] if has_markov else [(0, block_size)]
    for first_step, num_steps in launches:
        _markov_step_kernel[grid + (num_steps,)](
            *tensors, batch_size, block_size, vocab_size, rank, float(temperature), first_step, **flags, **MARKOV_TILING
        )
    tokens = _INDEX_COMPLEMENT - (keys & _MASK32)
    return MarkovBlockSample(tokens, logits, confidences)


def verify_block(
    target_scores: torch.Tensor,
    draft_tokens: torch.Tensor,
    draft_logits: torch.Tensor | None,
    num_drafts: torch.Tensor,
    seeds: torch.Tensor | None = None,
    backend: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Accept a prefix of each row's drafts and pick the token that follows it.

    target_scores: [B, S + 1, V] the target's logits after every logits processor; row k scores the token
        after verify position k (p = softmax(row)).
    draft_tokens: [B, S] the drafts d_1..d_S.
    draft_logits: [B, S, V] q = softmax(row) the drafts were sampled from; None verifies greedily
        (longest prefix equal to the target's argmax).
    num_drafts: [B] int64, how many leading drafts of each row are verified (the rest are ignored).
    seeds: [B] int64, randomness for sampled verification (uniforms from `counter_uniform`).
    backend: "auto" (Triton for CUDA tensors), "triton" or "reference"; default $DSPARK_KERNELS or "auto".

    Returns (num_accepted [B], next_tokens [B]): the row commits d_1..d_n then next_token, which is the
    residual sample norm(max(0, p - q)) at the first rejection, or the bonus token from p after n drafts.
    Acceptance of d_k uses u_k = counter_uniform(seed, k, V) (accept iff u_k * q < p); the next token is
    a Gumbel-max sample with noise counter_uniform(seed, S + 1 + n, v).

    The Triton path is two launches: per-split row statistics (target argmax, or the log-sum-exp parts
    of p and q), then one program per (row, vocab split) that decides acceptance and samples row n.
    """
    if not _use_triton(backend, target_scores):
        return verify_block_reference(target_scores, draft_tokens, draft_logits, num_drafts, seeds)
    if draft_logits is not None and seeds is None:
        raise ValueError("verify_block: sampled verification needs `seeds`.")
    with _device_guard(target_scores):
        return _verify_block_triton(target_scores, draft_tokens, draft_logits, num_drafts, seeds)


def _verify_block_triton(target_scores, draft_tokens, draft_logits, num_drafts, seeds):
    batch_size, block_size = draft_tokens.shape
    vocab_size = target_scores.shape[-1]
    device = target_scores.device
    greedy = draft_logits is None
    if target_scores.stride(-1) != 1:
        target_scores = target_scores.contiguous()
    if not greedy and draft_logits.stride(-1) != 1:
        draft_logits = draft_logits.contiguous()
    draft = target_scores if greedy else draft_logits
    # Vocab splits: enough (row, position, split) programs to fill the device; chunks of 32 to 1024, at most V / 8
    # above 256 so that small vocabularies still split.
    block_v = min(1024, max(32, triton.next_power_of_2(triton.cdiv(vocab_size, 8))))
    num_rows = batch_size * (block_size + 1)
    num_splits = min(triton.cdiv(vocab_size, block_v), triton.cdiv(_num_programs_target(target_scores), num_rows))
    split_size = triton.cdiv(triton.cdiv(vocab_size, num_splits), block_v) * block_v
    num_splits = triton.cdiv(vocab_size, split_size)

    keys = torch.empty(batch_size, block_size + 1, num_splits, dtype=torch.int64, device=device)
    stats = torch.empty(batch_size, block_size + 1, num_splits, 4, dtype=torch.float32, device=device)
    result = torch.empty(batch_size, 3, dtype=torch.int64, device=device)
    num_accepted = torch.empty(batch_size, dtype=torch.int64, device=device)
    next_tokens = torch.empty(batch_size, dtype=torch.int64, device=device)
    logits_arguments = (target_scores, *target_scores.stride()[:2], draft, *draft.stride()[:2])
    _verify_stats_kernel[(batch_size, block_size + 1, num_splits)](
        *logits_arguments, keys, stats, result, block_size, vocab_size, split_size, num_splits,
        GREEDY=greedy, BLOCK_V=block_v,
    )  # fmt: skip
    _verify_kernel[(batch_size, 1 if greedy else num_splits)](
        *logits_arguments,
        draft_tokens.long().contiguous(), num_drafts.long().contiguous(),
        keys if greedy else seeds.long().contiguous(),
        keys, stats, result, num_accepted, next_tokens,
        block_size, vocab_size, split_size, num_splits,
        GREEDY=greedy,
        BLOCK_S=triton.next_power_of_2(block_size + 1), BLOCK_NS=triton.next_power_of_2(num_splits), BLOCK_V=block_v,
    )  # fmt: skip
    return num_accepted, next_tokens
