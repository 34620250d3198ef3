"""Benchmark the DSpark round kernels (kernels.py) at Kimi K3 sizes.

For each batch size and temperature it times three implementations of
  sample: `markov_block_sample` (Markov chain + confidence over one block),
  verify: `verify_block` (acceptance + residual / bonus sampling),
  step:   both, one sample-and-verify round outside the backbone,
- triton:    the Triton kernels (CUDA only),
- reference: the PyTorch references of kernels.py,
- naive:     a deliberately straightforward PyTorch version (per-step loop, softmax + multinomial),
and prints each time against the memory-bandwidth bound: the bytes the op must move (markov_w2 once per
draft position, base logits, output logits, target and draft logits once) over the copy bandwidth
measured on the device. Goals on an H200: sample within 1.5x of its bound, step >= 5x faster than naive.

    python benchmarks/bench_kernels.py                   # Kimi K3 sizes, batch 1 and 32, T = 0 and 1
    python benchmarks/bench_kernels.py --batch 1 --vocab 32768 --json results.json
    python benchmarks/bench_kernels.py --sweep           # also time MARKOV_TILING alternatives (CUDA)

The hidden size only shapes the confidence-head input (the part of the logit from h_k), as in modeling.
"""

import argparse
import itertools
import json
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import kernels  # noqa: E402

H200_DATASHEET_BANDWIDTH = 4.8e12  # bytes/s


# ------------------------------------------------------------------------------------------- naive baseline
def naive_markov_block_sample(base_logits, anchor_ids, w1, w2, temperature, conf_base, conf_weight, conf_temperatures):
    """The chain as one would first write it: per step gather, linear, softmax, multinomial."""
    tokens, all_logits, confidences = [], [], []
    prev = anchor_ids
    for k in range(base_logits.shape[1]):
        embedding = w1[prev]  # [B, r]
        logits = base_logits[:, k].float() + F.linear(embedding, w2).float()  # [B, V]
        confidence_logits = conf_base[:, k] + embedding.float() @ conf_weight.float()
        confidences.append(torch.sigmoid(confidence_logits / conf_temperatures[k]))
        if temperature > 0:
            logits = logits / temperature
            prev = torch.multinomial(torch.softmax(logits, dim=-1), 1)[:, 0]
        else:
            prev = logits.argmax(dim=-1)
        tokens.append(prev)
        all_logits.append(logits)
    return torch.stack(tokens, 1), torch.stack(all_logits, 1), torch.stack(confidences, 1)


def naive_verify_block(target_scores, draft_tokens, draft_logits, num_drafts):
    """Speculative sampling position by position: full softmaxes, a residual and a multinomial per position."""
    batch_size, block_size = draft_tokens.shape
    rows = torch.arange(batch_size, device=draft_tokens.device)
    p = torch.softmax(target_scores.float(), dim=-1)
    num_accepted = torch.zeros(batch_size, dtype=torch.long, device=draft_tokens.device)
    next_tokens = torch.zeros_like(num_accepted)
    finished = torch.zeros(batch_size, dtype=torch.bool, device=draft_tokens.device)
    for k in range(block_size):
        p_k = p[:, k]
        if draft_logits is None:
            accept = p_k.argmax(-1) == draft_tokens[:, k]
            correction = p_k
        else:
            q_k = torch.softmax(draft_logits[:, k].float(), dim=-1)
            token = draft_tokens[:, k : k + 1]
            accept = torch.rand(batch_size, device=p.device) * q_k.gather(-1, token)[:, 0] < p_k.gather(-1, token)[:, 0]
            residual = (p_k - q_k).clamp(min=0)
            correction = torch.where(residual.sum(-1, keepdim=True) > 0, residual, p_k)
        pick = correction.argmax(-1) if draft_logits is None else torch.multinomial(correction, 1)[:, 0]
        active = ~finished & (k < num_drafts)
        next_tokens = torch.where(active & ~accept, pick, next_tokens)
        num_accepted += (active & accept).long()
        finished |= active & ~accept
    bonus_p = p[rows, num_accepted]
    bonus = bonus_p.argmax(-1) if draft_logits is None else torch.multinomial(bonus_p, 1)[:, 0]
    return num_accepted, torch.where(finished, next_tokens, bonus)


# ------------------------------------------------------------------------------------------- measuring
def median_seconds(fn, device: torch.device, repeats: int) -> float:
    if device.type == "cuda":
        import triton.testing

        return triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median") / 1e3
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def copy_bandwidth(device: torch.device, repeats: int) -> float:
    """Bytes/s of a large device copy, counting bytes read plus written."""
    source = torch.empty(2**29 if device.type == "cuda" else 2**26, dtype=torch.bfloat16, device=device).normal_()
    target = torch.empty_like(source)
    seconds = median_seconds(lambda: target.copy_(source), device, repeats)
    return 2 * source.numel() * source.element_size() / seconds


def make_round(batch, block, vocab, rank, hidden, device, dtype, seed=0):
    g = torch.Generator(device=device).manual_seed(seed)

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g, device=device) * scale).to(dtype)

    hidden_rows = randn(batch, block, hidden).float()
    conf_weight = randn(hidden + rank, scale=hidden**-0.5)
    return {
        "base_logits": randn(batch, block, vocab, scale=2.0),
        "anchor_ids": torch.randint(0, vocab, (batch,), generator=g, device=device),
        "markov_w1": randn(vocab, rank, scale=0.3),
        "markov_w2": randn(vocab, rank, scale=0.3),
        "seeds": torch.randint(0, 2**62, (batch,), generator=g, device=device),
        "confidence_base": hidden_rows @ conf_weight[:hidden].float() + 0.1,
        "confidence_markov_weight": conf_weight[hidden:],
        "confidence_temperatures": torch.linspace(0.8, 1.5, block, device=device),
    }


def round_bytes(inputs, block, sampled: bool) -> dict[str, int]:
    """Bytes each op must move at least: every input read once, every output written once."""
    base, w2 = inputs["base_logits"], inputs["markov_w2"]
    batch, _, vocab = base.shape
    draft_logits = batch * block * vocab * 4
    sample = block * w2.numel() * w2.element_size() + base.numel() * base.element_size() + draft_logits
    verify = batch * (block + 1) * vocab * 4 + (draft_logits if sampled else 0)  # float32 target scores, q
    return {"sample": sample, "verify": verify, "step": sample + verify}


def implementations(inputs, target_scores, temperature, block, device):
    """{op: {impl: callable}} for the three ops of one round."""
    num_drafts = torch.full_like(inputs["anchor_ids"], block)
    sampled = temperature > 0

    def step(backend):
        def run():
            draft = kernels.markov_block_sample(**inputs, temperature=temperature, backend=backend)
            logits = draft.logits if sampled else None
            return kernels.verify_block(target_scores, draft.tokens, logits, num_drafts, inputs["seeds"], backend)

        return run

    def naive_step():
        tokens, logits, _ = naive_markov_block_sample(*naive_arguments)
        return naive_verify_block(target_scores, tokens, logits if sampled else None, num_drafts)

    naive_arguments = [inputs[name] for name in ("base_logits", "anchor_ids", "markov_w1", "markov_w2")]
    naive_arguments += [temperature] + [inputs[name] for name in ("confidence_base", "confidence_markov_weight")]
    naive_arguments += [inputs["confidence_temperatures"]]
    draft = kernels.markov_block_sample(**inputs, temperature=temperature, backend="reference")
    draft_logits = draft.logits if sampled else None
    ops = {"sample": {}, "verify": {}, "step": {}}
    for backend in (["triton"] if device.type == "cuda" else []) + ["reference"]:
        ops["sample"][backend] = lambda b=backend: kernels.markov_block_sample(
            **inputs, temperature=temperature, backend=b
        )
        ops["verify"][backend] = lambda b=backend: kernels.verify_block(
            target_scores, draft.tokens, draft_logits, num_drafts, inputs["seeds"], backend=b
        )
        ops["step"][backend] = step(backend)
    ops["sample"]["naive"] = lambda: naive_markov_block_sample(*naive_arguments)
    ops["verify"]["naive"] = lambda: naive_verify_block(target_scores, draft.tokens, draft_logits, num_drafts)
    ops["step"]["naive"] = naive_step
    return ops, draft


def agreement(inputs, target_scores, temperature, block, draft) -> dict:
    """Kernel vs reference at full size: drafted tokens, logits and verification outcomes."""
    kernel_draft = kernels.markov_block_sample(**inputs, temperature=temperature, backend="triton")
    logits = draft.logits if temperature > 0 else None
    num_drafts = torch.full_like(inputs["anchor_ids"], block)
    outcome = [
        kernels.verify_block(target_scores, draft.tokens, logits, num_drafts, inputs["seeds"], backend=backend)
        for backend in ("triton", "reference")
    ]
    return {
        "tokens_equal": (kernel_draft.tokens == draft.tokens).float().mean().item(),
        "logits_max_abs_diff": (kernel_draft.logits - draft.logits).abs().max().item(),
        "confidences_max_abs_diff": (kernel_draft.confidences - draft.confidences).abs().max().item(),
        "verify_equal": all(torch.equal(a, b) for a, b in zip(*outcome)),
    }


def sweep(inputs, temperature, device) -> list[dict]:
    """Time the sampler kernel under alternative MARKOV_TILING choices."""
    default = dict(kernels.MARKOV_TILING)
    rows = []
    for block_v, block_r, num_warps in itertools.product((64, 128, 256), (32, 64), (4, 8)):
        kernels.MARKOV_TILING.update(BLOCK_V=block_v, BLOCK_R=block_r, num_warps=num_warps)
        try:
            seconds = median_seconds(
                lambda: kernels.markov_block_sample(**inputs, temperature=temperature, backend="triton"), device, 1
            )
        except Exception as error:  # a tiling the compiler rejects (shared memory, registers)
            seconds, note = float("nan"), type(error).__name__
        else:
            note = ""
        rows.append({**kernels.MARKOV_TILING, "ms": seconds * 1e3, "error": note})
    kernels.MARKOV_TILING.update(default)
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--temperature", type=float, nargs="+", default=[0.0, 1.0], help="0 = greedy")
    parser.add_argument("--vocab", type=int, default=163840)
    parser.add_argument("--rank", type=int, default=256)
    parser.add_argument("--hidden", type=int, default=7168)
    parser.add_argument("--block", type=int, default=7)
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16", help="weights, base logits")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per measurement on CPU (median)")
    parser.add_argument("--skip-naive", action="store_true", help="time only the kernels and the references")
    parser.add_argument("--sweep", action="store_true", help="also time MARKOV_TILING alternatives (CUDA, T > 0)")
    parser.add_argument("--json", help="write all results to this JSON file")
    args = parser.parse_args()

    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    bandwidth = copy_bandwidth(device, args.repeats)
    report = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu", "config": vars(args)}
    report |= {"copy_bandwidth_GBps": bandwidth / 1e9, "h200_datasheet_bandwidth_GBps": H200_DATASHEET_BANDWIDTH / 1e9}
    report |= {"torch": torch.__version__, "results": [], "agreement": []}
    print(f"{report['device']}: copy bandwidth {bandwidth / 1e9:.0f} GB/s (read + write; H200 datasheet "
          f"{H200_DATASHEET_BANDWIDTH / 1e9:.0f}); bound = bytes / copy bandwidth")  # fmt: skip
    print(f"{'batch':>5} {'T':>4} {'op':>7} {'impl':>9} {'ms':>9} {'bound ms':>9} {'x bound':>8} {'naive/x':>8}")
    with torch.no_grad():
        for batch, temperature in itertools.product(args.batch, args.temperature):
            inputs = make_round(batch, args.block, args.vocab, args.rank, args.hidden, device, dtype)
            target_scores = torch.randn(batch, args.block + 1, args.vocab, device=device)
            ops, draft = implementations(inputs, target_scores, temperature, args.block, device)
            target_scores[:, :-1] += draft.logits  # a target close to the draft: realistic acceptance
            bounds = round_bytes(inputs, args.block, temperature > 0)
            for op, impls in ops.items():
                timed = {impl: median_seconds(fn, device, args.repeats) for impl, fn in impls.items()
                         if not (args.skip_naive and impl == "naive")}  # fmt: skip
                for impl, seconds in timed.items():
                    row = {"batch": batch, "temperature": temperature, "op": op, "impl": impl, "ms": seconds * 1e3,
                           "bound_ms": bounds[op] / bandwidth * 1e3, "bytes": bounds[op]}  # fmt: skip
                    row["x_bound"] = row["ms"] / row["bound_ms"]
                    row["naive_speedup"] = timed["naive"] / seconds if "naive" in timed else None
                    report["results"].append(row)
                    speedup = f"{row['naive_speedup']:8.1f}" if row["naive_speedup"] else f"{'-':>8}"
                    print(f"{batch:>5} {temperature:>4g} {op:>7} {impl:>9} {row['ms']:9.3f} {row['bound_ms']:9.3f} "
                          f"{row['x_bound']:8.2f} {speedup}")  # fmt: skip
            if device.type == "cuda":
                check = {"batch": batch, "temperature": temperature}
                check |= agreement(inputs, target_scores, temperature, args.block, draft)
                report["agreement"].append(check)
                print(f"      kernel vs reference: {check}")
            if args.sweep and device.type == "cuda" and temperature > 0:
                rows = sweep(inputs, temperature, device)
                report.setdefault("sweep", []).extend({"batch": batch, "temperature": temperature, **r} for r in rows)
                best = min((r for r in rows if r["ms"] == r["ms"]), key=lambda r: r["ms"], default=None)
                print(f"      sweep best: {best} (default {kernels.MARKOV_TILING})")
            if args.json:  # after every configuration, so that a run cut short keeps what it measured
                with open(args.json, "w") as f:
                    json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
