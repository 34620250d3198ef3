"""DSpark draft model configuration.

A DSpark draft is a small bidirectional transformer (a DFlash backbone) that drafts a block of
`block_size` tokens in one forward pass from hidden states of the target model, plus a low-rank Markov
head (each draft token depends on the previous one) and a confidence head (predicts which drafts survive
verification).

Two engines read this configuration besides transformers:
- SGLang reads the DSpark keys at the top level (several of them only there);
- SpecForge reads them from a nested `dflash_config` object.
The config therefore accepts the DSpark keys from either place and always writes both.
"""

import inspect
import math
from collections.abc import Callable
from typing import NamedTuple

import torch
from transformers import PreTrainedConfig
from transformers.activations import ACT2FN

# DSpark keys that live both at the top level and inside `dflash_config`, with their defaults
# (the Kimi K3 checkpoint's values).
DSPARK_KEYS = {
    "block_size": 7,
    "target_layer_ids": [7, 23, 51, 67, 83],
    "num_target_layers": 93,
    "mask_token_id": 163824,
    "markov_rank": 256,
    "markov_head_type": "vanilla",
    "enable_confidence_head": True,
    "confidence_head_with_markov": True,
}

SUPPORTED_MARKOV_HEAD_TYPES = ("vanilla",)
KNOWN_MARKOV_HEAD_TYPES = ("vanilla", "gated", "rnn")


class ValueType(NamedTuple):
    """A JSON type a config value must have: how errors describe it, and the test (bool is never a number)."""

    description: str
    accepts: Callable[[object], bool]

    def or_null(self) -> "ValueType":
        return ValueType(f"{self.description} or null", lambda value: value is None or self.accepts(value))


def _is_integer(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _is_list_of(value, accepts: Callable[[object], bool]) -> bool:
    return isinstance(value, (list, tuple)) and all(accepts(item) for item in value)


def _is_torch_dtype(value) -> bool:
    named = isinstance(value, str) and isinstance(getattr(torch, value, None), torch.dtype)
    return named or isinstance(value, torch.dtype)


def _json_type(value) -> str:
    """How an error names the type a value has: `null`, `str`, `a list of float`."""
    if value is None:
        return "null"
    if isinstance(value, (list, tuple)) and value:
        return "a list of " + " / ".join(sorted({_json_type(item) for item in value}))
    return type(value).__name__


INTEGER = ValueType("an integer", _is_integer)
NUMBER = ValueType("a finite number", _is_number)
BOOLEAN = ValueType("true or false", lambda value: isinstance(value, bool))
STRING = ValueType("a string", lambda value: isinstance(value, str))
INTEGER_LIST = ValueType("a list of integers", lambda value: _is_list_of(value, _is_integer))
NUMBER_LIST = ValueType("a list of finite numbers", lambda value: _is_list_of(value, _is_number))
TORCH_DTYPE = ValueType("a torch dtype name such as 'bfloat16'", _is_torch_dtype)
INTEGER_OR_INTEGER_LIST = ValueType("an integer or a list of integers",
                                    lambda value: _is_integer(value) or INTEGER_LIST.accepts(value))

# The type of every value the draft reads, checked before any rule on the values themselves.
VALUE_TYPES = {
    **dict.fromkeys(
        ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
         "num_key_value_heads", "head_dim", "max_position_embeddings", "trained_context_length", "block_size",
         "num_target_layers", "mask_token_id", "markov_rank"),
        INTEGER,
    ),
    **dict.fromkeys(("rms_norm_eps", "rope_theta", "attention_dropout", "initializer_range"), NUMBER),
    **dict.fromkeys(("hidden_act", "markov_head_type"), STRING),
    **dict.fromkeys(("attention_bias", "enable_confidence_head", "confidence_head_with_markov"), BOOLEAN),
    "target_layer_ids": INTEGER_LIST,
    "confidence_temperatures": NUMBER_LIST.or_null(),
    "bos_token_id": INTEGER.or_null(),
    "pad_token_id": INTEGER.or_null(),
    "eos_token_id": INTEGER_OR_INTEGER_LIST.or_null(),
    "dtype": TORCH_DTYPE.or_null(),
}
POSITIVE_INTEGER_KEYS = (
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "num_target_layers", "max_position_embeddings", "trained_context_length",
)  # fmt: skip


class DSparkConfig(PreTrainedConfig):
    r"""
    Configuration of a [`DSparkDraftModel`]. Defaults reproduce the Kimi K3 draft (2,249,289,601 parameters).
    Every value's JSON type is checked first (`VALUE_TYPES`; true / false is not an integer), then the rules on
    the values; an error names the key, the value and what it must be.

    Args:
        vocab_size: size of the target's vocabulary (rows of the Markov tables).
        hidden_size: width of the draft; must equal the target's hidden size.
        intermediate_size: SwiGLU inner width.
        num_hidden_layers: number of draft decoder layers.
        num_attention_heads / num_key_value_heads / head_dim: grouped-query attention geometry.
        hidden_act: MLP activation.
        rms_norm_eps: epsilon of every RMSNorm (also q_norm / k_norm).
        rope_theta: RoPE base.
        max_position_embeddings: largest position the engines prepare RoPE tables for.
        trained_context_length: context length the draft was trained on; longer prompts get a warning.
        block_size: tokens per draft block, `[anchor, mask x (block_size - 1)]`; the block yields
            `block_size` draft tokens and the target verifies `block_size + 1` positions.
        target_layer_ids: 0-based target layers whose outputs (pre-norm residual stream) are concatenated
            as the draft's context features, in this order.
        num_target_layers: number of layers of the target the draft was trained against.
        mask_token_id: id of the mask token that fills the block after the anchor.
        markov_rank: rank r of the Markov head (`0` disables it: a plain DFlash draft).
        markov_head_type: `"vanilla"` (bias = w2(w1[prev])).
        enable_confidence_head: build the confidence head.
        confidence_head_with_markov: feed `w1[prev]` to the confidence head besides the hidden row.
        confidence_temperatures: one temperature per block position (Sequential Temperature Scaling),
            `None` means all ones.
    """

    model_type = "dspark"
    keys_to_ignore_at_inference = ["past_key_values"]

    def __init__(
        self,
        vocab_size: int = 163840,
        hidden_size: int = 7168,
        intermediate_size: int = 14336,
        num_hidden_layers: int = 5,
        num_attention_heads: int = 64,
        num_key_value_heads: int = 16,
        head_dim: int = 64,
        hidden_act: str = "silu",
        rms_norm_eps: float = 1e-6,
        rope_theta: float = 10000.0,
        max_position_embeddings: int = 131072,
        trained_context_length: int = 4096,
        attention_bias: bool = False,
        attention_dropout: float = 0.0,
        initializer_range: float = 0.02,
        confidence_temperatures: list[float] | None = None,
        dflash_config: dict | None = None,
        bos_token_id: int | None = 163584,
        eos_token_id: int | None = 163586,
        pad_token_id: int | None = 163839,
        **kwargs,
    ):
        # DSpark keys: top level (SGLang) wins over nested (SpecForge); a disagreement is an error.
        if dflash_config is not None and not isinstance(dflash_config, dict):
            _fail("dflash_config", dflash_config, f"must be an object, not {_json_type(dflash_config)}.")
        nested = dflash_config or {}
        for key, default in DSPARK_KEYS.items():
            if key in kwargs and key in nested and nested[key] != kwargs[key]:
                raise ValueError(
                    f"DSparkConfig: `{key}` is {kwargs[key]!r} at the top level but {nested[key]!r} in "
                    "`dflash_config`. SGLang reads the top level and SpecForge the nested value: make them equal."
                )
            setattr(self, key, kwargs.pop(key) if key in kwargs else nested.get(key, default))

        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.num_key_value_heads = num_key_value_heads
        self.head_dim = head_dim
        self.hidden_act = hidden_act
        self.rms_norm_eps = rms_norm_eps
        self.rope_theta = rope_theta
        self.max_position_embeddings = max_position_embeddings
        self.trained_context_length = trained_context_length
        self.attention_bias = attention_bias
        self.attention_dropout = attention_dropout
        self.initializer_range = initializer_range
        self.confidence_temperatures = confidence_temperatures
        kwargs.pop("is_causal", None)  # the draft is bidirectional; SGLang would obey a stray `is_causal`
        token_ids = {"bos_token_id": bos_token_id, "eos_token_id": eos_token_id, "pad_token_id": pad_token_id}
        _validate_types({**vars(self), **token_ids, "dtype": kwargs.get("dtype", kwargs.get("torch_dtype"))})
        super().__init__(**token_ids, **kwargs)
        self.target_layer_ids = list(self.target_layer_ids)
        if self.confidence_temperatures is not None:
            self.confidence_temperatures = [float(t) for t in self.confidence_temperatures]
        self._validate_dspark()

    @classmethod
    def from_dict(cls, config_dict: dict, **kwargs) -> "DSparkConfig":
        """`PreTrainedConfig.from_dict`, but values given at load time (`from_pretrained(path, block_size=8)`) are
        checked like config.json's: transformers would set them on the built config, past every check. Such a value
        replaces the file's in both copies of a DSpark key; `dflash_config={...}` overrides the keys it holds."""
        config_dict = dict(config_dict)
        for key in [key for key in kwargs if key in CONFIG_KEYS]:
            value = kwargs.pop(key)
            nested_override = key == "dflash_config" and isinstance(value, dict)  # its DSpark keys, as in a file
            overrides = {k: v for k, v in value.items() if k in DSPARK_KEYS} if nested_override else {key: value}
            config_dict.update(overrides)
            if isinstance(config_dict.get("dflash_config"), dict):
                nested = {k: v for k, v in overrides.items() if k in DSPARK_KEYS}
                config_dict["dflash_config"] = {**config_dict["dflash_config"], **nested}
        return super().from_dict(config_dict, **kwargs)

    @property
    def dflash_config(self) -> dict:
        """The nested copy of the DSpark keys that SpecForge reads."""
        return {key: getattr(self, key) for key in DSPARK_KEYS}

    @property
    def has_markov_head(self) -> bool:
        return self.markov_rank > 0

    @property
    def confidence_input_size(self) -> int:
        return self.hidden_size + (self.markov_rank if self.confidence_head_with_markov else 0)

    def to_dict(self) -> dict:
        output = super().to_dict()
        output["dflash_config"] = self.dflash_config
        output.pop("is_causal", None)
        return output

    def _validate_dspark(self) -> None:
        def fail(key: str, rule: str) -> None:
            _fail(key, getattr(self, key), rule)

        for key in POSITIVE_INTEGER_KEYS:
            if getattr(self, key) <= 0:
                fail(key, "must be a positive integer.")
        if self.num_attention_heads % self.num_key_value_heads:
            fail("num_attention_heads", f"must be divisible by num_key_value_heads ({self.num_key_value_heads}).")
        if self.head_dim % 2:
            fail("head_dim", "must be even (RoPE rotates pairs of dimensions).")
        if self.block_size < 2:
            fail("block_size", "must be at least 2 (the anchor plus at least one mask token).")
        ids = self.target_layer_ids
        if not ids:
            fail("target_layer_ids", "must name at least one target layer.")
        if any(not 0 <= i < self.num_target_layers for i in ids):
            fail("target_layer_ids", f"every id must be a 0-based layer index in [0, {self.num_target_layers}).")
        if any(a >= b for a, b in zip(ids, ids[1:])):
            fail("target_layer_ids", "must be strictly increasing (sorted, no duplicates).")
        if not 0 <= self.mask_token_id < self.vocab_size:
            fail("mask_token_id", f"must be a token id inside the vocabulary [0, {self.vocab_size}).")
        if self.markov_rank < 0:
            fail("markov_rank", "must be a non-negative integer (0 disables the Markov head).")
        if self.markov_head_type not in KNOWN_MARKOV_HEAD_TYPES:
            fail("markov_head_type", f"unknown type; expected one of {KNOWN_MARKOV_HEAD_TYPES}.")
        if self.markov_head_type not in SUPPORTED_MARKOV_HEAD_TYPES:
            fail("markov_head_type", f"this implementation supports {SUPPORTED_MARKOV_HEAD_TYPES} only.")
        if self.confidence_head_with_markov and not self.enable_confidence_head:
            fail("confidence_head_with_markov", "requires enable_confidence_head = true.")
        if self.confidence_head_with_markov and not self.has_markov_head:
            fail("confidence_head_with_markov", "requires a Markov head (markov_rank > 0); set it to false.")
        temps = self.confidence_temperatures
        if temps is not None and (len(temps) != self.block_size or any(t <= 0 for t in temps)):
            fail("confidence_temperatures", f"must hold {self.block_size} positive values (one per block position).")
        if self.rms_norm_eps <= 0:
            fail("rms_norm_eps", "must be positive.")
        if self.rope_theta <= 0:
            fail("rope_theta", "must be positive.")
        if self.hidden_act not in ACT2FN:
            fail("hidden_act", "unknown activation; use one of transformers' ACT2FN names, e.g. 'silu'.")


# The keys DSparkConfig itself reads (its arguments and the DSpark keys), as opposed to PreTrainedConfig's.
CONFIG_KEYS = frozenset(inspect.signature(DSparkConfig.__init__).parameters) - {"self", "kwargs"} | set(DSPARK_KEYS)


def _fail(key: str, value, rule: str) -> None:
    raise ValueError(f"DSparkConfig: invalid `{key}` = {value!r}: {rule}")


def _validate_types(values: dict) -> None:
    """Checks the type of every key of `VALUE_TYPES` in `values` (the config's values before any use)."""
    for key, value_type in VALUE_TYPES.items():
        if not value_type.accepts(values[key]):
            _fail(key, values[key], f"must be {value_type.description}, not {_json_type(values[key])}. "
                                    "Fix its type in config.json.")


__all__ = ["DSparkConfig"]
