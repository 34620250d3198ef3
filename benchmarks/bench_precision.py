"""How often does greedy DSpark output differ from the target's plain greedy output, per dtype?

DSpark's greedy output is the target's greedy output computed another way: the target scores up to 8 tokens
in one verify forward instead of 8 one-token forwards. In float32 both agree (up to the target's own kernels).
In bf16 / fp16 the two ways round differently, so where the target's top two logits are nearly tied the argmax
can flip, after which the texts diverge; every speculative decoder (stock assisted generation included) has
this. For each dtype and prompt this script runs

    plain  = target.generate(input_ids, do_sample=False, max_new_tokens=N)
    dspark = target.generate(input_ids, assistant_model=draft, do_sample=False, max_new_tokens=N)

and reports the fraction of prompts whose new tokens differ, the mean index (0-based, in new tokens) of the
first difference, and the gap between the top two logits of the plain run at that index. Prompts: the first
--per-dataset user turns of each eval/ set, rendered with the chat template (tools/common.chat_prompt_ids).

    python benchmarks/bench_precision.py --threads 1     # embedded pair, 24 prompts x 64 tokens, bf16 and fp32
    python benchmarks/bench_precision.py --target smollm2 --draft embedded/smollm2/dspark --threads 2 \\
        --per-dataset 16 --max-new-tokens 128 --dtypes bf16 fp16 fp32 --json embedded/smollm2/results/precision.json
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from tqdm import tqdm

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))
from tools.common import (  # noqa: E402
    DTYPES, chat_prompt_ids, load_eval_prompts, load_target, resolve_device, write_json,
)
from tools.smollm2 import describe_target, resolve_target  # noqa: E402

DATASETS = ["humaneval", "mbpp", "gsm8k", "math500", "mt-bench", "aime25"]


def first_difference(a: list[int], b: list[int]) -> int | None:
    """Index of the first position where the token lists differ (a length difference counts), None if equal."""
    for index, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return index
    return None if len(a) == len(b) else min(len(a), len(b))


def compare_prompt(target, draft, input_ids: torch.Tensor, max_new_tokens: int, **dspark_kwargs) -> dict:
    """Plain greedy vs DSpark greedy on one [1, P] prompt."""
    prompt_length = input_ids.shape[1]
    plain = target.generate(input_ids, max_new_tokens=max_new_tokens, do_sample=False,
                            return_dict_in_generate=True, output_logits=True)
    dspark = target.generate(input_ids, assistant_model=draft, max_new_tokens=max_new_tokens, do_sample=False,
                             **dspark_kwargs)
    plain_tokens, dspark_tokens = plain.sequences[0, prompt_length:].tolist(), dspark[0, prompt_length:].tolist()
    index = first_difference(plain_tokens, dspark_tokens)
    record = {"new_tokens": len(plain_tokens), "first_difference": index, "top2_gap": None}
    if index is not None and index < len(plain.logits):
        top2 = plain.logits[index][0].float().topk(2).values
        record["top2_gap"] = (top2[0] - top2[1]).item()
        record["tokens"] = {"plain": plain_tokens[index],
                            "dspark": dspark_tokens[index] if index < len(dspark_tokens) else None}
    return record


def summarize(records: list[dict]) -> dict:
    """Fraction of prompts that differ, mean first-difference index and mean / max top-2 gap over them."""
    differing = [r for r in records if r["first_difference"] is not None]
    gaps = [r["top2_gap"] for r in differing if r["top2_gap"] is not None]
    mean = lambda values: sum(values) / len(values) if values else None  # noqa: E731
    return {
        "prompts": len(records),
        "differing": len(differing),
        "fraction_differing": len(differing) / len(records) if records else None,
        "mean_first_difference": mean([r["first_difference"] for r in differing]),
        "mean_top2_gap": mean(gaps),
        "max_top2_gap": max(gaps) if gaps else None,
    }


def measure(target, draft, prompts: list[torch.Tensor], max_new_tokens: int, progress=None, **dspark_kwargs) -> dict:
    """`summarize` of `compare_prompt` over prompts ([1, P] each), plus the per-prompt records."""
    records = []
    with torch.no_grad():
        for input_ids in prompts:
            records.append(compare_prompt(target, draft, input_ids, max_new_tokens, **dspark_kwargs))
            if progress is not None:
                progress.update()
    return {**summarize(records), "records": records}


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default=str(REPO_ROOT / "embedded/target"),
                        help="target folder (with tokenizer), or `smollm2` for the cached SmolLM2 "
                             "(default: %(default)s)")
    parser.add_argument("--draft", default=str(REPO_ROOT / "embedded/dspark"), help="DSpark draft folder")
    parser.add_argument("--datasets", nargs="+", default=DATASETS, help="eval/ sets (default: all six)")
    parser.add_argument("--per-dataset", type=int, default=4, help="prompts per set (default: %(default)s)")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--dtypes", nargs="+", choices=sorted(DTYPES), default=["bf16", "fp32"],
                        help="dtypes of target and draft (default: %(default)s)")
    parser.add_argument("--device", default="auto", help="torch device, or 'auto' (default: %(default)s)")
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0 = torch's default)")
    parser.add_argument("--json", default=str(REPO_ROOT / "benchmarks/results/precision.json"),
                        help="where to write the JSON report (default: %(default)s)")
    return parser.parse_args(argv)


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    from transformers import AutoModel, AutoTokenizer

    device = resolve_device(args.device)
    target_path = resolve_target(args.target)  # `smollm2`: fetched and converted on first use, then cached
    tokenizer = AutoTokenizer.from_pretrained(target_path)
    texts = [text for texts in load_eval_prompts(args.datasets, args.per_dataset).values() for text in texts]
    prompts = [torch.tensor([chat_prompt_ids(tokenizer, text)], device=device) for text in texts]
    report = {"target": describe_target(args.target), "draft": args.draft, "device": str(device),
              "max_new_tokens": args.max_new_tokens, "datasets": args.datasets, "by_dtype": {}}
    with tqdm(total=len(args.dtypes) * len(prompts), desc="precision", unit="prompt") as progress:
        for name in args.dtypes:
            progress.set_postfix_str(name)
            target, _ = load_target(target_path, device, DTYPES[name])
            draft = AutoModel.from_pretrained(args.draft, trust_remote_code=True, dtype=DTYPES[name]).to(device).eval()
            report["by_dtype"][name] = measure(target, draft, prompts, args.max_new_tokens, progress)
    write_json(args.json, report)

    print(f"\n{report['target']} + {args.draft} on {device}: {len(prompts)} prompts x {args.max_new_tokens} new "
          "tokens, greedy DSpark vs plain greedy")
    print(f"{'dtype':<6}{'differ':>10}{'mean first diff':>17}{'mean top-2 gap':>16}{'max top-2 gap':>15}")
    fmt = lambda value: "-" if value is None else f"{value:.4g}"  # noqa: E731
    for name, result in report["by_dtype"].items():
        print(f"{name:<6}{result['differing']:>4}/{result['prompts']:<3} ({result['fraction_differing']:.0%})"
              f"{fmt(result['mean_first_difference']):>10}{fmt(result['mean_top2_gap']):>16}"
              f"{fmt(result['max_top2_gap']):>15}")
    print(f"JSON: {args.json}")
    return report


if __name__ == "__main__":
    main()
