#!/usr/bin/env python
"""Train a draft for ANY transformers causal LM target by online distillation (SpecForge recipe).

Kinds (--kind):
  dspark     the DSpark draft: DFlash backbone + Markov head (--markov-rank) + confidence head;
  dflash     the ablation: same backbone and budget, markov_rank 0, no confidence head;
  assistant  a small autoregressive Qwen3 (the target's vocabulary, a frozen copy of its embedding and LM
             head) for transformers' stock assisted generation, distilled on the same data and loss.

Data: the target's own answers to the corpus prompts (tools/regenerate_data.py), loss on the response.
Online (the default), every step runs the frozen target once: its layer outputs at `target_layer_ids` are
captured live by forward hooks (TargetFeatureCapture) and its logits come from the same forward. Offline
(--features-cache DIR, for targets whose forward dominates), the target runs once over the data first and
its features and final hidden states are stored in DIR (tools/feature_cache.py; built if missing, resumable);
training then reads them back and takes the target's logits from its LM head, `lm_head(last_hidden)`.
DSpark/DFlash use `DSparkDraftModel.compute_loss` (anchors, blocks, cumulative masks, exp(-k/4) weights,
0.1 CE + 0.9 L1 + 1.0 BCE); the assistant gets 0.1 CE + 0.9 L1 at every response position. The draft shares the
target's frozen embedding and LM head. AdamW (peak --lr 6e-4), 4% linear warmup, cosine to 0, gradient
clipping 1.0, gradient accumulation, periodic checkpoints, --resume. --dtype bf16 runs the target (the
bulk of the compute and memory) in bfloat16; the draft keeps float32 weights and compute.

Scales beyond one device: --device / --target-device-map place the target (accelerate device_map for
big ones) and the draft; launched with torchrun, the draft is wrapped in DistributedDataParallel (nccl on
GPUs, gloo on CPUs): every process trains on its share of each step's micro-batches, the offline cache is
built in shards by all ranks and each rank reads only its own micro-batches' records; rank 0 writes. A step
sees the same global batch (batch size x grad accum x processes) whatever the split, so N processes reach
the weights of one process with N times the gradient accumulation.

Outputs in --out: train_log.jsonl (one line per step), checkpoint-STEP/ (weights + trainer_state.pt),
train_summary.json, and the final model in --final-dir (default OUT/final): for dspark/dflash the Hub
layout (config.json + model.safetensors + the four remote-code .py files, loadable with
AutoModel.from_pretrained(..., trust_remote_code=True)); for the assistant a save_pretrained folder
with the tokenizer.

Example:
    python tools/train_draft.py --kind dspark --data data/regen/train.jsonl --heldout data/regen/heldout.jsonl \\
        --num-layers 2 --markov-rank 64 --epochs 2 --out runs/dspark --final-dir embedded/dspark
    python tools/train_draft.py --target smollm2 --features-cache data/smollm2/features ...   # offline
    torchrun --nproc-per-node 8 tools/train_draft.py --kind dspark --device cuda --dtype bf16 ...
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
import time
from contextlib import nullcontext
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import load_file
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script from anywhere
import tools  # noqa: E402,F401
from dspark.configuration_dspark import DSparkConfig  # noqa: E402
from dspark.generation_utils import TargetFeatureCapture, decoder_layers
from dspark.modeling_dspark import CE_WEIGHT, L1_WEIGHT, DSparkDraftModel
from tools import chat_format
from tools.feature_cache import FeatureCache
from tools.common import (
    DTYPES, RoundRecords, add_model_arguments, apply_threads, finished_lines, load_target, load_training_state,
    read_jsonl, refuse_other_settings, resolve_device, save_hub_layout, save_training_state, teacher_forced_rounds,
    warn_if_bf16_is_slow, write_json,
)

KINDS = ("dspark", "dflash", "assistant")
METRICS = ("loss", "cross_entropy", "l1", "confidence_bce", "accuracy")
RESUME_MAY_CHANGE = {"resume", "out", "final_dir", "threads", "save_every", "keep_checkpoints", "eval_every"}


# ---------------------------------------------------------------------------------------------- models
def default_target_layer_ids(num_layers: int, num_features: int) -> list[int]:
    """`num_features` layers evenly spread from layer 1 to layer L - 2 (late layers included)."""
    if num_layers < 3:
        return [num_layers - 1]
    num_features = min(num_features, num_layers - 2)
    if num_features == 1:
        return [num_layers - 2]
    step = (num_layers - 3) / (num_features - 1)
    return [round(1 + i * step) for i in range(num_features)]


def backbone_geometry(args, target, tokenizer) -> dict:
    """Config arguments shared by every draft kind: width and vocabulary from the target, the rest from the CLI."""
    text_config = target.config.get_text_config()
    hidden = text_config.hidden_size
    heads = args.num_heads or max(1, hidden // 64)
    return dict(
        vocab_size=text_config.vocab_size,
        hidden_size=hidden,
        intermediate_size=args.intermediate_size or 2 * hidden,
        num_hidden_layers=args.num_layers,
        num_attention_heads=heads,
        num_key_value_heads=args.num_kv_heads or max(1, heads // 4),
        head_dim=args.head_dim or hidden // heads,
        rms_norm_eps=getattr(text_config, "rms_norm_eps", 1e-6),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )


def build_draft(args, target, tokenizer) -> DSparkDraftModel:
    """A fresh DSpark / DFlash draft sized from the CLI, with hidden size and vocabulary from the target."""
    num_layers = len(decoder_layers(target))
    layer_ids = args.target_layer_ids or default_target_layer_ids(num_layers, args.num_target_features)
    mask_token_id = tokenizer.convert_tokens_to_ids(args.mask_token)
    if mask_token_id is None or mask_token_id == tokenizer.unk_token_id:
        raise SystemExit(f"the tokenizer has no {args.mask_token!r} token; pass --mask-token")
    dspark = args.kind == "dspark"
    config = DSparkConfig(
        **backbone_geometry(args, target, tokenizer),
        max_position_embeddings=getattr(target.config.get_text_config(), "max_position_embeddings", 131072),
        trained_context_length=args.max_length,
        block_size=args.block_size,
        target_layer_ids=layer_ids,
        num_target_layers=num_layers,
        mask_token_id=mask_token_id,
        markov_rank=args.markov_rank if dspark else 0,
        enable_confidence_head=dspark,
        confidence_head_with_markov=dspark and args.markov_rank > 0,
    )
    draft = DSparkDraftModel(config)
    with torch.no_grad():
        draft.norm.weight.fill_(args.final_norm_init)
    return draft


def build_assistant(args, target, tokenizer):
    """A small Qwen3 causal LM with the target's vocabulary and a frozen copy of its embedding and LM head."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(
        **backbone_geometry(args, target, tokenizer),
        max_position_embeddings=getattr(target.config.get_text_config(), "max_position_embeddings", 32768),
        tie_word_embeddings=False,
    )
    assistant = Qwen3ForCausalLM(config)
    with torch.no_grad():
        for own, borrowed in ((assistant.get_input_embeddings(), target.get_input_embeddings()),
                              (assistant.get_output_embeddings(), target.get_output_embeddings())):
            own.weight.copy_(borrowed.weight[: own.weight.shape[0]])
            own.weight.requires_grad_(False)
    return assistant


# ---------------------------------------------------------------------------------------------- data
class SequenceData:
    """Regenerated sequences cut to `max_length`, served as a deterministic stream of micro-batches.

    Micro-batch m is batch m % per_epoch of epoch m // per_epoch (a seeded shuffle per epoch), so the
    stream position is a pure function of the step: resuming needs no data state.
    """

    def __init__(self, paths: list[str], max_length: int, batch_size: int, pad_id: int, seed: int):
        records = [record for path in paths for record in read_jsonl(path)]
        self.records = [r for r in records if len(r["input_ids"]) > r["prompt_len"] + 1]
        if not self.records:
            raise SystemExit(f"{' '.join(paths)}: no sequence with a response")
        self.max_length, self.batch_size, self.pad_id, self.seed = max_length, batch_size, pad_id, seed
        self.per_epoch = math.ceil(len(self.records) / batch_size)

    def micro_batch(self, index: int) -> tuple[list[int], torch.Tensor, torch.Tensor]:
        """(record indices, input_ids [B, T], loss_mask [B, T]) of micro-batch `index`."""
        epoch, within = divmod(index, self.per_epoch)
        order = torch.randperm(len(self.records), generator=torch.Generator().manual_seed(self.seed + epoch))
        chosen = order[within * self.batch_size : (within + 1) * self.batch_size].tolist()
        return (chosen, *collate([self.records[i] for i in chosen], self.max_length, self.pad_id))


def collate(records: list[dict], max_length: int, pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded input_ids [B, T] and loss_mask [B, T] (1 on response tokens)."""
    rows = [r["input_ids"][:max_length] for r in records]
    width = max(len(r) for r in rows)
    input_ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    loss_mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, (row, record) in enumerate(zip(rows, records)):
        input_ids[i, : len(row)] = torch.tensor(row)
        loss_mask[i, record["prompt_len"] : len(row)] = 1
    return input_ids, loss_mask


# ---------------------------------------------------------------------------------------------- losses
def target_forward(target, input_ids: torch.Tensor, layer_ids: list[int] | None, device: torch.device):
    """The frozen target's logits [B, T, V] and (for DSpark/DFlash) its captured features, on `device`."""
    with torch.no_grad():
        if layer_ids is None:
            return target(input_ids.to(target.device), use_cache=False).logits.to(device), None
        with TargetFeatureCapture(target, layer_ids, device=device) as capture:
            logits = target(input_ids.to(target.device), use_cache=False).logits.to(device)
            return logits, capture.features()


class DraftLoss(nn.Module):
    """The loss (with its parts) of one micro-batch, for any --kind, given the target's logits and features.

    A module so that DistributedDataParallel can wrap it: the draft is its only trainable part; the target's
    embedding and LM head are borrowed, frozen.
    """

    def __init__(self, kind: str, model: nn.Module, embed_tokens: nn.Module, lm_head: nn.Module, num_anchors: int,
                 compile_terms: bool = False):
        super().__init__()
        self.kind, self.model, self.num_anchors = kind, model, num_anchors
        self.borrowed = {"embed_tokens": embed_tokens, "lm_head": lm_head}  # not submodules: never trained or saved
        self.distillation_terms = DSparkDraftModel.distillation_terms
        if compile_terms:  # the vocabulary-wide passes fused by inductor; the draft itself stays eager
            self.distillation_terms = torch.compile(self.distillation_terms)
            if kind != "assistant":
                model.distillation_terms = self.distillation_terms

    def forward(self, input_ids, loss_mask, target_logits, features, generator) -> dict[str, torch.Tensor]:
        if self.kind == "assistant":
            supervised = loss_mask[:, 1:].bool()
            logits = self.model(input_ids).logits[:, :-1][supervised]
            cross_entropy, l1, correct = self.distillation_terms(
                logits, None, target_logits[:, :-1][supervised], input_ids[:, 1:][supervised]
            )
            cross_entropy, l1, accuracy = cross_entropy.mean(), l1.mean(), correct.float().mean()
            loss = CE_WEIGHT * cross_entropy + L1_WEIGHT * l1
            return {"loss": loss, "cross_entropy": cross_entropy, "l1": l1,
                    "confidence_bce": torch.zeros((), device=input_ids.device), "accuracy": accuracy}
        output = self.model.compute_loss(
            input_ids, loss_mask, features, target_logits, self.borrowed["embed_tokens"], self.borrowed["lm_head"],
            num_anchors=self.num_anchors, generator=generator,
        )
        return {name: getattr(output, name) for name in METRICS}


# ---------------------------------------------------------------------------------------------- schedule
def lr_lambda(total_steps: int, warmup_ratio: float):
    """Linear warmup over `warmup_ratio` of the steps, then cosine decay to 0."""
    warmup = max(1, round(warmup_ratio * total_steps))

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, total_steps - warmup)
        return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))

    return factor


# ---------------------------------------------------------------------------------------------- training
class Trainer:
    def __init__(self, args):
        self.args = args
        self.rank, self.world_size, self.device = init_distributed(args)
        self.is_main = self.rank == 0
        dtype = DTYPES[args.dtype]
        self.target, self.tokenizer = load_target(args.target, self.device, dtype, args.target_device_map)
        if args.autocast == "bf16":
            warn_if_bf16_is_slow(self.device, "--autocast bf16 runs the draft", "--autocast none")
        builder = build_assistant if args.kind == "assistant" else build_draft
        self.model = builder(args, self.target, self.tokenizer).float().to(self.device).train()
        if args.init_from:  # a saved draft of this architecture: its weights, with a fresh optimiser and schedule
            self.model.load_state_dict(load_file(Path(args.init_from) / "model.safetensors", device=str(self.device)))
        self.data = SequenceData(args.data, args.max_length, args.batch_size, self.tokenizer.pad_token_id, args.seed)
        micro_per_step = args.grad_accum * self.world_size
        self.total_steps = args.max_steps or math.ceil(args.epochs * self.data.per_epoch / micro_per_step)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(self.params, lr=args.lr, betas=(0.9, 0.95), weight_decay=args.weight_decay)
        schedule = lr_lambda(self.total_steps, args.warmup_ratio)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, schedule)
        self.out = Path(args.out)
        self.step = 0
        self.elapsed = 0.0  # training seconds, carried across resumes
        self.tokens = 0
        self.layer_ids = None if args.kind == "assistant" else self.model.config.target_layer_ids
        self.cache = self.build_feature_cache() if args.features_cache else None
        self.loss = DraftLoss(args.kind, self.model, self.target.get_input_embeddings(),
                              self.target.get_output_embeddings(), args.num_anchors, args.compile)
        self.distributed_loss = DistributedDataParallel(self.loss) if self.world_size > 1 else self.loss

    # -- the target's side of the loss
    def build_feature_cache(self) -> FeatureCache:
        """The offline cache of this run's data (built first where it is missing, by every rank)."""
        args = self.args
        if self.layer_ids is None:
            raise SystemExit("--features-cache trains DSpark / DFlash drafts; train the assistant online.")
        if getattr(self.target.config.get_text_config(), "final_logit_softcapping", None):
            raise SystemExit("--features-cache takes the target's logits as lm_head(last hidden state); this target "
                             "soft-caps its logits after the LM head. Train it online (drop --features-cache).")
        identity = {
            "target": str(args.target), "layer_ids": self.layer_ids, "max_length": args.max_length,
            "dtype": args.cache_dtype, "data": [[str(path), os.path.getsize(path)] for path in args.data],
        }
        cache = FeatureCache(args.features_cache, identity, len(self.data.records))
        sequences = [record["input_ids"][: args.max_length] for record in self.data.records]
        cache.build(self.target, sequences, self.layer_ids, self.rank, self.world_size, DTYPES[args.cache_dtype])
        return cache

    def target_outputs(self, indices: list[int], input_ids: torch.Tensor):
        """The target's logits [B, T, V] and features [B, T, n * H] of a micro-batch: live, or from the cache."""
        if self.cache is None:
            return target_forward(self.target, input_ids, self.layer_ids, self.device)
        features, last_hidden = self.cache.batch(indices, input_ids.shape[1])
        lm_head = self.target.get_output_embeddings()
        with torch.no_grad(), self.autocast():
            logits = lm_head(last_hidden.to(self.device, lm_head.weight.dtype)).float()
        return logits, features.to(self.device)

    # -- checkpoints
    def save_checkpoint(self) -> None:
        if not self.is_main:
            return
        path = self.out / f"checkpoint-{self.step}"
        self.save_model(path)
        state = {"step": self.step, "optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict(),
                 "elapsed": self.elapsed, "tokens": self.tokens, "args": vars(self.args)}
        save_training_state(path / "trainer_state.pt", state)
        checkpoints = sorted(self.out.glob("checkpoint-*"), key=lambda p: int(p.name.split("-")[1]))
        for old in checkpoints[: -self.args.keep_checkpoints]:
            shutil.rmtree(old)

    def save_model(self, path: Path) -> None:
        if self.args.kind == "assistant":
            self.model.save_pretrained(path)
            self.tokenizer.save_pretrained(path)
        else:
            save_hub_layout(self.model, path)

    def resume(self, spec: str) -> None:
        if spec == "auto":
            checkpoints = sorted(self.out.glob("checkpoint-*"), key=lambda p: int(p.name.split("-")[1]))
            if not checkpoints:
                return
            path = checkpoints[-1]
        else:
            path = Path(spec)
        state = load_training_state(path / "trainer_state.pt", map_location=self.device)
        def run_settings(args: dict) -> dict:
            return {key: value for key, value in args.items() if key not in RESUME_MAY_CHANGE}

        refuse_other_settings(path, run_settings(state["args"]), run_settings(vars(self.args)),
                              "Resume with the run's settings, or start a new --out (--init-from takes its weights).")
        weights = load_file(path / "model.safetensors", device=str(self.device))
        self.model.load_state_dict(weights)
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.step, self.elapsed, self.tokens = state["step"], state["elapsed"], state["tokens"]
        if self.is_main:
            log = self.out / "train_log.jsonl"
            if log.exists():  # the steps logged after this checkpoint are run (and logged) again
                log.write_text("".join(line for line in finished_lines(log) if json.loads(line)["step"] <= self.step))
            print(f"resumed from {path} at step {self.step}")

    def autocast(self):
        """--autocast bf16: the draft's matmuls (its layers, the shared LM head) in bfloat16, weights, softmaxes
        and the loss in float32 (mixed precision, as GPU training runs); a no-op otherwise."""
        return torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.args.autocast == "bf16")

    # -- one optimiser step
    def train_step(self) -> dict[str, float]:
        args = self.args
        totals = torch.zeros(len(METRICS) + 1)  # the step's mean metrics, then its supervised tokens
        generator = torch.Generator(self.device)
        for micro in range(args.grad_accum):
            index = (self.step * args.grad_accum + micro) * self.world_size + self.rank
            indices, input_ids, loss_mask = self.data.micro_batch(index)
            input_ids, loss_mask = input_ids.to(self.device), loss_mask.to(self.device)
            target_logits, features = self.target_outputs(indices, input_ids)
            generator.manual_seed(args.seed * 1_000_003 + index)  # anchors: a function of the micro-batch
            last = micro == args.grad_accum - 1
            with nullcontext() if last or self.world_size == 1 else self.distributed_loss.no_sync(), self.autocast():
                metrics = self.distributed_loss(input_ids, loss_mask, target_logits, features, generator)
                (metrics["loss"] / args.grad_accum).backward()  # DDP averages the gradients over the processes
            totals += torch.tensor([float(metrics[name].detach()) for name in METRICS] + [float(loss_mask.sum())])
        if self.world_size > 1:
            dist.all_reduce(totals)
        totals[: len(METRICS)] /= args.grad_accum * self.world_size
        self.tokens += int(totals[-1])
        totals = dict(zip(METRICS, totals.tolist()))
        totals["grad_norm"] = float(torch.nn.utils.clip_grad_norm_(self.params, args.grad_clip))
        totals["lr"] = self.scheduler.get_last_lr()[0]
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        return totals

    # -- held-out evaluation
    def evaluate_heldout(self) -> dict[str, float]:
        """The held-out metrics of both held-out files: `heldout_*` (greedy answers) and `heldout_sampled_*`."""
        result = self.heldout_metrics(self.args.heldout, "heldout", greedy=True)
        if self.args.heldout_sampled:
            result.update(self.heldout_metrics(self.args.heldout_sampled, "heldout_sampled", greedy=False))
        return result

    @torch.no_grad()
    def heldout_metrics(self, path: str, prefix: str, greedy: bool) -> dict[str, float]:
        """Mean loss parts over the first --heldout-limit records of `path`, plus, for greedy answers and
        DSpark / DFlash, the greedy acceptance length (tau) of the rounds greedy decoding runs over them
        (teacher-forced, `RoundRecords.decoded`). On sampled answers, 1 - L1 / 2 is the mean probability that
        speculative sampling accepts a draft position (its prefix accepted)."""
        args = self.args
        records = read_jsonl(path)[: args.heldout_limit]
        self.model.eval()
        totals = dict.fromkeys(METRICS, 0.0)
        generator = torch.Generator(self.device).manual_seed(args.seed)
        rounds = []
        for record in records:
            input_ids, loss_mask = collate([record], args.max_length, self.tokenizer.pad_token_id)
            input_ids, loss_mask = input_ids.to(self.device), loss_mask.to(self.device)
            target_logits, features = target_forward(self.target, input_ids, self.layer_ids, self.device)
            metrics = self.loss(input_ids, loss_mask, target_logits, features, generator)
            for name in METRICS:
                totals[name] += float(metrics[name]) / len(records)
            if greedy and args.kind != "assistant":
                ids = record["input_ids"][: args.max_length]
                rounds.append(teacher_forced_rounds(self.target, self.model, ids, record["prompt_len"]).decoded())
        self.model.train()
        result = {f"{prefix}_{name}": value for name, value in totals.items()}
        if rounds:
            result[f"{prefix}_greedy_acceptance_length"] = RoundRecords.concatenate(rounds).acceptance_length()
        return result

    def log(self, record: dict) -> None:
        if self.is_main:
            with open(self.out / "train_log.jsonl", "a") as f:
                f.write(json.dumps(record) + "\n")

    def train(self) -> dict:
        args = self.args
        self.out.mkdir(parents=True, exist_ok=True)
        if args.resume:
            self.resume(args.resume)
        if self.is_main:
            write_json(self.out / "train_args.json", vars(args))
        bar = tqdm(total=self.total_steps, initial=self.step, desc=f"train {args.kind}", unit="step",
                   disable=not self.is_main)
        metrics, heldout = {}, {}
        while self.step < self.total_steps:
            started = time.time()
            metrics = self.train_step()
            self.elapsed += time.time() - started
            record = {"step": self.step, **{k: round(v, 6) for k, v in metrics.items()},
                      "tokens": self.tokens, "elapsed_s": round(self.elapsed, 1)}
            if args.heldout and self.is_main and (self.step % args.eval_every == 0 or self.step == self.total_steps):
                heldout = self.evaluate_heldout()
                record.update({k: round(v, 6) for k, v in heldout.items()})
            self.log(record)
            bar.update(1)
            bar.set_postfix(loss=f"{metrics['loss']:.3f}", acc=f"{metrics['accuracy']:.3f}", lr=f"{metrics['lr']:.1e}")
            if self.step % args.save_every == 0 and self.step < self.total_steps:
                self.save_checkpoint()
        bar.close()
        summary = {}
        if self.is_main:
            final_dir = Path(args.final_dir or self.out / "final")
            self.save_model(final_dir)
            summary = {
                "kind": args.kind, "steps": self.step, "train_seconds": round(self.elapsed, 1),
                "supervised_tokens": self.tokens, "trainable_parameters": sum(p.numel() for p in self.params),
                "final_dir": str(final_dir), "last_step": metrics, **heldout,
            }
            write_json(self.out / "train_summary.json", summary)
        if self.world_size > 1:
            self.close_distributed()
        return summary

    def close_distributed(self) -> None:
        """Leave the process group together: every rank waits for rank 0's final writes, and DDP (whose reducer
        holds the group) goes before the group. A gloo rank that tears down alone can hang at exit."""
        dist.barrier()
        self.distributed_loss = self.loss
        dist.destroy_process_group()


def init_distributed(args) -> tuple[int, int, torch.device]:
    """(rank, world size, device); under torchrun, one process group and one GPU per local rank."""
    device = resolve_device(args.device)
    if int(os.environ.get("WORLD_SIZE", "1")) == 1:
        return 0, 1, device
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    if device.type == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    return dist.get_rank(), dist.get_world_size(), device


# ---------------------------------------------------------------------------------------------- CLI
def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kind", choices=KINDS, default="dspark")
    add_model_arguments(parser)
    data = parser.add_argument_group("data")
    data.add_argument("--data", nargs="+", default=["data/regen/train.jsonl"],
                      help="regenerated training data (tools/regenerate_data.py), one or more files")
    data.add_argument("--heldout", default=None,
                      help="regenerated GREEDY held-out data, evaluated every --eval-every steps")
    data.add_argument("--heldout-sampled", default=None,
                      help="held-out answers sampled at temperature 1, also evaluated (loss parts only)")
    data.add_argument("--heldout-limit", type=int, default=32, help="held-out sequences per evaluation")
    data.add_argument("--max-length", type=int, default=1024, help="tokens per training sequence (longer ones are cut)")
    data.add_argument("--features-cache", default=None,
                      help="offline mode: the folder of the target's cached features (built first if missing)")
    data.add_argument("--cache-dtype", choices=sorted(DTYPES), default="bf16",
                      help="dtype of the cached features and hidden states (default: %(default)s)")
    model = parser.add_argument_group("draft architecture (hidden size and vocabulary come from the target)")
    model.add_argument("--num-layers", type=int, default=2)
    model.add_argument("--num-heads", type=int, default=0, help="0 = hidden_size // 64")
    model.add_argument("--num-kv-heads", type=int, default=0, help="0 = num_heads // 4")
    model.add_argument("--head-dim", type=int, default=0, help="0 = hidden_size // num_heads")
    model.add_argument("--intermediate-size", type=int, default=0, help="0 = 2 * hidden_size")
    model.add_argument("--markov-rank", type=int, default=64, help="dspark only (dflash is the markov_rank 0 ablation)")
    model.add_argument("--block-size", type=int, default=7)
    model.add_argument("--target-layer-ids", type=int, nargs="+", default=None,
                       help="0-based target layers read by the draft (default: --num-target-features evenly spread)")
    model.add_argument("--num-target-features", type=int, default=5)
    model.add_argument("--mask-token", default=chat_format.MASK, help="tokenizer token used as mask_token_id")
    model.add_argument("--final-norm-init", type=float, default=1.0,
                       help="initial weight of the draft's final norm. An untrained row is close to its own input "
                            "embedding, so through a tied LM head it predicts its input token with very large "
                            "logits; a small value (0.1) starts from a softer distribution (default: %(default)s)")
    optim = parser.add_argument_group("optimisation")
    optim.add_argument("--epochs", type=float, default=1.0)
    optim.add_argument("--max-steps", type=int, default=0, help="optimiser steps (0 = from --epochs)")
    optim.add_argument("--batch-size", type=int, default=4, help="sequences per micro-batch and process")
    optim.add_argument("--grad-accum", type=int, default=1, help="micro-batches per optimiser step")
    optim.add_argument("--lr", type=float, default=6e-4)
    optim.add_argument("--warmup-ratio", type=float, default=0.04)
    optim.add_argument("--weight-decay", type=float, default=0.0)
    optim.add_argument("--grad-clip", type=float, default=1.0)
    optim.add_argument("--num-anchors", type=int, default=512, help="anchors (blocks) per sequence")
    optim.add_argument("--autocast", choices=("none", "bf16"), default="none",
                       help="mixed precision of the draft's forward and backward (weights stay float32)")
    optim.add_argument("--compile", action="store_true",
                       help="compile the loss's vocabulary-wide passes (softmaxes, L1, cross-entropy) with "
                            "torch.compile: about 5x faster on a CPU, after a minute of compiling")
    optim.add_argument("--seed", type=int, default=0)
    run = parser.add_argument_group("run")
    run.add_argument("--out", default="runs/dspark", help="run folder: log, checkpoints, summary")
    run.add_argument("--final-dir", default=None, help="where the final model goes (default: OUT/final)")
    run.add_argument("--save-every", type=int, default=200, help="checkpoint every N steps")
    run.add_argument("--keep-checkpoints", type=int, default=2)
    run.add_argument("--eval-every", type=int, default=200)
    run.add_argument("--resume", default=None, help="'auto' (latest checkpoint in --out) or a checkpoint folder")
    run.add_argument("--init-from", default=None,
                     help="start from the weights of a saved draft folder (same architecture; fresh optimiser and "
                          "schedule), e.g. to continue training a shipped draft on a new machine. Give it another "
                          "--seed than the earlier run's: batches and anchors are a function of seed and step")
    return parser


def main(argv=None) -> dict:
    args = build_parser().parse_args(argv)
    apply_threads(args)
    torch.manual_seed(args.seed)
    summary = Trainer(args).train()
    if summary:
        print(json.dumps(summary, indent=2))
    return summary


if __name__ == "__main__":
    main()
