"""DSparkConfig: the Kimi K3 configuration, both key layouts, and validation of bad values."""

import json
import re

import pytest
import torch

import tools
from dspark.configuration_dspark import DSPARK_KEYS, DSparkConfig
from dspark.modeling_dspark import DSparkDraftModel

ROOT_CONFIG = json.loads((tools.REPO_ROOT / "config.json").read_text())

# Hub names and shapes of the Kimi K3 draft (DSPARK.md section 1): H = 7168, r = 256, V = 163840.
H, R, V = 7168, 256, 163840
LAYER_SHAPES = {
    "input_layernorm.weight": (H,),
    "post_attention_layernorm.weight": (H,),
    "self_attn.q_proj.weight": (4096, H),
    "self_attn.k_proj.weight": (1024, H),
    "self_attn.v_proj.weight": (1024, H),
    "self_attn.o_proj.weight": (H, 4096),
    "self_attn.q_norm.weight": (64,),
    "self_attn.k_norm.weight": (64,),
    "mlp.gate_proj.weight": (14336, H),
    "mlp.up_proj.weight": (14336, H),
    "mlp.down_proj.weight": (H, 14336),
}
KIMI_K3_SHAPES = {
    "fc.weight": (H, 5 * H),
    "hidden_norm.weight": (H,),
    "norm.weight": (H,),
    **{f"layers.{i}.{name}": shape for i in range(5) for name, shape in LAYER_SHAPES.items()},
    "markov_head.markov_w1.weight": (V, R),
    "markov_head.markov_w2.weight": (V, R),
    "confidence_head.proj.weight": (1, H + R),
    "confidence_head.proj.bias": (1,),
}


def test_root_config_builds_the_kimi_k3_draft_exactly():
    with torch.device("meta"):
        model = DSparkDraftModel(DSparkConfig(**ROOT_CONFIG))
    shapes = {name: tuple(tensor.shape) for name, tensor in model.state_dict().items()}
    assert shapes == KIMI_K3_SHAPES
    assert len(shapes) == 62
    assert sum(p.numel() for p in model.parameters()) == 2_249_289_601


def test_root_config_has_the_keys_sglang_and_specforge_read():
    assert ROOT_CONFIG["architectures"] == ["DSparkDraftModel"]
    assert ROOT_CONFIG["auto_map"] == {
        "AutoConfig": "configuration_dspark.DSparkConfig",
        "AutoModel": "modeling_dspark.DSparkDraftModel",
    }
    assert ROOT_CONFIG["dtype"] == "bfloat16"
    assert "is_causal" not in ROOT_CONFIG
    expected = {
        "markov_rank": 256, "markov_head_type": "vanilla", "confidence_head_with_markov": True,
        "enable_confidence_head": True, "mask_token_id": 163824, "block_size": 7,
        "target_layer_ids": [7, 23, 51, 67, 83], "num_target_layers": 93,
    }
    for key, value in expected.items():
        assert ROOT_CONFIG[key] == value, key
        assert ROOT_CONFIG["dflash_config"][key] == value, key
    backbone = {
        "hidden_size": 7168, "num_hidden_layers": 5, "num_attention_heads": 64, "num_key_value_heads": 16,
        "head_dim": 64, "intermediate_size": 14336, "hidden_act": "silu", "vocab_size": 163840,
        "rope_theta": 10000.0, "bos_token_id": 163584, "eos_token_id": 163586, "pad_token_id": 163839,
    }
    for key, value in backbone.items():
        assert ROOT_CONFIG[key] == value, key
    assert {"rms_norm_eps", "max_position_embeddings"} <= set(ROOT_CONFIG)


def tiny_kwargs(**overrides):
    kwargs = dict(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, target_layer_ids=[1, 3], num_target_layers=4, mask_token_id=63,
        markov_rank=8, block_size=4, bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )
    kwargs.update(overrides)
    return kwargs


@pytest.mark.parametrize("layout", ["top_level", "nested"])
def test_reads_either_layout_and_writes_both(layout, tmp_path):
    dspark_values = {"block_size": 5, "target_layer_ids": [0, 2], "num_target_layers": 3, "mask_token_id": 60,
                     "markov_rank": 4, "markov_head_type": "vanilla", "enable_confidence_head": True,
                     "confidence_head_with_markov": False}
    base = {k: v for k, v in tiny_kwargs().items() if k not in DSPARK_KEYS}
    layout_kwargs = dspark_values if layout == "top_level" else {"dflash_config": dspark_values}
    config = DSparkConfig(**base, **layout_kwargs)
    config.save_pretrained(tmp_path)
    written = json.loads((tmp_path / "config.json").read_text())
    for key, value in dspark_values.items():
        assert written[key] == value and written["dflash_config"][key] == value
    assert DSparkConfig.from_pretrained(tmp_path).to_dict() == config.to_dict()


def test_values_given_at_load_time_are_checked_and_set_both_copies(tmp_path):
    """`from_pretrained(path, key=value)`: transformers would set such values after every check."""
    DSparkConfig(**tiny_kwargs()).save_pretrained(tmp_path)
    loaded = DSparkConfig.from_pretrained(tmp_path, block_size=6, confidence_temperatures=None)
    assert loaded.block_size == loaded.dflash_config["block_size"] == 6
    nested = DSparkConfig.from_pretrained(tmp_path, dflash_config={"markov_rank": 8})
    assert nested.markov_rank == nested.to_dict()["dflash_config"]["markov_rank"] == 8
    for override, message in [({"block_size": 1}, "`block_size` = 1: must be at least 2"),
                              ({"markov_rank": 0}, "requires a Markov head"),
                              ({"mask_token_id": 64}, "`mask_token_id` = 64: must be a token id inside"),
                              ({"block_size": "7"}, "`block_size` = '7': must be an integer"),
                              ({"dflash_config": {"target_layer_ids": [3, 1]}}, "must be strictly increasing")]:
        with pytest.raises(ValueError, match=message):
            DSparkConfig.from_pretrained(tmp_path, **override)


def test_top_level_and_nested_values_must_agree():
    with pytest.raises(ValueError, match="`block_size` is 4 at the top level but 6 in `dflash_config`"):
        DSparkConfig(**tiny_kwargs(), dflash_config={"block_size": 6})


def test_is_causal_is_never_written(tmp_path):
    DSparkConfig(**tiny_kwargs(), is_causal=True).save_pretrained(tmp_path)
    assert "is_causal" not in json.loads((tmp_path / "config.json").read_text())


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"num_attention_heads": 5}, "`num_attention_heads` = 5: must be divisible by num_key_value_heads"),
        ({"target_layer_ids": [1, 4]},
         "`target_layer_ids` = \\[1, 4\\]: every id must be a 0-based layer index in \\[0, 4\\)"),
        ({"target_layer_ids": [-1, 2]}, "every id must be a 0-based layer index"),
        ({"target_layer_ids": [2, 1]}, "must be strictly increasing"),
        ({"target_layer_ids": [1, 1]}, "must be strictly increasing"),
        ({"target_layer_ids": []}, "must name at least one target layer"),
        ({"mask_token_id": 64}, "`mask_token_id` = 64: must be a token id inside the vocabulary \\[0, 64\\)"),
        ({"block_size": 1}, "`block_size` = 1: must be at least 2"),
        ({"markov_rank": -1}, "`markov_rank` = -1: must be a non-negative integer"),
        ({"markov_head_type": "lstm"}, "`markov_head_type` = 'lstm': unknown type"),
        ({"markov_head_type": "gated"}, "supports \\('vanilla',\\) only"),
        ({"markov_rank": 0}, "`confidence_head_with_markov` = True: requires a Markov head"),
        ({"enable_confidence_head": False}, "`confidence_head_with_markov` = True: requires enable_confidence_head"),
        ({"confidence_temperatures": [1.0, 1.0]}, "`confidence_temperatures`.*must hold 4 positive values"),
        ({"confidence_temperatures": [1.0, 1.0, 0.0, 1.0]}, "must hold 4 positive values"),
        ({"hidden_size": 0}, "`hidden_size` = 0: must be a positive integer"),
        ({"head_dim": 7}, "`head_dim` = 7: must be even"),
        ({"rms_norm_eps": 0.0}, "`rms_norm_eps` = 0.0: must be positive"),
        ({"trained_context_length": 0}, "`trained_context_length` = 0: must be a positive integer"),
        ({"hidden_act": "bogus"}, "`hidden_act` = 'bogus': unknown activation; use one of transformers' ACT2FN"),
    ],
)
def test_bad_values_name_the_key_and_the_rule(overrides, message):
    with pytest.raises(ValueError, match=message):
        DSparkConfig(**tiny_kwargs(**overrides))


def test_a_plain_dflash_draft_is_valid():
    config = DSparkConfig(**tiny_kwargs(markov_rank=0, enable_confidence_head=False, confidence_head_with_markov=False))
    model = DSparkDraftModel(config)
    assert model.markov_head is None and model.confidence_head is None


# (key, a value of the wrong type, the type the error must ask for); bool is never accepted as a number.
WRONG_TYPES = [
    ("block_size", "7", "an integer"),
    ("block_size", 7.0, "an integer"),
    ("block_size", None, "an integer"),
    ("block_size", True, "an integer"),
    ("mask_token_id", "3", "an integer"),
    ("markov_rank", 8.0, "an integer"),
    ("hidden_size", True, "an integer"),
    ("trained_context_length", "4096", "an integer"),
    ("max_position_embeddings", 1.5, "an integer"),
    ("rms_norm_eps", "1e-5", "a finite number"),
    ("rms_norm_eps", float("nan"), "a finite number"),
    ("rope_theta", "10000", "a finite number"),
    ("target_layer_ids", "1,2,4", "a list of integers"),
    ("target_layer_ids", [1.0, 3.0], "a list of integers"),
    ("target_layer_ids", [1, True], "a list of integers"),
    ("enable_confidence_head", "true", "true or false"),
    ("attention_bias", 0, "true or false"),
    ("hidden_act", 1, "a string"),
    ("markov_head_type", None, "a string"),
    ("confidence_temperatures", "1,1,1,1", "a list of finite numbers or null"),
    ("eos_token_id", "2", "an integer or a list of integers or null"),
    ("pad_token_id", 0.0, "an integer or null"),
    ("dtype", ["bfloat16"], "a torch dtype name such as 'bfloat16' or null"),
    ("dtype", "bogus", "a torch dtype name such as 'bfloat16' or null"),
]


@pytest.mark.parametrize("key, value, expected", WRONG_TYPES)
def test_values_of_the_wrong_type_name_the_key_the_value_and_the_type(key, value, expected):
    with pytest.raises(ValueError, match=rf"invalid `{key}` = {re.escape(repr(value))}: must be {expected}, not "):
        DSparkConfig(**tiny_kwargs(**{key: value}))


def test_a_wrong_type_in_dflash_config_is_reported_too():
    config = {k: v for k, v in tiny_kwargs().items() if k not in DSPARK_KEYS}
    with pytest.raises(ValueError, match=r"invalid `target_layer_ids` = '1,3': must be a list of integers, not str"):
        DSparkConfig(**config, dflash_config={**tiny_kwargs(), "target_layer_ids": "1,3"})
    with pytest.raises(ValueError, match=r"invalid `dflash_config` = \[4\]: must be an object, not a list of int"):
        DSparkConfig(**config, dflash_config=[4])
