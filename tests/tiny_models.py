"""Tiny float32 targets and DSpark drafts shared by the tests and the benchmark (CPU, seconds to build).

Targets (vocab 512, hidden 64, pad/bos/eos = 0/1/2, the mask token 3 never appears in text):
- `qwen3_target()`: dense Qwen3, 4 layers; draft features from layers [1, 3];
- `deepseek_v3_target()`: DeepseekV3 with MLA, 4 all-dense layers; features [1, 3];
- `kimi_linear_target()`: the stateful hybrid of background-kimi-target.md (8 layers, KDA except MLA at 0-based
  3 and 7, MoE after layer 0); features [3, 7], the last layer included.
- `qwen3_next_target()`: the gated-delta-rule hybrid (4 dense-MLP layers, gated DeltaNet except gated attention at
  layer 3; 2 key heads shared by 4 value heads); features [1, 3].

Drafts: `random_draft(name)` agrees with its target by chance only; `fitted_draft(name)` is briefly trained with
`compute_loss` on the target's own greedy text, so it agrees partially (tau > 1, with rejections). Every builder
is cached in-process: treat the returned models as read-only.
"""

import functools

import torch
import transformers.models.kimi_linear.modeling_kimi_linear as modeling_kimi_linear
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import (
    DeepseekV3Config,
    DeepseekV3ForCausalLM,
    KimiLinearConfig,
    KimiLinearForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3NextConfig,
    Qwen3NextForCausalLM,
    PreTrainedModel,
    PreTrainedTokenizerFast,
)

import tools  # noqa: F401  (registers the repository root as the package `dspark`)
from dspark.configuration_dspark import DSparkConfig
from dspark.generation_utils import TargetFeatureCapture
from dspark.modeling_dspark import DSparkDraftModel

# Tiny models are latency-bound: extra intra-op threads only spin against other processes on a shared CPU
# (measured here: 11 ms instead of 0.05 ms per 64-wide linear under load).
torch.set_num_threads(1)

VOCAB_SIZE, HIDDEN_SIZE = 512, 64
PAD, BOS, EOS, MASK = 0, 1, 2, 3
FIRST_TEXT_TOKEN = 4
TARGET_NAMES = ("qwen3", "deepseek_v3", "kimi_linear", "qwen3_next")
TARGET_LAYER_IDS = {"qwen3": [1, 3], "deepseek_v3": [1, 3], "kimi_linear": [3, 7], "qwen3_next": [1, 3]}
_SPECIAL = dict(pad_token_id=PAD, bos_token_id=BOS, eos_token_id=EOS, tie_word_embeddings=False)


def _frozen(model):
    model.generation_config.eos_token_id = EOS
    model.generation_config.pad_token_id = PAD
    return model.eval().requires_grad_(False)


@functools.cache
def qwen3_target(vocab_size: int = VOCAB_SIZE, initializer_range: float = 0.02, seed: int = 0) -> Qwen3ForCausalLM:
    torch.manual_seed(seed)
    config = Qwen3Config(
        vocab_size=vocab_size, hidden_size=HIDDEN_SIZE, intermediate_size=128, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, initializer_range=initializer_range, **_SPECIAL,
    )
    return _frozen(Qwen3ForCausalLM(config))


@functools.cache
def deepseek_v3_target(seed: int = 0) -> DeepseekV3ForCausalLM:
    torch.manual_seed(seed)
    config = DeepseekV3Config(
        vocab_size=VOCAB_SIZE, hidden_size=HIDDEN_SIZE, intermediate_size=128, moe_intermediate_size=32,
        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=32,
        qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=8, num_experts_per_tok=2,
        n_shared_experts=1, n_group=1, topk_group=1, first_k_dense_replace=4, **_SPECIAL,
    )
    return _frozen(DeepseekV3ForCausalLM(config))


def use_short_kda_chunks(chunk_size: int = 16) -> None:
    """Speed up kimi_linear on CPU (process-wide, idempotent): transformers' reference chunked KDA pads every
    multi-token forward to 64 tokens and loops over them in Python; 16-token chunks compute the same recurrence
    about 3x faster for the short forwards of these tests."""
    chunk = modeling_kimi_linear.chunk_kimi_delta_attention
    if getattr(chunk, "short_chunks", False):
        return

    @functools.wraps(chunk)
    def short_chunks(*args, **kwargs):
        return chunk(*args, **{**kwargs, "chunk_size": chunk_size})

    short_chunks.short_chunks = True
    modeling_kimi_linear.chunk_kimi_delta_attention = short_chunks


@functools.cache
def kimi_linear_target(seed: int = 0) -> KimiLinearForCausalLM:
    use_short_kda_chunks()
    torch.manual_seed(seed)
    config = KimiLinearConfig(
        vocab_size=VOCAB_SIZE, hidden_size=HIDDEN_SIZE, intermediate_size=128, moe_intermediate_size=32,
        num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=32,
        qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, num_local_experts=8, num_experts_per_tok=2,
        n_shared_experts=1, n_group=1, topk_group=1, routed_scaling_factor=2.446, norm_topk_prob=True,
        linear_attn_config={"full_attn_layers": [4, 8], "kda_layers": [1, 2, 3, 5, 6, 7], "num_heads": 4,
                            "head_dim": 16, "short_conv_kernel_size": 4},
        first_k_dense_replace=1, max_position_embeddings=4096, rms_norm_eps=1e-5, initializer_range=0.02,
        hidden_act="silu", **_SPECIAL,
    )
    return _frozen(KimiLinearForCausalLM(config))


@functools.cache
def qwen3_next_target(seed: int = 0) -> Qwen3NextForCausalLM:
    torch.manual_seed(seed)
    config = Qwen3NextConfig(
        vocab_size=VOCAB_SIZE, hidden_size=HIDDEN_SIZE, intermediate_size=128, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=0,
        layer_types=["linear_attention"] * 3 + ["full_attention"], linear_num_key_heads=2, linear_num_value_heads=4,
        linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4, **_SPECIAL,
    )
    return _frozen(Qwen3NextForCausalLM(config))


TARGETS = {"qwen3": qwen3_target, "deepseek_v3": deepseek_v3_target, "kimi_linear": kimi_linear_target,
           "qwen3_next": qwen3_next_target}


def draft_config(target_layer_ids: list[int], num_target_layers: int, vocab_size: int = VOCAB_SIZE, **overrides):
    """A 1-layer DSpark config matching the tiny targets (block 7 as Kimi K3's draft)."""
    return DSparkConfig(**{
        "vocab_size": vocab_size, "hidden_size": HIDDEN_SIZE, "intermediate_size": 128, "num_hidden_layers": 1,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "block_size": 7,
        "target_layer_ids": target_layer_ids, "num_target_layers": num_target_layers, "mask_token_id": MASK,
        "markov_rank": 16, "bos_token_id": BOS, "eos_token_id": EOS, "pad_token_id": PAD, **overrides,
    })


@functools.cache
def random_draft(name: str, seed: int = 0) -> DSparkDraftModel:
    target = TARGETS[name]()
    torch.manual_seed(seed)
    config = draft_config(TARGET_LAYER_IDS[name], target.config.num_hidden_layers, target.config.vocab_size)
    return DSparkDraftModel(config).eval().requires_grad_(False)


SMALL_VOCAB = 16


@functools.cache
def peaked_pair(name: str) -> tuple[PreTrainedModel, DSparkDraftModel]:
    """`name`'s tiny target with a 16-token vocabulary and larger initial weights (peaked next-token distributions),
    and a random draft for it: the drafts are often rejected and often accepted, at every block position, so
    sampled verification takes both of its branches (a draft accepted, a token from the residual) everywhere."""
    base = TARGETS[name]()
    torch.manual_seed(0)
    config = type(base.config)(**{**base.config.to_dict(), "vocab_size": SMALL_VOCAB, "initializer_range": 0.1})
    target = _frozen(type(base)(config))
    draft_settings = draft_config(TARGET_LAYER_IDS[name], config.num_hidden_layers, SMALL_VOCAB, initializer_range=0.1)
    return target, DSparkDraftModel(draft_settings).eval().requires_grad_(False)


def greedy_text(target, num_sequences: int, prompt_length: int, new_tokens: int, seed: int) -> torch.Tensor:
    """[N, prompt_length + new_tokens] random prompts continued greedily by the target (no EOS)."""
    generator = torch.Generator().manual_seed(seed)
    vocab_size = target.config.vocab_size
    prompts = torch.randint(FIRST_TEXT_TOKEN, vocab_size, (num_sequences, prompt_length), generator=generator)
    return target.generate(prompts, max_new_tokens=new_tokens, do_sample=False, eos_token_id=None)


@functools.cache
def fitting_text(name: str, seed: int = 0) -> torch.Tensor:
    """[12, 8 + 40] the target's greedy continuations of random 8-token prompts: what `fitted_draft` learns.
    Prefixes of these rows make prompts the fitted draft partially agrees on."""
    return greedy_text(TARGETS[name](), num_sequences=12, prompt_length=8, new_tokens=40, seed=seed)


@functools.cache
def fitted_draft(name: str, steps: int = 100, seed: int = 0) -> DSparkDraftModel:
    """A draft trained for `steps` AdamW steps (lr 1e-2) on `fitting_text(name)`."""
    target = TARGETS[name]()
    draft = random_draft.__wrapped__(name, seed).requires_grad_(True).train()
    text = fitting_text(name, seed)
    with TargetFeatureCapture(target, draft.config.target_layer_ids) as capture, torch.no_grad():
        target_logits = target(text).logits
        features = capture.features()
    loss_mask = torch.zeros_like(text)
    loss_mask[:, 8:] = 1
    optimizer = torch.optim.AdamW(draft.parameters(), lr=1e-2)
    generator = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        loss = draft.compute_loss(
            text, loss_mask, features, target_logits, target.get_input_embeddings(), target.get_output_embeddings(),
            num_anchors=16, generator=generator,
        ).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return draft.eval().requires_grad_(False)


def agreeing_prompts(name: str, num_prompts: int, seed: int = 0) -> list[torch.Tensor]:
    """Prefixes (8 to 20 tokens) of `fitting_text` rows: prompts whose continuation the fitted draft has seen."""
    text = fitting_text(name)
    generator = torch.Generator().manual_seed(seed)
    rows = torch.randint(len(text), (num_prompts,), generator=generator).tolist()
    lengths = torch.randint(8, 21, (num_prompts,), generator=generator).tolist()
    return [text[row, :length] for row, length in zip(rows, lengths)]


def random_prompts(num_prompts: int, min_length: int, max_length: int, seed: int, vocab_size: int = VOCAB_SIZE):
    """List of 1-D prompts of random lengths (text tokens only)."""
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(min_length, max_length + 1, (num_prompts,), generator=generator).tolist()
    return [torch.randint(FIRST_TEXT_TOKEN, vocab_size, (n,), generator=generator) for n in lengths]


def left_pad(prompts: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, attention_mask) [B, max_len] of left-padded prompts."""
    width = max(len(p) for p in prompts)
    input_ids = torch.full((len(prompts), width), PAD, dtype=torch.long)
    attention_mask = torch.zeros_like(input_ids)
    for row, prompt in enumerate(prompts):
        input_ids[row, width - len(prompt):] = prompt
        attention_mask[row, width - len(prompt):] = 1
    return input_ids, attention_mask


def letters_tokenizer() -> PreTrainedTokenizerFast:
    """One token per id: ids 4-29 are the letters a-z, every other id i is the string "<i>"; decoding
    concatenates tokens (what StopStringCriteria needs to map tokens to text)."""
    letters = {chr(ord("a") + i): 4 + i for i in range(26)}
    vocab = {**{f"<{i}>": i for i in range(VOCAB_SIZE) if i not in letters.values()}, **letters}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<0>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tokenizer.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="<0>", eos_token="<2>")
