"""The user-facing surface of DSpark generation: the `generate` route, the explicit function, errors, streamers,
stopping criteria, the SPS curve and its profiler, stage timings and accelerate offloading."""

import inspect
import re
import sys

import pytest
import torch
from tiny_models import (
    EOS,
    TARGETS,
    VOCAB_SIZE,
    agreeing_prompts,
    draft_config,
    fitted_draft,
    left_pad,
    letters_tokenizer,
    qwen3_target,
    random_draft,
    random_prompts,
)
from transformers import (
    AutoModel,
    FalconH1Config,
    FalconH1ForCausalLM,
    GenerationConfig,
    GenerationMixin,
    Qwen3Config,
    Qwen3ForCausalLM,
    StoppingCriteria,
    StoppingCriteriaList,
    SynthIDTextWatermarkingConfig,
)
from transformers.generation.streamers import BaseStreamer

from dspark import generation_utils
from dspark.generation_utils import SpsCurve, dspark_generate, install_generate_route, load_sps_curve
from dspark.modeling_dspark import DSparkDraftModel


def _prompt(seed: int = 0) -> torch.Tensor:
    return agreeing_prompts("qwen3", 1, seed=seed)[0][None]


# ------------------------------------------------------------------------------------------------ routing
def test_generation_without_a_dspark_assistant_runs_the_original_generate_unchanged():
    target = qwen3_target()
    routed = GenerationMixin.generate
    original = routed.__wrapped__
    input_ids = _prompt()
    expected = original(target, input_ids, max_new_tokens=12, do_sample=False)

    executed = set()
    sys.setprofile(lambda frame, event, arg: executed.add(frame.f_code) if event == "call" else None)
    try:
        actual = target.generate(input_ids, max_new_tokens=12, do_sample=False)
    finally:
        sys.setprofile(None)
    assert torch.equal(actual, expected)
    assert inspect.unwrap(original).__code__ in executed  # the original function object ran
    assert dspark_generate.__wrapped__.__code__ not in executed


def test_route_is_installed_once():
    routed = GenerationMixin.generate
    install_generate_route()
    install_generate_route()
    assert GenerationMixin.generate is routed
    assert not getattr(routed.__wrapped__, "_dspark_route", False)


def test_stock_assisted_generation_with_a_small_autoregressive_assistant_is_untouched():
    target = qwen3_target()
    torch.manual_seed(0)
    config = {**target.config.to_dict(), "num_hidden_layers": 2, "layer_types": None}
    assistant = Qwen3ForCausalLM(Qwen3Config(**config)).eval()
    input_ids = _prompt()
    expected = target.generate(input_ids, max_new_tokens=10, do_sample=False)
    assisted = target.generate(input_ids, assistant_model=assistant, max_new_tokens=10, do_sample=False)
    assert torch.equal(assisted, expected)


def test_user_call_with_a_draft_loaded_as_remote_code(tmp_path):
    """`AutoModel.from_pretrained(dir, trust_remote_code=True)` builds a second copy of the classes (a different
    module); `target.generate(input_ids, assistant_model=draft)` still runs DSpark, with no other step."""
    target, draft = qwen3_target(), fitted_draft("qwen3")
    draft.save_pretrained(tmp_path)
    remote_draft = AutoModel.from_pretrained(tmp_path, trust_remote_code=True).eval()
    assert type(remote_draft).__module__ != DSparkDraftModel.__module__
    input_ids = _prompt()
    expected = target.generate(input_ids, max_new_tokens=20, do_sample=False)
    actual = target.generate(input_ids, assistant_model=remote_draft, max_new_tokens=20, do_sample=False)
    assert torch.equal(actual, expected)
    assert remote_draft.last_stats.tau > 1
    # The remote copy's own loop accepts objects made by this copy (an SPS curve) too.
    remote_generation_utils = sys.modules[type(remote_draft).__module__.rsplit(".", 1)[0] + ".generation_utils"]
    scheduled = remote_generation_utils.dspark_generate(
        target, remote_draft, input_ids, max_new_tokens=20, do_sample=False,
        truncation="schedule", sps_curve=SpsCurve({1: 100.0, 8: 100.0}),
    )
    assert torch.equal(scheduled, expected)


def test_stateful_target_works_through_the_user_call():
    """Stock transformers refuses assisted generation for kimi_linear; through the route it works and is exact."""
    target, draft = TARGETS["kimi_linear"](), fitted_draft("kimi_linear")
    input_ids = agreeing_prompts("kimi_linear", 1, seed=7)[0][None]
    expected = target.generate(input_ids, max_new_tokens=8, do_sample=False)
    assert torch.equal(target.generate(input_ids, assistant_model=draft, max_new_tokens=8, do_sample=False), expected)
    assert draft.last_stats.rollback == "replay"


# ------------------------------------------------------------------------------------- explicit function
def test_explicit_function_returns_generate_output_scores_and_statistics():
    target, draft = qwen3_target(), fitted_draft("qwen3")
    input_ids = _prompt(1)
    kwargs = dict(max_new_tokens=15, do_sample=False, return_dict_in_generate=True, output_scores=True,
                  output_logits=True, repetition_penalty=1.3)
    expected = target.generate(input_ids, **kwargs)
    actual = dspark_generate(target, draft, input_ids, **kwargs)
    assert torch.equal(actual.sequences, expected.sequences)
    assert len(actual.scores) == len(expected.scores) == len(actual.logits) == 15
    for ours, theirs in zip(actual.scores + actual.logits, expected.scores + expected.logits):
        torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=1e-4)
    stats = draft.last_stats
    assert actual.past_key_values is None  # the speculative cache (holes, dropped rows) cannot continue
    assert stats.generated_tokens == 15 and stats.committed_tokens == 14  # the prefill made the first token
    assert stats.rounds == len(stats.verify_lengths) and stats.tau > 1
    assert stats.time_total >= stats.time_draft + stats.time_verify + stats.time_rollback
    assert stats.conditional_acceptance == [a / t if t else pytest.approx(float("nan"), nan_ok=True)
                                            for a, t in zip(stats.position_accepted, stats.position_tried)]
    assert sum(stats.position_accepted) == stats.committed_tokens - stats.row_rounds  # accepted drafts + bonuses


# -------------------------------------------------------------------------------------------------- errors
def falcon_h1_target() -> FalconH1ForCausalLM:
    """Mamba and attention side by side in every layer: transformers' "hybrid" cache layers."""
    torch.manual_seed(0)
    config = FalconH1Config(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, mamba_d_ssm=64, mamba_n_heads=4, mamba_d_head=16, mamba_n_groups=1,
        mamba_d_state=16, mamba_chunk_size=16, pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )
    return FalconH1ForCausalLM(config).eval()


def _draft_with(**overrides) -> DSparkDraftModel:
    config = draft_config([1, 3], 4, **overrides)
    return DSparkDraftModel(config).eval()


@pytest.mark.parametrize(
    "make_draft, kwargs, message",  # each message names the problem, then the fix
    [
        (lambda: _draft_with(hidden_size=32, num_attention_heads=2, num_key_value_heads=1), {},
         r"hidden_size 32 but the target .* has 64.*Use the target the draft was trained for"),
        (lambda: _draft_with(vocab_size=600), {}, r"vocab_size is 600 but the target's is 512.*Use the target"),
        (lambda: DSparkDraftModel(draft_config([1, 5], 8)), {}, r"layers \[1, 5\] but .* has only 4 layers.*Use the"),
        (lambda: random_draft("qwen3"), {"num_beams": 2}, r"beam search .* use num_beams=1"),
        (lambda: random_draft("qwen3"), {"num_return_sequences": 2, "do_sample": True},
         r"num_return_sequences=2 is not supported; repeat the prompt in the batch"),
        (lambda: random_draft("qwen3"), {"truncation": "sometimes"},
         r"unknown truncation 'sometimes'; choose one of \('full', 'threshold', 'schedule'\)"),
        (lambda: _draft_with(enable_confidence_head=False, confidence_head_with_markov=False),
         {"truncation": "threshold"}, r"needs the draft's confidence head; use truncation='full'"),
        (lambda: random_draft("qwen3"), {"rollback": "sometimes"}, r"unknown rollback 'sometimes'; choose one of"),
        (lambda: random_draft("qwen3"), {"output_hidden_states": True},  # transformers passes it on to the model
         r"unsupported generate arguments \['output_hidden_states'\]: .* remove them"),
        (lambda: random_draft("qwen3"), {"generation_config": GenerationConfig(output_attentions=True)},
         r"unsupported generate arguments \['output_attentions'\]: .* remove them"),
        (lambda: random_draft("qwen3"), {"guidance_scale": 2.0}, r"guidance_scale\) is not supported; remove"),
        (lambda: random_draft("qwen3"), {"token_type_ids": torch.zeros(1, 3, dtype=torch.long)},
         r"unsupported generate arguments \['token_type_ids'\]: .* remove them"),
        (lambda: random_draft("qwen3"),
         {"input_ids": torch.ones(2, 3, dtype=torch.long) * 7, "streamer": BaseStreamer()},
         r"streamers take one sequence; stream with batch"),
        (lambda: random_draft("qwen3"), {"confidence_threshold": 0.0}, r"confidence_threshold must be in \(0, 1\]"),
        (lambda: random_draft("qwen3"), {"confidence_threshold": 1.5}, r"confidence_threshold must be in \(0, 1\]"),
        (lambda: random_draft("qwen3"), {"confidence_threshold": float("nan")}, r"\(0, 1\].*got nan.*default is 0.5"),
        (lambda: random_draft("qwen3"), {"target": falcon_h1_target},
         r"FalconH1ForCausalLM keeps linear attention .* Decode it without an assistant"),
        (lambda: random_draft("qwen3"), {"do_sample": True, "watermarking_config": SynthIDTextWatermarkingConfig(
            keys=[3, 5, 7], ngram_len=2)}, r"SynthID text watermarking keeps state.*without the assistant"),
    ],
    ids=["hidden", "vocab", "layers", "beams", "return_sequences", "truncation", "no_confidence_head", "rollback",
         "hidden_states", "attentions", "guidance", "model_kwargs", "streamer_batch", "threshold_zero",
         "threshold_above_one", "threshold_nan", "hybrid_cache_layers", "synthid_watermark"],
)
def test_clear_errors_before_any_target_forward(make_draft, kwargs, message):
    kwargs = dict(kwargs)
    target, draft = kwargs.pop("target", qwen3_target)(), make_draft()
    input_ids = kwargs.pop("input_ids") if "input_ids" in kwargs else _prompt()  # (_prompt runs the qwen3 target)
    forwards = []
    handle = target.register_forward_hook(lambda *args: forwards.append(1))
    try:
        with pytest.raises(ValueError, match=message):
            target.generate(input_ids, assistant_model=draft, max_new_tokens=4, **kwargs)
    finally:
        handle.remove()
    assert not forwards


def test_warnings_for_float16_targets_and_prompts_longer_than_the_trained_context():
    target = qwen3_target()
    with pytest.warns(UserWarning, match="float16"):
        dspark_generate(Qwen3ForCausalLM(target.config).half().eval(), random_draft("qwen3"), _prompt(),
                        max_new_tokens=1)
    short_context_draft = _draft_with(trained_context_length=4)
    with pytest.warns(UserWarning, match="trained context of 4"):
        dspark_generate(target, short_context_draft, _prompt(), max_new_tokens=1)


# -------------------------------------------------------------------------------- streaming and stopping
class RecordingStreamer(BaseStreamer):
    def __init__(self):
        self.chunks, self.ended = [], False

    def put(self, value):
        self.chunks.append(value.reshape(-1).tolist())

    def end(self):
        self.ended = True


def test_streamer_receives_every_token_once_in_order():
    target, draft = qwen3_target(), fitted_draft("qwen3")
    input_ids = _prompt(2)
    streamer = RecordingStreamer()
    sequences = target.generate(input_ids, assistant_model=draft, max_new_tokens=20, do_sample=False, streamer=streamer)
    assert streamer.chunks[0] == input_ids[0].tolist()  # the prompt first, as `generate` does
    assert sum(streamer.chunks[1:], []) == sequences[0, input_ids.shape[1]:].tolist()
    assert streamer.ended and len(streamer.chunks) < 1 + 20  # several tokens per round


class StopAfterTokens(StoppingCriteria):
    """A custom criterion: stop a row once one of `tokens` occurs among its last 3 tokens."""

    def __init__(self, tokens: list[int]):
        self.tokens = torch.tensor(tokens)

    def __call__(self, input_ids, scores, **kwargs):
        return torch.isin(input_ids[:, -3:], self.tokens).any(-1)


@pytest.mark.parametrize("eos_token_id", [EOS, None], ids=["eos_pads_finished_rows", "no_eos_rows_continue"])
def test_stop_strings_and_custom_criteria_stop_where_plain_generate_stops(eos_token_id):
    """Every row stops mid-block at a different step. With an EOS token, stopped rows are padded; without one,
    `generate` keeps every row going until the last one stops: the same here."""
    target, draft = qwen3_target(), fitted_draft("qwen3")
    tokenizer = letters_tokenizer()
    input_ids, attention_mask = left_pad(agreeing_prompts("qwen3", 2, seed=8) + random_prompts(1, 3, 5, seed=8))
    common = dict(attention_mask=attention_mask, max_new_tokens=24, do_sample=False, eos_token_id=eos_token_id)
    plain = target.generate(input_ids, **common)
    start = input_ids.shape[1]
    stop_tokens = [int(plain[row, start + 3 + 4 * row]) for row in range(3)]
    stop_strings = tokenizer.convert_ids_to_tokens(stop_tokens)
    for extra in ({"stop_strings": stop_strings, "tokenizer": tokenizer},
                  {"stopping_criteria": StoppingCriteriaList([StopAfterTokens(stop_tokens)])}):
        expected = target.generate(input_ids, **common, **extra)
        actual = target.generate(input_ids, assistant_model=draft, **common, **extra)
        assert torch.equal(actual, expected)
        assert expected.shape[1] < plain.shape[1]


# ---------------------------------------------------------------------------------------- SPS profiler
def test_sps_profiler_writes_a_curve_that_schedule_then_reuses(tmp_path):
    target, draft = qwen3_target(), fitted_draft("qwen3")
    path = tmp_path / "sps.json"
    curve = load_sps_curve(target, batch_size=1, max_tokens_per_row=8, path=path)
    assert sorted(curve.points) == list(range(1, 9)) and all(sps > 0 for sps in curve.points.values())
    assert SpsCurve.load(path).points == curve.points
    written = path.stat().st_mtime_ns
    input_ids = _prompt(3)
    expected = target.generate(input_ids, max_new_tokens=10, do_sample=False)
    actual = target.generate(input_ids, assistant_model=draft, max_new_tokens=10, do_sample=False,
                             truncation="schedule", sps_curve=path)
    assert torch.equal(actual, expected)
    assert path.stat().st_mtime_ns == written  # profiled once, then read from the cache


def test_schedule_profiles_verifies_with_the_rollback_it_decodes_with(tmp_path, monkeypatch):
    """A stateful target: the profiler times each verify window with the call's rollback and forgets it again (with
    rerun that restores the state and re-runs nothing), and keeps one cached curve per rollback."""
    monkeypatch.setenv("DSPARK_CACHE", str(tmp_path))
    target, draft = TARGETS["qwen3_next"](), fitted_draft("qwen3_next")
    input_ids = agreeing_prompts("qwen3_next", 1, seed=2)[0][None]
    expected = target.generate(input_ids, max_new_tokens=12, do_sample=False)
    for rollback in ("rerun", "replay"):
        actual = target.generate(input_ids, assistant_model=draft, max_new_tokens=12, do_sample=False,
                                 truncation="schedule", rollback=rollback)
        assert torch.equal(actual, expected) and draft.last_stats.rollback == rollback
    assert len(list((tmp_path / "sps").glob("*.json"))) == 2


def test_schedule_stops_at_the_first_throughput_drop():
    confidences = torch.tensor([[0.9, 0.9, 0.1, 0.9, 0.9, 0.9, 0.9]])
    flat = SpsCurve({1: 100.0, 8: 100.0})  # verifying is free: take every draft
    steep = SpsCurve({1: 100.0, 8: 30.0})  # each extra token costs 10%: stop once survival falls
    max_drafts = torch.tensor([7])
    assert generation_utils.choose_num_drafts(confidences, max_drafts, "schedule", sps=flat).tolist() == [7]
    assert generation_utils.choose_num_drafts(confidences, max_drafts, "schedule", sps=steep).tolist() == [2]
    assert generation_utils.choose_num_drafts(confidences, max_drafts, "threshold", 0.5).tolist() == [2]
    assert generation_utils.choose_num_drafts(confidences, torch.tensor([1]), "full").tolist() == [1]


@pytest.mark.parametrize(
    "points, message",
    [({}, "at least one point"), ({0: 10.0}, "token count 0 must be a positive int"),
     ({2.5: 10.0}, "token count 2.5 must be a positive int"), ({8: -1.0}, "steps/s -1.0 at 8 tokens"),
     ({8: float("nan")}, "steps/s nan at 8 tokens"), ({8: float("inf")}, "steps/s inf at 8 tokens")],
    ids=["empty", "zero_tokens", "fractional_tokens", "negative_sps", "nan_sps", "infinite_sps"],
)
def test_sps_curve_refuses_invalid_points(points, message):
    with pytest.raises(ValueError, match=message):
        SpsCurve(points)


@pytest.mark.parametrize("text", ["{not json", "[1, 2]", '{"points": [8, 100]}', '{"points": {"8": "fast"}}',
                                  '{"points": {"8": -3}}', '{"curve": {}}'])
def test_a_corrupt_sps_file_is_named_with_the_fix(tmp_path, text):
    path = tmp_path / "sps.json"
    path.write_text(text)
    message = f"SPS curve file {re.escape(str(path))} is corrupt.*Delete it"
    with pytest.raises(ValueError, match=message):
        SpsCurve.load(path)
    with pytest.raises(ValueError, match=message):
        dspark_generate(qwen3_target(), fitted_draft("qwen3"), _prompt(), max_new_tokens=2, truncation="schedule",
                        sps_curve=path)


# ------------------------------------------------------------------------------------------------ timing
def test_stage_timings_wait_for_every_device_of_the_target_and_the_draft(monkeypatch):
    """A target split over several GPUs (and a draft on another) queues work on each: the per-stage timings must
    wait for all of them, not only the input device."""
    split = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2, device="meta"))
    assert generation_utils._devices(split) == {torch.device("cpu"), torch.device("meta")}

    synchronized = []
    monkeypatch.setattr(torch.cuda, "synchronize", synchronized.append)
    generation_utils._synchronize({torch.device("cuda", 0), torch.device("cuda", 1), torch.device("cpu")})
    assert sorted(synchronized, key=str) == [torch.device("cuda", 0), torch.device("cuda", 1)]

    waited_for = []
    monkeypatch.setattr(generation_utils, "_synchronize", waited_for.append)
    target, draft = qwen3_target(), fitted_draft("qwen3")
    dspark_generate(target, draft, _prompt(), max_new_tokens=10, do_sample=False)
    assert waited_for and all(devices == generation_utils._devices(target, draft) for devices in waited_for)


# ------------------------------------------------------------------------------------------ accelerate
def test_target_dispatched_with_offloaded_embedding_and_lm_head(tmp_path):
    """A target whose embedding, LM head and one layer live on disk (accelerate offload: their weights are on the
    meta device between calls) generates the same tokens as the in-memory target."""
    target, draft = qwen3_target(), fitted_draft("qwen3")
    target.save_pretrained(tmp_path / "target")
    device_map = {"model.embed_tokens": "disk", "model.layers.0": "cpu", "model.layers.1": "disk",
                  "model.layers.2": "cpu", "model.layers.3": "cpu", "model.norm": "cpu", "model.rotary_emb": "cpu",
                  "lm_head": "disk"}
    offloaded = Qwen3ForCausalLM.from_pretrained(tmp_path / "target", device_map=device_map,
                                                 offload_folder=tmp_path / "offload", dtype=torch.float32).eval()
    assert offloaded.get_output_embeddings().weight.device.type == "meta"
    input_ids = _prompt(4)
    expected = target.generate(input_ids, max_new_tokens=12, do_sample=False)
    actual = offloaded.generate(input_ids, assistant_model=draft, max_new_tokens=12, do_sample=False)
    assert torch.equal(actual, expected)
