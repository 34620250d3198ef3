"""DSpark speculative decoding for transformers targets.

`dspark_generate(target, draft, input_ids, ...)` runs the DSpark loop (DSPARK.md section 2) with a transformers
causal LM as the target; `install_generate_route()` (called when `modeling_dspark` is imported) makes the plain
`target.generate(input_ids, assistant_model=draft, ...)` call land there. One round, per batch row:

1. the draft context holds the target features (outputs of `target_layer_ids`) of every committed token
   before the anchor (the last committed token);
2. the draft drafts a block of S = block_size tokens with its Markov chain, plus confidences c_k;
3. a verify length L <= S is chosen (`truncation`: all S, a survival threshold, or the throughput schedule);
4. ONE target forward over [anchor, d_1 .. d_L] yields L + 1 next-token distributions (after every logits
   processor of the target's generation config) and the features of those tokens;
5. `verify_block` accepts n drafts and picks the next token (greedy: longest argmax match; sampling:
   speculative sampling, lossless);
6. the target cache is brought back to the committed tokens (anchor + n drafts): attention K/V by crop (or
   masked holes when rows of a batch commit different counts), linear-attention conv windows by re-slicing and
   recurrent states by replaying the recurrence on the committed tokens (or re-running them, see
   `TargetCache`); the draft context appends the features of the committed tokens only.
"""

import contextvars
import copy
import functools
import hashlib
import inspect
import json
import math
import os
import sys
import threading
import time
import warnings
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from torch import nn
from transformers import DynamicCache, GenerationMixin
from transformers.cache_utils import DynamicLayer, LinearAttentionCacheLayerMixin
from transformers.generation import (
    EncoderRepetitionPenaltyLogitsProcessor,
    EosTokenCriteria,
    EpsilonLogitsWarper,
    EtaLogitsWarper,
    ExponentialDecayLengthPenalty,
    ForcedBOSTokenLogitsProcessor,
    ForcedEOSTokenLogitsProcessor,
    GenerateDecoderOnlyOutput,
    InfNanRemoveLogitsProcessor,
    LogitNormalization,
    LogitsProcessorList,
    MaxLengthCriteria,
    MaxTimeCriteria,
    MinLengthLogitsProcessor,
    MinNewTokensLengthLogitsProcessor,
    MinPLogitsWarper,
    NoBadWordsLogitsProcessor,
    NoRepeatNGramLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
    SequenceBiasLogitsProcessor,
    StoppingCriteriaList,
    StopStringCriteria,
    SuppressTokensAtBeginLogitsProcessor,
    SuppressTokensLogitsProcessor,
    SynthIDTextWatermarkLogitsProcessor,
    TemperatureLogitsWarper,
    TopHLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
    TypicalLogitsWarper,
)

from .kernels import verify_block

TRUNCATION_MODES = ("full", "threshold", "schedule")
ROLLBACK_METHODS = ("auto", "replay", "rerun", "none")

SPS_PROFILE_VERSION = 3  # what `profile_sps` times; a new value invalidates the curves cached by older code

# Chunked delta-rule kernels whose inputs can be replayed with the matching token-by-token recurrence:
# (module-level chunk function, recurrent function), looked up in the target's modeling module. A verify
# forward runs the recurrence in place of the chunked kernel (see `TargetCache`). Both take the gate g in log
# space, per key channel (KDA: [B, T, heads, d_k]) or per head (gated delta rule: [B, T, heads]).
DELTA_RULE_KERNELS = (
    ("chunk_kimi_delta_attention", "recurrent_kimi_delta_attention"),  # kimi_linear (KDA)
    ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule"),  # qwen3_next, qwen3_5, olmo_hybrid
)
# The keywords of a chunked delta-rule call, besides g, beta and initial_state, whose meaning replay knows (all that
# transformers 5.23 passes): q/k normalisation (per token), the final-state flag and chunking that replay sets
# itself, packed sequences (`cu_seqlens`, only None) and generation flags the model forwards to its kernels
# untouched. Any other keyword (fla's `use_gate_in_kernel`, say) may change what g = 0, beta = 0 mean.
REPLAYABLE_KEYWORDS = frozenset(
    {"use_qk_l2norm_in_kernel", "output_final_state", "chunk_size", "cu_seqlens", "use_cache", "output_router_logits"}
)

# Interception points exist only while DSpark calls use them: a forward hook on each captured target layer (for
# the span of a `TargetFeatureCapture`) and a wrapper of the target's chunked delta-rule kernel (for the span of a
# replay forward). The first user installs one and the last removes it, also when it raised; in between it acts
# only for the DSpark calls running in the current context (thread), through a ContextVar, so concurrent calls
# share it and every other call of the model is unchanged.
_INSTALL_LOCK = threading.Lock()  # this copy's capture hooks (each copy of this file installs its own)
# On a kernel wrapper, for every copy of this file: {"route": ContextVar, "users": int}. (Revisions before the
# wrapper was call-scoped marked theirs "_dspark_kernel_route": the two treat each other's as foreign.)
_KERNEL_ROUTE = "_dspark_routed_kernel"


def decoder_layers(target: nn.Module) -> nn.ModuleList:
    """The decoder layers of a transformers causal LM (`target.model.layers` and its equivalents)."""
    decoder = target.get_decoder() if hasattr(target, "get_decoder") else target
    layers = getattr(decoder, "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise ValueError(
            f"DSpark: cannot find the decoder layers of {type(target).__name__} (expected `get_decoder().layers`). "
            "The target must be a transformers decoder-only causal LM."
        )
    return layers


class TargetFeatureCapture:
    """Records the outputs of `layer_ids` (pre-norm residual stream) of the target forwards run inside its block.

    Used as a context manager around target forwards. `features()` returns the captured layers
    concatenated in `layer_ids` order, [B, T, len(layer_ids) * H], on `device`: those of the LAST forward, so
    read them before another one (a "rerun" rollback, say) replaces them.
    Call-scoped: while any capture is open, each captured layer carries one forward hook (registered by the first
    capture, removed by the last) that records into the captures open in the current context only, so threads
    sharing one target each receive the features of their own forwards.
    Works for targets dispatched with accelerate (each layer's output lives on that layer's device).
    """

    def __init__(self, target: nn.Module, layer_ids: list[int], device: torch.device | str | None = None):
        layers = decoder_layers(target)
        if max(layer_ids) >= len(layers):
            raise ValueError(
                f"DSpark: the draft reads target layers {layer_ids} but {type(target).__name__} has only "
                f"{len(layers)} layers. Use the target the draft was trained for (see `num_target_layers`)."
            )
        self.device = device
        self._slots: dict[nn.Module, list[int]] = {}  # layer -> its positions in `layer_ids`
        for slot, index in enumerate(layer_ids):
            self._slots.setdefault(layers[index], []).append(slot)
        self._outputs: list[torch.Tensor | None] = [None] * len(layer_ids)
        self._token = None

    def __enter__(self) -> "TargetFeatureCapture":
        _use_capture_hooks(self._slots)
        self._token = _open_captures.set((*_open_captures.get(), self))
        return self

    def __exit__(self, *exc) -> None:
        try:
            _open_captures.reset(self._token)
        finally:
            _release_capture_hooks(self._slots)

    def record(self, layer: nn.Module, output) -> None:
        """Called by the capture hooks with every layer output of this context's forwards."""
        for slot in self._slots.get(layer, ()):
            self._outputs[slot] = output[0] if isinstance(output, tuple) else output

    def features(self) -> torch.Tensor:
        if any(output is None for output in self._outputs):
            raise RuntimeError("DSpark: no target forward was captured yet.")
        device = self.device if self.device is not None else self._outputs[0].device
        return torch.cat([output.to(device, non_blocking=True) for output in self._outputs], dim=-1)


_open_captures = contextvars.ContextVar("dspark_open_captures", default=())
_capture_hooks: dict[nn.Module, list] = {}  # captured layer -> [its hook's handle, open captures of the layer]


def _record_layer_output(layer: nn.Module, args, output) -> None:
    """The capture hook: hands a layer's output to the captures open in the current context."""
    for capture in _open_captures.get():
        capture.record(layer, output)


def _use_capture_hooks(layers) -> None:
    with _INSTALL_LOCK:
        for layer in layers:
            entry = _capture_hooks.setdefault(layer, [None, 0])
            if entry[0] is None:
                entry[0] = layer.register_forward_hook(_record_layer_output)
            entry[1] += 1


def _release_capture_hooks(layers) -> None:
    with _INSTALL_LOCK:
        for layer in layers:
            entry = _capture_hooks[layer]
            entry[1] -= 1
            if not entry[1]:
                entry[0].remove()
                del _capture_hooks[layer]


def is_dspark_draft(model) -> bool:
    """True for a DSpark draft, whichever copy of the remote code built it (duck typing, no isinstance)."""
    return getattr(getattr(model, "config", None), "model_type", None) == "dspark"


# ----------------------------------------------------------------------------------------------- statistics
@dataclass
class DSparkStats:
    """What one `dspark_generate` call did (also stored on `draft.last_stats`).

    A row-round is one batch row in one verify forward. tau = committed tokens per row-round (accepted
    drafts + the bonus/correction token). `position_tried[k]` counts row-rounds that verified draft k+1 with
    drafts 1..k accepted, `position_accepted[k]` those that accepted it: their ratio is the conditional
    acceptance of block position k. `rounds_without_draft` counts the rounds of threshold or schedule truncation
    whose first confidences ruled out every draft, so that the block's logits were never computed.
    """

    rollback: str = "crop"
    truncation: str = "full"
    rounds: int = 0
    row_rounds: int = 0
    committed_tokens: int = 0
    generated_tokens: int = 0
    verify_lengths: list[int] = field(default_factory=list)  # drafts verified per forward (L)
    rounds_without_draft: int = 0
    position_tried: list[int] = field(default_factory=list)
    position_accepted: list[int] = field(default_factory=list)
    time_prefill: float = 0.0
    time_draft: float = 0.0
    time_verify: float = 0.0
    time_rollback: float = 0.0
    time_total: float = 0.0

    @property
    def tau(self) -> float:
        return self.committed_tokens / max(self.row_rounds, 1)

    @property
    def conditional_acceptance(self) -> list[float]:
        return [a / t if t else float("nan") for a, t in zip(self.position_accepted, self.position_tried)]

    def summary(self) -> dict:
        return {**asdict(self), "tau": self.tau, "conditional_acceptance": self.conditional_acceptance}


# ------------------------------------------------------------------------------------- verify-length choice
@dataclass
class SpsCurve:
    """Target forward steps per second as a function of the tokens in one forward (DSPARK.md step 7).

    `points` maps a token count (batch rows x tokens per row) to measured steps/s; other counts are linearly
    interpolated (constant beyond the ends).
    """

    points: dict[int, float]

    def __post_init__(self):
        if not self.points:
            raise ValueError(
                "DSpark: an SpsCurve needs at least one point {tokens per forward: steps/s}; pass measured points, "
                "or sps_curve=None to profile the target (`load_sps_curve`)."
            )
        for num_tokens, sps in self.points.items():
            if isinstance(num_tokens, bool) or not isinstance(num_tokens, int) or num_tokens < 1:
                raise ValueError(f"DSpark: SpsCurve token count {num_tokens!r} must be a positive int.")
            if isinstance(sps, bool) or not isinstance(sps, (int, float)) or not (math.isfinite(sps) and sps > 0):
                raise ValueError(
                    f"DSpark: SpsCurve steps/s {sps!r} at {num_tokens} tokens must be a positive finite number."
                )

    def __call__(self, num_tokens: int) -> float:
        counts = sorted(self.points)
        if num_tokens <= counts[0]:
            return self.points[counts[0]]
        for low, high in zip(counts, counts[1:]):
            if num_tokens <= high:
                weight = (num_tokens - low) / (high - low)
                return (1 - weight) * self.points[low] + weight * self.points[high]
        return self.points[counts[-1]]

    def save(self, path: str | os.PathLike) -> None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps({"points": {str(k): v for k, v in sorted(self.points.items())}}, indent=1))

    @classmethod
    def load(cls, path: str | os.PathLike) -> "SpsCurve":
        try:
            return cls({int(k): float(v) for k, v in json.loads(Path(path).read_text())["points"].items()})
        except (ValueError, KeyError, TypeError, AttributeError) as error:  # JSONDecodeError is a ValueError
            raise ValueError(
                f"DSpark: the SPS curve file {path} is corrupt ({type(error).__name__}: {error}). Delete it; "
                "truncation='schedule' (or `load_sps_curve`) then profiles the target again."
            ) from error


@torch.no_grad()
def profile_sps(
    target: nn.Module,
    batch_size: int,
    max_tokens_per_row: int,
    context_length: int = 64,
    repeats: int = 3,
    rollback: str = "auto",
) -> SpsCurve:
    """Time verify steps of [batch_size, t] tokens (t = 1 .. max_tokens_per_row) after a context of
    `context_length` tokens, as the decoder runs them: the target forward, then the `rollback` of all but the
    first token (decoding always commits at least the anchor; with rerun, that is a forward of the kept token).
    Returns the median steps/s per token count (batch_size * t)."""
    vocab_size = target.config.get_text_config(decoder=True).vocab_size
    device, devices = _input_device(target), _devices(target)
    target_cache = TargetCache(target, rollback)
    context = torch.randint(vocab_size, (batch_size, context_length), device=device)
    target_cache.forward(context, torch.arange(context_length, device=device).expand(batch_size, -1), num_logits=1)
    target_cache.start_recording()
    kept = torch.ones(batch_size, dtype=torch.long, device=device)  # decoding commits at least the anchor
    points = {}
    for tokens in range(1, max_tokens_per_row + 1):
        input_ids = torch.randint(vocab_size, (batch_size, tokens), device=device)
        position_ids = torch.arange(context_length, context_length + tokens, device=device).expand(batch_size, -1)
        seconds = []
        for _ in range(repeats + 1):  # the first run warms up
            _synchronize(devices)
            start = time.perf_counter()
            target_cache.forward(input_ids, position_ids, num_logits=tokens, verify=True)
            target_cache.commit(kept)
            _synchronize(devices)
            seconds.append(time.perf_counter() - start)
        points[batch_size * tokens] = 1.0 / sorted(seconds[1:])[len(seconds[1:]) // 2]
    return SpsCurve(points)


def default_sps_path(target: nn.Module, rollback: str = "auto") -> Path:
    """~/.cache/dspark/sps/<target, dtype, device, rollback>.json: one curve per target, hardware and rollback."""
    config = target.config.get_text_config(decoder=True)
    device = _input_device(target)
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu{torch.get_num_threads()}"
    identity = json.dumps([SPS_PROFILE_VERSION, type(target).__name__, config.to_json_string(), str(target.dtype),
                           device_name, rollback])
    key = hashlib.sha1(identity.encode()).hexdigest()[:16]
    return Path(os.environ.get("DSPARK_CACHE", Path.home() / ".cache" / "dspark")) / "sps" / f"{key}.json"


def load_sps_curve(
    target: nn.Module,
    batch_size: int,
    max_tokens_per_row: int,
    path: str | os.PathLike | None = None,
    rollback: str = "auto",
) -> SpsCurve:
    """The cached SPS curve of this target with this rollback (`path`, default `default_sps_path`), profiled and
    saved first if it lacks the token counts of this batch size."""
    path = Path(path) if path is not None else default_sps_path(target, rollback)
    points = SpsCurve.load(path).points if path.exists() else {}
    needed = {batch_size * t for t in range(1, max_tokens_per_row + 1)}
    if not needed <= points.keys():
        points.update(profile_sps(target, batch_size, max_tokens_per_row, rollback=rollback).points)
        SpsCurve(points).save(path)
    return SpsCurve(points)


def choose_num_drafts(
    confidences: torch.Tensor | None,  # [B, S] c_k of the drafted block
    max_drafts: torch.Tensor,  # [B] drafts each row may still verify (its token budget minus the bonus)
    truncation: str,
    threshold: float = 0.5,
    sps: SpsCurve | None = None,
) -> torch.Tensor:
    """Drafts to verify per row [B] (DSPARK.md step 7). Every choice is made before verification, so every
    mode is lossless.

    full: every draft. threshold: the drafts whose survival a_k = c_1 * ... * c_k stays >= `threshold`.
    schedule: one verify length L for the batch (the target forward is rectangular) maximising the expected
    throughput (sum over rows of 1 + a_1 + ... + a_L) * SPS(rows * (L + 1)); L grows while that rises and
    stops at the first drop.
    """
    if truncation == "full":
        return max_drafts
    survival = confidences.float().cumprod(dim=-1)  # [B, S]
    if truncation == "threshold":
        return torch.minimum((survival >= threshold).sum(-1), max_drafts)
    batch_size, block_size = survival.shape
    expected = torch.cat([survival.new_ones(batch_size, 1), 1 + survival.cumsum(-1)], dim=-1)  # [B, S + 1]
    lengths = torch.arange(block_size + 1, device=expected.device)
    expected = expected.gather(1, torch.minimum(lengths, max_drafts[:, None]))
    throughput = [float(expected[:, length].sum()) * sps(batch_size * (length + 1)) for length in range(block_size + 1)]
    length = 0
    while length < int(max_drafts.max()) and throughput[length + 1] >= throughput[length]:
        length += 1
    return max_drafts.clamp(max=length)


def rules_out_every_draft(
    first_confidences: torch.Tensor,  # [B] c_1 of each row's block
    max_drafts: torch.Tensor,  # [B]
    truncation: str,
    threshold: float = 0.5,
    sps: SpsCurve | None = None,
) -> bool:
    """Whether `choose_num_drafts` will verify no draft of any row, decided from c_1 alone: threshold and schedule
    both take draft 1 before any later one, and decide it from a_1 = c_1 (schedule stops at the first
    throughput drop, so when draft 1 lowers the expected throughput no later draft is reached)."""
    return not choose_num_drafts(first_confidences[:, None], max_drafts.clamp(max=1), truncation, threshold, sps).any()


# ------------------------------------------------------------------------------------------ target cache
@dataclass
class _DeltaRuleCall:
    """Inputs of one linear-attention layer's recurrence during a verify forward (what a replay needs)."""

    state: torch.Tensor  # the cache's recurrent state tensor (updated in place by the verify)
    initial_state: torch.Tensor  # its value before the verify
    inputs: tuple[torch.Tensor, ...]  # query, key, value, g, beta: [B, T, heads, ...]
    kwargs: dict


class TargetCache:
    """The target's transformers cache, its attention slot mask and its rollback after a verify forward.

    Attention layers (and conv windows) roll back by `crop`; when the rows of a batch commit different numbers
    of tokens, the shortfall of a row stays in the cache as masked slots ("holes": `slot_mask` is 0 there).
    Linear-attention layers are detected from the cache's layer types. Their conv windows are re-sliced per
    row to end at the last committed token; their recurrent state, which `crop` cannot undo, is restored by:

    - "replay": during the verify, keep the pre-verify state and the recurrence inputs (q, k, v, g, beta)
      of the verify tokens (by intercepting the model's chunked delta-rule kernel, see `DELTA_RULE_KERNELS`),
      then recompute the state over each row's committed tokens with the model's own token-by-token
      recurrence. Tokens past a row's commit get g = 0 and beta = 0, an exact identity step. No weight reads.
      The verify itself also runs through that recurrence rather than the chunked kernel: a verify window
      is a few tokens, the chunked kernel pads it to a whole chunk (64; transformers' PyTorch fallback then
      loops over all 64 rows), and the recurrence is what the target decodes single tokens with.
      Replay relies on the kernel's gating convention, so it accepts only calls whose keywords it knows
      (`REPLAYABLE_KEYWORDS`), checked at the prefill: otherwise "auto" falls back to "rerun" and "replay" raises.
      The interception is call-scoped: a wrapper of the modeling module's kernel, in place only during replay
      forwards, routes the calls made in this context to this cache, and calls from any other context to the
      kernel unchanged (`_routed_kernel`).
    - "rerun": snapshot the linear-attention states before the verify, restore them after it and re-run
      the committed tokens through the target (one extra forward, with the model's own kernels; the fallback
      for recurrences this module does not know). All rows commit the batch minimum of accepted drafts,
      which keeps the cache rectangular and stays lossless.
    - "none": leave the recurrent state as the verify left it (wrong after a rejection; a control only).

    Sliding-window attention layers keep only their last window of slots, so holes would push real tokens
    out: with such layers every row commits the batch minimum too. Cache layers that hold linear attention
    and attention together (transformers' "hybrid" layer types) are refused.
    """

    def __init__(self, target: nn.Module, rollback: str = "auto"):
        if rollback not in ROLLBACK_METHODS:
            raise ValueError(f"DSpark: unknown rollback {rollback!r}; choose one of {ROLLBACK_METHODS}.")
        self.target = target
        self.cache = DynamicCache(config=target.config.get_text_config(decoder=True))
        hybrid = [type(layer).__name__ for layer in self.cache.layers
                  if isinstance(layer, LinearAttentionCacheLayerMixin) and isinstance(layer, DynamicLayer)]
        if hybrid:
            raise ValueError(
                f"DSpark: {type(target).__name__} keeps linear attention and attention K/V in one cache layer "
                f"({sorted(set(hybrid))}), which DSpark cannot roll back. Decode it without an assistant."
            )
        self.kernels = _delta_rule_kernels(target)
        requested = rollback
        if not self.linear_layers:
            rollback = "crop"
        elif rollback == "auto":
            rollback = "replay" if self.kernels is not None else "rerun"
        elif rollback == "replay" and self.kernels is None:
            raise ValueError(
                f"DSpark: rollback='replay' needs a known linear-attention recurrence; {type(target).__name__} has "
                f"none of {[chunk for chunk, _ in DELTA_RULE_KERNELS]}. Use rollback='rerun'."
            )
        self.rollback = rollback
        self._fall_back_to_rerun = rollback == "replay" and requested == "auto"  # if the kernel's keywords are unknown
        self.input_device = _input_device(target)
        self.slot_mask: torch.Tensor | None = None  # [B, C] 1 where an attention slot holds a committed token
        self.logits_to_keep = "logits_to_keep" in inspect.signature(target.forward).parameters
        self._verify: dict = {}  # what the last verify forward left for `commit`

    @property
    def linear_layers(self) -> list:
        return [layer for layer in self.cache.layers if isinstance(layer, LinearAttentionCacheLayerMixin)]

    @property
    def attention_layers(self) -> list:
        return [layer for layer in self.cache.layers if not isinstance(layer, LinearAttentionCacheLayerMixin)]

    @property
    def uniform_commit(self) -> bool:
        """Whether every row must commit the same number of tokens per round (no holes in the cache)."""
        return self.rollback == "rerun" or any(getattr(layer, "is_sliding", False) for layer in self.cache.layers)

    def forward(
        self,
        input_ids: torch.Tensor,  # [B, T]
        position_ids: torch.Tensor,  # [B, T]
        num_logits: int,
        slot_valid: torch.Tensor | None = None,  # [B, T] 1 for real tokens (prompt padding: 0)
        verify: bool = False,
    ) -> torch.Tensor:
        """One target forward that appends T tokens to the cache; returns the last `num_logits` logits [B, n, V] on
        the device of `input_ids` (as `generate`, which accepts inputs on the CPU for a target elsewhere).
        `verify=True` prepares the rollback of these tokens (`commit`)."""
        caller_device = input_ids.device
        input_ids, position_ids = input_ids.to(self.input_device), position_ids.to(self.input_device)
        slot_valid = torch.ones_like(input_ids) if slot_valid is None else slot_valid.to(self.input_device).long()
        self.slot_mask = slot_valid if self.slot_mask is None else torch.cat([self.slot_mask, slot_valid], dim=-1)
        kwargs = {"logits_to_keep": num_logits} if self.logits_to_keep else {}
        attention_mask = None if bool(self.slot_mask.all()) else self.slot_mask
        with self._prepare_rollback(input_ids, position_ids, verify):
            outputs = self.target(
                input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                past_key_values=self.cache, use_cache=True, **kwargs,
            )
        return outputs.logits[:, -num_logits:].to(caller_device)

    def start_recording(self) -> None:
        """After the prefill: keep full conv windows until `commit` (so they can be re-sliced per row)."""
        self.cache.activate_past_recording()

    @contextmanager
    def _prepare_rollback(self, input_ids, position_ids, verify: bool):
        self._verify = {"input_ids": input_ids, "position_ids": position_ids, "calls": [], "unreplayable": set()}
        verify = verify and input_ids.shape[1] > 1  # a 1-token verify commits its token: nothing to roll back
        if self.rollback == "rerun" and verify:
            self._verify["snapshot"] = [
                ({i: s.clone() for i, s in layer.conv_states.items() if s is not None},
                 {i: s.clone() for i, s in layer.recurrent_states.items() if s is not None})
                for layer in self.linear_layers
            ]
            yield
        elif self.rollback == "replay":  # every forward: the prefill checks the kernel's keywords
            self._verify["replaying"] = verify
            with _routed_kernel(*self.kernels[:2], self._route_chunk_call):
                yield
            self._check_replayable(verify)
        else:
            yield

    def _route_chunk_call(self, chunk, query, key, value, g, beta, *args, initial_state=None, **kwargs):
        """Runs in place of the model's chunked delta-rule kernel during this cache's forwards (in this context):
        notes the arguments replay does not know, and during a verify runs the token-by-token recurrence instead,
        recording the pre-verify state and the inputs for `_replay`."""
        unreplayable = [f"{len(args)} more positional arguments"] if args else []
        unreplayable += [name for name in kwargs if name not in REPLAYABLE_KEYWORDS]
        if kwargs.get("cu_seqlens") is not None:
            unreplayable.append("cu_seqlens (packed sequences)")
        self._verify["unreplayable"].update(unreplayable)
        if unreplayable or initial_state is None or not self._verify["replaying"]:
            return chunk(query, key, value, g, beta, *args, initial_state=initial_state, **kwargs)
        module, _, recurrent_name = self.kernels
        kwargs = _recurrent_kwargs(kwargs)
        self._verify["calls"].append(
            _DeltaRuleCall(initial_state, initial_state.clone(), (query, key, value, g, beta), kwargs)
        )
        return getattr(module, recurrent_name)(query, key, value, g=g, beta=beta, initial_state=initial_state, **kwargs)

    def _check_replayable(self, verify: bool) -> None:
        """After a forward in replay mode: fall back to rerun (rollback="auto", at the prefill) or raise if the
        kernel was called with arguments replay does not know, or if a verify bypassed the kernel."""
        unreplayable = sorted(self._verify["unreplayable"])
        if unreplayable and self._fall_back_to_rerun and not verify:
            self.rollback = "rerun"  # before any verify: rerun restores the state with the model's own kernels
        elif unreplayable:
            raise ValueError(
                f"DSpark: replay cannot restore the recurrent state of {type(self.target).__name__}: its "
                f"`{self.kernels[1]}` is called with {unreplayable}, whose effect replay does not know (it masks "
                "rejected tokens with g = 0, beta = 0, an identity step in transformers' convention; known keywords: "
                f"{sorted(REPLAYABLE_KEYWORDS)}). Pass rollback='rerun'."
            )
        elif verify and len(self._verify["calls"]) != len(self.linear_layers):
            raise RuntimeError(
                f"DSpark: {len(self._verify['calls'])} of the target's {len(self.linear_layers)} linear-attention "
                f"layers called `{self.kernels[1]}` during the verify, so their state cannot be replayed (was the "
                "kernel replaced, or the model compiled?). Pass rollback='rerun'."
            )

    def commit(self, num_committed: torch.Tensor) -> None:
        """Keep the first `num_committed[b]` tokens of the last verify forward in row b; forget the rest."""
        verify_length = self._verify["input_ids"].shape[1]
        if self.rollback == "rerun" and "snapshot" in self._verify:
            self._rerun(int(num_committed[0]), verify_length)
        else:
            dropped = verify_length - num_committed  # [B]
            self._drop_attention_slots(dropped, verify_length)
            for layer in self.linear_layers:
                _reslice_conv_windows(layer, dropped)
            if self._verify["calls"] and bool((dropped > 0).any()):
                self._replay(num_committed)
        self._verify = {}  # drop the recorded inputs / snapshots

    def _drop_attention_slots(self, dropped: torch.Tensor, verify_length: int) -> None:
        common = int(dropped.min())
        if common:
            for layer in self.attention_layers:
                layer.crop(-common)
            self.slot_mask = self.slot_mask[:, :-common]
        start = self.slot_mask.shape[1] - (verify_length - common)  # the verify slots that remain
        offsets = torch.arange(verify_length - common, device=dropped.device)
        holes = offsets[None, :] >= (verify_length - dropped)[:, None]  # [B, remaining verify slots]
        self.slot_mask[:, start:] = self.slot_mask[:, start:].masked_fill(holes.to(self.slot_mask.device), 0)

    def _replay(self, num_committed: torch.Tensor) -> None:
        """Recompute every recorded layer's state over each row's committed tokens (one recurrence call per
        device, all layers concatenated along heads)."""
        module, _, recurrent_name = self.kernels
        recurrent = getattr(module, recurrent_name)
        calls_by_device: dict[torch.device, list[_DeltaRuleCall]] = {}
        for call in self._verify["calls"]:
            calls_by_device.setdefault(call.state.device, []).append(call)
        for device, calls in calls_by_device.items():
            query, key, value, g, beta = (torch.cat(parts, dim=2) for parts in zip(*(c.inputs for c in calls)))
            tokens = torch.arange(query.shape[1], device=device)
            committed = (tokens[None, :] < num_committed.to(device)[:, None]).float()  # [B, T]
            g = g * committed.view(*committed.shape, *[1] * (g.dim() - 2))  # identity step past the commit
            beta = beta * committed.view(*committed.shape, *[1] * (beta.dim() - 2))
            initial_state = torch.cat([c.initial_state for c in calls], dim=1)
            _, state = recurrent(query, key, value, g=g, beta=beta, initial_state=initial_state, **calls[0].kwargs)
            for call, layer_state in zip(calls, state.split([c.state.shape[1] for c in calls], dim=1)):
                call.state.copy_(layer_state)

    def _rerun(self, num_committed: int, verify_length: int) -> None:
        """Restore the pre-verify linear-attention states, drop the verify slots, re-run the committed tokens."""
        for layer, (conv_states, recurrent_states) in zip(self.linear_layers, self._verify.pop("snapshot")):
            layer.conv_states.update(conv_states)
            for index, state in recurrent_states.items():
                layer.recurrent_states[index].copy_(state)
        for layer in self.attention_layers:
            layer.crop(-verify_length)
        self.slot_mask = self.slot_mask[:, :-verify_length]
        input_ids = self._verify["input_ids"][:, :num_committed]
        self.forward(input_ids, self._verify["position_ids"][:, :num_committed], num_logits=1)
        for layer in self.linear_layers:
            _reslice_conv_windows(layer, torch.zeros(input_ids.shape[0], dtype=torch.long, device=input_ids.device))

    def select_rows(self, rows: torch.Tensor) -> None:
        """Keep only `rows` of the batch (finished rows leave)."""
        self.cache.reorder_cache(rows)
        self.slot_mask = self.slot_mask[rows.to(self.slot_mask.device)]


def _recurrent_kwargs(chunk_kwargs: dict) -> dict:
    """The keyword arguments of a chunked delta-rule call, for the token-by-token recurrence of the same
    step (which has no chunking or variable-length packing, and must return the final state)."""
    kwargs = {k: v for k, v in chunk_kwargs.items() if k not in ("chunk_size", "cu_seqlens")}
    return {**kwargs, "output_final_state": True}


def _reslice_conv_windows(layer: LinearAttentionCacheLayerMixin, dropped: torch.Tensor) -> None:
    """Per row, keep the conv window (kernel size) that ends `dropped[b]` columns before the recorded end.
    Equal to `layer.crop(-dropped)` when every row drops the same count."""
    for index, conv in layer.conv_states.items():
        if conv is None:
            continue
        kernel = layer.conv_kernel_size[index]
        start = conv.shape[-1] - kernel - dropped.to(conv.device)  # [B]
        columns = start[:, None] + torch.arange(kernel, device=conv.device)  # [B, kernel]
        layer.conv_states[index] = conv.gather(-1, columns[:, None, :].expand(-1, conv.shape[1], -1))


def _delta_rule_kernels(target: nn.Module):
    """(module, chunk name, recurrent name) of the target's chunked delta-rule kernel, or None."""
    module = sys.modules.get(type(target).__module__)
    for chunk_name, recurrent_name in DELTA_RULE_KERNELS:
        if hasattr(module, chunk_name) and hasattr(module, recurrent_name):
            return module, chunk_name, recurrent_name
    return None


@contextmanager
def _routed_kernel(module, name: str, interceptor):
    """Routes the calls of `module.<name>` (a chunked delta-rule kernel) made in this context to
    `interceptor(kernel, *args, **kwargs)` while the block runs; calls from other contexts reach the kernel.

    The first block installs the wrapper that routes them and the last removes it. Copies of this file (remote code
    is copied once per revision) share one wrapper, found by its mark (also under other `functools.wraps`
    wrappers), and one lock, kept on the modeling module. One that another wrapper was installed over cannot be
    unlinked: it stays, a pass-through.
    """
    lock = vars(module).setdefault("_dspark_install_lock", threading.Lock())  # shared by every copy of this file
    with lock:
        wrapper = inspect.unwrap(getattr(module, name), stop=lambda function: hasattr(function, _KERNEL_ROUTE))
        if not hasattr(wrapper, _KERNEL_ROUTE):
            kernel, route = getattr(module, name), contextvars.ContextVar(f"dspark_{name}", default=None)

            @functools.wraps(kernel)
            def wrapper(*args, **kwargs):
                routed_to = route.get()
                return kernel(*args, **kwargs) if routed_to is None else routed_to(kernel, *args, **kwargs)

            setattr(wrapper, _KERNEL_ROUTE, {"route": route, "users": 0})
            setattr(module, name, wrapper)
        state = getattr(wrapper, _KERNEL_ROUTE)
        state["users"] += 1
    token = state["route"].set(interceptor)
    try:
        yield
    finally:
        state["route"].reset(token)
        with lock:
            state["users"] -= 1
            if not state["users"] and getattr(module, name) is wrapper:
                setattr(module, name, wrapper.__wrapped__)


# ------------------------------------------------------------------------------------------------ generation
def check_pair(target: nn.Module, draft: nn.Module) -> None:
    """Raise if the draft cannot serve this target (before any work)."""
    target_config = target.config.get_text_config(decoder=True)
    draft_config = draft.config
    if target_config.hidden_size != draft_config.hidden_size:
        raise ValueError(
            f"DSpark: the draft has hidden_size {draft_config.hidden_size} but the target "
            f"{type(target).__name__} has {target_config.hidden_size}: the draft reads the target's hidden states and "
            "shares its embedding and LM head. Use the target the draft was trained for."
        )
    if target_config.vocab_size != draft_config.vocab_size:
        raise ValueError(
            f"DSpark: the draft's vocab_size is {draft_config.vocab_size} but the target's is "
            f"{target_config.vocab_size}: draft and target must share one tokenizer. Use the target the draft was "
            "trained for."
        )
    num_layers = len(decoder_layers(target))
    if max(draft_config.target_layer_ids) >= num_layers:
        raise ValueError(
            f"DSpark: the draft reads target layers {draft_config.target_layer_ids} but {type(target).__name__} has "
            f"only {num_layers} layers (the draft was trained on a {draft_config.num_target_layers}-layer target). "
            "Use the target the draft was trained for."
        )
    if target.dtype == torch.float16:
        warnings.warn(
            "DSpark: the target runs in float16; its hidden states (the draft's features) can overflow float16. "
            "Load the target in bfloat16 or float32.",
            stacklevel=3,
        )


@torch.no_grad()
def dspark_generate(
    target: nn.Module,
    draft: nn.Module,
    input_ids: torch.Tensor | None = None,
    attention_mask: torch.Tensor | None = None,
    generation_config=None,
    truncation: str = "full",
    confidence_threshold: float = 0.5,
    sps_curve: SpsCurve | str | os.PathLike | None = None,
    rollback: str = "auto",
    logits_processor: LogitsProcessorList | None = None,
    stopping_criteria: StoppingCriteriaList | None = None,
    prefix_allowed_tokens_fn=None,
    streamer=None,
    tokenizer=None,
    negative_prompt_ids: torch.Tensor | None = None,
    negative_prompt_attention_mask: torch.Tensor | None = None,
    **kwargs,
):
    """Generate with `target`, drafting with the DSpark `draft`: the same tokens as `target.generate` (greedy) or
    the same distribution (sampling, every logits processor of the target applied to p).

    Args:
        target: a transformers decoder-only causal LM (dense, MLA, or hybrid with linear attention, e.g. kimi_linear;
            accelerate `device_map` dispatch included).
        draft: a DSpark draft (`AutoModel.from_pretrained(repo, trust_remote_code=True)`), on one device.
        input_ids, attention_mask: [B, P] prompts, left-padded for B > 1.
        generation_config, **kwargs: as for `target.generate` (max_new_tokens, do_sample, temperature, top_k,
            top_p, eos_token_id, stop_strings (with `tokenizer`), return_dict_in_generate, output_scores, ...).
        truncation: "full" (verify all drafts), "threshold" (verify while the survival c_1*...*c_k stays >=
            `confidence_threshold`) or "schedule" (maximise expected tokens/s with the SPS curve `sps_curve`: an
            `SpsCurve`, a JSON path, or None for the profiled default under ~/.cache/dspark).
        rollback: stateful targets only: "auto" (replay when the recurrence is known, else rerun), "replay",
            "rerun" or "none" (a control that is not lossless), see `TargetCache`.

    Returns the sequences [B, P + new] (rows that finished early are padded with pad_token_id, as `generate`
    does), or a `GenerateDecoderOnlyOutput` with `return_dict_in_generate=True` (its `past_key_values` is None:
    the speculative cache cannot continue a generation). Statistics: `draft.last_stats`
    (`DSparkStats`).
    """
    start = time.perf_counter()
    check_pair(target, draft)
    setup = _GenerationSetup.build(
        target, input_ids, attention_mask, generation_config, kwargs, logits_processor, stopping_criteria,
        prefix_allowed_tokens_fn, tokenizer, negative_prompt_ids, negative_prompt_attention_mask,
    )
    if truncation not in TRUNCATION_MODES:
        raise ValueError(f"DSpark: unknown truncation {truncation!r}; choose one of {TRUNCATION_MODES}.")
    if truncation != "full" and draft.confidence_head is None:
        raise ValueError(f"DSpark: truncation={truncation!r} needs the draft's confidence head; use truncation='full'.")
    if isinstance(confidence_threshold, bool) or not isinstance(confidence_threshold, (int, float)) or not (
        0 < confidence_threshold <= 1
    ):
        raise ValueError(
            f"DSpark: confidence_threshold must be in (0, 1] (the survival c_1 * ... * c_k a draft needs to be "
            f"verified), got {confidence_threshold!r}; the default is 0.5."
        )
    if streamer is not None and setup.input_ids.shape[0] > 1:
        raise ValueError("DSpark: streamers take one sequence; stream with batch size 1 or pass streamer=None.")
    prompt_length = int(setup.attention_mask.sum(-1).max())
    if prompt_length > draft.config.trained_context_length:
        warnings.warn(
            f"DSpark: the prompt has {prompt_length} tokens, more than the draft's trained context of "
            f"{draft.config.trained_context_length}: acceptance (not correctness) may drop. Shorten the prompt to "
            "keep the full speed-up.",
            stacklevel=2,
        )
    if truncation == "schedule" and not callable(sps_curve):  # a path or None; curves may come from another module copy
        sps_curve = load_sps_curve(target, setup.input_ids.shape[0], draft.config.block_size + 1, sps_curve, rollback)

    decoder = _DSparkDecoder(target, draft, setup, truncation, confidence_threshold, sps_curve, rollback, streamer)
    output = decoder.run()
    decoder.stats.time_total = time.perf_counter() - start
    draft.last_stats = decoder.stats
    return output


@dataclass
class _GenerationSetup:
    """Everything `target.generate` prepares before its decoding loop, prepared by the target's own helpers."""

    input_ids: torch.Tensor  # [B, P]
    attention_mask: torch.Tensor  # [B, P] long
    generation_config: object
    logits_processor: LogitsProcessorList
    stopping_criteria: StoppingCriteriaList

    @classmethod
    def build(cls, target, input_ids, attention_mask, generation_config, kwargs, logits_processor, stopping_criteria,
              prefix_allowed_tokens_fn, tokenizer, negative_prompt_ids, negative_prompt_attention_mask):
        has_default_max_length = (
            kwargs.get("max_length") is None
            and (generation_config is None or generation_config.max_length is None)
            and target.generation_config.max_length is None
        )
        has_default_min_length = (
            kwargs.get("min_length") is None
            and (generation_config is None or generation_config.min_length is None)
            and target.generation_config.min_length is None
        )
        generation_config, model_kwargs = target._prepare_generation_config(generation_config, **kwargs)
        unsupported = sorted(set(model_kwargs) - {"use_cache"})
        if unsupported:
            raise ValueError(
                f"DSpark: unsupported generate arguments {unsupported}: DSpark's loop does not pass them to the model "
                "or return what they ask for (output_scores and output_logits are supported); remove them."
            )
        _check_generation_config(generation_config)

        input_ids, _, _ = target._prepare_model_inputs(input_ids, generation_config.bos_token_id, {})
        batch_size, prompt_length = input_ids.shape
        target._prepare_special_tokens(generation_config, attention_mask is not None, input_ids.device, batch_size)
        if attention_mask is None:
            attention_mask = target._prepare_attention_mask_for_generation(input_ids, generation_config, {})
        generation_config = target._prepare_generated_length(
            generation_config, has_default_max_length, has_default_min_length, "input_ids", prompt_length, input_ids
        )
        target._validate_generated_length(generation_config, prompt_length, has_default_max_length)
        logits_processor = target._get_logits_processor(
            generation_config=generation_config,
            input_ids_seq_length=prompt_length,
            encoder_input_ids=input_ids,
            prefix_allowed_tokens_fn=prefix_allowed_tokens_fn,
            logits_processor=logits_processor if logits_processor is not None else LogitsProcessorList(),
            device=input_ids.device,
            model_kwargs={"attention_mask": attention_mask},
            negative_prompt_ids=negative_prompt_ids,
            negative_prompt_attention_mask=negative_prompt_attention_mask,
        )
        stopping_criteria = target._get_stopping_criteria(
            generation_config, stopping_criteria if stopping_criteria is not None else StoppingCriteriaList(), tokenizer
        )
        _check_logits_processors(logits_processor)
        return cls(input_ids, attention_mask.long(), generation_config, logits_processor, stopping_criteria)


def _check_generation_config(generation_config) -> None:
    if generation_config.num_beams > 1:
        raise ValueError(
            f"DSpark: beam search (num_beams={generation_config.num_beams}) cannot be speculated; use num_beams=1 "
            "(greedy or sampling) with a DSpark assistant, or drop the assistant for beam search."
        )
    if generation_config.num_return_sequences > 1:
        raise ValueError(
            f"DSpark: num_return_sequences={generation_config.num_return_sequences} is not supported; repeat the "
            "prompt in the batch instead (each row samples independently)."
        )
    if generation_config.guidance_scale is not None and generation_config.guidance_scale != 1:
        raise ValueError("DSpark: classifier-free guidance (guidance_scale) is not supported; remove guidance_scale.")


def _check_logits_processors(logits_processor: LogitsProcessorList) -> None:
    """Speculative decoding calls each processor once per verified position, also on drafts that are then rejected:
    right for any processor whose output depends on (input_ids, scores) alone, not for one that keeps state."""
    if any(isinstance(processor, SynthIDTextWatermarkLogitsProcessor) for processor in logits_processor):
        raise ValueError(
            "DSpark: SynthID text watermarking keeps state across its calls (the tokens it was called on), and "
            "speculative decoding also calls it on drafted tokens that are then rejected, so its watermark would "
            "differ from plain generate's. Generate without the assistant to watermark with SynthID."
        )


# The logits processors and stopping criteria of transformers known to act row by row: row b of what they return
# depends only on row b of (input_ids, scores), on the sequence length, and on row b of the attributes named here
# (per-row state, a tensor with one entry per batch row when set). They may be called on any group of rows of equal
# length, with those attributes sliced to the group (`_rows_of`).
ROW_WISE = {
    **dict.fromkeys((
        MinLengthLogitsProcessor, MinNewTokensLengthLogitsProcessor, TemperatureLogitsWarper, TopPLogitsWarper,
        TopKLogitsWarper, TopHLogitsWarper, MinPLogitsWarper, TypicalLogitsWarper, EpsilonLogitsWarper,
        EtaLogitsWarper, NoRepeatNGramLogitsProcessor, SequenceBiasLogitsProcessor, NoBadWordsLogitsProcessor,
        ForcedBOSTokenLogitsProcessor, ForcedEOSTokenLogitsProcessor, InfNanRemoveLogitsProcessor,
        ExponentialDecayLengthPenalty, LogitNormalization, SuppressTokensAtBeginLogitsProcessor,
        SuppressTokensLogitsProcessor, MaxLengthCriteria, MaxTimeCriteria, StopStringCriteria, EosTokenCriteria,
    ), ()),
    RepetitionPenaltyLogitsProcessor: ("prompt_ignore_length",),  # [B] each prompt's left padding
    EncoderRepetitionPenaltyLogitsProcessor: ("encoder_input_ids",),  # [B, P] the prompts
}


def _rows_of(function, rows: torch.Tensor):
    """A processor or criterion of `ROW_WISE` for the batch rows `rows`: a copy with its per-row attributes sliced
    to them, or `function` itself when it holds no per-row state (every other function is returned unchanged)."""
    names = ROW_WISE.get(type(function), ())
    per_row = {name: getattr(function, name) for name in names if isinstance(getattr(function, name), torch.Tensor)}
    if not per_row:
        return function
    view = copy.copy(function)
    for name, value in per_row.items():
        setattr(view, name, value[rows.to(value.device)])
    return view


class _DSparkDecoder:
    """The DSpark decoding loop over a batch.

    Logits processors and stopping criteria see each row as `generate` shows it at that step. Rows commit different
    numbers of tokens per round, so the rows of equal length are called together, which is exact for the functions
    of `ROW_WISE`. If any other processor or criterion is present (`whole_batch`), every row commits the batch
    minimum (the rows stay step-aligned) and each call sees all B rows at one step. Finished rows stay in the batch,
    fed pad tokens as `generate` feeds them, when a whole-batch call or the returned scores/logits need them;
    otherwise they leave the batch.
    """

    def __init__(self, target, draft, setup: _GenerationSetup, truncation, threshold, sps, rollback, streamer):
        self.target, self.draft, self.setup = target, draft, setup
        self.truncation, self.threshold, self.sps = truncation, threshold, sps
        self.streamer = streamer
        config = setup.generation_config
        self.do_sample = bool(config.do_sample)
        self.temperature = float(config.temperature or 1.0) if self.do_sample else 0.0
        self.processors, self.criteria = setup.logits_processor, setup.stopping_criteria
        # As `generate`: with an EOS criterion, a finished row is padded; without one it keeps generating
        # until every row has stopped.
        self.pad_finished = any(hasattr(criterion, "eos_token_id") for criterion in self.criteria)
        self.want_scores = config.return_dict_in_generate and config.output_scores
        self.want_logits = config.return_dict_in_generate and config.output_logits
        self.whole_batch = not all(type(function) in ROW_WISE for function in [*self.processors, *self.criteria])
        self.keep_finished = self.whole_batch or self.want_scores or self.want_logits
        self.device = setup.input_ids.device
        self.draft_device = next(draft.parameters()).device
        self.devices = _devices(target, draft)
        self.embed_tokens, self.lm_head = target.get_input_embeddings(), target.get_output_embeddings()

        batch_size, self.prompt_length = setup.input_ids.shape
        self.max_new_tokens = config.max_length - self.prompt_length
        pad = config._pad_token_tensor
        self.pad_token_id = 0 if pad is None else int(pad)
        self.sequences = setup.input_ids.new_full((batch_size, config.max_length), self.pad_token_id)
        self.sequences[:, : self.prompt_length] = setup.input_ids
        self.num_generated = [0] * batch_size
        self.stop_step: list[int | None] = [None] * batch_size
        self.num_running = batch_size  # rows whose stopping criteria have not fired yet
        self.last_stop_step: int | None = None  # the step at which the last row stopped
        self.row_scores = [[] for _ in range(batch_size)]
        self.row_logits = [[] for _ in range(batch_size)]

        self.target_cache = TargetCache(target, rollback)
        self.context = draft.new_context_cache()
        self.stats = DSparkStats(rollback=self.target_cache.rollback, truncation=truncation,
                                 position_tried=[0] * draft.config.block_size,
                                 position_accepted=[0] * draft.config.block_size)

    @property
    def step_aligned(self) -> bool:
        """Whether every row commits the same number of tokens per round (the batch minimum)."""
        return self.whole_batch or self.target_cache.uniform_commit

    # ------------------------------------------------------------------ loop
    def run(self):
        if self.streamer is not None:
            self.streamer.put(self.setup.input_ids.cpu())
        with TargetFeatureCapture(self.target, self.draft.config.target_layer_ids, self.draft_device) as capture:
            rows, anchors, positions = self._prefill(capture)
            self.stats.rollback = self.target_cache.rollback  # "auto" may fall back to "rerun" at the prefill
            while len(rows):
                rows, anchors, positions = self._round(capture, rows, anchors, positions)
        if self.streamer is not None:
            self.streamer.end()
        return self._output()

    def _prefill(self, capture: TargetFeatureCapture):
        start = time.perf_counter()
        input_ids, prompt_mask = self.setup.input_ids, self.setup.attention_mask
        positions = (prompt_mask.cumsum(-1) - 1).clamp(min=0)
        logits = self.target_cache.forward(input_ids, positions, num_logits=1, slot_valid=prompt_mask)[:, 0].float()
        self.target_cache.start_recording()
        self.draft.append_context(
            self.context, capture.features(), positions.to(self.draft_device), prompt_mask.bool().to(self.draft_device)
        )
        scores = self.processors(input_ids, logits.clone()) if len(self.processors) else logits
        tokens = self._sample(scores)
        rows = torch.arange(input_ids.shape[0], device=self.device)
        self._emit(rows, tokens[:, None], torch.ones_like(tokens), scores[:, None], logits[:, None])
        self.stats.time_prefill = time.perf_counter() - start
        return self._keep_unfinished(rows, tokens, prompt_mask.sum(-1))

    def _round(self, capture: TargetFeatureCapture, rows, anchors, positions):
        """Draft, verify, commit and emit once for the active `rows` (original batch indices)."""
        stats = self.stats
        budget = torch.tensor([self._budget(row) for row in rows.tolist()], device=self.device)  # tokens left
        max_drafts = (budget - 1).clamp(min=0, max=self.draft.config.block_size)
        padded = torch.tensor([self._padded(row) for row in rows.tolist()], device=self.device)  # [B] fed pads

        start = time.perf_counter()
        draft_tokens = draft_logits = None
        num_drafts = torch.zeros_like(max_drafts)
        block = self._draft(anchors, positions, max_drafts) if int(max_drafts.max()) > 0 else None
        if block is not None:
            confidences = None if block.confidences is None else block.confidences.to(self.device)
            num_drafts = choose_num_drafts(confidences, max_drafts, self.truncation, self.threshold, self.sps)
            draft_tokens = block.tokens.to(self.device).masked_fill(padded[:, None], self.pad_token_id)
            draft_logits = block.logits
        num_verified = int(num_drafts.max())
        _synchronize(self.devices)
        stats.time_draft += time.perf_counter() - start

        start = time.perf_counter()
        verify_ids = anchors[:, None]  # [B, L + 1]: the anchor and the drafts to verify
        if num_verified:
            verify_ids = torch.cat([verify_ids, draft_tokens[:, :num_verified]], dim=-1)
        verify_positions = positions[:, None] + torch.arange(num_verified + 1, device=self.device)
        logits = self.target_cache.forward(verify_ids, verify_positions, num_verified + 1, verify=True).float()
        features = capture.features()  # [B, L + 1, n * H] on the draft's device
        scores = self._process(rows, verify_ids, logits)  # [B, L + 1, V]
        num_accepted, next_tokens = self._verify(scores, verify_ids[:, 1:], draft_logits, num_drafts, num_verified,
                                                 padded)
        stats.time_verify += time.perf_counter() - start
        self._count(num_drafts[~padded], num_accepted[~padded], num_verified)

        index = torch.arange(len(rows), device=self.device)
        emitted = torch.cat([verify_ids[:, 1:], next_tokens[:, None]], dim=-1)  # drafts, then the last slot below
        emitted[index, num_accepted] = next_tokens
        counts = self._emit(rows, emitted, num_accepted + 1, scores, logits)  # [B] tokens each row commits

        start = time.perf_counter()
        self.target_cache.commit(counts)
        _synchronize(self.devices)
        stats.time_rollback += time.perf_counter() - start

        start = time.perf_counter()
        committed = torch.arange(num_verified + 1, device=self.device)[None, :] < counts[:, None]
        self.draft.append_context(
            self.context, features, verify_positions.to(self.draft_device), committed.to(self.draft_device)
        )
        stats.time_draft += time.perf_counter() - start
        return self._keep_unfinished(rows, emitted[index, counts - 1], positions + counts)

    def _draft(self, anchors: torch.Tensor, positions: torch.Tensor, max_drafts: torch.Tensor):
        """Draft one block per row (tokens, the logits q they were drawn from, confidences), or None when the
        first confidences rule out every draft (`rules_out_every_draft`): such a round skips the block's logits,
        the LM head over every position, which is most of a draft's cost when the target is small."""
        draft_anchors = anchors.to(self.draft_device)
        draft_positions = positions.to(self.draft_device)
        embeds, block_positions = self.draft.block_inputs(draft_anchors, draft_positions, self.embed_tokens)
        hidden = self.draft(embeds.to(self.draft_device), block_positions, self.context)
        seeds = _random_seeds(len(anchors), self.draft_device) if self.do_sample else None  # drawn in every round
        if self.truncation != "full":
            first_confidences = self.draft.first_confidences(hidden, draft_anchors).to(self.device)
            if rules_out_every_draft(first_confidences, max_drafts, self.truncation, self.threshold, self.sps):
                self.stats.rounds_without_draft += 1
                return None
        return self.draft.draft_block(hidden, draft_anchors, self.lm_head, self.temperature, seeds)

    def _process(self, rows: torch.Tensor, verify_ids: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        """The target's logits processors applied position by position, each row's sequence extended by the
        verified drafts before that position (as `generate` would have seen it)."""
        if not len(self.processors):
            return logits
        scores = logits.clone()
        for index, length in self._groups(rows):
            processors = LogitsProcessorList(_rows_of(processor, rows[index]) for processor in self.processors)
            sequences = torch.cat([self.sequences[rows[index], :length], verify_ids[index, 1:]], dim=-1)
            for k in range(verify_ids.shape[1]):
                scores[index, k] = processors(sequences[:, : length + k], scores[index, k])
        return scores

    def _groups(self, rows: torch.Tensor) -> list[tuple[torch.Tensor, int]]:
        """(batch positions, sequence length) per length among `rows`: processors and criteria are called once per
        group. Step-aligned rows form one group, the whole batch while finished rows stay in it."""
        lengths = torch.tensor([self.prompt_length + self.num_generated[row] for row in rows.tolist()])
        return [((lengths == length).nonzero()[:, 0].to(self.device), length) for length in lengths.unique().tolist()]

    def _verify(self, scores, drafts, draft_logits, num_drafts, num_verified, padded):
        """(accepted drafts [B], next token [B]) by DSPARK.md step 8. `padded` rows accept every verified pad and
        take a pad next; step-aligned rows all commit the minimum of the other rows."""
        if num_verified == 0:
            next_tokens = self._sample(scores[:, 0])
            return torch.zeros_like(next_tokens), next_tokens.masked_fill(padded, self.pad_token_id)
        q_logits = draft_logits[:, :num_verified].to(self.device) if self.do_sample else None
        seeds = _random_seeds(len(drafts), self.device) if self.do_sample else None
        num_accepted, next_tokens = verify_block(scores, drafts, q_logits, num_drafts, seeds)
        num_accepted = num_accepted.masked_fill(padded, num_verified)
        next_tokens = next_tokens.masked_fill(padded, self.pad_token_id)
        if self.step_aligned:
            common = num_accepted[~padded].min()  # a step-aligned batch always has an unfinished row
            rows = torch.arange(len(drafts), device=drafts.device)
            last_agreed = drafts[rows, common.clamp(max=num_verified - 1)]  # the target's own token there
            next_tokens = torch.where(num_accepted > common, last_agreed, next_tokens)
            num_accepted = torch.full_like(num_accepted, int(common))
        return num_accepted, next_tokens

    def _sample(self, scores: torch.Tensor) -> torch.Tensor:
        """The next token [B] from processed scores [B, V], as plain decoding picks it."""
        if self.do_sample:
            return torch.multinomial(torch.softmax(scores, dim=-1), num_samples=1)[:, 0]
        return scores.argmax(dim=-1)

    def _count(self, num_drafts: torch.Tensor, num_accepted: torch.Tensor, num_verified: int) -> None:
        stats = self.stats
        stats.rounds += 1
        stats.row_rounds += len(num_accepted)
        stats.committed_tokens += int((num_accepted + 1).sum())
        stats.verify_lengths.append(num_verified)
        for k in range(num_verified):
            stats.position_tried[k] += int(((num_drafts > k) & (num_accepted >= k)).sum())
            stats.position_accepted[k] += int((num_accepted > k).sum())

    # ------------------------------------------------------------------ rows
    def _emit(self, rows, tokens, counts, scores, logits) -> torch.Tensor:
        """Append tokens[i, :counts[i]] to row rows[i] one step at a time (tokens [R, C], scores and logits
        [R, C, V]), calling the stopping criteria after each step as `generate` does. Returns the tokens each row
        commits [R]: `counts`, except that a row which stops and stays in the batch (fed pads from then on) ends its
        round at that step, and so does every row when step-aligned."""
        row_ids, token_ids, counts = rows.tolist(), tokens.tolist(), counts.tolist()
        taken = [0] * len(row_ids)
        for step in range(max(counts)):
            active = [i for i, row in enumerate(row_ids) if step < counts[i] and not self._finished(row)]
            if not active:
                break
            for i in active:
                row = row_ids[i]
                if not self._padded(row):
                    self.stats.generated_tokens += 1
                self.sequences[row, self.prompt_length + self.num_generated[row]] = token_ids[i][step]
                self.num_generated[row] += 1
                taken[i] += 1
                if self.want_scores:
                    self.row_scores[row].append(scores[i, step])
                if self.want_logits:
                    self.row_logits[row].append(logits[i, step])
            stopped = []
            active_positions = torch.tensor(active, device=self.device)
            for index, length in self._groups(rows[active_positions]):
                group = active_positions[index]
                criteria = StoppingCriteriaList(_rows_of(criterion, rows[group]) for criterion in self.criteria)
                done = criteria(self.sequences[rows[group], :length], scores[group, step]).tolist()
                stopped += [i for i, stop in zip(group.tolist(), done) if stop and self.stop_step[row_ids[i]] is None]
            for i in stopped:
                self.stop_step[row_ids[i]] = self.num_generated[row_ids[i]]
            self.num_running -= len(stopped)
            if stopped and self.num_running == 0:
                self.last_stop_step = max(self.stop_step)
            if stopped and self.keep_finished and self.pad_finished:
                ends = range(len(counts)) if self.step_aligned else stopped
                for i in ends:
                    counts[i] = min(counts[i], step + 1)
        if self.streamer is not None:
            self.streamer.put(tokens[:1, : taken[0]].cpu())  # streaming takes batch size 1
        return torch.tensor(counts, device=self.device)

    def _budget(self, row: int) -> int:
        """Tokens row may still emit: up to max_new_tokens or, once every row has stopped, up to the last stop
        (rows that go on after their own stop: without an EOS criterion, or padded while they stay in the batch)."""
        limit = self.max_new_tokens if self.last_stop_step is None else self.last_stop_step
        return limit - self.num_generated[row]

    def _padded(self, row: int) -> bool:
        """Whether the row has stopped and takes pad tokens from now on (as `generate` pads a finished row)."""
        return self.pad_finished and self.stop_step[row] is not None

    def _finished(self, row: int) -> bool:
        return self._budget(row) <= 0 or (self._padded(row) and not self.keep_finished)

    def _keep_unfinished(self, rows, anchors, positions):
        keep = torch.tensor([not self._finished(row) for row in rows.tolist()], device=self.device)
        if bool(keep.all()):
            return rows, anchors, positions
        index = keep.nonzero()[:, 0]
        self.target_cache.select_rows(index)
        self.context.select_rows(index.to(self.draft_device))
        return rows[index], anchors[index], positions[index]

    def _output(self):
        config = self.setup.generation_config
        length = self.prompt_length + self.last_stop_step  # every row stops, at max_length at the latest
        sequences = self.sequences[:, :length]
        if not config.return_dict_in_generate:
            return sequences
        return GenerateDecoderOnlyOutput(
            sequences=sequences,
            scores=_steps(self.row_scores, self.last_stop_step) if self.want_scores else None,
            logits=_steps(self.row_logits, self.last_stop_step) if self.want_logits else None,
            past_key_values=None,  # rows may leave the cache as they finish, and holes stay in it: not reusable
        )


def _steps(per_row: list[list[torch.Tensor]], num_steps: int) -> tuple[torch.Tensor, ...]:
    """Per-row lists of at least num_steps [V] tensors -> a tuple of num_steps [B, V] tensors."""
    return tuple(torch.stack([values[step] for values in per_row]) for step in range(num_steps))


def _random_seeds(batch_size: int, device: torch.device) -> torch.Tensor:
    """[B] int64 seeds for the counter-based samplers, drawn from torch's global RNG (so torch.manual_seed
    makes a run reproducible)."""
    return torch.randint(0, 2**31 - 1, (batch_size,)).to(device)


def execution_device(module: nn.Module) -> torch.device:
    """Where a module computes: accelerate's execution device if it was dispatched (its weights may be offloaded to
    the meta device), else the device of its weights."""
    device = getattr(getattr(module, "_hf_hook", None), "execution_device", None)
    return torch.device(device) if device is not None else next(module.parameters()).device


def _input_device(target: nn.Module) -> torch.device:
    """Where a target's input ids go: its embedding's execution device."""
    return execution_device(target.get_input_embeddings())


def _devices(*models: nn.Module) -> set[torch.device]:
    """Every device holding a parameter or buffer of `models` (a target split by accelerate spans several)."""
    return {tensor.device for model in models for tensor in [*model.parameters(), *model.buffers()]}


def _synchronize(devices: set[torch.device]) -> None:
    """Wait for the queued work of every CUDA device in `devices`, so that wall-clock stage timings are complete."""
    for device in devices:
        if device.type == "cuda":
            torch.cuda.synchronize(device)


# ---------------------------------------------------------------------------------------------------- routing
def install_generate_route() -> None:
    """Make `GenerationMixin.generate(..., assistant_model=<DSpark draft>)` run `dspark_generate`.

    Idempotent (also across copies of this module). Every call without a DSpark assistant, or with
    `custom_generate`, runs the original `generate` unchanged.
    """
    original = GenerationMixin.generate
    if getattr(original, "_dspark_route", False):
        return
    signature = inspect.signature(original)

    @functools.wraps(original)
    def generate(self, *args, **kwargs):
        assistant = kwargs.get("assistant_model")
        if assistant is None and args:
            assistant = signature.bind(self, *args, **kwargs).arguments.get("assistant_model")
        if not is_dspark_draft(assistant) or kwargs.get("custom_generate") is not None:
            return original(self, *args, **kwargs)
        arguments = signature.bind(self, *args, **kwargs).arguments
        extra = arguments.pop("kwargs", {})
        for name in ("self", "assistant_model", "synced_gpus", "custom_generate"):
            arguments.pop(name, None)
        extra.pop("trust_remote_code", None)
        inputs = arguments.pop("inputs", None)
        input_ids = inputs if inputs is not None else extra.pop("input_ids", None)
        return dspark_generate(self, assistant, input_ids, **arguments, **extra)

    generate._dspark_route = True
    GenerationMixin.generate = generate


__all__ = [
    "DSparkStats",
    "SpsCurve",
    "TargetCache",
    "TargetFeatureCapture",
    "choose_num_drafts",
    "dspark_generate",
    "install_generate_route",
    "is_dspark_draft",
    "load_sps_curve",
    "profile_sps",
]
