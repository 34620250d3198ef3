#!/usr/bin/env python
"""Calibrate a DSpark draft's confidence head by Sequential Temperature Scaling (STS).

1. Rounds: greedy DSpark rounds over held-out prompts answered greedily by the target
   (tools/regenerate_data.py --temperature 0). Lossless greedy decoding reproduces those continuations,
   so a round anchored at any response token sees its decoding context; per round and block position k
   we keep the raw confidence logit raw_k and the prefix-accept mask (d_1..d_{k+1} all accepted).
   `--rounds decoded` (default) keeps the rounds greedy decoding actually runs (each anchored right
   after the previous one's committed tokens): the confidences are used there. `--rounds every-token`
   keeps a round at every response token, which over-weights the easy tokens inside accepted runs.
2. Fit: one temperature per position, left to right. Position k takes the temperature of a grid of 41
   log-spaced values in [0.1, 10] that minimises the expected calibration error of the survival
   a_k = prod_{j<=k} sigmoid(raw_j / T_j) (earlier T_j already fitted) against the prefix-accept mask.
3. Report: the ECE of the survival per position and pooled, and its mean per position against the accept
   rate (which way it errs), before (all temperatures 1) and after, on rounds the fit did not see: those
   of --eval-data, or with --cross-validate each --data file scored with the temperatures fitted on the
   other files (the ECE of the pooled out-of-fold survival, plus each fold's). Without either, on the
   fitted rounds themselves, which flatters "after"; the report says which. The temperatures written are
   always those fitted on all of --data. Then, per position k over the rounds whose first k-1 drafts were
   accepted, the raw confidence c_k against both the accept rate it predicts and the target it was trained
   towards (1 - L1/2): a head that matches its training target but not the accept rate learned the wrong
   quantity for these rounds, one that matches neither does not carry over to them.
4. Write: the temperatures go into the draft's config.json `confidence_temperatures` (only that key is
   changed; transformers, through this remote code, reads them there) and into the draft's `sts.json`, in the
   format of SGLang's `--speculative-dspark-confidence-sts-path` (`DSparkStsCalibration`: temperatures,
   dataset, num_samples, per-position ece_before / ece_after); the report goes to calibration.json and
   calibration.txt in --out.

Example:
    python tools/calibrate.py --target embedded/target --draft embedded/dspark \\
        --data data/regen/heldout_skip64.jsonl --eval-data data/regen/heldout.jsonl
    python tools/calibrate.py --draft embedded/dspark --data A.jsonl B.jsonl C.jsonl --cross-validate
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script from anywhere
import tools  # noqa: E402,F401
from dspark.configuration_dspark import DSparkConfig  # noqa: E402
from tools.common import (  # noqa: E402
    DTYPES, STS_FILE, RoundRecords, add_model_arguments, apply_threads, expected_calibration_error,
    load_dspark_draft, load_target, read_jsonl, resolve_device, survival, teacher_forced_rounds, write_json,
)

TEMPERATURE_GRID = torch.logspace(-1, 1, 41, dtype=torch.float64)  # 0.1 .. 10


def fit_sequential_temperatures(rounds: RoundRecords, num_bins: int = 10) -> list[float]:
    """Per position, left to right, the grid temperature minimising the survival's ECE."""
    raw = rounds.confidence_logits.double()
    prefix_survival = torch.ones(raw.shape[0], dtype=torch.float64)
    temperatures = []
    for k in range(raw.shape[1]):
        valid = rounds.valid[:, k]
        outcome = rounds.accepted[valid, k]
        errors = [
            expected_calibration_error((prefix_survival * torch.sigmoid(raw[:, k] / t))[valid], outcome, num_bins)
            for t in TEMPERATURE_GRID
        ]
        best = float(TEMPERATURE_GRID[min(range(len(errors)), key=errors.__getitem__)]) if valid.any() else 1.0
        temperatures.append(best)
        prefix_survival = prefix_survival * torch.sigmoid(raw[:, k] / best)
    return temperatures


def survival_ece(rounds: RoundRecords, temperatures: list[float] | torch.Tensor | None, num_bins: int = 10) -> dict:
    """ECE of the survival per position and pooled over all valid (round, position) pairs, and the mean survival per
    position (against the accept rate, the direction of a miscalibration, which the ECE does not show).
    `temperatures`: one per position, or [N, S] one per round and position."""
    curve = survival(rounds.confidence_logits.double(), temperatures)
    valid, accepted = rounds.valid, rounds.accepted
    per_position = [
        expected_calibration_error(curve[valid[:, k], k], accepted[valid[:, k], k], num_bins)
        for k in range(curve.shape[1])
    ]
    mean_survival = (curve.where(valid, 0).sum(0) / valid.sum(0).clamp(min=1)).tolist()
    pooled = expected_calibration_error(curve[valid], accepted[valid], num_bins)
    return {"per_position": per_position, "pooled": pooled, "mean_survival": mean_survival}


def conditional_acceptance(rounds: RoundRecords) -> dict:
    """Per position k, over the rounds that reach it (drafts 1..k-1 accepted, so the Markov and confidence heads
    saw the true previous tokens, as in training): how many, the rate at which draft k is accepted, the mean raw
    confidence c_k (temperature 1), and the mean of its training target 1 - L1/2 (None if not measured)."""
    accepted_before = torch.cat([torch.ones_like(rounds.accepted[:, :1]), rounds.accepted[:, :-1]], dim=-1)
    reached = rounds.valid & accepted_before
    count = reached.sum(0)

    def mean(values: torch.Tensor) -> list[float]:
        return ((values.double() * reached).sum(0) / count.clamp(min=1)).tolist()

    training_target = rounds.sampling_acceptance
    return {"rounds": count.tolist(), "accept_rate": mean(rounds.accepted),
            "mean_confidence": mean(torch.sigmoid(rounds.confidence_logits.double())),
            "mean_training_target": None if training_target is None else mean(training_target)}


def cross_validate(rounds_per_file: dict[str, RoundRecords], num_bins: int = 10) -> dict:
    """Leave one file out: each file's rounds scored with the temperatures fitted on the other files.

    Returns each fold's temperatures and pooled ECE before/after, and `ece_after` of the out-of-fold
    survival of all files together (per position and pooled).
    """
    folds, round_temperatures = [], []
    for path, held_out in rounds_per_file.items():
        others = RoundRecords.concatenate([rounds for other, rounds in rounds_per_file.items() if other != path])
        temperatures = fit_sequential_temperatures(others, num_bins)
        folds.append({"data": path, "rounds": held_out.accepted.shape[0], "temperatures": temperatures,
                      "ece_before": survival_ece(held_out, None, num_bins)["pooled"],
                      "ece_after": survival_ece(held_out, temperatures, num_bins)["pooled"]})
        round_temperatures.append(torch.tensor(temperatures, dtype=torch.float64).expand(len(held_out.accepted), -1))
    all_rounds = RoundRecords.concatenate(list(rounds_per_file.values()))
    return {"folds": folds, "ece_after": survival_ece(all_rounds, torch.cat(round_temperatures), num_bins)}


def write_temperatures(draft_dir: str | Path, temperatures: list[float]) -> None:
    """Set `confidence_temperatures` in config.json (nothing else changes), then check it loads back."""
    path = Path(draft_dir) / "config.json"
    config = json.loads(path.read_text())
    config["confidence_temperatures"] = [round(t, 6) for t in temperatures]
    path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    loaded = DSparkConfig.from_pretrained(draft_dir).confidence_temperatures
    if loaded != config["confidence_temperatures"]:
        raise RuntimeError(f"{path}: wrote {config['confidence_temperatures']} but read back {loaded}")


def write_sts_file(draft_dir: str | Path, report: dict) -> None:
    """The fitted temperatures as SGLang's STS calibration file (SGLang reads them from there, not from
    config.json). Its ECE lists are floats: they are left out if a position had no rounds (NaN)."""
    ece = {key: report[key]["per_position"] for key in ("ece_before", "ece_after")}
    sts = {"temperatures": [round(t, 6) for t in report["temperatures"]], "dataset": " ".join(report["data"]),
           "num_samples": report["rounds"]}
    if all(math.isfinite(value) for values in ece.values() for value in values):
        sts |= ece
    write_json(Path(draft_dir) / STS_FILE, sts)


def collect_rounds(target, draft, paths: list[str], limit: int, max_length: int, kind: str,
                   desc: str) -> dict[str, RoundRecords]:
    """Greedy rounds (`kind`: "decoded" or "every-token") over the first `limit` sequences of the (greedy) files,
    per file that keeps any sequence."""
    for path in paths:
        check_greedy(path)
    records = [(path, record) for path in paths for record in read_jsonl(path)][:limit]
    per_file: dict[str, list[RoundRecords]] = {}
    for path, record in tqdm(records, desc=desc, unit="prompt"):
        rounds = teacher_forced_rounds(target, draft, record["input_ids"][:max_length], record["prompt_len"])
        per_file.setdefault(path, []).append(rounds.decoded() if kind == "decoded" else rounds)
    return {path: RoundRecords.concatenate(rounds) for path, rounds in per_file.items()}


def check_greedy(path: str) -> None:
    meta_path = Path(path).with_suffix(".meta.json")
    if meta_path.exists() and json.loads(meta_path.read_text())["settings"]["temperature"] != 0:
        raise SystemExit(f"{path} holds sampled continuations; calibrate on greedy ones (--temperature 0)")


def report_text(report: dict) -> str:
    where = "the fitted rounds (in-sample)"
    if report["validation"] == "held-out":
        where = f"{report['eval_rounds']} other held-out rounds"
    elif report["validation"] == "cross-validated":
        where = (f"the same rounds out of fold (each of {len(report['folds'])} files scored with temperatures "
                 "fitted on the others)")
    lines = [f"Sequential Temperature Scaling fitted on {report['rounds']} {report['round_kind']} greedy rounds "
             f"({report['positions']} positions); ECE on {where}",
             "(accept: the rate at which the first k drafts all survive; mean a_k: the mean survival predicted for it)",
             f"{'position':>8} {'T':>8} {'accept':>8} {'mean a_k before':>16} {'after':>6} "
             f"{'ECE before':>11} {'ECE after':>10}"]
    before, after = report["ece_before"], report["ece_after"]
    for k, t in enumerate(report["temperatures"]):
        lines.append(f"{k + 1:>8} {t:>8.3f} {report['prefix_accept_rate'][k]:>8.3f} "
                     f"{before['mean_survival'][k]:>16.3f} {after['mean_survival'][k]:>6.3f} "
                     f"{before['per_position'][k]:>11.4f} {after['per_position'][k]:>10.4f}")
    lines.append(f"{'pooled':>8} {'':>8} {'':>8} {'':>16} {'':>6} {before['pooled']:>11.4f} {after['pooled']:>10.4f}")
    for fold in report.get("folds", []):
        lines.append(f"fold {fold['data']}: {fold['rounds']} rounds, T {[round(t, 3) for t in fold['temperatures']]}, "
                     f"ECE {fold['ece_before']:.4f} -> {fold['ece_after']:.4f}")
    conditional, target = report["conditional"], report["conditional"]["mean_training_target"]
    lines += ["Per position, over the rounds whose earlier drafts were all accepted: the accept rate, the mean raw "
              "confidence c_k that predicts it, and the mean of c_k's training target 1 - L1/2",
              f"{'position':>8} {'rounds':>8} {'accept':>8} {'mean c_k':>9} {'mean 1-L1/2':>12}"]
    for k, count in enumerate(conditional["rounds"]):
        lines.append(f"{k + 1:>8} {count:>8} {conditional['accept_rate'][k]:>8.3f} "
                     f"{conditional['mean_confidence'][k]:>9.3f} {'-' if target is None else f'{target[k]:.3f}':>12}")
    return "\n".join(lines)


def calibrate(args) -> dict:
    device = resolve_device(args.device)
    target, _ = load_target(args.target, device, DTYPES[args.dtype], args.target_device_map)
    draft = load_dspark_draft(args.draft, device)
    if draft.confidence_head is None:
        raise SystemExit(f"{args.draft} has no confidence head (a DFlash draft): nothing to calibrate")
    rounds_per_file = collect_rounds(target, draft, args.data, args.limit, args.max_length, args.rounds, "fit rounds")
    rounds = RoundRecords.concatenate(list(rounds_per_file.values()))
    temperatures = fit_sequential_temperatures(rounds, args.bins)
    folds = None
    if args.cross_validate:
        if len(rounds_per_file) < 2:
            raise SystemExit("--cross-validate needs at least two --data files with sequences within --limit")
        eval_rounds, validation = rounds, cross_validate(rounds_per_file, args.bins)
        folds, ece_after = validation["folds"], validation["ece_after"]
    else:
        eval_rounds = rounds
        if args.eval_data:
            eval_rounds = RoundRecords.concatenate(list(collect_rounds(
                target, draft, args.eval_data, args.eval_limit, args.max_length, args.rounds, "eval rounds").values()))
        ece_after = survival_ece(eval_rounds, temperatures, args.bins)
    valid = eval_rounds.valid.double()
    report = {
        "draft": str(args.draft), "data": args.data, "round_kind": args.rounds, "rounds": rounds.accepted.shape[0],
        "positions": int(rounds.valid.sum()), "eval_data": args.eval_data or args.data,
        "eval_rounds": eval_rounds.accepted.shape[0],
        "validation": "cross-validated" if args.cross_validate else "held-out" if args.eval_data else "in-sample",
        "bins": args.bins, "temperatures": temperatures,
        "prefix_accept_rate": ((eval_rounds.accepted.double() * valid).sum(0) / valid.sum(0).clamp(min=1)).tolist(),
        "greedy_acceptance_length": eval_rounds.acceptance_length(),
        "ece_before": survival_ece(eval_rounds, None, args.bins),
        "ece_after": ece_after,
        **({"folds": folds} if folds else {}),
        "conditional": conditional_acceptance(eval_rounds),
        "written_to_config": not args.dry_run,
    }
    if not args.dry_run:
        write_temperatures(args.draft, temperatures)
        write_sts_file(args.draft, report)
    out = Path(args.out)
    write_json(out / "calibration.json", report)
    (out / "calibration.txt").write_text(report_text(report) + "\n")
    return report


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_arguments(parser)
    parser.add_argument("--draft", default="embedded/dspark", help="DSpark draft folder; its config.json is updated")
    parser.add_argument("--data", nargs="+", default=["data/regen/heldout.jsonl"],
                        help="held-out GREEDY regenerated data to fit the temperatures on, one or more files")
    parser.add_argument("--limit", type=int, default=256, help="sequences of --data to fit on")
    validation = parser.add_mutually_exclusive_group()
    validation.add_argument("--eval-data", nargs="+", default=None,
                            help="other held-out GREEDY data to report the ECE on (default: the fitted rounds)")
    validation.add_argument("--cross-validate", action="store_true",
                            help="report the ECE out of fold: each --data file scored with temperatures fitted on "
                                 "the other files")
    parser.add_argument("--eval-limit", type=int, default=256, help="sequences of --eval-data to use")
    parser.add_argument("--rounds", choices=["decoded", "every-token"], default="decoded",
                        help="the rounds greedy decoding runs, or one at every response token (default: %(default)s)")
    parser.add_argument("--max-length", type=int, default=1024, help="tokens per sequence (longer ones are cut)")
    parser.add_argument("--bins", type=int, default=10, help="equal-width bins of the ECE")
    parser.add_argument("--out", default="results/calibration", help="report folder")
    parser.add_argument("--dry-run", action="store_true", help="report only, leave config.json untouched")
    return parser


def main(argv=None) -> dict:
    args = build_parser().parse_args(argv)
    apply_threads(args)
    report = calibrate(args)
    print(report_text(report))
    return report


if __name__ == "__main__":
    main()
