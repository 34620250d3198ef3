#!/usr/bin/env python
"""Train the embedded tiny Kimi-K3-family target (transformers ``KimiLinearForCausalLM``) from scratch on CPU.

Stages (all in one run; each is skipped when its output already exists in ``--run-dir``):

1. tokenizer: byte-level BPE (``--vocab-size``, default 4096) trained with ``tokenizers`` on the
   training corpus, special tokens ``tools.chat_format.SPECIAL_TOKENS`` at ids 0..5; saved as a
   ``PreTrainedTokenizerFast`` in ``{run-dir}/tokenizer`` (adds no special tokens by itself:
   the chat template writes ``<|bos|>`` explicitly).
2. data: the corpus (``tools/build_corpus.py``) is rendered with ``tools/chat_format.py``,
   tokenized and packed into rows of ``--seq-len`` tokens. Pairs are never split: the loss is on
   the response tokens (+ EOS) only. Plain code chunks are a token stream (loss on every token) that
   fills the gap a pair leaves at the end of a row and makes whole rows up to ``--code-frac`` of
   the tokens. Cached in ``{run-dir}/rows_{split}.pt``.
3. model: ``KimiLinearConfig`` built from the flags: MLA (NoPE) full attention everywhere except the
   1-based ``--kda-layers`` (Kimi Delta Attention), dense SiLU MLPs in every layer (no MoE),
   checkpoint-style ``linear_attn_config``, untied embeddings, float32.
4. train: AdamW, linear warmup then cosine decay over the ``--max-minutes`` wall-clock budget (or
   ``--max-steps``), grad clipping, JSON-lines log ``{run-dir}/log.jsonl``, checkpoint
   ``{run-dir}/ckpt.pt`` every ``--ckpt-minutes`` (``--resume`` continues from it, budget included).
5. export: ``save_pretrained`` of model + tokenizer (with ``tools.chat_format.CHAT_TEMPLATE`` in its
   ``tokenizer_config.json``) + generation config to ``--final-dir``
   (default ``embedded/target``) and ``TRAINING.md`` there; a greedy sample is generated through
   ``AutoModelForCausalLM``/``AutoTokenizer`` from the exported folder. ``--export-only`` exports
   the latest checkpoint without training.

Training speed-up (does not change the model): ``--kda-train-chunk`` runs transformers' reference
chunked KDA with a smaller chunk during training only (exact math, cheaper on CPU).
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import random
import shlex
import sys
import time

import torch
import torch.nn.functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from tools import chat_format as cf  # noqa: E402
from tools.common import load_training_state, save_training_state  # noqa: E402

KIND_NONE, KIND_RESP, KIND_CODE = 0, 1, 2


# --------------------------------------------------------------------------- corpus
def read_jsonl(path):
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def render(rec):
    """(prompt_text, loss_text): prompt_text carries no loss (empty for plain code)."""
    if rec["kind"] == "pair":
        return cf.format_prompt([rec["prompt"]]), cf.format_response(rec["response"])
    return "", cf.format_plain(rec["text"])


# --------------------------------------------------------------------------- tokenizer
def train_tokenizer(corpus_path, out_dir, vocab_size, max_chars):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    recs = read_jsonl(corpus_path)
    texts, total = [], 0
    for rec in recs:  # corpus is already shuffled deterministically
        p, r = render(rec)
        texts.append(p + r)
        total += len(texts[-1])
        if total >= max_chars:
            break
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, min_frequency=2, special_tokens=list(cf.SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    for i, s in enumerate(cf.SPECIAL_TOKENS):
        assert tok.token_to_id(s) == i, (s, tok.token_to_id(s))
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=cf.BOS, eos_token=cf.EOS, pad_token=cf.PAD, mask_token=cf.MASK,
        additional_special_tokens=[cf.USER, cf.ASSISTANT], clean_up_tokenization_spaces=False,
        model_max_length=4096)
    hf.save_pretrained(out_dir)
    return len(texts), total


def load_tokenizer(path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


# --------------------------------------------------------------------------- packing
def tokenize_records(tok, recs, seq_len):
    """List of (ids, kinds) per record, a pair's kinds mark its response; None for dropped ones."""
    backend = tok.backend_tokenizer
    prompts, losses = zip(*(render(r) for r in recs))
    p_ids = [e.ids for e in backend.encode_batch(list(prompts), add_special_tokens=False)]
    l_ids = [e.ids for e in backend.encode_batch(list(losses), add_special_tokens=False)]
    pairs, code = [], []
    for rec, p, l in zip(recs, p_ids, l_ids):
        if rec["kind"] == "pair":
            if len(p) > seq_len - 32:
                continue
            ids = (p + l)[:seq_len]
            kinds = ([KIND_NONE] * len(p) + [KIND_RESP] * len(l))[:seq_len]
            pairs.append((ids, kinds))
        else:
            code.append((l, [KIND_NONE] + [KIND_CODE] * (len(l) - 1)))  # no loss on the BOS
    return pairs, code


def pack_rows(pairs, code, seq_len, code_frac, seed, pad_id):
    """Pack into rows. Returns (ids int16 [N, T], kinds int8 [N, T], stats)."""
    rng = random.Random(seed)
    pairs = list(pairs)
    rng.shuffle(pairs)
    code_order = list(range(len(code)))
    rng.shuffle(code_order)
    state = {"ci": 0, "buf_ids": [], "buf_kinds": [], "cycles": 0}

    def take_code(n):
        ids, kinds = [], []
        while len(ids) < n:
            if not state["buf_ids"]:
                if state["ci"] >= len(code_order):
                    if not code_order:
                        break
                    state["ci"] = 0
                    state["cycles"] += 1
                    rng.shuffle(code_order)
                c = code[code_order[state["ci"]]]
                state["ci"] += 1
                state["buf_ids"], state["buf_kinds"] = list(c[0]), list(c[1])
            k = n - len(ids)
            ids += state["buf_ids"][:k]
            kinds += state["buf_kinds"][:k]
            state["buf_ids"], state["buf_kinds"] = state["buf_ids"][k:], state["buf_kinds"][k:]
        return ids, kinds

    rows_ids, rows_kinds = [], []
    n_code = n_total = 0
    pi = 0
    while pi < len(pairs):
        if code and n_total and n_code / n_total < code_frac:
            ids, kinds = take_code(seq_len)
        else:
            ids, kinds = [], []
            while pi < len(pairs) and len(ids) + len(pairs[pi][0]) <= seq_len:
                ids += pairs[pi][0]
                kinds += pairs[pi][1]
                pi += 1
            if len(ids) < seq_len:
                cids, ckinds = take_code(seq_len - len(ids)) if code else ([], [])
                ids += cids
                kinds += ckinds
        if len(ids) < seq_len:
            kinds += [KIND_NONE] * (seq_len - len(ids))
            ids += [pad_id] * (seq_len - len(ids))
        n_total += seq_len
        n_code += sum(k == KIND_CODE for k in kinds)
        rows_ids.append(ids)
        rows_kinds.append(kinds)
    ids_t = torch.tensor(rows_ids, dtype=torch.int16)
    kinds_t = torch.tensor(rows_kinds, dtype=torch.int8)
    stats = {"rows": len(rows_ids), "tokens": int(ids_t.numel()), "pairs": len(pairs),
             "response_tokens": int((kinds_t == KIND_RESP).sum()), "code_tokens": int((kinds_t == KIND_CODE).sum()),
             "code_chunks_used": state["ci"] + state["cycles"] * len(code_order), "code_chunks": len(code)}
    return ids_t, kinds_t, stats


def build_rows(tok, corpus_path, out_path, seq_len, code_frac, seed):
    recs = read_jsonl(corpus_path)
    pairs, code = tokenize_records(tok, recs, seq_len)
    ids, kinds, stats = pack_rows(pairs, code, seq_len, code_frac, seed, tok.pad_token_id)
    stats["records"] = len(recs)
    torch.save({"ids": ids, "kinds": kinds, "stats": stats}, out_path)
    return stats


# --------------------------------------------------------------------------- model
def parse_layers(s):
    return [int(x) for x in s.split(",") if x.strip()] if s else []


def build_config(args, tok):
    from transformers import KimiLinearConfig

    n = args.layers
    kda = parse_layers(args.kda_layers)
    if any(not 1 <= k <= n for k in kda) or n in kda:
        raise SystemExit("--kda-layers must be 1-based layer numbers below the last layer (the last is MLA)")
    full = [i for i in range(1, n + 1) if i not in kda]
    cfg = KimiLinearConfig(
        vocab_size=len(tok),
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        moe_intermediate_size=args.intermediate,  # unused: every MLP is dense
        num_hidden_layers=n,
        num_attention_heads=args.heads,
        num_key_value_heads=args.heads,
        q_lora_rank=args.q_lora_rank or None,
        kv_lora_rank=args.kv_lora_rank,
        qk_nope_head_dim=args.qk_nope_dim,
        qk_rope_head_dim=args.qk_rope_dim,
        v_head_dim=args.v_head_dim,
        linear_attn_config={"full_attn_layers": full, "kda_layers": kda, "num_heads": args.linear_heads,
                            "head_dim": args.linear_head_dim, "short_conv_kernel_size": 4},
        first_k_dense_replace=n,  # all dense MLPs, no MoE
        hidden_act="silu",  # also the KDA conv activation
        max_position_embeddings=4096,
        rms_norm_eps=1e-5,
        initializer_range=0.02,
        tie_word_embeddings=False,
        pad_token_id=tok.pad_token_id,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        use_cache=True,
    )
    assert cfg.mlp_layer_types == ["dense"] * n and cfg.layer_types[-1] == "full_attention"
    return cfg


def patch_kda_chunk(chunk):
    """Use a smaller chunk in transformers' reference chunked KDA (same math; cheaper on CPU)."""
    from transformers.models.kimi_linear import modeling_kimi_linear as mkl

    orig = getattr(mkl.chunk_kimi_delta_attention, "_orig", mkl.chunk_kimi_delta_attention)
    if chunk and chunk != 64:
        patched = functools.partial(orig, chunk_size=chunk)
        patched._orig = orig
        mkl.chunk_kimi_delta_attention = patched
    else:
        mkl.chunk_kimi_delta_attention = orig


# --------------------------------------------------------------------------- training
def lm_loss(model, ids, kinds):
    """Mean CE over labelled tokens; also per-kind sums/counts for logging."""
    x = ids.long()
    logits = model(input_ids=x, use_cache=False).logits[:, :-1].float()
    tgt = x[:, 1:]
    k = kinds[:, 1:]
    ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tgt.reshape(-1), reduction="none").view_as(tgt)
    mask = k != KIND_NONE
    loss = (ce * mask).sum() / mask.sum().clamp(min=1)
    parts = {}
    for name, kv in (("resp", KIND_RESP), ("code", KIND_CODE)):
        m = k == kv
        parts[name] = (float((ce.detach() * m).sum()), int(m.sum()))
    return loss, parts


@torch.no_grad()
def evaluate(model, ids, kinds, batch):
    model.eval()
    tot = {"resp": [0.0, 0], "code": [0.0, 0]}
    for s in range(0, ids.shape[0], batch):
        _, parts = lm_loss(model, ids[s : s + batch], kinds[s : s + batch])
        for n, (a, c) in parts.items():
            tot[n][0] += a
            tot[n][1] += c
    model.train()
    all_sum = tot["resp"][0] + tot["code"][0]
    all_cnt = tot["resp"][1] + tot["code"][1]
    return {"loss": all_sum / max(all_cnt, 1), "resp_loss": tot["resp"][0] / max(tot["resp"][1], 1),
            "code_loss": tot["code"][0] / max(tot["code"][1], 1), "tokens": all_cnt}


def lr_at(args, step, progress):
    if step < args.warmup_steps:
        return args.lr * (step + 1) / args.warmup_steps
    p = min(max(progress, 0.0), 1.0)
    lo = args.lr * args.min_lr_ratio
    return lo + (args.lr - lo) * 0.5 * (1 + math.cos(math.pi * p))


def save_ckpt(path, model, opt, state, cfg_dict):
    checkpoint = {"model": model.state_dict(), "opt": opt.state_dict(), "state": state, "config": cfg_dict}
    save_training_state(path, checkpoint)


def log_line(path, obj):
    with open(path, "a") as f:
        f.write(json.dumps(obj) + "\n")


SAMPLE_PROMPT = '''def count_vowels(text: str) -> int:
    """Return the number of vowels (a, e, i, o, u) in the given string, ignoring case.
    >>> count_vowels("Hello World")
    3
    """'''


def export(args, model, tok, state, extra):
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    out = args.final_dir
    os.makedirs(out, exist_ok=True)
    model.generation_config = GenerationConfig(
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
        do_sample=False, max_new_tokens=256)
    model.save_pretrained(out)
    tok.chat_template = cf.CHAT_TEMPLATE
    tok.save_pretrained(out, save_jinja_files=False)  # the template inside tokenizer_config.json, as shipped
    # check the export loads offline and generates greedily
    m2 = AutoModelForCausalLM.from_pretrained(out)
    t2 = AutoTokenizer.from_pretrained(out)
    prompt = cf.format_prompt([cf.code_user_turn(SAMPLE_PROMPT)])
    enc = t2(prompt, return_tensors="pt")
    t0 = time.time()
    gen = m2.generate(**enc, max_new_tokens=160, do_sample=False)
    gen_s = time.time() - t0
    sample = t2.decode(gen[0, enc["input_ids"].shape[1]:], skip_special_tokens=False)
    size = os.path.getsize(os.path.join(out, "model.safetensors"))
    cfg = m2.config
    n_params = sum(p.numel() for p in m2.parameters())
    write_training_md(args, cfg, n_params, size, state, extra, prompt, sample, gen_s)
    return sample


def write_training_md(args, cfg, n_params, size, state, extra, prompt, sample, gen_s):
    kda0 = [i for i, t in enumerate(cfg.layer_types) if t == "linear_attention"]
    ev = state.get("last_eval") or {}
    tr = state.get("last_train") or {}
    cmds = extra.get("commands", [])
    lines = [
        "# Training record of the embedded target",
        "",
        "Written by `tools/train_target.py` at export. A tiny Kimi-K3-family model (transformers",
        "`KimiLinearForCausalLM`) trained from scratch on CPU on Python sources found on the build machine.",
        "",
        "## Commands",
        "",
        "```bash",
        extra.get("corpus_command", "python tools/build_corpus.py"),
        *cmds,
        "```",
        "",
        "## Model",
        "",
        f"- layers: {cfg.num_hidden_layers}; KDA (linear attention) at 0-based {kda0}, MLA (NoPE) elsewhere; "
        f"layer_types = {cfg.layer_types}",
        f"- hidden {cfg.hidden_size}, dense SiLU MLP {cfg.intermediate_size}, MLA heads {cfg.num_attention_heads} "
        f"(qk_nope {cfg.qk_nope_head_dim}, qk_rope {cfg.qk_rope_head_dim}, v {cfg.v_head_dim}, kv_lora_rank "
        f"{cfg.kv_lora_rank}, q_lora_rank {cfg.q_lora_rank}), KDA heads {cfg.linear_num_heads} x {cfg.linear_head_dim}",
        f"- vocab {cfg.vocab_size} (byte-level BPE), untied embeddings, float32",
        f"- parameters: {n_params:,}; model.safetensors: {size / 1e6:.2f} MB",
        "",
        "## Data",
        "",
        f"- corpus: `{args.corpus}` built by `tools/build_corpus.py`: {json.dumps(extra.get('corpus_stats', {}))}",
        f"- packed train rows: {json.dumps(extra.get('train_rows', {}))}",
        f"- packed held-out rows: {json.dumps(extra.get('heldout_rows', {}))}",
        f"- sequence length {args.seq_len}, batch {args.batch} rows, code share target {args.code_frac}",
        "",
        "## Run",
        "",
        f"- optimizer AdamW lr {args.lr} (warmup {args.warmup_steps} steps, cosine to x{args.min_lr_ratio} over the "
        f"budget), weight decay {args.weight_decay}, grad clip {args.grad_clip}, {args.threads} torch thread(s)",
        f"- steps: {state['step']}; tokens seen: {state['tokens']:,} (of which loss-bearing {state['loss_tokens']:,})",
        f"- wall time of training: {state['elapsed'] / 60:.1f} min "
        f"({state['tokens'] / max(state['elapsed'], 1e-9):.0f} tok/s)",
        f"- final train loss (mean of the last log interval): {tr.get('loss', float('nan')):.4f} "
        f"(response {tr.get('resp_loss', float('nan')):.4f}, code {tr.get('code_loss', float('nan')):.4f})",
        f"- final held-out loss ({ev.get('tokens', 0)} tokens): {ev.get('loss', float('nan')):.4f} "
        f"(response {ev.get('resp_loss', float('nan')):.4f}, code {ev.get('code_loss', float('nan')):.4f})",
        f"- log: `{os.path.join(args.run_dir, 'log.jsonl')}` (not shipped)",
        "",
        "## Greedy sample (from the exported folder, `model.generate`, 160 new tokens, "
        f"{gen_s:.1f} s)",
        "",
        "Prompt:",
        "",
        "````text",
        prompt,
        "````",
        "",
        "Completion:",
        "",
        "````text",
        sample,
        "````",
        "",
    ]
    with open(os.path.join(args.final_dir, "TRAINING.md"), "w") as f:
        f.write("\n".join(lines))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    g = ap.add_argument_group("paths")
    g.add_argument("--corpus", default="data/corpus", help="directory with train.jsonl / heldout.jsonl")
    g.add_argument("--run-dir", default="runs/target", help="tokenizer, packed rows, checkpoint, log")
    g.add_argument("--final-dir", default="embedded/target", help="export directory")
    g = ap.add_argument_group("tokenizer")
    g.add_argument("--vocab-size", type=int, default=4096)
    g.add_argument("--tokenizer-chars", type=int, default=40_000_000, help="corpus characters to train BPE on")
    g = ap.add_argument_group("model")
    g.add_argument("--hidden", type=int, default=192)
    g.add_argument("--layers", type=int, default=8)
    g.add_argument("--intermediate", type=int, default=288)
    g.add_argument("--heads", type=int, default=4)
    g.add_argument("--qk-nope-dim", type=int, default=32)
    g.add_argument("--qk-rope-dim", type=int, default=16, help="(NoPE in kimi_linear: a shared key part)")
    g.add_argument("--v-head-dim", type=int, default=32)
    g.add_argument("--kv-lora-rank", type=int, default=64)
    g.add_argument("--q-lora-rank", type=int, default=0, help="0 = plain q_proj")
    g.add_argument("--kda-layers", default="1", help="1-based KDA layer numbers, comma separated; rest MLA")
    g.add_argument("--linear-heads", type=int, default=4)
    g.add_argument("--linear-head-dim", type=int, default=32)
    g = ap.add_argument_group("training")
    g.add_argument("--seq-len", type=int, default=512)
    g.add_argument("--batch", type=int, default=4, help="rows per step")
    g.add_argument("--code-frac", type=float, default=0.3, help="target share of plain-code tokens")
    g.add_argument("--lr", type=float, default=3e-3)
    g.add_argument("--min-lr-ratio", type=float, default=0.1)
    g.add_argument("--warmup-steps", type=int, default=60)
    g.add_argument("--weight-decay", type=float, default=0.1)
    g.add_argument("--grad-clip", type=float, default=1.0)
    g.add_argument("--max-minutes", type=float, default=60.0, help="wall-clock training budget (drives the schedule)")
    g.add_argument("--max-steps", type=int, default=0, help="step budget instead (0 = use --max-minutes)")
    g.add_argument("--ckpt-minutes", type=float, default=5.0)
    g.add_argument("--log-every", type=int, default=20, help="steps per train-loss log line")
    g.add_argument("--eval-rows", type=int, default=64, help="held-out rows evaluated at each checkpoint")
    g.add_argument("--threads", type=int, default=1)
    g.add_argument("--kda-train-chunk", type=int, default=16, help="KDA chunk size used while training (64 = stock)")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--resume", action="store_true", help="continue from {run-dir}/ckpt.pt")
    g.add_argument("--export-only", action="store_true", help="export {run-dir}/ckpt.pt to --final-dir and exit")
    g.add_argument("--no-export", action="store_true", help="do not export at the end")
    g.add_argument("--prepare-only", action="store_true", help="only build the tokenizer and packed rows")
    args = ap.parse_args(argv)

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    import transformers
    from tqdm import tqdm
    from transformers import KimiLinearConfig, KimiLinearForCausalLM

    transformers.logging.set_verbosity_error()
    os.makedirs(args.run_dir, exist_ok=True)
    log_path = os.path.join(args.run_dir, "log.jsonl")
    ckpt_path = os.path.join(args.run_dir, "ckpt.pt")
    meta_path = os.path.join(args.run_dir, "meta.json")
    meta = json.load(open(meta_path)) if os.path.exists(meta_path) else {"commands": []}
    script = os.path.relpath(os.path.abspath(sys.argv[0]), ROOT)
    cmd = "python " + " ".join(shlex.quote(a) for a in [script] + sys.argv[1:])
    meta["commands"].append(cmd)

    # 1. tokenizer
    tok_dir = os.path.join(args.run_dir, "tokenizer")
    if not os.path.exists(os.path.join(tok_dir, "tokenizer.json")):
        t0 = time.time()
        n, chars = train_tokenizer(
            os.path.join(args.corpus, "train.jsonl"), tok_dir, args.vocab_size, args.tokenizer_chars
        )
        print(f"tokenizer trained on {n} records / {chars} chars in {time.time() - t0:.0f}s", flush=True)
    tok = load_tokenizer(tok_dir)

    # 2. data
    rows = {}
    for split in ("train", "heldout"):
        p = os.path.join(args.run_dir, f"rows_{split}.pt")
        if not os.path.exists(p):
            t0 = time.time()
            st = build_rows(tok, os.path.join(args.corpus, f"{split}.jsonl"), p, args.seq_len, args.code_frac,
                            args.seed + (split == "heldout"))
            print(f"{split}: packed {st} in {time.time() - t0:.0f}s", flush=True)
        rows[split] = torch.load(p)
        meta[f"{split}_rows"] = rows[split]["stats"]
    cs = os.path.join(args.corpus, "stats.json")
    if os.path.exists(cs):
        c = json.load(open(cs))
        meta["corpus_stats"] = {k: c[k] for k in ("files", "pairs", "chunks", "train", "heldout") if k in c}
        meta["corpus_command"] = c.get("command", "python tools/build_corpus.py")
    with open(meta_path, "w") as f:
        json.dump(meta, f, indent=1)
    if args.prepare_only:
        return
    train_ids, train_kinds = rows["train"]["ids"], rows["train"]["kinds"]
    held_ids = rows["heldout"]["ids"][: args.eval_rows]
    held_kinds = rows["heldout"]["kinds"][: args.eval_rows]
    if train_ids.shape[1] != args.seq_len:
        raise SystemExit(f"cached rows have length {train_ids.shape[1]}, not --seq-len {args.seq_len}")

    # 3. model
    ck = load_training_state(ckpt_path) if (args.resume or args.export_only) and os.path.exists(ckpt_path) else None
    if (args.resume or args.export_only) and ck is None:
        raise SystemExit(f"no checkpoint at {ckpt_path}")
    cfg = KimiLinearConfig.from_dict(ck["config"]) if ck else build_config(args, tok)
    model = KimiLinearForCausalLM(cfg).float()
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: layer_types={cfg.layer_types} params={n_params:,} (~{n_params * 4 / 1e6:.1f} MB fp32)", flush=True)
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2 and "embed" not in n]
    no_decay = [p for n, p in model.named_parameters() if not (p.ndim >= 2 and "embed" not in n)]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=args.lr, betas=(0.9, 0.95), eps=1e-8)
    state = {"step": 0, "tokens": 0, "loss_tokens": 0, "elapsed": 0.0, "epoch": 0, "ptr": 0,
             "last_eval": None, "last_train": None}
    if ck:
        model.load_state_dict(ck["model"])
        opt.load_state_dict(ck["opt"])
        state.update(ck["state"])
        print(f"resumed at step {state['step']} ({state['elapsed'] / 60:.1f} min)", flush=True)
    if args.export_only:
        print(export(args, model, tok, state, meta))
        return

    # 4. train
    patch_kda_chunk(args.kda_train_chunk)
    budget_s = args.max_minutes * 60
    n_rows = train_ids.shape[0]

    def perm_for(epoch):
        gen = torch.Generator().manual_seed(args.seed * 1000 + epoch)
        return torch.randperm(n_rows, generator=gen)

    perm = perm_for(state["epoch"])
    model.train()
    acc = {"loss": 0.0, "n": 0, "resp": [0.0, 0], "code": [0.0, 0]}
    last_ckpt = time.time()
    t_start = time.time() - state["elapsed"]
    t_interval, tok_interval = time.time(), 0
    bar = tqdm(total=args.max_steps or int(budget_s),
               initial=state["step"] if args.max_steps else int(state["elapsed"]),
               unit="step" if args.max_steps else "s", mininterval=10, dynamic_ncols=True)
    done = False
    while not done:
        if state["ptr"] + args.batch > n_rows:
            state["epoch"] += 1
            state["ptr"] = 0
            perm = perm_for(state["epoch"])
        idx = perm[state["ptr"] : state["ptr"] + args.batch]
        state["ptr"] += args.batch
        ids, kinds = train_ids[idx], train_kinds[idx]
        progress = state["step"] / args.max_steps if args.max_steps else state["elapsed"] / budget_s
        lr = lr_at(args, state["step"], progress)
        for grp in opt.param_groups:
            grp["lr"] = lr
        loss, parts = lm_loss(model, ids, kinds)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        gnorm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip))
        opt.step()
        state["step"] += 1
        state["tokens"] += ids.numel()
        state["loss_tokens"] += parts["resp"][1] + parts["code"][1]
        tok_interval += ids.numel()
        acc["loss"] += float(loss.detach())
        acc["n"] += 1
        for n_ in ("resp", "code"):
            acc[n_][0] += parts[n_][0]
            acc[n_][1] += parts[n_][1]
        prev = state["elapsed"]
        state["elapsed"] = time.time() - t_start
        if not args.max_steps:
            bar.update(int(state["elapsed"]) - int(prev))
        else:
            bar.update(1)
        done = (state["step"] >= args.max_steps) if args.max_steps else (state["elapsed"] >= budget_s)
        if state["step"] % args.log_every == 0 or done:
            now = time.time()
            tr = {"type": "train", "step": state["step"], "tokens": state["tokens"],
                  "elapsed_s": round(state["elapsed"], 1), "lr": lr, "loss": acc["loss"] / acc["n"],
                  "resp_loss": acc["resp"][0] / max(acc["resp"][1], 1),
                  "code_loss": acc["code"][0] / max(acc["code"][1], 1),
                  "grad_norm": gnorm, "tok_s": tok_interval / (now - t_interval)}
            state["last_train"] = tr
            log_line(log_path, tr)
            bar.set_postfix(loss=f"{tr['loss']:.3f}", tok_s=f"{tr['tok_s']:.0f}", step=state["step"])
            acc = {"loss": 0.0, "n": 0, "resp": [0.0, 0], "code": [0.0, 0]}
            t_interval, tok_interval = now, 0
        if done or time.time() - last_ckpt >= args.ckpt_minutes * 60:
            t_ev = time.time()
            ev = evaluate(model, held_ids, held_kinds, args.batch)
            ev.update({"type": "eval", "step": state["step"], "tokens": state["tokens"],
                       "elapsed_s": round(state["elapsed"], 1), "eval_s": round(time.time() - t_ev, 1)})
            state["last_eval"] = ev
            log_line(log_path, ev)
            tqdm.write(json.dumps(ev))
            save_ckpt(ckpt_path, model, opt, state, cfg.to_dict())
            last_ckpt = time.time()
            t_start += time.time() - t_ev  # eval/checkpoint time is not training time
            t_interval = time.time()
    bar.close()
    patch_kda_chunk(64)
    if not args.no_export:
        print(export(args, model, tok, state, meta), flush=True)
        print(f"exported to {args.final_dir}", flush=True)


if __name__ == "__main__":
    main()
