"""End-to-end runs of the draft tools on a tiny random Qwen3 target with a byte-level tokenizer.

Regenerated data -> training (dspark, dflash, assistant) -> checkpoint / resume -> Hub layout loaded by
AutoModel(trust_remote_code) -> Sequential Temperature Scaling -> evaluation outputs.
"""

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import warnings

import pytest
import torch
from safetensors.torch import load_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from torch._dynamo.utils import counters
from transformers import AutoModel, AutoModelForCausalLM, AutoTokenizer, KimiLinearConfig, PreTrainedTokenizerFast

import tools  # noqa: F401  (registers the repository root as the package `dspark`)
from dspark.configuration_dspark import DSparkConfig
from dspark.generation_utils import _DSparkDecoder, dspark_generate
from tools import calibrate, chat_format, common, compare_runs, regenerate_data, train_draft
from tools.common import (
    REMOTE_CODE_FILES, REPO_ROOT, RoundRecords, load_eval_prompts, load_target, load_training_state, read_jsonl,
    save_training_state, survival, teacher_forced_rounds,
)
from tiny_models import TARGETS, agreeing_prompts, fitted_draft, qwen3_target

torch.set_num_threads(1)
TRAIN_FLAGS = ["--batch-size", "2", "--num-layers", "1", "--markov-rank", "16", "--max-length", "512", "--threads", "1"]


def byte_tokenizer() -> PreTrainedTokenizerFast:
    """Byte-level tokenizer without merges; the chat template's special tokens take ids 0..5."""
    vocab = {token: i for i, token in enumerate(chat_format.SPECIAL_TOKENS)}
    for char in sorted(pre_tokenizers.ByteLevel.alphabet()):
        vocab[char] = len(vocab)
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(chat_format.SPECIAL_TOKENS)
    return PreTrainedTokenizerFast(tokenizer_object=backend, bos_token=chat_format.BOS, eos_token=chat_format.EOS,
                                   pad_token=chat_format.PAD)


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    """A saved tiny target + tokenizer, a corpus of prompts, and the target's greedy answers to them."""
    root = tmp_path_factory.mktemp("tools")
    tokenizer = byte_tokenizer()
    qwen3_target(vocab_size=len(tokenizer)).save_pretrained(root / "target")
    tokenizer.save_pretrained(root / "target")
    with open(root / "corpus.jsonl", "w") as f:
        for i in range(8):
            prompt = f"def add_{i}(x):\n    '''x + {i}'''"
            f.write(json.dumps({"kind": "pair", "prompt": prompt, "response": "", "source": str(i)}) + "\n")
    regenerate(root, root / "regen.jsonl", "--batch-size", "4")
    return root


def regenerate(workspace, out, *extra: str) -> None:
    regenerate_data.main(["--target", str(workspace / "target"), "--corpus", str(workspace / "corpus.jsonl"),
                          "--out", str(out), "--max-new-tokens", "24", "--threads", "1", *extra])


def train(workspace, kind: str, out: str, *extra: str) -> dict:
    return train_draft.main(["--kind", kind, "--target", str(workspace / "target"), "--data",
                             str(workspace / "regen.jsonl"), "--out", str(workspace / out), *TRAIN_FLAGS, *extra])


def losses(run_dir) -> list[float]:
    return [record["loss"] for record in read_jsonl(run_dir / "train_log.jsonl")]


def test_regenerated_data_is_the_targets_greedy_answer(workspace):
    records = read_jsonl(workspace / "regen.jsonl")
    target = AutoModelForCausalLM.from_pretrained(workspace / "target")
    record = records[0]
    prompt = torch.tensor([record["input_ids"][: record["prompt_len"]]])
    expected = target.generate(prompt, max_new_tokens=24, do_sample=False, pad_token_id=0)[0].tolist()
    assert record["input_ids"] == expected[: len(record["input_ids"])]
    assert len(records) == 8 and json.loads((workspace / "regen.meta.json").read_text())["complete"]


def test_an_interrupted_regeneration_resumes_after_its_last_whole_batch(workspace, tmp_path):
    """8 prompts in batches of 3, 3 and 2. A run killed in the second batch left 4 answers and a cut line: the
    rerun writes the second batch again and the file equals an uninterrupted run's. A rerun of a finished file
    adds nothing, and one with other settings is refused, naming the difference."""
    whole, resumed = tmp_path / "whole.jsonl", tmp_path / "resumed.jsonl"
    regenerate(workspace, whole, "--batch-size", "3")
    lines = whole.read_text().splitlines(keepends=True)
    resumed.write_text("".join(lines[:4]) + lines[4][:40])
    shutil.copy(whole.with_suffix(".meta.json"), resumed.with_suffix(".meta.json"))
    regenerate(workspace, resumed, "--batch-size", "3")
    regenerate(workspace, whole, "--batch-size", "3")
    assert resumed.read_text() == whole.read_text() == "".join(lines) and len(lines) == 8
    with pytest.raises(SystemExit, match=r"batch_size \(was 3, now 4\).*another --out"):
        regenerate(workspace, resumed, "--batch-size", "4")


def test_skip_prompts_continues_the_data_set_where_it_stopped(workspace, tmp_path):
    """A part of 3 prompts reads 4 when one is too long: the next part starts after all 4, so the parts tile
    the corpus without an overlap."""
    tokenizer = AutoTokenizer.from_pretrained(workspace / "target")
    corpus = tmp_path / "corpus.jsonl"
    texts = [f"def add_{i}(x):" + (" pass;" * 200 if i == 1 else "") for i in range(8)]
    corpus.write_text("".join(json.dumps({"prompt": text, "source": str(i)}) + "\n" for i, text in enumerate(texts)))
    everything, _ = regenerate_data.corpus_prompts(str(corpus), tokenizer, max_prompts=8, max_prompt_tokens=200)
    first, next_skip = regenerate_data.corpus_prompts(str(corpus), tokenizer, max_prompts=3, max_prompt_tokens=200)
    rest, _ = regenerate_data.corpus_prompts(str(corpus), tokenizer, max_prompts=8, max_prompt_tokens=200,
                                             skip=next_skip)
    assert next_skip == 4 and [p["source"] for p in first] == ["0", "2", "3"]
    assert [p["source"] for p in first + rest] == [p["source"] for p in everything] == ["0", *map(str, range(2, 8))]


def test_training_data_may_span_several_files(workspace):
    regen = str(workspace / "regen.jsonl")
    one = train_draft.SequenceData([regen], max_length=64, batch_size=4, pad_id=0, seed=0)
    two = train_draft.SequenceData([regen, regen], max_length=64, batch_size=4, pad_id=0, seed=0)
    assert two.records == one.records * 2 and two.per_epoch == 2 * one.per_epoch


def test_training_decreases_the_loss_and_saves_the_hub_layout(workspace):
    heldout = str(workspace / "regen.jsonl")
    summary = train(workspace, "dspark", "dspark", "--max-steps", "12", "--heldout", heldout, "--heldout-sampled",
                    heldout, "--heldout-limit", "2", "--eval-every", "12", "--target-layer-ids", "1", "3")
    history = losses(workspace / "dspark")
    assert sum(history[-3:]) / 3 < history[0] - 0.05
    final_draft = AutoModel.from_pretrained(workspace / "dspark" / "final", trust_remote_code=True)
    target = AutoModelForCausalLM.from_pretrained(workspace / "target")
    decoded = [teacher_forced_rounds(target, final_draft, r["input_ids"][:512], r["prompt_len"]).decoded()
               for r in read_jsonl(heldout)[:2]]  # the rounds greedy decoding runs over the held-out answers
    assert summary["heldout_greedy_acceptance_length"] == pytest.approx(
        RoundRecords.concatenate(decoded).acceptance_length(), abs=1e-6)
    # the sampled held-out set reports the loss parts only (here the same file, so the same figures)
    assert summary["heldout_sampled_l1"] == summary["heldout_l1"] > 0
    assert "heldout_sampled_greedy_acceptance_length" not in summary
    final = workspace / "dspark" / "final"
    assert {"config.json", "model.safetensors", *REMOTE_CODE_FILES} <= {p.name for p in final.iterdir()}
    draft = AutoModel.from_pretrained(final, trust_remote_code=True)
    assert type(draft).__name__ == "DSparkDraftModel"
    assert draft.config.target_layer_ids == [1, 3] and draft.config.mask_token_id == 3
    assert draft.config.hidden_size == 64 and draft.config.vocab_size == 262
    saved = load_file(final / "model.safetensors")
    assert all(torch.equal(saved[name], tensor) for name, tensor in draft.state_dict().items())


def test_dflash_ablation_and_assistant(workspace):
    train(workspace, "dflash", "dflash", "--max-steps", "2")
    dflash = json.loads((workspace / "dflash" / "final" / "config.json").read_text())
    assert dflash["markov_rank"] == 0 and dflash["enable_confidence_head"] is False
    assert dflash["target_layer_ids"] == train_draft.default_target_layer_ids(4, 5) == [1, 2]

    train(workspace, "assistant", "assistant", "--max-steps", "6")
    history = losses(workspace / "assistant")
    assert history[-1] < history[0]
    assistant = AutoModelForCausalLM.from_pretrained(workspace / "assistant" / "final")
    target = AutoModelForCausalLM.from_pretrained(workspace / "target")
    assert torch.equal(assistant.get_input_embeddings().weight, target.get_input_embeddings().weight)  # frozen copy


def test_compare_runs_tabulates_geometry_cost_and_heldout_quality(workspace, tmp_path):
    heldout = str(workspace / "regen.jsonl")
    train(workspace, "dspark", "compare-dspark", "--max-steps", "2", "--heldout", heldout, "--heldout-sampled",
          heldout, "--heldout-limit", "2", "--eval-every", "2", "--target-layer-ids", "0", "2")
    rows = compare_runs.main([str(workspace / "compare-dspark"), "--json", str(tmp_path / "runs.json"),
                              "--markdown", str(tmp_path / "runs.md")])
    summary = json.loads((workspace / "compare-dspark" / "train_summary.json").read_text())
    assert rows == json.loads((tmp_path / "runs.json").read_text())
    row = rows[0]
    assert (row["run"], row["kind"], row["num_layers"], row["target_layer_ids"], row["markov_rank"]) == (
        "compare-dspark", "dspark", 1, [0, 2], 16)
    assert row["steps"] == 2 and row["seconds_per_step"] == summary["train_seconds"] / 2
    assert row["heldout_greedy_acceptance_length"] == summary["heldout_greedy_acceptance_length"]
    assert row["sampled_acceptance"] == 1 - summary["heldout_sampled_l1"] / 2
    table = (tmp_path / "runs.md").read_text().splitlines()
    assert table[0].startswith("| run | kind | layers | target layers |") and len(table) == 3
    assert f"| {row['heldout_greedy_acceptance_length']:.3f} |" in table[2]

    train(workspace, "dflash", "compare-dflash", "--max-steps", "1")  # no held-out evaluation
    no_heldout = "compare-dflash: its summary has no held-out evaluation; train with --heldout"
    with pytest.raises(SystemExit, match=no_heldout):
        compare_runs.main([str(workspace / "compare-dflash")])


def test_resume_from_a_checkpoint_reproduces_the_run(workspace):
    """A run killed after step 3 (checkpoint at step 2, a cut log line) resumes to the uninterrupted run's weights
    and log; a resume with other settings is refused, naming them."""
    flags = ["--max-steps", "4", "--save-every", "2", "--keep-checkpoints", "1"]
    train(workspace, "dspark", "straight", *flags)
    (workspace / "resumed").mkdir()
    shutil.copytree(workspace / "straight" / "checkpoint-2", workspace / "resumed" / "checkpoint-2")
    log_lines = (workspace / "straight" / "train_log.jsonl").read_text().splitlines(keepends=True)
    (workspace / "resumed" / "train_log.jsonl").write_text("".join(log_lines[:3]) + log_lines[3][:20])
    with pytest.raises(SystemExit, match=r"lr \(was 0.0006, now 0.001\)"):
        train(workspace, "dspark", "resumed", *flags, "--resume", "auto", "--lr", "1e-3")
    train(workspace, "dspark", "resumed", *flags, "--resume", "auto")
    straight = load_file(workspace / "straight" / "final" / "model.safetensors")
    resumed = load_file(workspace / "resumed" / "final" / "model.safetensors")
    assert straight.keys() == resumed.keys()
    assert all(torch.equal(straight[name], resumed[name]) for name in straight)
    assert losses(workspace / "resumed") == losses(workspace / "straight") and len(log_lines) == 4


def test_final_norm_init_sets_the_untrained_drafts_output_scale(workspace):
    args = train_draft.build_parser().parse_args(["--final-norm-init", "0.1", *TRAIN_FLAGS])
    target = AutoModelForCausalLM.from_pretrained(workspace / "target")
    draft = train_draft.build_draft(args, target, AutoTokenizer.from_pretrained(workspace / "target"))
    assert torch.equal(draft.norm.weight, torch.full_like(draft.norm.weight, 0.1))


def test_init_from_starts_at_a_saved_drafts_weights(workspace):
    train(workspace, "dspark", "init", "--max-steps", "1", "--lr", "0", "--init-from",
          str(workspace / "straight" / "final"))
    start = load_file(workspace / "straight" / "final" / "model.safetensors")
    after = load_file(workspace / "init" / "final" / "model.safetensors")
    assert all(torch.equal(after[name], start[name]) for name in start)  # lr 0: the weights it started from


class RunsCodeWhenUnpickled:
    """Pickles to a call of `exec` that creates `marker`: what a hostile training state could hold."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return exec, (f"open({str(self.marker)!r}, 'w').close()",)


def test_resume_refuses_a_training_state_that_would_run_code(workspace, tmp_path):
    marker = tmp_path / "code-ran"
    checkpoint = tmp_path / "checkpoint-2"
    checkpoint.mkdir()
    torch.save({"step": 2, "optimizer": RunsCodeWhenUnpickled(marker)}, checkpoint / "trainer_state.pt")
    with pytest.raises(SystemExit, match="refusing to resume from .*unpickling them could run code"):
        train(workspace, "dspark", "hostile", "--max-steps", "2", "--resume", str(checkpoint))
    assert not marker.exists()


def test_training_states_of_both_trainers_round_trip_without_pickled_objects(tmp_path):
    """The states tools/train_draft.py and tools/train_target.py write (optimizer, LambdaLR, a transformers
    config dict, counters) load with weights_only=True; anything that could run code is refused."""
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.AdamW(model.parameters(), betas=(0.9, 0.95))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, train_draft.lr_lambda(10, 0.1))
    model(torch.ones(1, 3)).sum().backward()
    optimizer.step()
    scheduler.step()
    state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
             "config": KimiLinearConfig().to_dict(), "step": 1, "elapsed": 0.5, "last_eval": None,
             "args": {"data": ["a.jsonl"], "lr": 1e-3}}
    save_training_state(tmp_path / "state.pt", state)
    loaded = load_training_state(tmp_path / "state.pt")
    assert loaded.keys() == state.keys() and loaded["config"] == state["config"] and loaded["args"] == state["args"]
    assert torch.equal(loaded["optimizer"]["state"][0]["exp_avg"], optimizer.state_dict()["state"][0]["exp_avg"])
    assert loaded["scheduler"] == scheduler.state_dict()

    marker = tmp_path / "code-ran"
    torch.save({**state, "state": RunsCodeWhenUnpickled(marker)}, tmp_path / "hostile.pt")
    with pytest.raises(SystemExit, match="refusing to resume from .*hostile.pt"):
        load_training_state(tmp_path / "hostile.pt")
    assert not marker.exists()


def test_decoded_rounds_are_the_rounds_greedy_decoding_runs(monkeypatch):
    """Out of the teacher-forced rounds at every anchor, `decoded()` keeps the ones lossless greedy decoding
    runs, with the same accepted drafts (compared while decoding may still verify a whole block)."""
    target, draft = TARGETS["qwen3"](), fitted_draft("qwen3")
    decoding_accepted = []
    count = _DSparkDecoder._count

    def record_round(self, num_drafts, num_accepted, num_verified):
        decoding_accepted.append(int(num_accepted[0]))
        count(self, num_drafts, num_accepted, num_verified)

    monkeypatch.setattr(_DSparkDecoder, "_count", record_round)
    max_new_tokens = 40
    for prompt in agreeing_prompts("qwen3", 4, seed=3):
        decoding_accepted.clear()
        sequence = dspark_generate(target, draft, prompt[None], max_new_tokens=max_new_tokens, do_sample=False,
                                   eos_token_id=None)[0]
        decoded = teacher_forced_rounds(target, draft, sequence.tolist(), len(prompt)).decoded()
        accepted = decoded.accepted.sum(-1).tolist()
        anchors = [sum(n + 1 for n in accepted[:i]) for i in range(len(accepted))]  # response index of each anchor
        # Decoding keeps one token of its budget for the bonus: from anchor index max_new_tokens - 9 on, it
        # may verify fewer than 7 drafts.
        whole_blocks = sum(anchor <= max_new_tokens - 9 for anchor in anchors)
        assert sum(accepted) > 0 and whole_blocks >= 3
        assert accepted[:whole_blocks] == decoding_accepted[:whole_blocks]


def test_rounds_measure_the_confidence_heads_training_target():
    """`sampling_acceptance` is 1 - L1/2 between the draft's and the target's distributions of the same token (the
    confidence head's training target). The embedded draft, trained on its target, is accepted at position 1 in
    most greedy rounds, and its T=1 acceptance there is as high (pairing the target's distribution of the next
    token instead, a one-token shift, gives about 0.17)."""
    target = AutoModelForCausalLM.from_pretrained(common.REPO_ROOT / "embedded/target")
    draft = AutoModel.from_pretrained(common.REPO_ROOT / "embedded/dspark", trust_remote_code=True)
    tokenizer = AutoTokenizer.from_pretrained(common.REPO_ROOT / "embedded/target")
    rounds = []
    for question in ["Write a Python function that reverses a list.", "What is 12 times 7?"]:
        prompt = torch.tensor(common.chat_prompt_ids(tokenizer, question))
        sequence = target.generate(prompt[None], max_new_tokens=48, do_sample=False)[0]
        rounds.append(teacher_forced_rounds(target, draft, sequence.tolist(), len(prompt)))
    rounds = RoundRecords.concatenate(rounds)
    first = rounds.valid[:, 0]  # every round reaches position 1
    sampling, accepted = rounds.sampling_acceptance[first, 0], rounds.accepted[first, 0]
    assert calibrate.conditional_acceptance(rounds)["rounds"][0] == int(first.sum())
    assert 0 < int(accepted.sum()) < len(accepted)
    assert bool(((sampling >= 0) & (sampling <= 1 + 1e-6)).all())
    assert accepted.float().mean() > 0.7
    assert sampling.mean() == pytest.approx(accepted.float().mean(), abs=0.05)


def test_conditional_acceptance_counts_the_rounds_that_reach_each_position():
    accepted = torch.tensor([[1, 1, 0], [1, 0, 0], [0, 0, 0], [1, 1, 1]], dtype=torch.bool)
    valid = torch.ones(4, 3, dtype=torch.bool)
    valid[1, 2] = False
    sampling = torch.tensor([[0.9, 0.8, 0.1], [0.7, 0.2, 0.0], [0.1, 0.5, 0.5], [0.9, 0.9, 0.6]])
    result = calibrate.conditional_acceptance(RoundRecords(torch.zeros(4, 3), accepted, valid, sampling))
    assert result["rounds"] == [4, 3, 2]  # position 3: rounds 0 and 3 (round 1 rejected draft 2)
    assert result["accept_rate"] == pytest.approx([3 / 4, 2 / 3, 1 / 2])
    assert result["mean_confidence"] == pytest.approx([0.5, 0.5, 0.5])
    assert result["mean_training_target"] == pytest.approx([(0.9 + 0.7 + 0.1 + 0.9) / 4, (0.8 + 0.2 + 0.9) / 3,
                                                             (0.1 + 0.6) / 2])
    assert calibrate.conditional_acceptance(RoundRecords(torch.zeros(4, 3), accepted, valid))["mean_training_target"] \
        is None


def synthetic_rounds(scale: float, rounds: int = 4000, block_size: int = 7, seed: int = 0) -> RoundRecords:
    """Rounds whose true conditional acceptance is sigmoid(z) but whose head reports `scale` * z."""
    generator = torch.Generator().manual_seed(seed)
    true_logits = torch.randn(rounds, block_size, generator=generator) + 1.0
    draws = torch.rand(rounds, block_size, generator=generator) < torch.sigmoid(true_logits)
    valid = torch.ones(rounds, block_size, dtype=torch.bool)
    return RoundRecords(scale * true_logits, draws.long().cumprod(-1).bool(), valid)


def test_sts_lowers_ece_and_round_trips_through_config(tmp_path):
    rounds = synthetic_rounds(scale=3.0)  # overconfident
    temperatures = calibrate.fit_sequential_temperatures(rounds)
    before, after = calibrate.survival_ece(rounds, None), calibrate.survival_ece(rounds, temperatures)
    assert after["pooled"] < 0.5 * before["pooled"]
    assert all(a <= b + 1e-9 for a, b in zip(after["per_position"], before["per_position"]))
    assert 2.0 < temperatures[0] < 4.5  # the scale that was applied
    first_accept_rate = rounds.accepted[:, 0].double().mean().item()
    assert before["mean_survival"][0] > first_accept_rate + 0.05  # the head overstates survival...
    assert after["mean_survival"][0] == pytest.approx(first_accept_rate, abs=0.02)  # ...until its logits are scaled
    assert torch.all(survival(rounds.confidence_logits, temperatures).diff(dim=-1) <= 0)

    DSparkConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                 num_key_value_heads=1, head_dim=8, target_layer_ids=[0], num_target_layers=2, mask_token_id=3,
                 markov_rank=4).save_pretrained(tmp_path)
    before_json = json.loads((tmp_path / "config.json").read_text())
    calibrate.write_temperatures(tmp_path, temperatures)
    after_json = json.loads((tmp_path / "config.json").read_text())
    assert DSparkConfig.from_pretrained(tmp_path).confidence_temperatures == pytest.approx(temperatures, abs=1e-6)
    assert {k: v for k, v in after_json.items() if k != "confidence_temperatures"} == \
        {k: v for k, v in before_json.items() if k != "confidence_temperatures"}


def test_cross_validation_scores_each_file_with_temperatures_fitted_on_the_others():
    files = {name: synthetic_rounds(scale=3.0, rounds=2000, seed=seed) for seed, name in enumerate("abc")}
    files["c"] = RoundRecords(files["c"].confidence_logits / 3.0, files["c"].accepted, files["c"].valid)  # calibrated
    result = calibrate.cross_validate(files)
    folds = {fold["data"]: fold for fold in result["folds"]}
    assert folds["c"]["temperatures"] == calibrate.fit_sequential_temperatures(
        RoundRecords.concatenate([files["a"], files["b"]]))
    assert 2.0 < folds["c"]["temperatures"][0] < 4.5  # fitted on the overconfident files...
    assert folds["c"]["ece_after"] > folds["c"]["ece_before"]  # ...so they miscalibrate the calibrated one
    assert folds["a"]["ece_after"] < folds["a"]["ece_before"]
    pooled_before = calibrate.survival_ece(RoundRecords.concatenate(list(files.values())), None)["pooled"]
    assert result["ece_after"]["pooled"] < pooled_before


def test_calibrate_and_evaluate_on_a_tiny_pair(workspace, monkeypatch):
    from tools import evaluate

    monkeypatch.setenv("DSPARK_CACHE", str(workspace / "cache"))  # the schedule mode's profiled SPS curve

    draft_dir = workspace / "dspark" / "final"
    report = calibrate.main(["--target", str(workspace / "target"), "--draft", str(draft_dir), "--data",
                             str(workspace / "regen.jsonl"), "--limit", "2", "--out", str(workspace / "calibration")])
    assert report["validation"] == "in-sample"
    assert report["ece_after"]["pooled"] <= report["ece_before"]["pooled"] + 1e-9
    conditional = report["conditional"]  # every round reaches position 1; later ones only after acceptances
    assert conditional["rounds"][0] == report["eval_rounds"] and len(conditional["mean_training_target"]) == 7
    assert "mean 1-L1/2" in (workspace / "calibration" / "calibration.txt").read_text()
    held_out = calibrate.main(["--target", str(workspace / "target"), "--draft", str(draft_dir), "--data",
                               str(workspace / "regen.jsonl"), "--limit", "2", "--eval-data",
                               str(workspace / "regen.jsonl"), "--eval-limit", "3", "--dry-run",
                               "--out", str(workspace / "calibration_held_out")])
    assert held_out["validation"] == "held-out" and held_out["eval_rounds"] > held_out["rounds"]
    assert held_out["temperatures"] == report["temperatures"]
    written = [round(t, 6) for t in report["temperatures"]]
    assert json.loads((draft_dir / "config.json").read_text())["confidence_temperatures"] == written
    sts = json.loads((draft_dir / calibrate.STS_FILE).read_text())  # SGLang's DSparkStsCalibration fields
    assert sts == {"temperatures": written, "dataset": str(workspace / "regen.jsonl"), "num_samples": report["rounds"],
                   "ece_before": report["ece_before"]["per_position"], "ece_after": report["ece_after"]["per_position"]}

    records = read_jsonl(workspace / "regen.jsonl")
    halves = [workspace / "regen_first.jsonl", workspace / "regen_second.jsonl"]
    for path, part in zip(halves, (records[:4], records[4:])):
        path.write_text("".join(json.dumps(record) + "\n" for record in part))
    crossed = calibrate.main(["--target", str(workspace / "target"), "--draft", str(draft_dir), "--data",
                              *map(str, halves), "--cross-validate", "--dry-run",
                              "--out", str(workspace / "calibration_crossed")])
    assert crossed["validation"] == "cross-validated"
    assert [fold["data"] for fold in crossed["folds"]] == list(map(str, halves))
    assert sum(fold["rounds"] for fold in crossed["folds"]) == crossed["rounds"]
    assert "fold " in (workspace / "calibration_crossed" / "calibration.txt").read_text()

    out = workspace / "eval"
    evaluate.main(["--target", str(workspace / "target"), "--draft", str(draft_dir), "--dflash",
                   str(workspace / "dflash" / "final"), "--assistant", str(workspace / "assistant" / "final"),
                   "--datasets", "humaneval", "--limit", "1", "--max-new-tokens", "8", "--out", str(out),
                   "--threads", "1"])
    assert {"eval.json", "eval.md", "tau.png", "acceptance.png", "calibration.png"} <= {p.name for p in out.iterdir()}
    results = json.loads((out / "eval.json").read_text())["results"]
    greedy = results["T=0"]["humaneval"]
    methods = {"target", "dspark/full", "dspark/threshold", "dspark/schedule", "dflash", "assistant", "prompt_lookup"}
    assert set(greedy) == methods
    assert all(entry["lossless"] == 1.0 for method, entry in greedy.items() if method != "target")
    assert all(1.0 <= entry["tau"] <= 8.0 for entry in greedy.values())
    assert "| dspark/full |" in (out / "eval.md").read_text()
    assert "Prompts: humaneval 1; 8 new tokens at most." in (out / "eval.md").read_text()
    assert re.search(r"Jobs ran on: .+, 1 threads \(2\)\.", (out / "eval.md").read_text())  # 2 temperatures


def test_an_interrupted_evaluation_resumes_after_its_last_finished_job(workspace, monkeypatch):
    from tools import evaluate

    monkeypatch.setenv("DSPARK_CACHE", str(workspace / "cache"))
    draft_dir = workspace / "draft_to_evaluate"
    shutil.copytree(workspace / "dspark" / "final", draft_dir)
    command = ["--target", str(workspace / "target"), "--draft", str(draft_dir),
               "--datasets", "humaneval", "mbpp", "--limit", "2", "--max-new-tokens", "6", "--truncations", "full",
               "--prompt-lookup", "0", "--threads", "1"]
    whole = evaluate.main([*command, "--out", str(workspace / "eval_whole")])

    out = workspace / "eval_resumed"
    evaluate.main([*command, "--out", str(out), "--temperatures", "0"])  # a different run must not be resumed...
    with pytest.raises(SystemExit, match=r"temperatures \(was \[0\.0\], now \[0\.0, 1\.0\]\).*another --out"):
        evaluate.main([*command, "--out", str(out)])
    records_path = out / evaluate.RECORDS
    records_path.unlink()
    lines = (workspace / "eval_whole" / evaluate.RECORDS).read_text().splitlines(keepends=True)
    assert len(lines) == 1 + 2 * 2 * 2  # the settings, then temperatures x datasets x prompts
    records_path.write_text("".join(lines[:4]) + lines[4][:30])  # ...but a killed one is: 3 jobs and a cut line

    ran = []
    run_prompt = evaluate.Evaluation.run_prompt
    monkeypatch.setattr(evaluate.Evaluation, "run_prompt",
                        lambda self, dataset, index, prompt, temperature: ran.append((temperature, dataset, index))
                        or run_prompt(self, dataset, index, prompt, temperature))
    resumed = evaluate.main([*command, "--out", str(out)])
    # prompt by prompt, each through every set and temperature: the first job left was mbpp's first prompt at T=1
    assert ran == [(1.0, "mbpp", 0), (0.0, "humaneval", 1), (1.0, "humaneval", 1), (0.0, "mbpp", 1),
                   (1.0, "mbpp", 1)]
    assert len(records_path.read_text().splitlines()) == len(lines)

    def without_timing(report):
        return {t: {d: {m: {k: v for k, v in entry.items() if k not in ("tokens_per_s", "speedup")}
                        for m, entry in methods.items()} for d, methods in per_dataset.items()}
                for t, per_dataset in report["results"].items()}

    assert without_timing(resumed) == without_timing(whole)
    assert resumed["calibration"]["rounds"] == whole["calibration"]["rounds"]

    ran.clear()  # --limit may change on the same --out: a smaller one reports its prompts without running any...
    first_prompts = evaluate.main([*command, "--limit", "1", "--out", str(out)])
    assert ran == [] and first_prompts["settings"]["limit"] == 1
    assert {d: entry["target"]["prompts"] for d, entry in first_prompts["results"]["T=0"].items()} == {
        "humaneval": 1, "mbpp": 1, "all": 2}
    extended = evaluate.main([*command, "--limit", "3", "--out", str(out)])  # ...a larger one extends it
    assert ran == [(t, d, 2) for d in ("humaneval", "mbpp") for t in (0.0, 1.0)]
    assert list(extended["machines"].values()) == [12] and extended["speedup_by_machine"] is None

    header, *job_lines = records_path.read_text().splitlines()  # a run resumed elsewhere: speed-ups per machine too
    jobs = [json.loads(line) for line in job_lines]
    for job in jobs:
        job["machine"] = "elsewhere" if job["index"] == 2 else job["machine"]
    records_path.write_text("\n".join([header, *map(json.dumps, jobs)]) + "\n")
    report = evaluate.main([*command, "--limit", "3", "--out", str(out)])
    assert sorted(report["machines"].values()) == [4, 8]
    assert set(report["speedup_by_machine"]["elsewhere"]) == {"T=0", "T=1"}
    assert "| dspark/full | " in (out / "eval.md").read_text().split("on each machine")[1]

    digest = evaluate.folder_digest(str(draft_dir))  # an SGLang STS file does not change what transformers loads
    (draft_dir / calibrate.STS_FILE).write_text(json.dumps({"temperatures": [1.0] * 7}))
    assert evaluate.folder_digest(str(draft_dir)) == digest
    config = json.loads((draft_dir / "config.json").read_text())  # a recalibrated draft at the same path
    (draft_dir / "config.json").write_text(json.dumps({**config, "confidence_temperatures": [2.0] * 7}))
    with pytest.raises(SystemExit, match=r"draft sha256 \(was '[0-9a-f]{16}', now '[0-9a-f]{16}'\)"):
        evaluate.main([*command, "--out", str(out)])


def test_limit_0_reads_every_prompt_of_the_evaluation_sets():
    every = load_eval_prompts(["aime25", "mt-bench"], 0)
    assert {name: len(prompts) for name, prompts in every.items()} == {"aime25": 30, "mt-bench": 80}
    assert load_eval_prompts(["aime25"], 2)["aime25"] == every["aime25"][:2]


def test_evaluate_refuses_a_negative_limit(capsys):
    from tools import evaluate

    with pytest.raises(SystemExit):
        evaluate.main(["--limit", "-3"])
    assert "--limit -3: give a number of prompts per dataset, or 0 for all of them" in capsys.readouterr().err


def test_demo_runs_both_pairs(workspace, capsys):
    import demo

    pair = [str(workspace / "target"), str(workspace / "dspark" / "final")]
    summaries = demo.main(["--real-target", pair[0], "--real-draft", pair[1], "--real-max-new-tokens", "8",
                           "--target", pair[0], "--draft", pair[1], "--prompts", "1", "--max-new-tokens", "8",
                           "--threads", "1"])
    assert set(summaries) == {"real", "kimi"}
    assert all(summary["lossless"] == "1/1" and summary["tau"] >= 1.0 for summary in summaries.values())
    printed = capsys.readouterr().out
    assert printed.index("Real pair") < printed.index("Stateful Kimi-family pair")
    assert printed.count("identical to plain greedy") == 2


# ---------------------------------------------------------------------------------------------- offline and DDP
OFFLINE_FLAGS = ["--max-steps", "3", "--num-anchors", "8", "--target-layer-ids", "1", "3"]


def test_offline_training_from_cached_features_follows_the_online_run(workspace):
    """A float32 feature cache reproduces what the live target gives every step: same losses, same weights."""
    train(workspace, "dspark", "online", *OFFLINE_FLAGS)
    train(workspace, "dspark", "offline", *OFFLINE_FLAGS, "--features-cache", str(workspace / "cache-fp32"),
          "--cache-dtype", "fp32")
    torch.testing.assert_close(losses(workspace / "offline"), losses(workspace / "online"), rtol=1e-5, atol=1e-6)
    online = load_file(workspace / "online" / "final" / "model.safetensors")
    offline = load_file(workspace / "offline" / "final" / "model.safetensors")
    for name in online:
        torch.testing.assert_close(offline[name], online[name], rtol=1e-4, atol=1e-5)


def test_bf16_autocast_trains_the_same_model_in_mixed_precision(workspace):
    """--autocast bf16 keeps float32 weights and follows the float32 run within bfloat16 rounding."""
    train(workspace, "dspark", "autocast", *OFFLINE_FLAGS, "--features-cache", str(workspace / "cache-fp32"),
          "--cache-dtype", "fp32", "--autocast", "bf16")
    mixed, full = losses(workspace / "autocast"), losses(workspace / "offline")
    torch.testing.assert_close(mixed, full, rtol=2e-2, atol=0)
    assert mixed != full  # the matmuls did run in bfloat16
    weights = load_file(workspace / "autocast" / "final" / "model.safetensors")
    assert all(tensor.dtype == torch.float32 for tensor in weights.values())


def test_bf16_on_a_cpu_without_native_bf16_is_named_with_its_fix(workspace, monkeypatch):
    """On an AVX2-only CPU bfloat16 matmuls are several times slower than float32: the tools say so."""
    cpu, target = torch.device("cpu"), str(workspace / "target")
    monkeypatch.setattr(common, "cpu_has_native_bf16", lambda: False)
    with pytest.warns(UserWarning, match="without native bfloat16.*--dtype fp32"):
        load_target(target, cpu, torch.bfloat16)
    with pytest.warns(UserWarning, match="without native bfloat16.*--autocast none"):
        train(workspace, "dflash", "autocast-warning", "--max-steps", "1", "--autocast", "bf16")

    monkeypatch.setattr(common, "cpu_has_native_bf16", lambda: True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        load_target(target, cpu, torch.bfloat16)


@pytest.mark.parametrize("kind", ["dspark", "assistant"])
def test_compiled_loss_terms_train_the_same_model(workspace, kind):
    """--compile fuses the loss's vocabulary-wide passes with torch.compile: same losses and weights as eager."""
    flags = [*OFFLINE_FLAGS, "--features-cache", str(workspace / "cache-fp32"), "--cache-dtype", "fp32"]
    if kind == "assistant":
        flags = ["--max-steps", "3"]  # varying supervised-row counts: the compiled function meets new shapes
    train(workspace, kind, f"{kind}-eager", *flags)
    graphs = counters["stats"]["unique_graphs"]
    train(workspace, kind, f"{kind}-compiled", *flags, "--compile")
    assert counters["stats"]["unique_graphs"] > graphs  # the terms did run compiled
    torch.testing.assert_close(losses(workspace / f"{kind}-compiled"), losses(workspace / f"{kind}-eager"),
                               rtol=1e-5, atol=1e-6)
    weights = "model.safetensors"
    eager = load_file(workspace / f"{kind}-eager" / "final" / weights)
    compiled = load_file(workspace / f"{kind}-compiled" / "final" / weights)
    for name in eager:
        torch.testing.assert_close(compiled[name], eager[name], rtol=1e-4, atol=1e-5)


def test_feature_cache_resumes_a_partial_build_and_refuses_other_settings(workspace):
    cache = workspace / "cache-chunks"
    train(workspace, "dspark", "cached", *OFFLINE_FLAGS, "--features-cache", str(cache))
    chunks = sorted(cache.glob("records-*.safetensors"))
    first = load_file(chunks[0])
    chunks[0].unlink()  # an interrupted build: the missing chunk is built again, the same
    train(workspace, "dspark", "cached-again", *OFFLINE_FLAGS, "--features-cache", str(cache))
    rebuilt = load_file(chunks[0])
    assert rebuilt.keys() == first.keys() and all(torch.equal(rebuilt[k], first[k]) for k in first)
    assert first["features.0"].dtype == torch.bfloat16 and first["features.0"].shape[-1] == 2 * 64
    with pytest.raises(SystemExit, match=r"layer_ids \(was \[1, 3\], now \[2\]\)"):
        train(workspace, "dspark", "other-layers", "--max-steps", "1", "--target-layer-ids", "2",
              "--features-cache", str(cache))


def test_two_processes_reach_the_weights_of_one_process_on_the_same_global_batch(workspace):
    """torchrun with 2 gloo processes x 1 micro-batch == 1 process x 2 accumulated micro-batches (DDP averages
    the gradients; each rank builds half of the offline cache and reads only its own records)."""
    flags = ["--kind", "dspark", "--target", str(workspace / "target"), "--data", str(workspace / "regen.jsonl"),
             *TRAIN_FLAGS, *OFFLINE_FLAGS, "--device", "cpu"]
    train_draft.main([*flags, "--grad-accum", "2", "--out", str(workspace / "one-process"),
                      "--features-cache", str(workspace / "cache-one")])
    subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(_free_port()),
         str(REPO_ROOT / "tools" / "train_draft.py"), *flags, "--grad-accum", "1",
         "--out", str(workspace / "two-processes"), "--features-cache", str(workspace / "cache-two")],
        check=True, capture_output=True, env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=180,
    )
    one = load_file(workspace / "one-process" / "final" / "model.safetensors")
    two = load_file(workspace / "two-processes" / "final" / "model.safetensors")
    assert one.keys() == two.keys()
    for name in one:
        torch.testing.assert_close(two[name], one[name], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(losses(workspace / "two-processes"), losses(workspace / "one-process"))
    assert len(list((workspace / "cache-two").glob("records-*.safetensors"))) == 1  # 8 records: one chunk


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
