"""Benchmark DSpark generation against baselines, same prompts, same run.

Methods (each row reports tokens/s, the ratio to (a), tokens per target forward, tau when defined):
  (a) target      the target alone (`target.generate`)
  (b) dspark      the user's call `target.generate(input_ids, assistant_model=draft)`, per truncation mode
  (c) assisted    transformers' stock assisted generation with a small autoregressive assistant
  (d) dflash      transformers' built-in DFlash path (`speculation_type="dflash"`), where it applies
  (e) lookup      prompt lookup decoding (`prompt_lookup_num_tokens`)
Stateful targets also get the rollback cost of replay vs re-run (time per round, tokens/s). Memory: peak
allocated bytes per method on CUDA, the process's peak RSS on CPU, and the draft's context-cache size per token.

Without --target it runs in seconds on the tiny models of tests/tiny_models.py (`--tiny
qwen3|deepseek_v3|kimi_linear`, a partially agreeing fitted draft); the embedded pair, or any other pair, runs
with `--target DIR --draft DIR [--assistant DIR] [--dflash DIR]`, each prompt rendered as one user turn with
the target's chat template as tools/evaluate.py renders it, every model in --dtype (float32 by default, as
evaluate loads them).

    python benchmarks/bench_generation.py --tiny kimi_linear --max-new-tokens 32
    python benchmarks/bench_generation.py --target embedded/target --draft embedded/dspark --assistant DIR
"""

import argparse
import json
import resource
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO_ROOT), str(REPO_ROOT / "tests")]
import tools  # noqa: E402,F401  (the repository root as the package `dspark`)
from tools.common import DTYPES, ForwardCounter, chat_prompt_ids, load_target  # noqa: E402

DEFAULT_TEXTS = [
    "Explain why the sky is blue in two sentences.",
    "Write a Python function that returns the n-th Fibonacci number.",
    "List three prime numbers greater than 100 and explain how you checked them.",
    "Summarise the rules of chess for a beginner.",
]


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", default="qwen3", choices=["qwen3", "deepseek_v3", "kimi_linear"],
                        help="tiny target and fitted draft from tests/tiny_models.py (ignored with --target)")
    parser.add_argument("--target", help="target model directory (with its tokenizer)")
    parser.add_argument("--draft", help="DSpark draft directory (loaded with trust_remote_code)")
    parser.add_argument("--assistant", help="small autoregressive assistant for (c); tiny: a 2-layer copy")
    parser.add_argument("--dflash", help="a DFlash-protocol draft for (d) (e.g. a muse_glimmer_assistant)")
    parser.add_argument("--prompts", help="text file, one prompt per line (real models)")
    parser.add_argument("--num-prompts", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--do-sample", action="store_true", help="sample (temperature 1) instead of greedy")
    parser.add_argument("--truncation", nargs="+", default=["full", "threshold", "schedule"])
    parser.add_argument("--threshold", type=float, default=0.5, help="survival threshold of --truncation threshold")
    parser.add_argument("--lookup-tokens", type=int, default=10, help="prompt_lookup_num_tokens of (e)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="fp32", help="of the target and the drafts")
    parser.add_argument("--json", default=str(REPO_ROOT / "results" / "bench_generation.json"))
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args()


def load_models(args):
    """(target, draft, assistant or None, dflash draft or None, prompts [list of [1, P] tensors], description)."""
    from transformers import AutoModel, AutoModelForCausalLM

    if args.target:
        dtype = DTYPES[args.dtype]
        target, tokenizer = load_target(args.target, torch.device(args.device), dtype)
        draft = AutoModel.from_pretrained(args.draft, trust_remote_code=True, dtype=dtype).to(args.device).eval()
        texts = Path(args.prompts).read_text().splitlines() if args.prompts else DEFAULT_TEXTS
        prompts = [torch.tensor([chat_prompt_ids(tokenizer, text)], device=args.device)
                   for text in texts[: args.num_prompts]]
        load = lambda path: AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(args.device).eval()  # noqa: E731
        assistant = load(args.assistant) if args.assistant else None
        dflash = AutoModel.from_pretrained(args.dflash, dtype=dtype).to(args.device).eval() if args.dflash else None
        return target, draft, assistant, dflash, prompts, f"{args.target} + {args.draft}"

    import tiny_models

    target = tiny_models.TARGETS[args.tiny]().to(args.device)
    draft = tiny_models.fitted_draft(args.tiny).to(args.device)
    assistant = None  # stock assisted generation refuses stateful targets
    if not target._is_stateful:  # a random 2-layer copy: agrees with the target by chance only
        config = type(target.config)(**{**target.config.to_dict(), "num_hidden_layers": 2, "layer_types": None})
        torch.manual_seed(args.seed)
        assistant = type(target)(config).eval().to(args.device)
    half = args.num_prompts // 2
    prompts = tiny_models.agreeing_prompts(args.tiny, args.num_prompts - half, seed=args.seed)
    prompts += tiny_models.random_prompts(half, 8, 16, seed=args.seed)
    batches = [p[None].to(args.device) for p in prompts]
    return target, draft, assistant, None, batches, f"tiny {args.tiny} (fitted draft)"


def peak_memory(device: torch.device) -> float:
    """MiB: peak allocated since the last reset on CUDA; the process's peak RSS on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**10


ROUND_STAGES = ("draft", "verify", "rollback")  # the timed stages of a DSpark round (DSparkStats.time_*)


def run_method(name, generate, target, prompts, args, progress, stats_of=None):
    """Generate every prompt once (after one warm-up) and collect tokens/s, tokens per forward, tau, and for
    DSpark the milliseconds per round of each stage."""
    device = torch.device(args.device)
    generate(prompts[0], 16)  # warm-up: the prefill and rounds that draft (kernels compiled, caches sized)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    tokens = seconds = committed = row_rounds = rounds = 0
    stage_seconds = dict.fromkeys(ROUND_STAGES, 0.0)
    outputs = []
    with ForwardCounter(target) as counter:
        for prompt in prompts:
            torch.manual_seed(args.seed)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            start = time.perf_counter()
            sequences = generate(prompt, args.max_new_tokens)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            seconds += time.perf_counter() - start
            tokens += sequences.shape[1] - prompt.shape[1]
            outputs.append(sequences[0, prompt.shape[1]:].tolist())
            if stats_of is not None:
                stats = stats_of()
                committed, row_rounds = committed + stats.committed_tokens, row_rounds + stats.row_rounds
                rounds += stats.rounds
                for stage in ROUND_STAGES:
                    stage_seconds[stage] += getattr(stats, f"time_{stage}")
            progress.update(1)
    return {
        "method": name,
        "tokens": tokens,
        "seconds": seconds,
        "tokens_per_second": tokens / seconds,
        "tokens_per_forward": tokens / max(counter.count, 1),
        "tau": committed / row_rounds if row_rounds else None,
        **{f"{stage}_ms_per_round": 1e3 * stage_seconds[stage] / rounds if rounds else None for stage in ROUND_STAGES},
        "peak_memory_mib": peak_memory(device),
        "outputs": outputs,
    }


def skipped(name: str, reason: str) -> dict:
    return {"method": name, "skipped": reason}


def main():
    args = parse_args()
    from dspark.generation_utils import load_sps_curve

    target, draft, assistant, dflash, prompts, description = load_models(args)
    stateful = getattr(target, "_is_stateful", False)
    sample = dict(do_sample=args.do_sample)
    methods = [("target", lambda p, n: target.generate(p, max_new_tokens=n, **sample), None)]
    sps = None
    if "schedule" in args.truncation:
        sps = load_sps_curve(target, 1, draft.config.block_size + 1)
    for truncation in args.truncation:
        options = {"truncation": truncation, "confidence_threshold": args.threshold, "sps_curve": sps}
        methods.append((f"dspark[{truncation}]", lambda p, n, o=options: target.generate(
            p, assistant_model=draft, max_new_tokens=n, **o, **sample), lambda: draft.last_stats))
    if stateful:
        for rollback in ("replay", "rerun"):
            methods.append((f"dspark[full, {rollback}]", lambda p, n, r=rollback: target.generate(
                p, assistant_model=draft, max_new_tokens=n, rollback=r, **sample), lambda: draft.last_stats))
    reasons = {}
    if stateful:
        reason = f"transformers refuses assisted generation for stateful models ({type(target).__name__})"
        reasons = {"assisted": reason, "dflash": reason, "lookup": reason}
    if assistant is None:
        reasons.setdefault("assisted", "no --assistant given")
    if dflash is None:
        reasons.setdefault("dflash", "the DSpark draft does not implement transformers' DFlash protocol "
                                     "(forward(noise_embeds, context_hidden_states, ...), no Markov/confidence heads); "
                                     "pass --dflash DIR with a DFlash draft to run it")
    if "assisted" not in reasons:
        methods.append(("assisted", lambda p, n: target.generate(p, assistant_model=assistant, max_new_tokens=n,
                                                                 **sample), None))
    if "dflash" not in reasons:
        methods.append(("dflash", lambda p, n: target.generate(p, assistant_model=dflash, max_new_tokens=n,
                                                               speculation_type="dflash", **sample), None))
    if "lookup" not in reasons:
        methods.append(("lookup", lambda p, n: target.generate(p, prompt_lookup_num_tokens=args.lookup_tokens,
                                                               max_new_tokens=n, **sample), None))

    results = []
    with torch.no_grad(), tqdm(total=len(methods) * len(prompts), desc="bench", unit="prompt") as progress:
        for name, generate, stats_of in methods:
            progress.set_postfix_str(name)
            results.append(run_method(name, generate, target, prompts, args, progress, stats_of))
    results += [skipped(name, reason) for name, reason in reasons.items()]

    baseline = results[0]
    target_ms_per_token = 1e3 * baseline["seconds"] / baseline["tokens"]
    for result in results:
        if "tokens_per_second" in result:
            result["speedup"] = result["tokens_per_second"] / baseline["tokens_per_second"]
            # what a round costs in steps of the target alone: tau must exceed it for a speed-up
            result["round_cost_in_target_steps"] = None if result["draft_ms_per_round"] is None else (
                sum(result[f"{stage}_ms_per_round"] for stage in ROUND_STAGES) / target_ms_per_token)
            # greedy only: sampled runs draw different random numbers
            result["same_tokens_as_target"] = None if args.do_sample else result["outputs"] == baseline["outputs"]
    config = draft.config
    context_bytes = 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim * draft.dtype.itemsize
    report = {
        "models": description,
        "device": args.device,
        "prompts": len(prompts),
        "max_new_tokens": args.max_new_tokens,
        "do_sample": args.do_sample,
        "draft_context_cache_bytes_per_token": context_bytes,
        "sps_curve": None if sps is None else {str(k): v for k, v in sps.points.items()},
        "results": [{k: v for k, v in r.items() if k != "outputs"} for r in results],
    }
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(report, indent=1))

    print(f"\n{description} on {args.device}: {len(prompts)} prompts x {args.max_new_tokens} new tokens, "
          f"{'sampling' if args.do_sample else 'greedy'}; draft context cache {context_bytes / 1024:.2f} KiB/token")
    print(f"target alone: {target_ms_per_token:.1f} ms per token; a round's stages in ms, and its cost in target steps")
    print(f"{'method':<24}{'tok/s':>9}{'x target':>10}{'tok/fwd':>9}{'tau':>7}{'draft':>8}{'verify':>8}"
          f"{'rollback':>10}{'steps':>7}{'peak MiB':>10}  same")
    for result in report["results"]:
        if "skipped" in result:
            print(f"{result['method']:<24}skipped: {result['skipped']}")
            continue
        cells = {key: "-" if result[key] is None else f"{result[key]:.2f}" for key in (
            "tau", "draft_ms_per_round", "verify_ms_per_round", "rollback_ms_per_round", "round_cost_in_target_steps")}
        print(f"{result['method']:<24}{result['tokens_per_second']:>9.1f}{result['speedup']:>10.2f}"
              f"{result['tokens_per_forward']:>9.2f}{cells['tau']:>7}{cells['draft_ms_per_round']:>8}"
              f"{cells['verify_ms_per_round']:>8}{cells['rollback_ms_per_round']:>10}"
              f"{cells['round_cost_in_target_steps']:>7}{result['peak_memory_mib']:>10.0f}  "
              f"{ {True: 'yes', False: 'no', None: '-'}[result['same_tokens_as_target']]}")
    print(f"JSON: {args.json}")


if __name__ == "__main__":
    main()
