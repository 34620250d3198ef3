#!/usr/bin/env python
"""Evaluate speculative decoding of a target with a DSpark draft and the baselines, in one run.

Methods (each at every --temperatures value, on every prompt of every --datasets set):
  target             the target alone (`target.generate`), the reference for speed and for losslessness;
  dspark/MODE        `target.generate(..., assistant_model=draft)` (routed to `dspark_generate`) with the DSpark
                     draft, one entry per --truncations mode
                     (full: verify all drafts; threshold: stop at the first low confidence; schedule: the
                     throughput-optimal verify length);
  dflash             the DFlash ablation draft (--dflash) through the same loop (no confidence: full);
  assistant          transformers' stock assisted generation with the AR assistant (--assistant);
  prompt_lookup      transformers' prompt-lookup decoding (--prompt-lookup tokens per round).
transformers refuses its stock assisted generation for stateful targets (kimi_linear): those baselines
are then reported as unsupported, with transformers' reason.

Per dataset, method and temperature: tau (tokens per target verification, bonus included), tokens/s,
speedup over the target alone, and (temperature 0) the share of outputs identical to the target's greedy
output. DSpark / DFlash add the conditional acceptance of each block position and the mean verify
length. The calibration diagram compares the DSpark survival (with the config's temperatures, and with
all temperatures 1) to the prefix-accept mask of the greedy rounds that decoding runs on the target's
temperature-0 answers (`RoundRecords.decoded`).

Outputs in --out: eval.json, eval.md, tau.png, acceptance.png, calibration.png, and records.jsonl: one line
per finished job (every method on one prompt at one temperature). A run over all prompts takes days on a CPU:
rerun the same command after an interruption and it resumes after the last finished job; other settings
with the same --out are refused, but for --limit. Jobs run prompt by prompt, each through every set and
temperature, so a run stopped anywhere has the first k prompts of every set done: `--limit k` with its --out
reports them without running anything, and a larger --limit extends a finished run. Tokens/s of a job are
measured within that job, so speed-ups stay same-run ratios across resumes.

Example:
    python tools/evaluate.py --draft embedded/dspark --dflash runs/dflash/final --assistant runs/assistant/final \\
        --limit 10 --max-new-tokens 128
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
from collections import Counter, defaultdict
from pathlib import Path

import torch
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script from anywhere
import tools  # noqa: E402,F401
from tools.common import (  # noqa: E402
    DTYPES, STS_FILE, ForwardCounter, RoundRecords, add_model_arguments, apply_threads, chat_prompt_ids,
    describe_device, expected_calibration_error, finished_lines, load_dspark_draft, load_eval_prompts, load_target,
    refuse_other_settings, reliability_bins, resolve_device, round_counts, sampling_kwargs, survival,
    teacher_forced_rounds, write_json,
)
from tools.smollm2 import describe_target, resolve_target  # noqa: E402

DATASETS = ("humaneval", "mbpp", "gsm8k", "math500", "mt-bench", "aime25")
TRUNCATIONS = ("full", "threshold", "schedule")
MODEL_ARGUMENTS = ("target", "draft", "dflash", "assistant")  # folders whose files a resume must find unchanged
RECORDS = "records.jsonl"  # in --out: the settings, then one line per finished (temperature, dataset, prompt) job


# ---------------------------------------------------------------------------------------------- methods
class Evaluation:
    """Runs every method on one prompt and returns the job's record: per method its counts, to be added up."""

    def __init__(self, args, target, tokenizer, drafts: dict, assistant):
        self.args, self.target, self.tokenizer = args, target, tokenizer
        self.drafts, self.assistant = drafts, assistant
        self.unsupported: dict[str, str] = {}
        self.machine = describe_device(target.device)  # a resumed run may finish on another machine

    def methods(self) -> list[str]:
        names = ["target"]
        if "dspark" in self.drafts:
            names += [f"dspark/{mode}" for mode in self.args.truncations]
        if "dflash" in self.drafts:
            names.append("dflash")
        if self.assistant is not None:
            names.append("assistant")
        if self.args.prompt_lookup:
            names.append("prompt_lookup")
        return names

    def generate(self, method: str, input_ids: torch.Tensor, temperature: float, seed: int):
        """(new token ids, counts to add up) of one method on one prompt. The counts of the stock methods
        take every target forward as one verification."""
        common = {"attention_mask": torch.ones_like(input_ids), "max_new_tokens": self.args.max_new_tokens,
                  "pad_token_id": self.tokenizer.pad_token_id, **sampling_kwargs(temperature)}
        torch.manual_seed(seed)
        if method.startswith(("dspark", "dflash")):
            draft = self.drafts["dspark" if method.startswith("dspark") else "dflash"]
            truncation = method.split("/")[1] if "/" in method else "full"
            output = self.target.generate(input_ids, assistant_model=draft, truncation=truncation, **common)
            return output[0, input_ids.shape[1]:].tolist(), round_counts(draft.last_stats)
        extra = {"assistant": {"assistant_model": self.assistant},
                 "prompt_lookup": {"prompt_lookup_num_tokens": self.args.prompt_lookup}}.get(method, {})
        with ForwardCounter(self.target) as counter:
            output = self.target.generate(input_ids, **common, **extra)
        tokens = output[0, input_ids.shape[1]:].tolist()
        return tokens, {"verifications": counter.count, "round_tokens": len(tokens)}

    def run_prompt(self, dataset: str, index: int, prompt: str, temperature: float) -> dict:
        """One job: every method on one prompt at one temperature. At temperature 0 the record keeps the
        target's answer (the calibration diagram's rounds) and each method's identity to it."""
        input_ids = torch.tensor([chat_prompt_ids(self.tokenizer, prompt)], device=self.target.device)
        record = {"temperature": temperature, "dataset": dataset, "index": index, "machine": self.machine,
                  "methods": {}}
        for method in self.methods():
            if method in self.unsupported:
                continue
            started = time.perf_counter()
            try:
                tokens, counts = self.generate(method, input_ids, temperature, self.args.seed + index)
            except ValueError as error:  # transformers refuses stock assisted generation (stateful target)
                if method not in ("assistant", "prompt_lookup"):
                    raise
                self.unsupported[method] = str(error).split("\n")[0]
                continue
            entry = {"new_tokens": len(tokens), "seconds": time.perf_counter() - started, **counts}
            if method == "target" and temperature == 0:
                record["greedy_answer"], record["prompt_length"] = input_ids[0].tolist() + tokens, input_ids.shape[1]
            elif temperature == 0:
                entry["lossless"] = float(tokens == record["greedy_answer"][record["prompt_length"]:])
            record["methods"][method] = entry
        return record

    def warm_up(self, prompt: str) -> None:
        """One short run of every method, so that first-call costs do not count."""
        max_new, self.args.max_new_tokens = self.args.max_new_tokens, 4
        input_ids = torch.tensor([chat_prompt_ids(self.tokenizer, prompt)], device=self.target.device)
        for method in self.methods():
            try:
                self.generate(method, input_ids, 0.0, 0)
            except ValueError as error:
                if method not in ("assistant", "prompt_lookup"):
                    raise
                self.unsupported[method] = str(error).split("\n")[0]
        self.args.max_new_tokens = max_new


# ---------------------------------------------------------------------------------------------- summary
def add_counts(totals: dict, counts: dict) -> None:
    """Add numbers, and lists element-wise (per block position)."""
    for key, value in counts.items():
        if isinstance(value, list):
            current = totals.get(key) or [0] * len(value)
            totals[key] = [a + b for a, b in zip(current, value)]
        else:
            totals[key] += value


def summarize(records: list[dict]) -> dict:
    """results[T][dataset][method] (dataset 'all' pools the others): tau, tokens/s, speedup, lossless and, for
    DSpark / DFlash, the conditional acceptance per block position and the mean tokens per verify forward."""
    totals = defaultdict(lambda: defaultdict(float))  # (T, dataset, method) -> sums over prompts
    for pooled in (False, True):  # each dataset, then 'all'
        for record in records:
            dataset = "all" if pooled else record["dataset"]
            for method, counts in record["methods"].items():
                sums = totals[record["temperature"], dataset, method]
                sums["prompts"] += 1
                add_counts(sums, counts)
    results: dict = {}
    for (temperature, dataset, method), sums in totals.items():
        entry = {
            "prompts": int(sums["prompts"]),
            "new_tokens": int(sums["new_tokens"]),
            "tokens_per_s": sums["new_tokens"] / max(sums["seconds"], 1e-9),
            "tau": sums["round_tokens"] / max(sums["verifications"], 1),
        }
        if temperature == 0 and method != "target":
            entry["lossless"] = sums["lossless"] / max(sums["prompts"], 1)
        if sums.get("position_tried"):
            entry["conditional_acceptance"] = [
                a / t if t else None for a, t in zip(sums["position_accepted"], sums["position_tried"])
            ]
            entry["mean_verify_tokens"] = 1 + sums["verified_drafts"] / max(sums["verify_forwards"], 1)
        results.setdefault(f"T={temperature:g}", {}).setdefault(dataset, {})[method] = entry
    for per_dataset in results.values():
        for per_method in per_dataset.values():
            base = per_method.get("target", {}).get("tokens_per_s")
            for entry in per_method.values():
                entry["speedup"] = entry["tokens_per_s"] / base if base else None
    return results


def machine(record: dict) -> str:
    return record.get("machine", "not recorded")  # jobs finished before records named their machine


def speedups_by_machine(records: list[dict]) -> dict | None:
    """speedups[machine][T][method] over all sets, when the jobs ran on more than one machine: a pooled speed-up
    then mixes rounds whose costs differ."""
    machines = Counter(map(machine, records))
    if len(machines) < 2:
        return None
    return {name: {temperature: {method: entry["speedup"] for method, entry in per_dataset["all"].items()}
                   for temperature, per_dataset in summarize([r for r in records if machine(r) == name]).items()}
            for name in machines}


def calibration_summary(target, draft, greedy_answers, bins: int) -> dict | None:
    """Reliability of the DSpark survival on the greedy rounds decoding runs over the target's temperature-0
    answers."""
    if draft is None or draft.confidence_head is None or not greedy_answers:
        return None
    rounds = RoundRecords.concatenate(
        [teacher_forced_rounds(target, draft, ids, n).decoded() for ids, n in greedy_answers]
    )
    if rounds.accepted.shape[0] == 0:
        return None
    summary = {"rounds": rounds.accepted.shape[0]}
    for name, temperatures in (("uncalibrated", None), ("calibrated", draft.config.confidence_temperatures)):
        curve = survival(rounds.confidence_logits.double(), temperatures)[rounds.valid]
        outcome = rounds.accepted[rounds.valid]
        summary[name] = {"temperatures": temperatures, "ece": expected_calibration_error(curve, outcome, bins),
                         **reliability_bins(curve, outcome, bins)}
    return summary


# ---------------------------------------------------------------------------------------------- report
def prompt_counts(report: dict) -> str:
    """'humaneval 2, gsm8k 2, ...': the prompts each dataset contributed (the same at every temperature)."""
    per_dataset = next(iter(report["results"].values()))
    return ", ".join(f"{dataset} {entries['target']['prompts']}" for dataset, entries in per_dataset.items()
                     if dataset != "all")


def table(header: list[str], rows: list[list[str]]) -> list[str]:
    """A markdown table's lines, then a blank one."""
    return ["| " + " | ".join(header) + " |", "|---" * len(header) + "|",
            *("| " + " | ".join(row) + " |" for row in rows), ""]


def markdown(report: dict) -> str:
    lines = ["# Speculative decoding evaluation", "",
             f"Target: {report['target_name']}. Prompts: {prompt_counts(report)}; "
             f"{report['settings']['max_new_tokens']} new tokens at most. Cells: tau (tokens per target "
             "verification, bonus included) / speedup in tokens per second over the target alone, measured within "
             "each job (one prompt at one temperature).", "",
             "Jobs ran on: " + "; ".join(f"{name} ({jobs})" for name, jobs in report["machines"].items()) + ".", ""]
    by_machine = report["speedup_by_machine"]
    if by_machine:
        columns = [(name, temperature) for name, per_temperature in by_machine.items()
                   for temperature in per_temperature]
        methods = list(report["results"][columns[0][1]]["all"])
        speedups = [[by_machine[name][temperature].get(method) for name, temperature in columns] for method in methods]
        lines += ["Speedup over the target alone on each machine, all sets:", ""]
        lines += table(["method", *(f"{name}, {temperature}" for name, temperature in columns)],
                       [[method, *("-" if speedup is None else f"{speedup:.2f}x" for speedup in row)]
                        for method, row in zip(methods, speedups)])
    for temperature, per_dataset in report["results"].items():
        datasets = [d for d in per_dataset if d != "all"] + ["all"]
        rows = []
        for method in per_dataset["all"]:
            entries = [per_dataset[dataset].get(method) for dataset in datasets]
            cells = ["-" if e is None else f"{e['tau']:.2f} / {e['speedup']:.2f}x" for e in entries]
            rows.append([method, *cells, f"{per_dataset['all'][method]['tokens_per_s']:.1f}"])
        lines += [f"## {temperature}", ""] + table(["method", *datasets, "tok/s (all)"], rows)
        detail = [(m, e) for m, e in per_dataset["all"].items() if "conditional_acceptance" in e or "lossless" in e]
        if detail:
            rows = []
            for method, entry in detail:
                acceptance = " ".join("-" if a is None else f"{a:.2f}" for a in entry.get("conditional_acceptance", []))
                verify = f"{entry['mean_verify_tokens']:.2f}" if "mean_verify_tokens" in entry else "-"
                lossless = f"{entry['lossless']:.0%}" if "lossless" in entry else "-"
                rows.append([method, lossless, verify, acceptance or "-"])
            lines += table(["method", "lossless", "mean tokens per verify forward (drafts + 1)",
                            "conditional acceptance by position"], rows)
    for method, reason in report["unsupported"].items():
        lines.append(f"- `{method}` not run: {reason}")
    calibration = report.get("calibration")
    if calibration:
        lines += ["", f"Calibration of the survival on {calibration['rounds']} decoded greedy rounds: ECE "
                  f"{calibration['uncalibrated']['ece']:.4f} with all temperatures 1, "
                  f"{calibration['calibrated']['ece']:.4f} with the config's temperatures."]
    return "\n".join(lines) + "\n"


def plot(report: dict, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results = report["results"]
    fig, axes = plt.subplots(1, len(results), figsize=(7 * len(results), 4), squeeze=False)
    for ax, (temperature, per_dataset) in zip(axes[0], results.items()):
        datasets = list(per_dataset)
        methods = list(per_dataset["all"])
        width = 0.8 / len(methods)
        for i, method in enumerate(methods):
            values = [per_dataset[d].get(method, {}).get("tau", 0.0) for d in datasets]
            ax.bar([x + i * width for x in range(len(datasets))], values, width, label=method)
        ax.set_xticks([x + 0.4 - width / 2 for x in range(len(datasets))], datasets, rotation=30)
        ax.set_ylabel("tau (tokens per verification)")
        ax.set_title(f"tau per dataset, {temperature}")
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "tau.png", dpi=120)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6, 4))
    for temperature, per_dataset in results.items():
        for method, entry in per_dataset["all"].items():
            rates = entry.get("conditional_acceptance")
            if rates:
                positions = [k + 1 for k, r in enumerate(rates) if r is not None]
                ax.plot(positions, [r for r in rates if r is not None], marker="o", label=f"{method} {temperature}")
    ax.set_xlabel("block position k")
    ax.set_ylabel("P(accept k | 1..k-1 accepted)")
    ax.set_ylim(0, 1)
    ax.set_title("Conditional acceptance by position")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "acceptance.png", dpi=120)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(5, 5))
    ax.plot([0, 1], [0, 1], color="gray", linestyle="--", label="perfect calibration")
    calibration = report.get("calibration")
    if calibration:
        for name in ("uncalibrated", "calibrated"):
            bins = calibration[name]
            points = [(c, f) for c, f in zip(bins["confidence"], bins["frequency"]) if c is not None]
            ax.plot(*zip(*points), marker="o", label=f"{name} (ECE {calibration[name]['ece']:.3f})")
    else:
        ax.text(0.5, 0.5, "no DSpark confidence head", ha="center")
    ax.set_xlabel("predicted survival")
    ax.set_ylabel("observed prefix acceptance")
    ax.set_title("Calibration of the survival (decoded greedy rounds)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "calibration.png", dpi=120)
    plt.close(fig)


# ---------------------------------------------------------------------------------------------- main
def folder_digest(path: str | None) -> str | None:
    """sha256 (16 hex digits) of a local model folder's JSON and safetensors files (but SGLang's STS file, which
    transformers never reads), so that a retrained or recalibrated model at the same path is not resumed over;
    None for no model or a Hub id."""
    folder = Path(resolve_target(path)) if path else None
    if folder is None or not folder.is_dir():
        return None
    digest = hashlib.sha256()
    configs = sorted(file for file in folder.glob("*.json") if file.name != STS_FILE)
    for file in configs + sorted(folder.glob("*.safetensors")):
        digest.update(file.name.encode())
        with open(file, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 24), b""):
                digest.update(chunk)
    return digest.hexdigest()[:16]


def finished_jobs(path: Path, settings: dict) -> list[dict]:
    """The records of the jobs an earlier run with the same settings finished in `path` (a rerun resumes
    there; the file's first line holds the settings)."""
    if not path.exists():
        return []
    header, *records = finished_lines(path)
    refuse_other_settings(path, json.loads(header)["settings"], settings,
                          f"Rerun with the same settings to resume, or give another --out (or remove {path.name} "
                          "there to start over).")
    return [json.loads(line) for line in records]


def evaluate(args) -> dict:
    settings = {key: (str(value) if isinstance(value, Path) else value) for key, value in vars(args).items()}
    out = Path(args.out)
    records_path = out / RECORDS
    job_settings = {key: value for key, value in settings.items() if key not in ("out", "limit")}
    job_settings |= {f"{name} sha256": folder_digest(getattr(args, name)) for name in MODEL_ARGUMENTS}
    records = finished_jobs(records_path, job_settings)
    device = resolve_device(args.device)
    target, tokenizer = load_target(args.target, device, DTYPES[args.dtype], args.target_device_map)
    paths = {"dspark": args.draft, "dflash": args.dflash}
    drafts = {name: load_dspark_draft(path, device) for name, path in paths.items() if path}
    assistant = None
    if args.assistant:
        from transformers import AutoModelForCausalLM

        assistant = AutoModelForCausalLM.from_pretrained(args.assistant, dtype=DTYPES[args.dtype]).to(device).eval()
    prompts = load_eval_prompts(args.datasets, args.limit, args.eval_dir)
    evaluation = Evaluation(args, target, tokenizer, drafts, assistant)
    evaluation.warm_up(next(iter(prompts.values()))[0])
    # (temperature, dataset, prompt index), prompt-major: a run stopped anywhere is a balanced sample of the sets
    keys = [(t, d, i) for i in range(max(map(len, prompts.values()))) for d, ps in prompts.items() if i < len(ps)
            for t in args.temperatures]
    finished = {(r["temperature"], r["dataset"], r["index"]): r for r in records}
    records = [finished[key] for key in keys if key in finished]  # a smaller --limit reports its prompts only
    jobs = [key for key in keys if key not in finished]
    if not records_path.exists():
        out.mkdir(parents=True, exist_ok=True)
        records_path.write_text(json.dumps({"settings": job_settings}) + "\n")
    with open(records_path, "a", encoding="utf-8") as f:
        for temperature, dataset, index in tqdm(jobs, desc="evaluate", unit="prompt", initial=len(records),
                                                total=len(keys)):
            records.append(evaluation.run_prompt(dataset, index, prompts[dataset][index], temperature))
            f.write(json.dumps(records[-1]) + "\n")
            f.flush()
    greedy_answers = [(r["greedy_answer"], r["prompt_length"]) for r in records if "greedy_answer" in r]
    report = {
        "settings": settings,
        "target_name": describe_target(args.target),
        "results": summarize(records),
        "machines": dict(Counter(map(machine, records))),
        "speedup_by_machine": speedups_by_machine(records),
        "unsupported": evaluation.unsupported,
        "calibration": calibration_summary(target, drafts.get("dspark"), greedy_answers, args.bins),
    }
    write_json(out / "eval.json", report)
    (out / "eval.md").write_text(markdown(report))
    plot(report, out)
    return report


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_arguments(parser)
    parser.add_argument("--draft", default="embedded/dspark", help="DSpark draft folder ('' to skip)")
    parser.add_argument("--dflash", default=None, help="DFlash ablation draft folder")
    parser.add_argument("--assistant", default=None, help="autoregressive assistant folder (stock assisted generation)")
    parser.add_argument("--prompt-lookup", type=int, default=7, help="prompt-lookup tokens per round (0 = skip)")
    parser.add_argument("--datasets", nargs="+", default=list(DATASETS), help="shipped eval sets (default: all)")
    parser.add_argument("--eval-dir", default=str(tools.REPO_ROOT / "eval"), help="folder of the eval JSON lines")
    parser.add_argument("--limit", type=int, default=10, help="prompts per dataset (0: all of them)")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 1.0])
    parser.add_argument("--truncations", nargs="+", choices=TRUNCATIONS, default=list(TRUNCATIONS))
    parser.add_argument("--bins", type=int, default=10, help="bins of the calibration diagram")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="results/eval", help="output folder")
    return parser


def main(argv=None) -> dict:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.limit < 0:
        parser.error(f"--limit {args.limit}: give a number of prompts per dataset, or 0 for all of them")
    apply_threads(args)
    report = evaluate(args)
    print(markdown(report))
    return report


if __name__ == "__main__":
    main()
