"""DSpark speculative decoding for transformers targets."""

import torch
from torch import nn


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
    """Forward hooks that record the outputs of `layer_ids` (pre-norm residual stream) of a target.

    Used as a context manager around target forwards. `features()` returns the captured layers
    concatenated in `layer_ids` order, [B, T, len(layer_ids) * H], on `device`. The hooks record only while
    `enabled` is True, so extra target forwards (a stateful rollback, say) leave the capture untouched.
    Works for targets dispatched with accelerate (each layer's output lives on that layer's device).
    """

    def __init__(self, target: nn.Module, layer_ids: list[int], device: torch.device | str | None = None):
        layers = decoder_layers(target)
        if max(layer_ids) >= len(layers):
            raise ValueError(
                f"DSpark: the draft reads target layers {layer_ids} but {type(target).__name__} has only "
                f"{len(layers)} layers. Use the target the draft was trained for (see `num_target_layers`)."
            )
        self.layers = [layers[i] for i in layer_ids]
        self.device = device
        self.enabled = True
        self._outputs: list[torch.Tensor | None] = [None] * len(layer_ids)
        self._handles = []

    def __enter__(self) -> "TargetFeatureCapture":
        for slot, layer in enumerate(self.layers):
            self._handles.append(layer.register_forward_hook(self._hook(slot)))
        return self

    def __exit__(self, *exc) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _hook(self, slot: int):
        def record(module, args, output):
            if self.enabled:
                self._outputs[slot] = output[0] if isinstance(output, tuple) else output

        return record

    def features(self) -> torch.Tensor:
        if any(output is None for output in self._outputs):
            raise RuntimeError("DSpark: no target forward was captured yet.")
        device = self.device if self.device is not None else self._outputs[0].device
        return torch.cat([output.to(device, non_blocking=True) for output in self._outputs], dim=-1)
