"""Hot paths of a DSpark round outside the backbone, as PyTorch references.

- `markov_block_sample`: the Markov chain over a drafted block (DSPARK step 5) fused with the confidence
  head (step 6): draft tokens, the exact draft logits q was sampled from, and per-position confidences.
- `verify_block`: lossless verification of a block against the target's processed logits (step 8).

Sampling draws its randomness from `counter_uniform`, a counter-based hash of (seed, position, token), so
that every implementation of a kernel produces the same tokens for the same seed.
"""

from dataclasses import dataclass

import torch

_MASK32 = 0xFFFFFFFF


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
) -> MarkovBlockSample:
    """Run the Markov chain over a block (PyTorch reference).

    base_logits: [B, S, V] lm_head(h_k) of the draft's hidden rows.
    anchor_ids: [B] the last committed token of each row (prev_0).
    markov_w1, markov_w2: [V, r] Markov tables; None for a draft without Markov head.
    temperature: 0 drafts greedily (argmax, ties to the lowest index); > 0 samples from
        softmax(logits / temperature) by Gumbel-max with noise from `counter_uniform(seeds, k, v)`.
    seeds: [B] int64, required when sampling.
    confidence_base: [B, S] the hidden part of the confidence logit, proj_h . h_k + bias; None without head.
    confidence_markov_weight: [r] the Markov part of the confidence projection (None if the head has none).
    confidence_temperatures: [S] per-position calibration temperatures T_k (None means ones).
    """
    batch_size, block_size, vocab_size = base_logits.shape
    if temperature > 0 and seeds is None:
        raise ValueError("markov_block_sample: sampling (temperature > 0) needs `seeds`.")
    logits = base_logits.float().clone()
    tokens = torch.empty(batch_size, block_size, dtype=torch.long, device=base_logits.device)
    confidence_logits = None if confidence_base is None else confidence_base.float().clone()
    prev = anchor_ids
    for k in range(block_size):
        if markov_w1 is not None:
            prev_embedding = markov_w1[prev].float()  # [B, r]
            logits[:, k] += prev_embedding @ markov_w2.float().T
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


def verify_block(
    target_scores: torch.Tensor,
    draft_tokens: torch.Tensor,
    draft_logits: torch.Tensor | None,
    num_drafts: torch.Tensor,
    seeds: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Accept a prefix of each row's drafts and pick the token that follows it (PyTorch reference).

    target_scores: [B, S + 1, V] the target's logits after every logits processor; row k scores the token
        after verify position k (p = softmax(row)).
    draft_tokens: [B, S] the drafts d_1..d_S.
    draft_logits: [B, S, V] q = softmax(row) the drafts were sampled from; None verifies greedily
        (longest prefix equal to the target's argmax).
    num_drafts: [B] int64, how many leading drafts of each row are verified (the rest are ignored).
    seeds: [B] int64, randomness for sampled verification (uniforms from `counter_uniform`).

    Returns (num_accepted [B], next_tokens [B]): the row commits d_1..d_n then next_token, which is the
    residual sample norm(max(0, p - q)) at the first rejection, or the bonus token from p after n drafts.
    """
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
