"""benchmarks/bench_generation.py: every method against the target alone in one run, and what a DSpark round costs."""

import importlib.util
import json
import math
import sys

import tools  # noqa: F401  (registers the repository root as the package `dspark`)
from tools.common import REPO_ROOT

spec = importlib.util.spec_from_file_location("bench_generation", REPO_ROOT / "benchmarks/bench_generation.py")
bench_generation = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bench_generation)


def test_the_report_times_each_stage_of_a_round_against_a_target_step(tmp_path, monkeypatch):
    report_path = tmp_path / "bench.json"
    monkeypatch.setattr(sys, "argv", ["bench_generation.py", "--tiny", "qwen3", "--num-prompts", "2",
                                      "--max-new-tokens", "8", "--truncation", "full", "--json", str(report_path)])
    bench_generation.main()
    results = {r["method"]: r for r in json.loads(report_path.read_text())["results"]}

    target = results["target"]
    assert target["speedup"] == 1.0 and target["round_cost_in_target_steps"] is None
    target_ms_per_token = 1e3 * target["seconds"] / target["tokens"]

    dspark = results["dspark[full]"]
    assert dspark["same_tokens_as_target"] is True
    assert dspark["draft_ms_per_round"] > 0 and dspark["verify_ms_per_round"] > 0
    assert dspark["rollback_ms_per_round"] >= 0
    stages_ms = dspark["draft_ms_per_round"] + dspark["verify_ms_per_round"] + dspark["rollback_ms_per_round"]
    assert math.isclose(dspark["round_cost_in_target_steps"], stages_ms / target_ms_per_token)
    assert results["lookup"]["draft_ms_per_round"] is None and "skipped" in results["dflash"]
