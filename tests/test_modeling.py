"""DSparkDraftModel: loading, attention semantics, context caching, Markov chain, confidence and the loss."""

import json
import math

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import AutoModel

import tools  # noqa: F401  (registers the repository as the package `dspark`)
from dspark.configuration_dspark import DSparkConfig
from dspark.kernels import gumbel_noise
from dspark.modeling_dspark import DSparkDraftModel
from test_config import tiny_kwargs
from tools.common import save_hub_layout

VOCAB, HIDDEN, FEATURES = 64, 32, 64  # FEATURES = 2 target layers x HIDDEN


@pytest.fixture
def draft():
    torch.manual_seed(0)
    model = DSparkDraftModel(DSparkConfig(**tiny_kwargs()))
    with torch.no_grad():  # non-trivial norms and heads, so every weight matters
        for name, param in model.named_parameters():
            if name.endswith("norm.weight") or "head" in name:
                param.normal_(1.0 if "norm" in name else 0.0, 0.3)
    return model.eval()


@pytest.fixture
def target_modules():
    torch.manual_seed(1)
    return nn.Embedding(VOCAB, HIDDEN), nn.Linear(HIDDEN, VOCAB, bias=False)


def run_block(model, features, anchor_ids, anchor_positions, embed):
    """Hidden rows of one block per row after appending `features` [B, T, F] as context."""
    cache = model.new_context_cache()
    positions = torch.arange(features.shape[1]).expand(features.shape[0], -1)
    model.append_context(cache, features, positions)
    embeds, block_positions = model.block_inputs(anchor_ids, anchor_positions, embed)
    return model(embeds, block_positions, cache)


# ---------------------------------------------------------------- loading


def test_remote_code_round_trip_gives_identical_outputs(draft, target_modules, tmp_path):
    save_hub_layout(draft, tmp_path)
    loaded = AutoModel.from_pretrained(tmp_path, trust_remote_code=True).eval()
    assert type(loaded).__name__ == "DSparkDraftModel" and type(loaded) is not DSparkDraftModel
    features, anchors, positions = torch.randn(2, 9, FEATURES), torch.tensor([5, 7]), torch.tensor([9, 9])
    embed, lm_head = target_modules
    hidden, loaded_hidden = (run_block(m, features, anchors, positions, embed) for m in (draft, loaded))
    torch.testing.assert_close(loaded_hidden, hidden, rtol=0, atol=0)
    drafted = draft.draft_block(hidden, anchors, lm_head)
    loaded_drafted = loaded.draft_block(loaded_hidden, anchors, lm_head)
    assert torch.equal(drafted.tokens, loaded_drafted.tokens)
    assert torch.equal(drafted.confidences, loaded_drafted.confidences)
    # save_pretrained writes the Hub names back, unprefixed
    resaved = tmp_path / "resaved"
    loaded.save_pretrained(resaved)
    assert sorted(load_file(resaved / "model.safetensors")) == sorted(draft.state_dict())


@pytest.mark.parametrize(
    "rename",
    [
        pytest.param(lambda name: name, id="flat"),
        pytest.param(lambda name: "model." + name, id="model-prefix"),
        pytest.param(
            lambda name: name.replace("markov_head.", "logit_head.").replace("confidence_head.", "logit_head."),
            id="specforge-logit_head",
        ),
    ],
)
def test_loads_checkpoint_name_layouts(draft, tmp_path, rename):
    draft.save_pretrained(tmp_path)
    state_dict = {rename(name): tensor.contiguous() for name, tensor in draft.state_dict().items()}
    state_dict["model.embed_tokens.weight"] = torch.zeros(VOCAB, HIDDEN)  # SpecForge may ship the target's
    save_file(state_dict, tmp_path / "model.safetensors")
    loaded = DSparkDraftModel.from_pretrained(tmp_path)
    for name, tensor in draft.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name
    temperatures = [2.0] * draft.config.block_size  # config values given at load time, checked as the file's
    overridden = DSparkDraftModel.from_pretrained(tmp_path, confidence_temperatures=temperatures)
    assert overridden.config.confidence_temperatures == temperatures
    with pytest.raises(ValueError, match="`confidence_temperatures` = \\[2.0\\]: must hold"):
        DSparkDraftModel.from_pretrained(tmp_path, confidence_temperatures=[2.0])


def test_missing_tensor_is_an_error_not_a_random_init(draft, tmp_path):
    draft.save_pretrained(tmp_path)
    state_dict = {n: t.contiguous() for n, t in draft.state_dict().items() if n != "layers.1.mlp.up_proj.weight"}
    save_file(state_dict, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match=r"lacks 1 tensor\(s\) of the draft, e.g. \['layers.1.mlp.up_proj.weight'\]"):
        DSparkDraftModel.from_pretrained(tmp_path)


def test_missing_tensor_of_a_prefixed_checkpoint_names_its_folder(draft, tmp_path):
    draft.save_pretrained(tmp_path)
    state_dict = {"model." + n: t.contiguous() for n, t in draft.state_dict().items() if n != "fc.weight"}
    save_file(state_dict, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match=rf"checkpoint at '{tmp_path}' lacks 1 tensor\(s\).*\['fc.weight'\]"):
        DSparkDraftModel.from_pretrained(tmp_path)


def save_with_weights(draft, path, edit) -> None:
    """Saves `draft` to `path`, then rewrites its weights with `edit` applied to a copy of the state dict."""
    draft.save_pretrained(path)
    state_dict = {name: tensor.clone() for name, tensor in draft.state_dict().items()}
    edit(state_dict)
    save_file(state_dict, path / "model.safetensors")


def add_layer(state_dict) -> None:
    state_dict.update({n.replace("layers.1.", "layers.2."): t.clone() for n, t in list(state_dict.items())
                       if n.startswith("layers.1.")})


def set_value(name: str, value: float):
    return lambda state_dict: state_dict[name].view(-1).__setitem__(0, value)


def without_heads_in_config(path) -> None:
    config = json.loads((path / "config.json").read_text())
    for keys in (config, config["dflash_config"]):
        keys.update(markov_rank=0, enable_confidence_head=False, confidence_head_with_markov=False)
    (path / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize(
    "edit, message",
    [
        pytest.param(add_layer, r"has 11 tensor\(s\) the config does not build, e.g. "
                     r"\['layers.2.input_layernorm.weight'.*num_hidden_layers=2", id="one-layer-more-than-the-config"),
        pytest.param(lambda sd: sd.update({"model.fc.weight": sd["fc.weight"].clone()}),
                     r"holds 'fc.weight' twice, as 'fc.weight' and as 'model.fc.weight'. Keep one name layout",
                     id="fc-and-model.fc"),
        pytest.param(lambda sd: sd.update({"logit_head.markov_w1.weight": sd["markov_head.markov_w1.weight"].clone()}),
                     r"holds 'markov_head.markov_w1.weight' twice", id="markov_head-and-logit_head"),
        pytest.param(lambda sd: sd.update({"norm.weight": torch.ones(HIDDEN, dtype=torch.int32)}),
                     r"stores 1 tensor\(s\) in a non-floating-point dtype, e.g. \{'norm.weight': 'I32'\}",
                     id="integer-tensor"),
        pytest.param(set_value("layers.0.mlp.up_proj.weight", math.nan),
                     r"has NaN or inf values in 1 tensor\(s\), e.g. \['layers.0.mlp.up_proj.weight'\]", id="nan"),
        pytest.param(set_value("markov_head.markov_w1.weight", math.inf), r"NaN or inf values in 1 tensor", id="inf"),
        pytest.param(set_value("confidence_head.proj.bias", -math.inf), r"NaN or inf values in 1 tensor", id="-inf"),
    ],
)
def test_surprising_weights_are_refused_at_load(draft, tmp_path, edit, message):
    save_with_weights(draft, tmp_path, edit)
    with pytest.raises(ValueError, match=message):
        DSparkDraftModel.from_pretrained(tmp_path)


def test_head_tensors_the_config_does_not_build_are_an_error(draft, tmp_path):
    draft.save_pretrained(tmp_path)
    without_heads_in_config(tmp_path)
    with pytest.raises(ValueError, match=r"has 4 tensor\(s\) the config does not build, e.g. \['confidence_head"
                                         r".*markov_rank=0, enable_confidence_head=False"):
        DSparkDraftModel.from_pretrained(tmp_path)


def test_values_a_smaller_dtype_cannot_hold_are_refused_at_load(draft, tmp_path):
    save_with_weights(draft, tmp_path, set_value("fc.weight", 1e6))  # float16 holds at most 65504
    assert DSparkDraftModel.from_pretrained(tmp_path, dtype=torch.bfloat16).dtype == torch.bfloat16
    with pytest.raises(ValueError, match=r"loaded as torch.float16, has NaN or inf values in 1 tensor\(s\), e.g. "
                                         r"\['fc.weight'\]"):
        DSparkDraftModel.from_pretrained(tmp_path, dtype=torch.float16)


def test_a_state_dict_with_integer_tensors_is_refused(draft):
    state_dict = dict(draft.state_dict(), **{"norm.weight": torch.ones(HIDDEN, dtype=torch.int64)})
    with pytest.raises(ValueError, match=r"non-floating-point dtype, e.g. \{'norm.weight': 'torch.int64'\}"):
        DSparkDraftModel.from_pretrained(None, config=draft.config, state_dict=state_dict)


def test_wrong_shape_is_an_error(draft, tmp_path):
    draft.save_pretrained(tmp_path)
    state_dict = {n: t.contiguous() for n, t in draft.state_dict().items()}
    state_dict["fc.weight"] = torch.zeros(HIDDEN, 3 * HIDDEN)
    save_file(state_dict, tmp_path / "model.safetensors")
    with pytest.raises(RuntimeError, match="ignore_mismatched_sizes"):
        DSparkDraftModel.from_pretrained(tmp_path)


def test_feature_width_mismatch_names_the_fix(draft):
    with pytest.raises(ValueError, match="target features have width 96, the draft expects 64"):
        draft.append_context(draft.new_context_cache(), torch.randn(1, 3, 96), torch.arange(3)[None])


# ---------------------------------------------------------------- attention semantics


def test_block_sees_context_before_the_anchor_and_its_whole_block(draft, target_modules):
    """Training blocks (many per row) see features strictly before their anchor, and their own block only."""
    embed, _ = target_modules
    seq_len, anchor = 12, 6
    features, input_ids = torch.randn(1, seq_len, FEATURES), torch.randint(0, 60, (1, seq_len))
    anchors = torch.tensor([[anchor, 9]])

    def hidden_of(features, block_embeds=None):
        cache = draft.new_context_cache()
        draft.append_context(cache, features, torch.arange(seq_len)[None])
        block_ids = torch.full((1, 2, 4), 63)
        block_ids[..., 0] = input_ids[0, anchors[0]]
        embeds = embed(block_ids.flatten(1)) if block_embeds is None else block_embeds
        positions = (anchors[..., None] + torch.arange(4)).flatten(1)
        mask = draft.block_attention_mask(anchors, seq_len)
        return draft(embeds, positions, cache, mask)[0, :4], embeds  # rows of the block at `anchor`

    reference, embeds = hidden_of(features)
    at_and_after = features.clone()
    at_and_after[:, anchor:] += 5.0
    torch.testing.assert_close(hidden_of(at_and_after)[0], reference)  # nothing at or after the anchor
    before = features.clone()
    before[:, anchor - 1] += 5.0
    assert not torch.allclose(hidden_of(before)[0], reference)  # every context token before it
    last_row_changed = embeds.clone()
    last_row_changed[:, 3] += 5.0
    assert not torch.allclose(hidden_of(features, last_row_changed)[0][0], reference[0])  # bidirectional block
    other_block_changed = embeds.clone()
    other_block_changed[:, 4:] += 5.0
    torch.testing.assert_close(hidden_of(features, other_block_changed)[0], reference)  # not other blocks

    # One block at inference (context = the tokens before the anchor) equals the training block.
    inference = run_block(draft, features[:, :anchor], input_ids[0, anchor][None], torch.tensor([anchor]), embed)
    torch.testing.assert_close(inference[0], reference, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("attn_implementation", ["eager", "sdpa"])
def test_incremental_context_with_crops_equals_full_recompute(draft, target_modules, attn_implementation):
    draft.config._attn_implementation = attn_implementation
    embed, _ = target_modules
    features = torch.randn(2, 20, FEATURES)
    positions = torch.arange(20).expand(2, -1)
    anchors, anchor_positions = torch.tensor([3, 4]), torch.tensor([14, 14])
    full = run_block(draft, features[:, :14], anchors, anchor_positions, embed)

    cache = draft.new_context_cache()
    draft.append_context(cache, features[:, :5], positions[:, :5])
    draft.append_context(cache, features[:, 5:11], positions[:, 5:11])  # 11 committed
    cache.crop(3)  # roll back to 8
    draft.append_context(cache, torch.randn(2, 4, FEATURES), positions[:, 8:12])  # rejected later
    cache.crop(torch.tensor([4, 4]))
    draft.append_context(cache, features[:, 8:14], positions[:, 8:14])
    assert cache.lengths.tolist() == [14, 14]
    embeds, block_positions = draft.block_inputs(anchors, anchor_positions, embed)
    torch.testing.assert_close(draft(embeds, block_positions, cache), full, atol=1e-5, rtol=1e-5)


def test_rows_with_different_lengths_and_padding_are_independent(draft, target_modules):
    """Left padding is never stored: a padded row equals the same row alone."""
    embed, _ = target_modules
    features = torch.randn(2, 8, FEATURES)
    valid = torch.ones(2, 8, dtype=torch.bool)
    valid[1, :3] = False  # row 1 is left-padded by 3
    positions = (valid.long().cumsum(-1) - 1).clamp(min=0)
    cache = draft.new_context_cache()
    draft.append_context(cache, features, positions, valid)
    assert cache.lengths.tolist() == [8, 5]
    anchors, anchor_positions = torch.tensor([10, 11]), torch.tensor([8, 5])
    embeds, block_positions = draft.block_inputs(anchors, anchor_positions, embed)
    batched = draft(embeds, block_positions, cache)
    alone = run_block(draft, features[1:, 3:], anchors[1:], anchor_positions[1:], embed)
    torch.testing.assert_close(batched[1:], alone, atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------- Markov chain and confidence


def slow_reference_block(model, hidden, anchor, lm_head, temperature=0.0, seed=None):
    """Step-by-step DSpark drafting of one row (DSPARK.md section 2, steps 4-6), written independently."""
    tokens, confidences, prev = [], [], int(anchor)
    w1, w2 = model.markov_head.markov_w1.weight, model.markov_head.markov_w2.weight
    proj = model.confidence_head.proj
    temperatures = model.config.confidence_temperatures or [1.0] * model.config.block_size
    for k in range(model.config.block_size):
        logits = lm_head(hidden[k]) + w2 @ w1[prev]  # row k predicts the token at anchor position + k + 1
        confidence_logit = proj(torch.cat([hidden[k], w1[prev]]))[0]
        confidences.append(torch.sigmoid(confidence_logit / temperatures[k]))
        if temperature > 0:
            noise = gumbel_noise(torch.tensor([seed]), k, logits.shape[-1])[0]
            prev = int(torch.argmax(logits / temperature + noise))
        else:
            prev = int(torch.argmax(logits))
        tokens.append(prev)
    return tokens, torch.stack(confidences)


@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_draft_block_matches_a_step_by_step_reference(draft, target_modules, temperature):
    draft.config.confidence_temperatures = [0.5, 1.0, 2.0, 4.0]
    embed, lm_head = target_modules
    anchors = torch.tensor([5, 9])
    hidden = run_block(draft, torch.randn(2, 6, FEATURES), anchors, torch.tensor([6, 6]), embed)
    seeds = torch.tensor([11, 12])
    drafted = draft.draft_block(hidden, anchors, lm_head, temperature=temperature, seeds=seeds)
    for row in range(2):
        tokens, confidences = slow_reference_block(
            draft, hidden[row], anchors[row], lm_head, temperature, int(seeds[row])
        )
        assert drafted.tokens[row].tolist() == tokens
        torch.testing.assert_close(drafted.confidences[row], confidences)
    # q is the distribution the tokens were drawn from: its logits include the Markov bias of the drafts
    prev = torch.cat([anchors[:, None], drafted.tokens[:, :-1]], dim=1)
    expected = lm_head(hidden) + draft.markov_head(prev)
    torch.testing.assert_close(drafted.logits, expected / (temperature or 1.0))


def test_sampling_is_reproducible_by_seed(draft, target_modules):
    embed, lm_head = target_modules
    anchors = torch.tensor([5, 9])
    hidden = run_block(draft, torch.randn(2, 6, FEATURES), anchors, torch.tensor([6, 6]), embed)
    lm_head.weight.data.mul_(0.01)  # near-uniform logits: different seeds give different drafts

    def sample(seed):
        return draft.draft_block(hidden, anchors, lm_head, temperature=1.0, seeds=torch.tensor([seed, seed + 1])).tokens

    assert torch.equal(sample(3), sample(3))
    assert not torch.equal(sample(3), sample(4))


def test_a_dflash_draft_has_no_markov_bias_nor_confidence(target_modules):
    torch.manual_seed(0)
    config = DSparkConfig(**tiny_kwargs(markov_rank=0, enable_confidence_head=False, confidence_head_with_markov=False))
    model = DSparkDraftModel(config).eval()
    embed, lm_head = target_modules
    hidden = run_block(model, torch.randn(1, 5, FEATURES), torch.tensor([3]), torch.tensor([5]), embed)
    drafted = model.draft_block(hidden, torch.tensor([3]), lm_head)
    assert drafted.confidences is None
    assert torch.equal(drafted.tokens, lm_head(hidden).argmax(-1))


# ---------------------------------------------------------------- training loss


class ConstantLMHead(nn.Module):
    """An LM head whose logits ignore the hidden state (so the loss can be checked by hand)."""

    def __init__(self, logits):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(logits.shape[-1], HIDDEN))
        self.logits = logits

    def forward(self, hidden):
        return hidden @ self.weight.T + self.logits


def test_loss_terms_by_hand(target_modules):
    """Block of 2, zero Markov tables, constant LM head and confidence logit b: every term is closed-form."""
    config = DSparkConfig(**tiny_kwargs(block_size=2))
    model = DSparkDraftModel(config)
    with torch.no_grad():
        model.markov_head.markov_w1.weight.zero_()
        model.confidence_head.proj.weight.zero_()
        model.confidence_head.proj.bias.fill_(0.3)
    draft_logits = torch.tensor([2.0, 0.0, -1.0] + [-30.0] * (VOCAB - 3))
    embed, _ = target_modules
    input_ids = torch.tensor([[7, 0, 1, 2]])
    loss_mask = torch.tensor([[0, 1, 1, 1]])  # anchors 1 (labels at 2, 3) and 2 (label at 3; 4 is past the end)
    target_logits = torch.full((1, 4, VOCAB), -30.0)
    target_logits[0, 1, :3] = torch.tensor([0.0, 3.0, 0.0])  # the target's distribution of position 2
    target_logits[0, 2, :3] = torch.tensor([0.0, 0.0, 3.0])  # ... and of position 3
    out = model.compute_loss(input_ids, loss_mask, torch.randn(1, 4, FEATURES), target_logits,
                             embed, ConstantLMHead(draft_logits), num_anchors=4)

    q = torch.softmax(draft_logits, -1)
    p2, p3 = torch.softmax(target_logits[0, 1], -1), torch.softmax(target_logits[0, 2], -1)
    # (label, target distribution, position weight exp(-k / 4)) of the three supervised block rows
    rows = [(1, p2, 1.0), (2, p3, math.exp(-1 / 4)), (2, p3, 1.0)]
    weights = torch.tensor([w for _, _, w in rows])
    ce = torch.stack([-torch.log(q[label]) for label, _, _ in rows])
    l1 = torch.stack([(q - p).abs().sum() for _, p, _ in rows])
    bce = torch.stack([F.binary_cross_entropy_with_logits(torch.tensor(0.3), 1 - x / 2) for x in l1])

    def weighted(x):
        return (x * weights).sum() / weights.sum()

    torch.testing.assert_close(out.cross_entropy, weighted(ce))
    torch.testing.assert_close(out.l1, weighted(l1))
    torch.testing.assert_close(out.confidence_bce, weighted(bce))
    torch.testing.assert_close(out.loss, 0.1 * weighted(ce) + 0.9 * weighted(l1) + weighted(bce))
    assert out.num_positions == 3


def test_a_position_counts_only_while_its_block_is_valid(draft, target_modules):
    embed, lm_head = target_modules
    input_ids = torch.randint(0, 60, (1, 10))
    loss_mask = torch.tensor([[0, 0, 1, 1, 1, 0, 1, 1, 1, 1]])  # the hole at 5 cuts blocks that cross it
    out = draft.compute_loss(input_ids, loss_mask, torch.randn(1, 10, FEATURES), torch.randn(1, 10, VOCAB),
                             embed, lm_head, num_anchors=100)
    # anchors: 2 (labels 3, 4 valid, then 5 invalid), 3 (label 4), 6 (7, 8, 9), 7 (8, 9), 8 (9)
    assert out.num_positions == 2 + 1 + 3 + 2 + 1


def test_a_target_with_padded_vocabulary_rows_trains_on_the_real_vocabulary(draft, target_modules):
    """LM heads padded past `vocab_size` (for kernel-friendly shapes): the padding of both the draft's and the
    target's logits is dropped, so the loss is the unpadded one."""
    embed, lm_head = target_modules
    padded_head = torch.nn.Linear(lm_head.in_features, VOCAB + 8, bias=False)
    padded_head.weight.data[:VOCAB] = lm_head.weight.data
    input_ids, features = torch.randint(0, 60, (1, 10)), torch.randn(1, 10, FEATURES)
    target_logits = torch.randn(1, 10, VOCAB)
    padded_logits = torch.cat([target_logits, torch.randn(1, 10, 8)], dim=-1)
    losses = [draft.compute_loss(input_ids, torch.ones(1, 10), features, logits, embed, head, num_anchors=4,
                                 generator=torch.Generator().manual_seed(0)).loss
              for logits, head in ((target_logits, lm_head), (padded_logits, padded_head))]
    torch.testing.assert_close(losses[1], losses[0])


def test_gradients_reach_only_draft_parameters(draft, target_modules):
    embed, lm_head = target_modules
    features = torch.randn(2, 12, FEATURES, requires_grad=True)
    target_logits = torch.randn(2, 12, VOCAB, requires_grad=True)
    out = draft.compute_loss(torch.randint(0, 60, (2, 12)), torch.ones(2, 12), features, target_logits,
                             embed, lm_head, num_anchors=4)
    out.loss.backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in draft.parameters())
    assert embed.weight.grad is None and lm_head.weight.grad is None
    assert features.grad is None and target_logits.grad is None
