"""benchmarks/bench_precision.py's comparison of greedy DSpark against plain greedy, on a tiny float32 pair."""

import importlib.util
import json

import torch
from tiny_models import VOCAB_SIZE, qwen3_target, random_draft, random_prompts

import tools  # noqa: F401  (registers the repository root as the package `dspark`)
from tools.common import REPO_ROOT

spec = importlib.util.spec_from_file_location("bench_precision", REPO_ROOT / "benchmarks/bench_precision.py")
bench_precision = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bench_precision)

NEW_TOKENS, FLIP_AT = 12, 5


def tiny_pair_and_prompts():
    return qwen3_target(), random_draft("qwen3"), [p[None] for p in random_prompts(3, 6, 10, seed=1)]


def test_first_difference():
    assert bench_precision.first_difference([4, 5, 6], [4, 5, 6]) is None
    assert bench_precision.first_difference([4, 5, 6], [4, 9, 6]) == 1
    assert bench_precision.first_difference([4, 5], [4, 5, 6]) == 2


def test_float32_dspark_matches_plain_greedy_and_the_report_is_json():
    target, draft, prompts = tiny_pair_and_prompts()

    result = bench_precision.measure(target, draft, prompts, NEW_TOKENS)

    assert json.loads(json.dumps(result)) == result
    assert result["prompts"] == 3 and result["differing"] == 0 and result["fraction_differing"] == 0.0
    assert result["mean_first_difference"] is None and result["mean_top2_gap"] is None
    assert [r["new_tokens"] for r in result["records"]] == [NEW_TOKENS] * 3


def test_an_injected_difference_is_found_with_the_plain_runs_top2_gap(monkeypatch):
    target, draft, prompts = tiny_pair_and_prompts()
    generate = target.generate

    def generate_with_a_flipped_token(input_ids, **kwargs):
        output = generate(input_ids, **kwargs)
        if "assistant_model" in kwargs:
            output = output.clone()
            output[0, input_ids.shape[1] + FLIP_AT] = (output[0, input_ids.shape[1] + FLIP_AT] + 1) % VOCAB_SIZE
        return output

    monkeypatch.setattr(target, "generate", generate_with_a_flipped_token)
    result = bench_precision.measure(target, draft, prompts, NEW_TOKENS)

    assert result["differing"] == 3 and result["fraction_differing"] == 1.0
    assert result["mean_first_difference"] == FLIP_AT
    for prompt, record in zip(prompts, result["records"]):
        plain = generate(prompt, max_new_tokens=FLIP_AT, do_sample=False)
        with torch.no_grad():
            top2 = target(plain).logits[0, -1].topk(2).values
        assert abs(record["top2_gap"] - (top2[0] - top2[1]).item()) < 1e-4
        assert record["tokens"]["dspark"] == (record["tokens"]["plain"] + 1) % VOCAB_SIZE
    assert result["max_top2_gap"] == max(r["top2_gap"] for r in result["records"])


def test_the_command_compares_the_embedded_pair_per_dtype_and_writes_json(tmp_path):
    report_path = tmp_path / "precision.json"

    report = bench_precision.main(["--datasets", "gsm8k", "humaneval", "--per-dataset", "1", "--max-new-tokens",
                                   str(NEW_TOKENS), "--dtypes", "fp32", "bf16", "--json", str(report_path)])

    assert json.loads(report_path.read_text()) == report
    assert report["target"] == str(REPO_ROOT / "embedded/target") and list(report["by_dtype"]) == ["fp32", "bf16"]
    assert report["by_dtype"]["fp32"]["differing"] == 0
    for result in report["by_dtype"].values():
        assert result["prompts"] == 2 and all(0 < r["new_tokens"] <= NEW_TOKENS for r in result["records"])
