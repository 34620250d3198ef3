#!/usr/bin/env python
"""Compare finished `train_draft.py` runs side by side: geometry, cost and held-out quality.

Each run folder holds `train_summary.json` (written at the end of training, with the last held-out
evaluation) and `final/config.json` (the draft's geometry). The table lists, per run: kind, draft layers,
target layers read, Markov rank, trainable parameters, steps, training seconds per step, and the held-out
measures of the last evaluation: greedy cross-entropy, top-1 accuracy and teacher-forced acceptance length,
and, when the run had `--heldout-sampled`, cross-entropy and the mean acceptance probability of speculative
sampling (1 - L1/2) on answers sampled at temperature 1.

Usage::

    python tools/compare_runs.py runs/geo-* --json results/geometry.json --markdown results/geometry.md
"""

import argparse
import json
import sys
from pathlib import Path

COLUMNS = {  # key: (header, format)
    "run": ("run", "{}"),
    "kind": ("kind", "{}"),
    "num_layers": ("layers", "{}"),
    "target_layer_ids": ("target layers", "{}"),
    "markov_rank": ("Markov rank", "{}"),
    "trainable_parameters": ("parameters", "{:,}"),
    "steps": ("steps", "{}"),
    "seconds_per_step": ("s / step", "{:.2f}"),
    "heldout_cross_entropy": ("held-out CE", "{:.3f}"),
    "heldout_accuracy": ("top-1", "{:.3f}"),
    "heldout_greedy_acceptance_length": ("acceptance length", "{:.3f}"),
    "heldout_sampled_cross_entropy": ("T=1 CE", "{:.3f}"),
    "sampled_acceptance": ("T=1 acceptance", "{:.3f}"),
}


class RunError(Exception):
    """A run folder lacks what a finished run writes."""


def read_json(path: Path, what: str) -> dict:
    if not path.is_file():
        raise RunError(f"{path.parent}: no {path.name} ({what}); is the run finished?")
    return json.loads(path.read_text())


def summarize(run_dir: Path) -> dict:
    """One row of the comparison: the run's geometry, cost and last held-out evaluation."""
    summary = read_json(run_dir / "train_summary.json", "written when training ends")
    config = read_json(Path(summary["final_dir"]) / "config.json", "the final draft")
    if "heldout_cross_entropy" not in summary:
        raise RunError(f"{run_dir}: its summary has no held-out evaluation; train with --heldout")
    row = {
        "run": run_dir.name,
        "kind": summary["kind"],
        "num_layers": config["num_hidden_layers"],
        "target_layer_ids": config["target_layer_ids"],
        "markov_rank": config["markov_rank"],
        "trainable_parameters": summary["trainable_parameters"],
        "steps": summary["steps"],
        "seconds_per_step": summary["train_seconds"] / summary["steps"],
    }
    row.update({key: value for key, value in summary.items() if key.startswith("heldout_")})
    if "heldout_sampled_l1" in summary:
        row["sampled_acceptance"] = 1.0 - summary["heldout_sampled_l1"] / 2.0
    return row


def markdown_table(rows: list[dict]) -> str:
    columns = [key for key in COLUMNS if any(key in row for row in rows)]
    lines = [
        "| " + " | ".join(COLUMNS[key][0] for key in columns) + " |",
        "|" + "---|" * len(columns),
    ]
    for row in rows:
        cells = [COLUMNS[key][1].format(row[key]) if key in row else "-" for key in columns]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="+", type=Path, help="train_draft.py --out folders")
    parser.add_argument("--json", type=Path, help="also write the rows as JSON here")
    parser.add_argument("--markdown", type=Path, help="also write the table here")
    return parser


def main(argv=None) -> list[dict]:
    args = build_parser().parse_args(argv)
    try:
        rows = [summarize(run_dir) for run_dir in args.runs]
    except RunError as error:
        sys.exit(f"error: {error}")
    table = markdown_table(rows)
    print(table, end="")
    for path, text in ((args.json, json.dumps(rows, indent=2) + "\n"), (args.markdown, table)):
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
    return rows


if __name__ == "__main__":
    main()
