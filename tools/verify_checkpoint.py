#!/usr/bin/env python
"""Verify a DSpark draft checkpoint in the Hub layout without loading its weights (unless ``--values``).

Reads ``config.json`` and the safetensors headers only (each file's 8-byte length and JSON header;
sharded checkpoints through ``model.safetensors.index.json``), from a local directory or from a Hub
repository (HTTP range requests through ``huggingface_hub.HfFileSystem``), and checks:

* config: the keys SGLang and SpecForge read. ``architectures``, the DSpark keys and the backbone keys at
  the top level (SGLang), the DSpark keys again in ``dflash_config`` (SpecForge) with equal values, no
  ``is_causal``, ``auto_map`` and the code files it names, and that ``DSparkConfig`` accepts the config;
* files: every header parses, byte spans match shapes and dtypes, file sizes match the headers, the
  index matches the shards;
* tensors: names, shapes and dtypes against a ``DSparkDraftModel`` built from the config on the meta
  device (the model code is the one source of truth for the expected table), and the parameter count;
* with ``--values`` (local directories only): every tensor's values, read one tensor at a time, for NaN / inf
  and non-floating-point dtypes (the only check that reads the weights: 0.4 s per GB on two CPU cores, plus
  reading the files).

Usage::

    python tools/verify_checkpoint.py /path/to/checkpoint
    python tools/verify_checkpoint.py RadixArk/Kimi-K3-DSpark --json
    python tools/verify_checkpoint.py . --config-only
    python tools/verify_checkpoint.py /path/to/checkpoint --values

Exit status: 0 when every check passes, 1 when any fails, 2 when the checkpoint cannot be read at all.
"""

import argparse
import json
import math
import os
import re
import struct
import sys
from dataclasses import asdict, dataclass, field
from urllib.parse import quote

import fsspec
import torch
from huggingface_hub import HfFileSystem
from safetensors import SafetensorError, safe_open

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import tools  # noqa: E402,F401  (registers the repository root as the package `dspark`)
from dspark.configuration_dspark import DSPARK_KEYS, DSparkConfig  # noqa: E402
from dspark.modeling_dspark import DSparkDraftModel, has_nonfinite  # noqa: E402

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
ARCHITECTURE = "DSparkDraftModel"
# Backbone keys SGLang reads from the top level of config.json (besides the DSpark keys).
BACKBONE_KEYS = (
    "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
    "intermediate_size", "hidden_act", "rms_norm_eps", "vocab_size", "rope_theta", "max_position_embeddings",
)  # fmt: skip
# safetensors dtype names and their sizes in bytes.
DTYPE_BYTES = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
    "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8,
}  # fmt: skip
SAFETENSORS_DTYPES = {"bfloat16": "BF16", "float16": "F16", "float32": "F32"}
DEFAULT_DTYPE = "bfloat16"  # the Hub checkpoint is all BF16
HEADER_LIMIT = 100 * 1024 * 1024  # safetensors caps headers at 100 MB
REPO_ID = re.compile(r"^[\w.-]+/[\w.-]+$")


class CheckpointError(Exception):
    """The checkpoint cannot be read at all (no such directory or repository, no config.json)."""


@dataclass(frozen=True)
class TensorInfo:
    shape: tuple[int, ...]
    dtype: str  # safetensors name, e.g. "BF16"

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass
class Check:
    name: str
    errors: list[str] = field(default_factory=list)
    detail: str = ""
    skipped: bool = False

    @property
    def status(self) -> str:
        return "skipped" if self.skipped else ("fail" if self.errors else "ok")


# ---------------------------------------------------------------------------------------------- reading
class CheckpointFiles:
    """Read access to the files of a local directory or of a Hub repository, through fsspec."""

    def __init__(self, location: str, revision: str | None = None, filesystem: fsspec.AbstractFileSystem | None = None):
        if os.path.isdir(location):
            self.kind, self.fs, self.root = "local", filesystem or fsspec.filesystem("file"), os.path.abspath(location)
        elif REPO_ID.match(location) and not os.path.exists(location):
            self.kind, self.fs = "hub", filesystem or HfFileSystem()
            self.root = location + (f"@{quote(revision, safe='')}" if revision else "")
        else:
            raise CheckpointError(f"{location!r} is neither a directory nor a Hub repository id (owner/name).")

    def path(self, name: str) -> str:
        return f"{self.root}/{name}"

    def exists(self, name: str) -> bool:
        return self.fs.exists(self.path(name))

    def size(self, name: str) -> int:
        return self.fs.size(self.path(name))

    def read_json(self, name: str):
        with self.fs.open(self.path(name), "rb") as f:
            try:
                return json.loads(f.read())
            except ValueError as error:  # json.JSONDecodeError, UnicodeDecodeError
                raise ValueError(f"{name}: not valid JSON ({error})") from None

    def read_safetensors_header(self, name: str) -> tuple[dict, int]:
        """The JSON header of a safetensors file and the header's length in bytes (without the 8-byte prefix).

        Reads exactly 8 + header-length bytes (`cache_type="none"`: no read-ahead on the Hub).
        """
        with self.fs.open(self.path(name), "rb", cache_type="none") as f:
            prefix = f.read(8)
            if len(prefix) != 8:
                raise ValueError("shorter than the 8-byte header length")
            (length,) = struct.unpack("<Q", prefix)
            if length > HEADER_LIMIT:
                raise ValueError(f"header length {length} exceeds the safetensors limit of {HEADER_LIMIT} bytes")
            raw = f.read(length)
        if len(raw) != length:
            raise ValueError(f"header truncated ({len(raw)} of {length} bytes)")
        header = json.loads(raw)
        if not isinstance(header, dict):
            raise ValueError(f"the header is a JSON {type(header).__name__}, not an object")
        return header, length


def weight_map_of(index, path: str | os.PathLike) -> dict[str, str]:
    """The `weight_map` (tensor name -> shard file name) of the parsed model.safetensors.index.json at `path`."""
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(shard, str) for shard in weight_map.values()):
        raise ValueError(f"{path}: no `weight_map` object mapping tensor names to shard file names")
    return weight_map


def is_size(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def parse_header_entry(entry) -> tuple[TensorInfo, int, int]:
    """Shape, dtype and data span of one safetensors header entry; ValueError when any is malformed."""
    if not isinstance(entry, dict):
        raise ValueError("not an object")
    shape, dtype, offsets = entry.get("shape"), entry.get("dtype"), entry.get("data_offsets")
    if not (isinstance(shape, list) and all(map(is_size, shape)) and isinstance(dtype, str)
            and isinstance(offsets, list) and len(offsets) == 2 and all(map(is_size, offsets))
            and offsets[0] <= offsets[1]):
        raise ValueError("needs `shape` (sizes), `dtype` (a name) and `data_offsets` ([begin, end])")
    return TensorInfo(tuple(shape), dtype), offsets[0], offsets[1]


def read_tensor_table(files: CheckpointFiles) -> tuple[dict[str, TensorInfo], list[str], Check]:
    """Tensor names -> shape/dtype from the safetensors headers, the files read, and the file-layout check."""
    check = Check("files: safetensors headers and layout")
    tensors: dict[str, TensorInfo] = {}
    if files.exists(SINGLE_FILE):
        shard_names, weight_map = [SINGLE_FILE], None
    elif files.exists(INDEX_FILE):
        try:
            weight_map = weight_map_of(files.read_json(INDEX_FILE), INDEX_FILE)
        except ValueError as error:
            check.errors.append(str(error))
            return tensors, [], check
        shard_names = sorted(set(weight_map.values()))
    else:
        check.errors.append(f"neither {SINGLE_FILE} nor {INDEX_FILE} found")
        return tensors, [], check

    for shard in shard_names:
        if not files.exists(shard):
            check.errors.append(f"{shard}: named in {INDEX_FILE} but missing")
            continue
        try:
            header, header_length = files.read_safetensors_header(shard)
        except ValueError as error:  # json.JSONDecodeError is a ValueError
            check.errors.append(f"{shard}: unreadable safetensors header ({error})")
            continue
        header.pop("__metadata__", None)
        data_end = 0
        for name, entry in header.items():
            try:
                info, begin, end = parse_header_entry(entry)
            except ValueError as error:
                check.errors.append(f"{shard}: malformed header entry for {name} ({error})")
                continue
            data_end = max(data_end, end)
            if info.dtype not in DTYPE_BYTES:
                check.errors.append(f"{shard}: {name} has unknown dtype {info.dtype}")
            elif end - begin != info.numel * DTYPE_BYTES[info.dtype]:
                check.errors.append(f"{shard}: {name} spans {end - begin} bytes, its shape and dtype need "
                                    f"{info.numel * DTYPE_BYTES[info.dtype]}")
            if name in tensors:
                check.errors.append(f"{shard}: {name} is stored twice")
            if weight_map is not None and weight_map.get(name) != shard:
                check.errors.append(f"{shard}: holds {name}, which {INDEX_FILE} maps to {weight_map.get(name)}")
            tensors[name] = info
        expected_size = 8 + header_length + data_end
        if (size := files.size(shard)) != expected_size:
            check.errors.append(
                f"{shard}: {size} bytes, its header describes {expected_size} (truncated or padded file)"
            )
    if weight_map is not None:
        for name in sorted(set(weight_map) - set(tensors)):
            check.errors.append(f"{INDEX_FILE}: maps {name} to {weight_map[name]}, which does not hold it")
    check.detail = f"{len(shard_names)} file(s), {len(tensors)} tensors"
    return tensors, shard_names, check


# ---------------------------------------------------------------------------------------------- checks
def expected_tensor_table(config: DSparkConfig, dtype: str) -> dict[str, TensorInfo]:
    """Name -> shape/dtype of every tensor of a `DSparkDraftModel` built from `config` (on the meta device)."""
    with torch.device("meta"):
        model = DSparkDraftModel(config)
    return {name: TensorInfo(tuple(t.shape), SAFETENSORS_DTYPES[dtype]) for name, t in model.state_dict().items()}


def check_config(raw: dict, files: CheckpointFiles) -> tuple[list[Check], DSparkConfig | None]:
    """The config checks (SGLang, SpecForge, remote code) and the parsed config (None when invalid)."""
    architectures = Check("config: architectures")
    if raw.get("architectures") != [ARCHITECTURE]:
        architectures.errors.append(f"is {raw.get('architectures')!r}, SGLang and SpecForge need [{ARCHITECTURE!r}]")

    top_level = Check("config: top-level keys (SGLang)")
    missing = [key for key in (*DSPARK_KEYS, *BACKBONE_KEYS) if key not in raw]
    if missing:
        top_level.errors.append(f"missing {missing}: SGLang reads them from the top level only")
    if isinstance(raw.get("markov_rank"), int) and raw["markov_rank"] <= 0:
        top_level.errors.append("markov_rank must be positive: SGLang's DSpark loader builds the Markov head from it")
    dflash = raw.get("dflash_config")
    if "is_causal" in raw or (isinstance(dflash, dict) and "is_causal" in dflash):
        top_level.errors.append("`is_causal` present: SGLang would apply it to every draft layer; remove it")

    nested = Check("config: dflash_config (SpecForge)")
    if not isinstance(dflash, dict):
        nested.errors.append("missing or not an object: SpecForge reads the DSpark keys from the nested "
                             "`dflash_config` object")
    else:
        for key in DSPARK_KEYS:
            if key not in dflash:
                nested.errors.append(f"missing `{key}`")
            elif key in raw and dflash[key] != raw[key]:
                nested.errors.append(f"`{key}` is {dflash[key]!r} here but {raw[key]!r} at the top level")

    remote_code = Check("config: auto_map and remote-code files")
    auto_map = raw.get("auto_map")
    auto_map = auto_map if isinstance(auto_map, dict) else {}
    for auto_class in ("AutoConfig", "AutoModel"):
        reference = auto_map.get(auto_class)
        if not reference or not isinstance(reference, str):
            remote_code.errors.append(f"auto_map has no {auto_class} (a 'module.Class' name): "
                                      "transformers users cannot load it")
        elif not files.exists(reference.rsplit(".", 1)[0] + ".py"):
            remote_code.errors.append(f"auto_map.{auto_class} names {reference}, whose file is missing")

    parsed = Check("config: DSparkConfig accepts it")
    config = None
    try:
        config = DSparkConfig.from_dict(raw)
        parsed.detail = (f"{config.num_hidden_layers} layers, hidden {config.hidden_size}, block {config.block_size}, "
                         f"target layers {config.target_layer_ids}")
    except (ValueError, TypeError) as error:
        parsed.errors.append(str(error))
    return [architectures, top_level, nested, remote_code, parsed], config


def value_problem(name: str, tensor: torch.Tensor) -> str | None:
    """What is wrong with a weight's values, or None: a non-floating-point dtype, or NaN / inf values."""
    if not tensor.is_floating_point():
        return f"{name}: {str(tensor.dtype).removeprefix('torch.')} values; draft weights are floating point"
    if has_nonfinite(tensor):
        return f"{name}: {int((~torch.isfinite(tensor)).sum()):,} of {tensor.numel():,} values are NaN or inf"
    return None


def check_values(files: CheckpointFiles, shard_names: list[str]) -> Check:
    """Every tensor's values (`value_problem`), streamed one tensor at a time from local safetensors files."""
    check = Check("tensors: values (finite, floating point)")
    scanned = 0
    for shard in shard_names:
        if not files.exists(shard):
            continue  # reported by the layout check
        try:
            with safe_open(files.path(shard), framework="pt") as f:
                for name in f.keys():
                    if problem := value_problem(name, f.get_tensor(name)):
                        check.errors.append(f"{shard}: {problem}")
                    scanned += 1
        except SafetensorError as error:
            check.errors.append(f"{shard}: values unreadable ({error})")
    check.detail = f"{scanned} tensors read"
    return check


def abbreviate(names: list[str], limit: int = 8) -> str:
    return ", ".join(names[:limit]) + (f" (+{len(names) - limit} more)" if len(names) > limit else "")


def check_tensors(
    found: dict[str, TensorInfo], expected: dict[str, TensorInfo], expected_parameters: int | None = None
) -> list[Check]:
    """Names, shapes, dtypes and parameter count of `found` against `expected` (shared with the converter)."""
    names = Check("tensors: names")
    missing, unexpected = sorted(set(expected) - set(found)), sorted(set(found) - set(expected))
    if missing:
        names.errors.append(f"{len(missing)} missing: {abbreviate(missing)}")
    if unexpected:
        hint = ""
        if any(name.startswith(("model.", "logit_head.")) for name in unexpected):
            hint = " (training-checkpoint names: run tools/convert_checkpoint.py)"
        names.errors.append(f"{len(unexpected)} unexpected: {abbreviate(unexpected)}{hint}")
    names.detail = f"{len(found)} tensors, {len(expected)} expected"

    common = sorted(set(found) & set(expected))
    shapes = Check("tensors: shapes")
    shapes.errors = [f"{n}: {list(found[n].shape)}, expected {list(expected[n].shape)}"
                     for n in common if found[n].shape != expected[n].shape]
    dtypes = Check("tensors: dtypes")
    dtypes.errors = [f"{n}: {found[n].dtype}, expected {expected[n].dtype}"
                     for n in common if found[n].dtype != expected[n].dtype]
    dtypes.detail = ", ".join(sorted({info.dtype for info in found.values()}))

    count = Check("tensors: parameter count")
    total, target = sum(i.numel for i in found.values()), sum(i.numel for i in expected.values())
    count.detail = f"{total:,} parameters"
    if total != target:
        count.errors.append(f"{total:,} parameters, the config's draft has {target:,}")
    if expected_parameters is not None and total != expected_parameters:
        count.errors.append(f"{total:,} parameters, expected {expected_parameters:,} (--expected-parameters)")
    return [names, shapes, dtypes, count]


def verify_checkpoint(
    location: str,
    revision: str | None = None,
    dtype: str | None = None,
    expected_parameters: int | None = None,
    config_only: bool = False,
    filesystem: fsspec.AbstractFileSystem | None = None,
    values: bool = False,
) -> dict:
    """Run every check on the checkpoint at `location` (directory or Hub repository id); a JSON-able report.

    `dtype` (bfloat16 / float16 / float32) defaults to the config's `dtype`, else bfloat16. `values` also reads
    every tensor (`check_values`; local directories only).
    Raises `CheckpointError` when the checkpoint cannot be read at all.
    """
    files = CheckpointFiles(location, revision, filesystem)
    if values and files.kind != "local":
        raise CheckpointError(f"{location}: --values reads every tensor, so it needs a local directory; download "
                              f"the repository (huggingface-cli download {location} --local-dir DIR) and verify DIR")
    try:
        raw = files.read_json("config.json")
    except FileNotFoundError as error:
        raise CheckpointError(f"{location}: no config.json") from error
    except Exception as error:  # offline mode, network, authentication: whatever stops the first read
        raise CheckpointError(f"{location}: cannot read config.json ({type(error).__name__}: {error})") from error
    if not isinstance(raw, dict):
        raise CheckpointError(f"{location}: config.json holds a JSON {type(raw).__name__}, not an object")
    checks, config = check_config(raw, files)
    config_dtype = raw.get("dtype") or raw.get("torch_dtype")
    dtype = dtype or (config_dtype if isinstance(config_dtype, str) else DEFAULT_DTYPE)  # else a config finding
    if dtype not in SAFETENSORS_DTYPES:
        raise CheckpointError(f"{location}: unsupported dtype {dtype!r}; expected one of {sorted(SAFETENSORS_DTYPES)}")
    report = {"checkpoint": location, "source": files.kind, "revision": revision, "dtype": dtype, "files": []}

    if not config_only:
        found, report["files"], layout = read_tensor_table(files)
        checks.append(layout)
        if config is None or not report["files"]:
            reason = "no valid config to build the expected table from" if config is None else "no weight files read"
            checks.append(Check("tensors", detail=reason, skipped=True))
        else:
            expected = expected_tensor_table(config, dtype)
            checks.extend(check_tensors(found, expected, expected_parameters))
            report["expected_parameters"] = sum(i.numel for i in expected.values())
        if values:
            checks.append(check_values(files, report["files"]))
        report["num_tensors"] = len(found)
        report["parameters"] = sum(i.numel for i in found.values())
    report["checks"] = [{**asdict(check), "status": check.status} for check in checks]
    report["ok"] = not any(check.errors for check in checks)
    return report


# ---------------------------------------------------------------------------------------------- command line
STATUS_TAGS = {"ok": " ok ", "fail": "FAIL", "skipped": "skip"}


def format_report(report: dict) -> str:
    lines = [f"DSpark checkpoint: {report['checkpoint']} ({report['source']})"]
    for check in report["checks"]:
        detail = f"  ({check['detail']})" if check["detail"] else ""
        lines.append(f"  [{STATUS_TAGS[check['status']]}] {check['name']}{detail}")
        lines.extend(f"         - {error}" for error in check["errors"])
    if report["ok"]:
        summary = "config checks passed" if "parameters" not in report else (
            f"{report['num_tensors']} tensors, {report['parameters']:,} parameters, {report['dtype']}")
        lines.append(f"OK: {summary}")
    else:
        failed = sum(check["status"] == "fail" for check in report["checks"])
        lines.append(f"FAILED: {failed} check(s)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="Reads config.json and the safetensors headers only; the weights only "
                                            "with --values.")
    parser.add_argument("checkpoint", help="a local directory, or a Hub repository id such as RadixArk/Kimi-K3-DSpark")
    parser.add_argument("--revision", help="Hub revision (branch, tag or commit); Hub ids only")
    parser.add_argument("--dtype", choices=sorted(SAFETENSORS_DTYPES), help="expected dtype of every tensor "
                        "(default: the config's `dtype`, else bfloat16)")
    parser.add_argument("--expected-parameters", type=int, help="also require this exact parameter count")
    parser.add_argument("--config-only", action="store_true", help="check config.json only (no weight files needed)")
    parser.add_argument("--values", action="store_true", help="also read every tensor, one at a time, and report "
                        "NaN / inf values and non-floating-point dtypes (local directories only)")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    args = parser.parse_args(argv)
    try:
        report = verify_checkpoint(args.checkpoint, args.revision, args.dtype, args.expected_parameters,
                                   args.config_only, values=args.values)
    except CheckpointError as error:
        failure = {"checkpoint": args.checkpoint, "ok": False, "error": str(error)}
        print(json.dumps(failure) if args.json else f"error: {error}")
        return 2
    print(json.dumps(report, indent=2) if args.json else format_report(report))
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
