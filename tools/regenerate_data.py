#!/usr/bin/env python
"""Regenerate training data with the target: the target answers the corpus prompts itself.

A draft learns to predict the TARGET, so (as SpecForge does) every training prompt is answered by the
target, greedily (--temperature 0, the default) or sampled (--temperature > 0, plain softmax sampling:
no top-k / top-p). Prompts are the records with a `prompt` field of a JSON-lines file: the `pair` records
of tools/build_corpus.py or the prompt mix of tools/build_prompts.py, rendered as one user turn with the
target's chat template (tools/common.chat_prompt_ids). Output, one JSON line per prompt:

    {"input_ids": [prompt ..., response ..., <|eos|>], "prompt_len": int, "source": str}

plus `{out}.meta.json` (target, settings, counts, time). The file is a cache: rerunning with the same
settings continues where it stopped (batches are seeded by their index), other settings are refused.

The held-out split answered greedily is what tools/calibrate.py fits temperatures on.

Example:
    python tools/regenerate_data.py --target embedded/target --corpus data/corpus/train.jsonl \\
        --out data/regen/train.jsonl --max-prompts 4000 --max-new-tokens 256
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script from anywhere
import tools  # noqa: E402,F401
from tools.common import (
    DTYPES, add_model_arguments, apply_threads, chat_prompt_ids, finished_lines, load_target, read_jsonl,
    refuse_other_settings, resolve_device, sampling_kwargs, write_json,
)


def corpus_prompts(
    corpus: str, tokenizer, max_prompts: int, max_prompt_tokens: int, skip: int = 0
) -> tuple[list[dict], int]:
    """The first `max_prompts` prompts (records with a `prompt`) of the file that fit `max_prompt_tokens`,
    after the first `skip` prompts, tokenized with the target's chat template; and the `skip` of the data set
    that continues this one (the prompts read, those too long included)."""
    prompts, read = [], skip
    pairs = (record for record in read_jsonl(corpus) if "prompt" in record)
    for record in itertools.islice(pairs, skip, None):
        read += 1
        ids = chat_prompt_ids(tokenizer, record["prompt"])
        if len(ids) <= max_prompt_tokens:
            prompts.append({"ids": ids, "source": record.get("source", "")})
        if len(prompts) == max_prompts:
            break
    return prompts, read


@torch.no_grad()
def answer_batch(target, tokenizer, prompts: list[list[int]], max_new_tokens: int, temperature: float):
    """The target's continuations (up to and including EOS) of left-padded prompts."""
    pad_id = tokenizer.pad_token_id
    eos_id = tokenizer.eos_token_id
    width = max(len(p) for p in prompts)
    input_ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts], device=target.device)
    attention_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=target.device)
    output = target.generate(
        input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=max_new_tokens,
        pad_token_id=pad_id, eos_token_id=eos_id, **sampling_kwargs(temperature),
    )
    answers = []
    for row in output[:, width:].tolist():
        answers.append(row[: row.index(eos_id) + 1] if eos_id in row else row)
    return answers


def regenerate(args) -> dict:
    out = Path(args.out)
    meta_path = out.with_suffix(".meta.json")
    settings = {
        "target": str(args.target), "corpus": str(args.corpus), "temperature": args.temperature,
        "max_new_tokens": args.max_new_tokens, "skip_prompts": args.skip_prompts, "max_prompts": args.max_prompts,
        "max_prompt_tokens": args.max_prompt_tokens, "batch_size": args.batch_size, "seed": args.seed,
    }
    if out.exists():
        if not meta_path.exists():
            raise SystemExit(f"{out} exists without {meta_path}; remove it or pick another --out.")
        refuse_other_settings(out, json.loads(meta_path.read_text())["settings"], settings,
                              "Rerun with the same settings to resume, or pick another --out.")
    device = resolve_device(args.device)
    target, tokenizer = load_target(args.target, device, DTYPES[args.dtype], args.target_device_map)

    prompts, next_skip = corpus_prompts(args.corpus, tokenizer, args.max_prompts, args.max_prompt_tokens,
                                        args.skip_prompts)
    # Similar lengths share a batch (little padding) within windows of 8 batches, so that any prefix of the
    # output keeps the file's mix of prompts; the order is fixed, so a rerun resumes exactly.
    window = 8 * args.batch_size
    prompts = [p for start in range(0, len(prompts), window)
               for p in sorted(prompts[start : start + window], key=lambda p: len(p["ids"]))]
    batches = [prompts[i : i + args.batch_size] for i in range(0, len(prompts), args.batch_size)]
    # A rerun continues after the last batch written whole; one a killed run wrote in part is written again.
    batch_ends = list(itertools.accumulate(map(len, batches)))
    written = finished_lines(out) if out.exists() else []
    done = max(end for end in [0, *batch_ends] if end <= len(written))
    if done < len(written):
        out.write_text("".join(written[:done]), encoding="utf-8")
    out.parent.mkdir(parents=True, exist_ok=True)
    write_json(meta_path, {"settings": settings, "complete": False})
    start, new_tokens = time.time(), 0
    bar = tqdm(total=len(prompts), initial=done, desc="regenerate", unit="prompt")
    with open(out, "a", encoding="utf-8") as f, bar:
        for index, (batch, end) in enumerate(zip(batches, batch_ends)):
            if end <= done:
                continue  # written by an earlier run
            torch.manual_seed(args.seed + index)
            answers = answer_batch(target, tokenizer, [p["ids"] for p in batch], args.max_new_tokens, args.temperature)
            for prompt, answer in zip(batch, answers):
                f.write(json.dumps({"input_ids": prompt["ids"] + answer, "prompt_len": len(prompt["ids"]),
                                    "source": prompt["source"]}) + "\n")
                new_tokens += len(answer)
            f.flush()
            bar.update(len(batch))
            bar.set_postfix(tok_s=f"{new_tokens / (time.time() - start):.0f}")
    records = read_jsonl(out)
    response_lengths = [len(r["input_ids"]) - r["prompt_len"] for r in records]
    summary = {
        "settings": settings, "complete": True, "records": len(records), "next_skip_prompts": next_skip,
        "response_tokens": sum(response_lengths),
        "mean_response_tokens": sum(response_lengths) / max(1, len(records)),
        "ended_with_eos": sum(r["input_ids"][-1] == tokenizer.eos_token_id for r in records),
        "seconds_this_run": round(time.time() - start, 1),
    }
    write_json(meta_path, summary)
    return summary


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_arguments(parser)
    parser.add_argument("--corpus", default="data/corpus/train.jsonl", help="corpus JSON lines (default: %(default)s)")
    parser.add_argument("--out", default="data/regen/train.jsonl", help="output JSON lines (default: %(default)s)")
    parser.add_argument("--max-prompts", type=int, default=4000)
    parser.add_argument("--skip-prompts", type=int, default=0,
                        help="start after this many prompts (to extend a data set, or to shard it over "
                             "processes): the next_skip_prompts of the previous part's meta.json, which counts "
                             "the prompts skipped as too long too")
    parser.add_argument("--max-prompt-tokens", type=int, default=1024, help="skip longer prompts")
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default), > 0 = sampled")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    return parser


def main(argv=None) -> None:
    args = build_parser().parse_args(argv)
    apply_threads(args)
    print(json.dumps(regenerate(args), indent=2))


if __name__ == "__main__":
    main()
