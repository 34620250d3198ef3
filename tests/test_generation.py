"""DSpark decoding is lossless: token-identical to plain greedy `generate`, the target's distribution when sampling.

Targets: tiny float32 Qwen3 (dense), DeepseekV3 (MLA), kimi_linear and qwen3_next (stateful hybrids), see
tiny_models.py.
"""

import copy
import math

import pytest
import torch
from tiny_models import (
    EOS,
    PAD,
    SMALL_VOCAB,
    TARGET_NAMES,
    TARGETS,
    agreeing_prompts,
    fitted_draft,
    left_pad,
    peaked_pair,
    qwen3_target,
    random_prompts,
)
from transformers import Qwen3Config, Qwen3ForCausalLM, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper
from transformers.models.kimi_linear.modeling_kimi_linear import KimiLinearDeltaAttention

from dspark import generation_utils
from dspark.generation_utils import SpsCurve, TargetCache, dspark_generate
from dspark.kernels import MarkovBlockSample

# A made-up SPS curve (steps/s vs tokens per forward) whose decline makes `schedule` verify fewer than 7 drafts.
SPS = SpsCurve({1: 100.0, 8: 70.0, 24: 30.0})
TRUNCATIONS = {"full": {}, "threshold": {"confidence_threshold": 0.9}, "schedule": {"sps_curve": SPS}}
STATEFUL = ("kimi_linear", "qwen3_next")  # hybrids with linear-attention recurrent states


def _greedy_cases(name: str) -> list[tuple[list[torch.Tensor], int, str, bool]]:
    """(prompts, max_new_tokens, truncation, eos inside the output) cases, batch 1 and batch 3 (left-padded):
    44 prompts for a dense target, 27 for the (slower on CPU) stateful ones."""
    modes = list(TRUNCATIONS)
    agreeing = agreeing_prompts(name, 16, seed=1)
    random = random_prompts(16, 2, 9, seed=2)
    batch_1 = (1, 2, 6, 7, 8, 9, 50) if name not in STATEFUL else (1, 2, 7, 8, 9)
    cases = [([agreeing[i] if i % 2 else random[i]], n, modes[i % 3], False) for i, n in enumerate(batch_1)]
    cases.append(([agreeing[7]], 12, "full", True))
    batch_3 = [(9, False), (12, True)] if name in STATEFUL else [(9, False), (12, True), (6, False), (20, True)]
    for i, mode in enumerate(modes):  # two agreeing rows and a random one of other lengths
        prompts = [agreeing[8 + i], random[8 + i], agreeing[11 + i]]
        cases += [(prompts, n, mode, with_eos) for n, with_eos in batch_3]
    if name in STATEFUL:
        cases.append(([agreeing[14], random[14], agreeing[15]], 2, "schedule", False))
    return cases


@pytest.mark.parametrize("name, rollback", [*((name, "auto") for name in TARGET_NAMES), ("qwen3_next", "rerun")])
def test_greedy_equals_plain_generate(name, rollback):
    """169 prompts over the four targets, the gated-delta-rule hybrid with both of its exact rollbacks (replay, the
    default, and rerun): every truncation mode, max_new_tokens around the block size (1, 2, 6-9) and 50, EOS inside
    a block, batch 1 and left-padded batch 3 rows that accept different counts."""
    target, draft = TARGETS[name](), fitted_draft(name)
    committed = row_rounds = 0
    for prompts, max_new_tokens, truncation, with_eos in _greedy_cases(name):
        input_ids, attention_mask = left_pad(prompts)
        kwargs = dict(attention_mask=attention_mask, max_new_tokens=max_new_tokens, do_sample=False)
        if with_eos:  # a token the first row generates mid-block becomes EOS: that row stops there
            plain = target.generate(input_ids, **kwargs, eos_token_id=None)
            kwargs["eos_token_id"] = int(plain[0, input_ids.shape[1] + 4])
        expected = target.generate(input_ids, **kwargs)
        actual = target.generate(input_ids, assistant_model=draft, truncation=truncation, **TRUNCATIONS[truncation],
                                 rollback=rollback, **kwargs)
        assert torch.equal(actual, expected), (name, rollback, truncation, max_new_tokens, with_eos)
        if name in STATEFUL:
            assert draft.last_stats.rollback == ("replay" if rollback == "auto" else rollback)
        committed += draft.last_stats.committed_tokens
        row_rounds += draft.last_stats.row_rounds
    # The fitted draft agrees partially: tau > 1 (lower with rerun, whose batch rows commit the batch minimum).
    assert committed / row_rounds > (1.05 if rollback == "rerun" else 1.1)


@pytest.mark.parametrize("name", ["qwen3", "kimi_linear"])
def test_a_block_whose_drafts_are_all_right_is_accepted_whole(name, monkeypatch):
    """An oracle draft proposes the target's own greedy tokens: every full round accepts all 7 drafts and
    commits 8 tokens (the bonus from the last verified position), and the output is still plain greedy's."""
    target, draft = TARGETS[name](), fitted_draft(name)
    prompt = agreeing_prompts(name, 1, seed=9)[0][None]
    expected = target.generate(prompt, max_new_tokens=40, do_sample=False)
    block_size, vocab_size = draft.config.block_size, draft.config.vocab_size
    continuation = torch.cat([expected, torch.full((1, block_size), PAD)], dim=-1)  # drafts past the end: pads

    def oracle_draft(self, anchors, positions, max_drafts):
        tokens = continuation[:, positions[:, None] + 1 + torch.arange(block_size)][0]  # [B, S] after each anchor
        return MarkovBlockSample(tokens, torch.zeros(len(anchors), block_size, vocab_size), None)

    monkeypatch.setattr(generation_utils._DSparkDecoder, "_draft", oracle_draft)
    assert torch.equal(dspark_generate(target, draft, prompt, max_new_tokens=40, do_sample=False), expected)
    stats = draft.last_stats
    assert stats.position_accepted == stats.position_tried and stats.position_accepted[-1] == 4  # 4 full rounds
    assert stats.verify_lengths == [7, 7, 7, 7, 6] and stats.committed_tokens == 39


def test_partially_agreeing_draft_has_rejections_and_tau_above_one():
    target, draft = TARGETS["qwen3"](), fitted_draft("qwen3")
    input_ids, attention_mask = left_pad(agreeing_prompts("qwen3", 4, seed=3))
    dspark_generate(target, draft, input_ids, attention_mask=attention_mask, max_new_tokens=30, do_sample=False)
    stats = draft.last_stats
    assert stats.tau > 1.5
    assert 0 < stats.position_accepted[0] < stats.position_tried[0]  # some first drafts accepted, some rejected
    assert stats.generated_tokens == 4 * 30


@pytest.mark.parametrize("name", STATEFUL)
def test_stateful_rollback_is_exact_and_needed(name):
    """With the recurrent state restored (replay, or the rerun oracle) the tokens and the logits equal plain
    greedy's; with `crop` alone (rollback="none", the control) the logits drift from them (on kimi_linear the tokens
    diverge too; the tiny qwen3_next's greedy tokens happen to survive)."""
    target, draft = TARGETS[name](), fitted_draft(name)
    input_ids = agreeing_prompts(name, 1, seed=4)[0][None]
    kwargs = dict(max_new_tokens=16, do_sample=False, return_dict_in_generate=True, output_logits=True)
    expected = target.generate(input_ids, **kwargs)
    expected_logits = torch.stack(expected.logits)
    for rollback in ("replay", "rerun"):
        actual = dspark_generate(target, draft, input_ids, rollback=rollback, **kwargs)
        assert draft.last_stats.rollback == rollback
        assert torch.equal(actual.sequences, expected.sequences), rollback
        torch.testing.assert_close(torch.stack(actual.logits), expected_logits, atol=1e-4, rtol=1e-4)
        assert draft.last_stats.position_accepted[0] < draft.last_stats.position_tried[0]  # rejections happened
    control = dspark_generate(target, draft, input_ids, rollback="none", **kwargs)
    assert float((torch.stack(control.logits) - expected_logits).abs().max()) > 1e-3  # 0.86 and 0.015


@pytest.mark.parametrize("name", STATEFUL)
def test_replay_restores_the_same_state_as_rerun_and_reslicing_equals_crop(name):
    """After a 6-token verify forward in which rows commit 2 and 5 tokens, replay leaves the recurrent state
    that re-running the committed tokens gives (KDA's per-channel gates, the gated delta rule's per-head ones);
    with equal commits, per-row conv reslicing equals `crop`."""
    target = TARGETS[name]()
    input_ids, attention_mask = left_pad(random_prompts(2, 5, 9, seed=5))
    verify_ids = torch.randint(4, 512, (2, 6), generator=torch.Generator().manual_seed(5))

    def committed_cache(rollback, num_committed):
        cache = TargetCache(target, rollback)
        positions = (attention_mask.cumsum(-1) - 1).clamp(min=0)
        cache.forward(input_ids, positions, num_logits=1, slot_valid=attention_mask)
        cache.start_recording()
        verify_positions = attention_mask.sum(-1, keepdim=True) + torch.arange(6)
        cache.forward(verify_ids, verify_positions, num_logits=6, verify=True)
        if num_committed is not None:
            cache.commit(num_committed)
        return cache

    replayed = committed_cache("replay", torch.tensor([2, 5]))
    for row, count in enumerate((2, 5)):
        rerun = committed_cache("rerun", torch.tensor([count, count]))
        for layer_replayed, layer_rerun in zip(replayed.linear_layers, rerun.linear_layers):
            torch.testing.assert_close(layer_replayed.recurrent_states[0][row], layer_rerun.recurrent_states[0][row],
                                       atol=1e-5, rtol=1e-4)
            torch.testing.assert_close(layer_replayed.conv_states[0][row], layer_rerun.conv_states[0][row])
    assert replayed.slot_mask[:, -5:].tolist() == [[1, 1, 0, 0, 0], [1, 1, 1, 1, 1]]  # row 0's shortfall: holes

    resliced = committed_cache("none", torch.tensor([3, 3]))
    cropped = committed_cache("none", None)  # crop the recorded windows as stock assisted generation does
    for layer in cropped.linear_layers:
        layer.crop(-3)
    for a, b in zip(resliced.linear_layers, cropped.linear_layers):
        assert torch.equal(a.conv_states[0], b.conv_states[0])


def test_replay_refuses_a_verify_that_bypassed_the_intercepted_kernel():
    """If the model's linear-attention layers do not call the kernel TargetCache intercepts (one replaced during the
    forward, or a compiled model), replay has nothing to replay from: an error, never a silently stale recurrent
    state."""
    target = TARGETS["kimi_linear"]()
    cache = TargetCache(target, "replay")
    module, chunk_name, _ = cache.kernels
    kernel = getattr(module, chunk_name)  # transformers' function: nothing is installed outside DSpark forwards
    cache.forward(torch.tensor([[5, 6, 7]]), torch.arange(3)[None], num_logits=1)
    cache.start_recording()
    handle = target.register_forward_pre_hook(lambda *_: setattr(module, chunk_name, kernel))
    try:
        expected_error = r"0 of the target's 6 linear-attention layers called `chunk_kimi.*rerun"
        with pytest.raises(RuntimeError, match=expected_error):
            cache.forward(torch.tensor([[8, 9]]), torch.tensor([[3, 4]]), num_logits=2, verify=True)
    finally:
        handle.remove()
    assert getattr(module, chunk_name) is kernel


def test_replay_accepts_only_kernel_keywords_it_knows(monkeypatch):
    """A layer that passes its chunked kernel a keyword replay does not know (fla's `use_gate_in_kernel` would
    change what masking with g = 0, beta = 0 means): seen at the prefill, rollback="auto" falls back to rerun (still
    exact) and rollback="replay" refuses; first seen in a verify, the rollback cannot be done and both refuse."""
    target, draft = TARGETS["kimi_linear"](), fitted_draft("kimi_linear")
    forward = KimiLinearDeltaAttention.forward

    def with_gate_keyword(self, *args, **kwargs):
        return forward(self, *args, use_gate_in_kernel=False, **kwargs)  # transformers' kernels drop it

    input_ids = agreeing_prompts("kimi_linear", 1, seed=4)[0][None]
    monkeypatch.setattr(KimiLinearDeltaAttention, "forward", with_gate_keyword)
    expected = target.generate(input_ids, max_new_tokens=16, do_sample=False)
    assert torch.equal(dspark_generate(target, draft, input_ids, max_new_tokens=16, do_sample=False), expected)
    assert draft.last_stats.rollback == "rerun"
    unknown = r"`chunk_kimi_delta_attention` is called with \['use_gate_in_kernel'\].*Pass rollback='rerun'"
    with pytest.raises(ValueError, match=unknown):
        dspark_generate(target, draft, input_ids, max_new_tokens=16, do_sample=False, rollback="replay")

    monkeypatch.setattr(KimiLinearDeltaAttention, "forward", forward)
    cache = TargetCache(target, "auto")
    cache.forward(input_ids, torch.arange(input_ids.shape[1])[None], num_logits=1)
    cache.start_recording()
    monkeypatch.setattr(KimiLinearDeltaAttention, "forward", with_gate_keyword)
    with pytest.raises(ValueError, match=unknown):
        cache.forward(torch.tensor([[8, 9]]), torch.arange(2)[None] + input_ids.shape[1], num_logits=2, verify=True)


def sliding_window_target() -> Qwen3ForCausalLM:
    """Qwen3 (the weights of `qwen3_target`) whose even layers attend to the last 16 tokens only."""
    torch.manual_seed(0)
    config = {**qwen3_target().config.to_dict(), "sliding_window": 16, "use_sliding_window": True,
              "layer_types": ["sliding_attention", "full_attention"] * 2}
    target = Qwen3ForCausalLM(Qwen3Config(**config))
    target.load_state_dict(qwen3_target().state_dict())
    target.generation_config.eos_token_id, target.generation_config.pad_token_id = EOS, PAD
    return target.eval()


def test_sliding_window_layers_commit_the_batch_minimum_and_stay_exact(monkeypatch):
    """A sliding-window layer keeps only its last slots, so a masked hole would push a real token out of the
    window: rows commit the same count (as with the rerun rollback) and the output equals plain greedy.
    The control, per-row commits with holes, diverges."""
    target, draft = sliding_window_target(), fitted_draft("qwen3")
    assert TargetCache(target).uniform_commit and not TargetCache(qwen3_target()).uniform_commit
    input_ids, attention_mask = left_pad(agreeing_prompts("qwen3", 3, seed=0))
    kwargs = dict(attention_mask=attention_mask, max_new_tokens=30, do_sample=False)
    expected = target.generate(input_ids, **kwargs)
    assert torch.equal(target.generate(input_ids, assistant_model=draft, **kwargs), expected)
    assert draft.last_stats.tau > 1
    monkeypatch.setattr(TargetCache, "uniform_commit", property(lambda self: False))
    assert not torch.equal(target.generate(input_ids, assistant_model=draft, **kwargs), expected)


# ------------------------------------------------------------------------------------------------- sampling
NUM_SAMPLES, TV_TOLERANCE = 3000, 0.06
SAMPLING = {  # generation settings, and the warpers that give the processed target distribution
    "plain": (dict(temperature=1.0, top_k=0), [TemperatureLogitsWarper(1.0)]),
    "top_k": (dict(temperature=0.7, top_k=5), [TemperatureLogitsWarper(0.7), TopKLogitsWarper(5)]),
    "top_p": (dict(temperature=1.3, top_p=0.8, top_k=0), [TemperatureLogitsWarper(1.3), TopPLogitsWarper(0.8)]),
}


def _exact_marginals(target, prompt, warpers, num_tokens):
    """Exact marginal distributions [num_tokens, V] of the first generated tokens under the processed target."""
    vocab = SMALL_VOCAB
    prefixes, weights, marginals = prompt[None], torch.ones(1), []
    for _ in range(num_tokens):
        logits = target(prefixes).logits[:, -1].float()
        for warper in warpers:
            logits = warper(prefixes, logits)
        probs = torch.softmax(logits, dim=-1) * weights[:, None]  # [N, V] joint with each prefix
        marginals.append(probs.sum(0))
        next_tokens = torch.arange(vocab).repeat(len(prefixes))[:, None]
        prefixes = torch.cat([prefixes.repeat_interleave(vocab, 0), next_tokens], 1)
        weights = probs.flatten()
    return torch.stack(marginals)


@pytest.mark.parametrize("setting", SAMPLING)
def test_sampling_matches_the_target_distribution(setting):
    """3000 rows of one prompt, 3 new tokens (tokens 2-3 come from speculative verification): the empirical
    marginal of each token is within total-variation distance 0.06 of the exact processed target distribution
    (the sampling noise alone is about 0.03 here; fixed seed)."""
    settings, warpers = SAMPLING[setting]
    target, draft = peaked_pair("qwen3")
    prompt = torch.tensor([5, 9, 12, 7])
    torch.manual_seed(1)
    sequences = dspark_generate(target, draft, prompt.expand(NUM_SAMPLES, -1), max_new_tokens=3, do_sample=True,
                                eos_token_id=None, **settings)  # no EOS: no row stops early
    stats = draft.last_stats
    assert 0 < stats.position_accepted[0] < stats.position_tried[0]  # both speculative branches are exercised

    with torch.no_grad():
        exact = _exact_marginals(target, prompt, warpers, num_tokens=3)
    for position in range(3):
        empirical = torch.bincount(sequences[:, 4 + position], minlength=SMALL_VOCAB).float() / NUM_SAMPLES
        distance = 0.5 * (empirical - exact[position]).abs().sum()
        assert distance < TV_TOLERANCE, (position, float(distance))
    # The test has power: without top-k / top-p some marginal moves by more than twice the tolerance.
    if len(warpers) > 1:
        with torch.no_grad():
            unprocessed = _exact_marginals(target, prompt, warpers[:1], num_tokens=3)
        assert float(0.5 * (unprocessed - exact).abs().sum(-1).max()) > 2 * TV_TOLERANCE


PIT_PROMPTS = [torch.tensor(p) for p in ([5, 9, 12, 7], [4, 6, 8, 10], [11, 4, 4, 13], [15, 7, 9, 5])]
PIT_ALPHA = 1e-4  # the Kolmogorov-Smirnov test's false-alarm rate


def _sampled_pits(name: str, rollback: str, setting: str, rows: int, seeds: int) -> tuple[torch.Tensor, list[int]]:
    """Randomised probability integral transforms of every token DSpark sampled (16 per row, the rows of each
    PIT prompt under each seed) under the processed target distribution of its own prefix,
    F(x - 1) + U * p(x) with U ~ U(0, 1): independent U(0, 1) values exactly when each token is drawn from that
    distribution. Also the verified drafts per block position."""
    settings, warpers = SAMPLING[setting]
    target, draft = peaked_pair(name)
    values, tried = [], [0] * draft.config.block_size
    uniforms = torch.Generator().manual_seed(0)
    for prompt in PIT_PROMPTS:
        for seed in range(seeds):
            torch.manual_seed(seed)
            sequences = dspark_generate(target, draft, prompt.expand(rows, -1), max_new_tokens=16, do_sample=True,
                                        eos_token_id=None, rollback=rollback, **settings)
            tried = [a + b for a, b in zip(tried, draft.last_stats.position_tried)]
            with torch.no_grad():
                logits = target(sequences).logits[:, len(prompt) - 1 : -1].float()  # [B, 16, V]
            for warper in warpers:
                logits = warper(None, logits.flatten(0, 1)).view_as(logits)
            probs = torch.softmax(logits, dim=-1)
            tokens = sequences[:, len(prompt) :, None]
            below, at = (probs.cumsum(-1) - probs).gather(-1, tokens)[..., 0], probs.gather(-1, tokens)[..., 0]
            values.append(below + torch.rand(at.shape, generator=uniforms) * at)
    return torch.cat([v.flatten() for v in values]), tried


def _ks_distance_and_bound(values: torch.Tensor) -> tuple[float, float]:
    """The Kolmogorov-Smirnov distance of `values` from U(0, 1), and the distance that i.i.d. uniform values
    exceed with probability PIT_ALPHA (the asymptotic bound 2 exp(-2 n d^2) = alpha)."""
    ordered, n = values.double().sort().values, len(values)
    ranks = torch.arange(1, n + 1, dtype=torch.float64)
    distance = float(torch.maximum(ranks / n - ordered, ordered - (ranks - 1) / n).max())
    return distance, math.sqrt(math.log(2 / PIT_ALPHA) / (2 * n))


@pytest.mark.parametrize("setting", SAMPLING)
@pytest.mark.parametrize("name", ["qwen3", "kimi_linear", "qwen3_next"])
def test_every_sampled_token_follows_the_target_distribution_given_its_prefix(name, setting):
    """12,288 tokens (4 prompts x 192 rows x 16) on a dense and two stateful targets, every block position
    verified and rejected: the tokens' PITs under the processed target distribution pass a KS test at 1e-4. It
    tests each token's distribution given everything before it, so every draft position, the chained
    acceptances, the residual samples and the recurrent-state rollback after them."""
    values, tried = _sampled_pits(name, "auto", setting, rows=192, seeds=1)
    assert all(count > 0 for count in tried)
    distance, bound = _ks_distance_and_bound(values)
    assert distance < bound, (distance, bound)


def test_step_aligned_sampled_rows_follow_the_target_distribution():
    """Rows that commit the batch minimum (the rerun rollback) take the target's own token where they accepted
    more: their tokens too pass the PIT test (4 prompts x 8 seeds x 3 rows x 16 tokens)."""
    values, tried = _sampled_pits("qwen3_next", "rerun", "plain", rows=3, seeds=8)
    assert tried[1] > 0  # rounds that committed past the first draft
    distance, bound = _ks_distance_and_bound(values)
    assert distance < bound, (distance, bound)


def test_the_pit_test_detects_a_residual_drawn_from_p(monkeypatch):
    """The PIT test has power: a verifier that, after a rejection, draws the next token from p instead of the
    residual max(0, p - q) fails it on the dense target (KS distance 0.028 against the bound 0.020; the exact
    sampler's distances are 0.004 to 0.013). Smaller biases (top-k, top-p: 0.015, 0.020) can pass."""
    verify_block = generation_utils.verify_block

    def from_p_after_a_rejection(scores, drafts, draft_logits, num_drafts, seeds):
        num_accepted, next_tokens = verify_block(scores, drafts, draft_logits, num_drafts, seeds)
        p = torch.softmax(scores[torch.arange(len(drafts)), num_accepted].float(), dim=-1)
        return num_accepted, torch.where(num_accepted < num_drafts, torch.multinomial(p, 1)[:, 0], next_tokens)

    monkeypatch.setattr(generation_utils, "verify_block", from_p_after_a_rejection)
    distance, bound = _ks_distance_and_bound(_sampled_pits("qwen3", "auto", "plain", rows=192, seeds=1)[0])
    assert distance > bound, (distance, bound)


@pytest.mark.parametrize("truncation", ["threshold", "schedule"])
@pytest.mark.parametrize("do_sample", [False, True], ids=["greedy", "sampling"])
def test_rounds_whose_first_confidence_rules_out_every_draft_skip_the_block_logits(truncation, do_sample):
    """Threshold and schedule decide draft 1 from c_1 alone, so a round in which no row would verify it stops
    after the backbone, before the LM head: the same tokens, verify lengths and acceptance as drafting every
    block (the sampling runs draw the same random numbers), with fewer blocks drafted."""
    target, draft = TARGETS["qwen3"](), fitted_draft("qwen3")
    input_ids, attention_mask = left_pad(agreeing_prompts("qwen3", 2, seed=5) + random_prompts(1, 3, 6, seed=5))
    # The fitted draft's c_1 are 0.81-0.93. Schedule: doubling the tokens of a forward costs 47% of its speed, so
    # draft 1 pays only when the rows' c_1 average 0.905 or more.
    steep = SpsCurve({num_tokens: 100.0 / num_tokens**0.93 for num_tokens in range(1, 25)})
    settings = {"threshold": {"confidence_threshold": 0.9}, "schedule": {"sps_curve": steep}}
    kwargs = dict(attention_mask=attention_mask, max_new_tokens=30, do_sample=do_sample, truncation=truncation,
                  **settings[truncation])

    def run(gate: bool):
        drafted_blocks = []
        draft_block = type(draft).draft_block
        with pytest.MonkeyPatch.context() as patch:  # undone even if generation raises
            patch.setattr(type(draft), "draft_block", lambda *args: drafted_blocks.append(1) or draft_block(*args))
            if not gate:
                patch.setattr(generation_utils, "rules_out_every_draft", lambda *args: False)
            torch.manual_seed(0)
            sequences = dspark_generate(target, draft, input_ids, **kwargs)
        return sequences, draft.last_stats, len(drafted_blocks)

    gated, gated_stats, gated_blocks = run(gate=True)
    every, every_stats, every_blocks = run(gate=False)
    assert torch.equal(gated, every)
    assert gated_stats.verify_lengths == every_stats.verify_lengths
    assert gated_stats.position_accepted == every_stats.position_accepted
    assert every_stats.rounds_without_draft == 0
    assert 0 < gated_stats.rounds_without_draft < gated_stats.rounds  # both kinds of round happen
    assert gated_blocks == every_blocks - gated_stats.rounds_without_draft


@pytest.mark.parametrize("truncation", ["threshold", "schedule"])
def test_the_first_confidences_decide_whether_any_draft_is_verified(truncation):
    """`rules_out_every_draft(c_1)` is `choose_num_drafts(c_1..c_S) == 0` for every row, whatever c_2..c_S are."""
    torch.manual_seed(0)
    curves = [SPS, SpsCurve({num_tokens: 100.0 / num_tokens**0.9 for num_tokens in range(1, 33)})]
    outcomes = set()
    for trial in range(400):
        batch_size = 1 + trial % 4
        confidences = torch.rand(batch_size, 7) ** 0.3
        max_drafts = torch.randint(0, 8, (batch_size,))
        settings = dict(threshold=0.8, sps=curves[trial % 2])
        ruled_out = generation_utils.rules_out_every_draft(confidences[:, 0], max_drafts, truncation, **settings)
        chosen = generation_utils.choose_num_drafts(confidences, max_drafts, truncation, **settings)
        assert ruled_out == bool((chosen == 0).all()), (confidences, max_drafts)
        outcomes.add(ruled_out)
    assert outcomes == {True, False}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_first_confidences_are_the_blocks_first_confidences(dtype):
    """Also for a bf16 draft: both compute the confidence logit in float32 (a bf16 logit would round by ~0.01)."""
    draft = copy.deepcopy(fitted_draft("qwen3")).to(dtype)
    draft.config.confidence_temperatures = [1.7, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0]
    torch.manual_seed(0)
    hidden, anchors = torch.randn(4, 7, draft.config.hidden_size, dtype=dtype), torch.randint(100, (4,))
    lm_head = torch.nn.Linear(draft.config.hidden_size, draft.config.vocab_size, bias=False, dtype=dtype)
    block = draft.draft_block(hidden, anchors, lm_head)
    torch.testing.assert_close(draft.first_confidences(hidden, anchors), block.confidences[:, 0])
