#!/usr/bin/env python
"""DSpark speculative decoding with plain transformers: `pip install -r requirements.txt && python demo.py`.

Loads the embedded pair (the tiny Kimi-family target in embedded/target with AutoModelForCausalLM +
AutoTokenizer, the DSpark draft in embedded/dspark with AutoModel(trust_remote_code=True)), answers a few
HumanEval prompts (eval/humaneval.jsonl) with the target alone and with

    target.generate(input_ids, assistant_model=draft, max_new_tokens=...)

and prints the generated code, tau (tokens per target verification, bonus included), the speedup over
the target alone, and whether the speculative output equals plain greedy decoding token for token.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
from transformers import AutoModel, AutoModelForCausalLM, AutoTokenizer

from tools.common import EVAL_DIR, chat_prompt_ids, load_eval_prompts, resolve_device

HERE = Path(__file__).resolve().parent


def timed_generate(target, input_ids, max_new_tokens: int, **kwargs) -> tuple[list[int], float]:
    """(new tokens, seconds) of one greedy generate call."""
    started = time.perf_counter()
    output = target.generate(input_ids, max_new_tokens=max_new_tokens, do_sample=False, **kwargs)
    return output[0, input_ids.shape[1]:].tolist(), time.perf_counter() - started


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default=str(HERE / "embedded/target"), help="target folder or Hub id")
    parser.add_argument("--draft", default=str(HERE / "embedded/dspark"), help="DSpark draft folder or Hub id")
    parser.add_argument("--prompts", type=int, default=4, help="HumanEval prompts to run (default: %(default)s)")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--eval-dir", default=str(EVAL_DIR), help="folder holding humaneval.jsonl")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0 = torch's default)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    device = resolve_device(args.device)
    tokenizer = AutoTokenizer.from_pretrained(args.target)
    target = AutoModelForCausalLM.from_pretrained(args.target, dtype=torch.float32).to(device).eval()
    draft = AutoModel.from_pretrained(args.draft, trust_remote_code=True, dtype=torch.float32).to(device).eval()
    prompts = load_eval_prompts(["humaneval"], args.prompts, args.eval_dir)["humaneval"]

    warm = torch.tensor([chat_prompt_ids(tokenizer, prompts[0])], device=device)
    timed_generate(target, warm, 4)
    timed_generate(target, warm, 4, assistant_model=draft)

    totals = {"plain_s": 0.0, "dspark_s": 0.0, "committed": 0, "rounds": 0, "lossless": 0}
    for index, prompt in enumerate(prompts):
        input_ids = torch.tensor([chat_prompt_ids(tokenizer, prompt)], device=device)
        plain, plain_s = timed_generate(target, input_ids, args.max_new_tokens)
        spec, spec_s = timed_generate(target, input_ids, args.max_new_tokens, assistant_model=draft)
        stats = draft.last_stats  # DSparkStats of the call above
        same = spec == plain
        totals["plain_s"] += plain_s
        totals["dspark_s"] += spec_s
        totals["committed"] += stats.committed_tokens
        totals["rounds"] += stats.row_rounds
        totals["lossless"] += same
        print(f"\n=== HumanEval #{index}: {len(spec)} tokens, tau {stats.tau:.2f}, "
              f"{plain_s / spec_s:.2f}x vs target alone, {'identical to' if same else 'DIFFERS from'} plain greedy ===")
        print(tokenizer.decode(spec, skip_special_tokens=True))

    summary = {
        "prompts": len(prompts),
        "tau": totals["committed"] / max(totals["rounds"], 1),
        "speedup": totals["plain_s"] / max(totals["dspark_s"], 1e-9),
        "lossless": f"{totals['lossless']}/{len(prompts)}",
    }
    print(f"\nDSpark: tau {summary['tau']:.2f}, speedup {summary['speedup']:.2f}x over the target alone, "
          f"greedy-identical outputs {summary['lossless']}")
    return summary


if __name__ == "__main__":
    main()
