#!/usr/bin/env python
"""Convert a SpecForge or DeepSpec training checkpoint of a DSpark draft into the Hub layout.

SOURCE is a directory holding ``model.safetensors``, a sharded ``model.safetensors.index.json`` or one
torch state dict (``pytorch_model.bin``, ``*.pt``, ``*.pth``; optionally wrapped as ``{"state_dict": ...}``,
``{"model": ...}`` or ``{"module": ...}``), or such a file itself. Tensor names may carry SpecForge's
``model.`` prefix and legacy ``logit_head.`` container; the target's modules (``embed_tokens``, ``lm_head``,
``rotary_emb``) are dropped (``DSparkDraftModel.normalize_state_dict``). The config is SOURCE's
``config.json`` (or ``--config``), with the DSpark keys at the top level, nested in ``dflash_config`` or both.

OUTPUT (a new or empty directory) receives the Hub layout that SGLang, SpecForge and transformers load:
``config.json`` (DSpark keys at the top level and in ``dflash_config``, ``architectures``, ``auto_map``,
``dtype``), ``model.safetensors`` (or shards plus ``model.safetensors.index.json`` with
``--max-shard-size``) in bfloat16 by default, and the remote-code files. The result is then checked with
``tools/verify_checkpoint.py``.

Usage::

    python tools/convert_checkpoint.py runs/specforge/epoch_3 hub/Kimi-K3-DSpark
    python tools/convert_checkpoint.py draft.pt hub/draft --config draft_config.json --max-shard-size 2GB --json

Exit status: 0 when the converted checkpoint verifies, 1 when it was written but fails verification, 2 when
nothing was written (an unreadable source, a config or tensors that do not fit the draft): one ``error:`` line,
or a JSON object with ``--json``.
"""

import argparse
import json
import os
import pickle
import shutil
import sys
from pathlib import Path

import torch
from huggingface_hub import split_torch_state_dict_into_shards
from safetensors.torch import load_file, save_file

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from tools.common import REMOTE_CODE_FILES, REPO_ROOT  # noqa: E402  (importing `tools` registers `dspark`)
from tools.verify_checkpoint import (  # noqa: E402
    ARCHITECTURE, INDEX_FILE, SAFETENSORS_DTYPES, SINGLE_FILE, TensorInfo, check_tensors, expected_tensor_table,
    format_report, value_problem, verify_checkpoint, weight_map_of,
)  # fmt: skip
from dspark.configuration_dspark import DSparkConfig  # noqa: E402
from dspark.modeling_dspark import DSparkDraftModel  # noqa: E402

AUTO_MAP = {"AutoConfig": "configuration_dspark.DSparkConfig", "AutoModel": "modeling_dspark.DSparkDraftModel"}
TORCH_SUFFIXES = (".bin", ".pt", ".pth")
STATE_DICT_WRAPPERS = ("state_dict", "model", "module")
# Keys of a training config that the Hub config rewrites.
REWRITTEN_CONFIG_KEYS = ("architectures", "auto_map", "model_type", "dtype", "torch_dtype", "transformers_version")


# ---------------------------------------------------------------------------------------------- reading
def weight_files(source: Path) -> list[Path]:
    """The weight file(s) of a checkpoint file or directory."""
    if source.is_file():
        return [source]
    if (source / SINGLE_FILE).is_file():
        return [source / SINGLE_FILE]
    if (source / INDEX_FILE).is_file():
        weight_map = weight_map_of(read_json_file(source / INDEX_FILE), source / INDEX_FILE)
        return [source / name for name in sorted(set(weight_map.values()))]
    torch_files = sorted(p for p in source.iterdir() if p.suffix in TORCH_SUFFIXES)
    if len(torch_files) != 1:
        raise FileNotFoundError(
            f"{source}: expected {SINGLE_FILE}, {INDEX_FILE} or exactly one torch state dict "
            f"({', '.join(TORCH_SUFFIXES)}); found {[p.name for p in torch_files] or 'none'}"
        )
    return torch_files


def read_weight_file(path: Path):
    """The parsed contents of a safetensors or torch file; ValueError (naming the file) when it cannot be parsed."""
    try:
        if path.suffix == ".safetensors":
            return load_file(path)
        return torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise
    except pickle.UnpicklingError:
        raise ValueError(f"{path}: holds Python objects other than tensors, numbers and containers; refused, as "
                         "unpickling them could run code. Save a plain state dict (or safetensors)") from None
    except Exception as error:  # a truncated or foreign file: each format fails in its own way
        reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise ValueError(f"{path}: not a readable {path.suffix} weight file: truncated or corrupt ({reason})") from None


def read_json_file(path: Path):
    try:
        return json.loads(path.read_text())
    except ValueError as error:  # json.JSONDecodeError, UnicodeDecodeError
        raise ValueError(f"{path}: not valid JSON ({error})") from None


def load_torch_state_dict(path: Path) -> dict[str, torch.Tensor]:
    state = read_weight_file(path)
    if not isinstance(state, dict):
        raise ValueError(f"{path}: holds {type(state).__name__} data, not a state dict (tensor names -> tensors)")
    for wrapper in STATE_DICT_WRAPPERS:
        if isinstance(state.get(wrapper), dict):
            state = state[wrapper]
            break
    not_tensors = [name for name, value in state.items()
                   if not isinstance(name, str) or not isinstance(value, torch.Tensor)]
    if not_tensors:
        raise ValueError(f"{path}: not a state dict of tensors (non-tensor entries {not_tensors[:5]})")
    return state


def load_state_dict(source: Path) -> dict[str, torch.Tensor]:
    """All tensors of the checkpoint, with the Hub names (`DSparkDraftModel.normalize_state_dict`)."""
    state_dict = {}
    for path in weight_files(source):
        tensors = read_weight_file(path) if path.suffix == ".safetensors" else load_torch_state_dict(path)
        if repeated := sorted(state_dict.keys() & tensors.keys()):
            raise ValueError(f"{path}: repeats {repeated[:5]}, already read from another file of {source}")
        state_dict.update(tensors)
    return DSparkDraftModel.normalize_state_dict(state_dict)


def load_config(source: Path, config_path: Path | None = None) -> DSparkConfig:
    """The draft config from `config_path`, else from the config.json next to the weights."""
    config_path = config_path or (source if source.is_dir() else source.parent) / "config.json"
    if not config_path.is_file():
        raise FileNotFoundError(f"{config_path}: no config; pass --config")
    raw = read_json_file(config_path)
    if not isinstance(raw, dict):
        raise ValueError(f"{config_path}: holds a JSON {type(raw).__name__}, not a config object")
    return DSparkConfig.from_dict({key: value for key, value in raw.items() if key not in REWRITTEN_CONFIG_KEYS})


# ---------------------------------------------------------------------------------------------- writing
def copy_remote_code(output: Path) -> None:
    for name in REMOTE_CODE_FILES:
        shutil.copy(REPO_ROOT / name, output / name)


def write_hub_checkpoint(
    state_dict: dict[str, torch.Tensor],
    config: DSparkConfig,
    output: Path,
    dtype: str = "bfloat16",
    max_shard_size: int | str | None = None,
) -> list[str]:
    """Write config.json, the weights (cast to `dtype`, sharded above `max_shard_size`) and the remote code.

    The tensors must match the config's draft exactly (names and shapes) and hold finite floating-point values
    (`value_problem`); nothing is written otherwise. Returns the names of the weight files written.
    """
    errors = [problem for name, tensor in state_dict.items() if (problem := value_problem(name, tensor))]
    state_dict = {name: tensor.to(getattr(torch, dtype)).contiguous() for name, tensor in state_dict.items()}
    found = {name: TensorInfo(tuple(t.shape), SAFETENSORS_DTYPES[dtype]) for name, t in state_dict.items()}
    errors += [error for check in check_tensors(found, expected_tensor_table(config, dtype)) for error in check.errors]
    if errors:
        raise ValueError("the tensors do not make the config's draft: " + "; ".join(errors))

    output.mkdir(parents=True, exist_ok=True)
    if any(output.iterdir()):
        raise FileExistsError(f"{output}: not empty; choose a new output directory")
    config.architectures = [ARCHITECTURE]
    config.auto_map = dict(AUTO_MAP)
    config.dtype = getattr(torch, dtype)
    config.to_json_file(output / "config.json")

    shards = {SINGLE_FILE: list(state_dict)}
    if max_shard_size is not None:
        split = split_torch_state_dict_into_shards(state_dict, max_shard_size=max_shard_size)
        shards = split.filename_to_tensors
        if split.is_sharded:
            index = {"metadata": split.metadata, "weight_map": dict(sorted(split.tensor_to_filename.items()))}
            (output / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    for filename, names in shards.items():
        save_file({name: state_dict[name] for name in names}, output / filename, metadata={"format": "pt"})
    copy_remote_code(output)
    return sorted(shards)


def convert_checkpoint(
    source: Path,
    output: Path,
    config_path: Path | None = None,
    dtype: str = "bfloat16",
    max_shard_size: int | str | None = None,
) -> dict:
    """Convert `source` into the Hub layout at `output` and verify it; a JSON-able report."""
    config = load_config(source, config_path)
    state_dict = load_state_dict(source)
    files = write_hub_checkpoint(state_dict, config, output, dtype, max_shard_size)
    verification = verify_checkpoint(str(output))
    return {"source": str(source), "output": str(output), "dtype": dtype, "files": files,
            "ok": verification["ok"], "verification": verification}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="The converted checkpoint is verified with tools/verify_checkpoint.py.")
    parser.add_argument("source", type=Path,
                        help="training checkpoint directory or weight file (.safetensors, .bin, .pt, .pth)")
    parser.add_argument("output", type=Path, help="new or empty output directory (the Hub layout)")
    parser.add_argument("--config", type=Path, help="config.json of the draft (default: the one next to the weights)")
    parser.add_argument("--dtype", choices=sorted(SAFETENSORS_DTYPES), default="bfloat16",
                        help="dtype of the written tensors")
    parser.add_argument("--max-shard-size",
                        help="shard the weights above this size, e.g. 2GB or 500MB (default: one file)")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    args = parser.parse_args(argv)
    try:
        report = convert_checkpoint(args.source, args.output, args.config, args.dtype, args.max_shard_size)
    except (OSError, ValueError) as error:
        failure = {"source": str(args.source), "ok": False, "error": str(error)}
        print(json.dumps(failure) if args.json else f"error: {error}")
        return 2
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(f"Wrote {args.output}: {', '.join(report['files'])} ({args.dtype}) + config.json + remote code")
        print(format_report(report["verification"]))
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
