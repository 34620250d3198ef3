"""Offline training data for drafts: the frozen target's features, computed once and read back from disk.

Online distillation runs the target on every training step; on a target much bigger than its draft that
forward dominates the cost of training. `FeatureCache` runs the target ONCE over every training sequence
and stores, per sequence, what the draft's loss needs of it (as SpecForge's offline mode does):

- `features` [T, n * H]: the outputs of the draft's `target_layer_ids`, concatenated (TargetFeatureCapture);
- `last_hidden` [T, H]: the target's final hidden state (after its final norm), from which the shared LM
  head gives the target's logits, `lm_head(last_hidden)`, and so the distribution the L1 term matches.

Layout of a cache folder: `cache.json` (what it was built from: target, layers, data files, max length,
dtype) and `records-SSSSSS.safetensors` files of `chunk_size` consecutive records each (tensors
`features.I` / `last_hidden.I` for record I). Building is resumable (a chunk file appears complete or not at
all) and sharded over the ranks of a torchrun job (rank r builds chunks r, r + world, ...). Reading is lazy:
a process opens only the files of the records its own micro-batches use.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors import safe_open
from safetensors.torch import save_file
from tqdm import tqdm

import tools  # noqa: F401  (registers the repository root as the package `dspark`)
from dspark.generation_utils import TargetFeatureCapture
from tools.common import refuse_other_settings

CACHE_VERSION = 1


class FeatureCache:
    """Target features and final hidden states of a list of token sequences (see the module docstring)."""

    def __init__(self, folder: str | Path, identity: dict, num_records: int, chunk_size: int = 64):
        self.folder = Path(folder)
        self.identity = {"version": CACHE_VERSION, **identity, "num_records": num_records, "chunk_size": chunk_size}
        self.num_records, self.chunk_size = num_records, chunk_size
        self._files: dict[int, object] = {}  # chunk -> open safetensors handle

    def _path(self, chunk: int) -> Path:
        return self.folder / f"records-{chunk * self.chunk_size:06d}.safetensors"

    @property
    def num_chunks(self) -> int:
        return -(-self.num_records // self.chunk_size)

    def check_identity(self) -> None:
        """Refuse a folder built from other data, another target or other layers."""
        meta = self.folder / "cache.json"
        if meta.exists():
            refuse_other_settings(self.folder, json.loads(meta.read_text()), self.identity,
                                  "Pass another --features-cache folder, or delete this one.")
        else:
            self.folder.mkdir(parents=True, exist_ok=True)
            meta.write_text(json.dumps(self.identity, indent=2) + "\n")

    @torch.no_grad()
    def build(self, target, sequences: list[list[int]], layer_ids: list[int], rank: int = 0, world_size: int = 1,
              dtype: torch.dtype = torch.bfloat16) -> None:
        """Run the target over the sequences missing from the cache (this rank's chunks) and store them."""
        if rank == 0:
            self.check_identity()
        if world_size > 1:
            dist.barrier()
        mine = [c for c in range(rank, self.num_chunks, world_size) if not self._path(c).exists()]
        decoder = target.get_decoder()
        bar = tqdm(total=sum(min(self.chunk_size, self.num_records - c * self.chunk_size) for c in mine),
                   desc=f"cache target features (rank {rank})", unit="seq", disable=not mine)
        with TargetFeatureCapture(target, layer_ids) as capture, bar:
            for chunk in mine:
                tensors = {}
                first = chunk * self.chunk_size
                for index in range(first, min(first + self.chunk_size, self.num_records)):
                    input_ids = torch.tensor([sequences[index]], device=target.device)
                    last_hidden = decoder(input_ids=input_ids, use_cache=False).last_hidden_state
                    tensors[f"features.{index}"] = capture.features()[0].to("cpu", dtype).contiguous()
                    tensors[f"last_hidden.{index}"] = last_hidden[0].to("cpu", dtype).contiguous()
                    bar.update(1)
                partial = self._path(chunk).with_suffix(".partial")
                save_file(tensors, str(partial))
                os.replace(partial, self._path(chunk))  # complete or absent
        if world_size > 1:
            dist.barrier()
        missing = [c for c in range(self.num_chunks) if not self._path(c).exists()]
        if missing:
            raise RuntimeError(f"{self.folder}: chunks {missing} were not built")

    def get(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(features [T, n * H], last_hidden [T, H]) of record `index`, as stored."""
        chunk = index // self.chunk_size
        if chunk not in self._files:
            self._files[chunk] = safe_open(str(self._path(chunk)), framework="pt")
        handle = self._files[chunk]
        return handle.get_tensor(f"features.{index}"), handle.get_tensor(f"last_hidden.{index}")

    def batch(self, indices: list[int], width: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Right-padded (with zeros) float32 features [B, width, n * H] and last hidden states [B, width, H] of
        the records, cut to `width` tokens (the padding is never supervised)."""
        rows = [self.get(index) for index in indices]
        features = torch.zeros(len(rows), width, rows[0][0].shape[-1])
        last_hidden = torch.zeros(len(rows), width, rows[0][1].shape[-1])
        for row, (row_features, row_hidden) in enumerate(rows):
            length = min(width, row_features.shape[0])
            features[row, :length] = row_features[:length].float()
            last_hidden[row, :length] = row_hidden[:length].float()
        return features, last_hidden
