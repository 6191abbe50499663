"""A PEFT LoRA model's weights as its merged base: what ``merge_and_unload()`` would leave, under
the base model's names (what vLLM loads), one layer at a time.

Read from the module tree by PEFT's layer protocol, without importing PEFT: a LoRA layer has a
``base_layer``, ``lora_A``/``lora_B`` module dicts, ``active_adapters`` and
``get_delta_weight(adapter)``; a ``modules_to_save`` wrapper has ``original_module`` and
``modules_to_save``. Names lose PeftModel's ``base_model.model.`` prefix and the ``.base_layer``
of each wrapped module; the adapters' own entries and the originals of modules to save are left
out. A layer's merged weight is ``base += get_delta_weight(adapter)`` for each active adapter,
PEFT's own computation on the layer's adapter weights (gathered for it), so it equals PEFT's merge.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

_PEFT_PREFIX = "base_model.model."


class AdapterMerge:
    """Where a PEFT model's LoRA layers are, and how each of its state-dict names leaves."""

    def __init__(self, module: nn.Module) -> None:
        self.prefix = _PEFT_PREFIX if hasattr(module, "peft_config") and hasattr(module, "base_model") else ""
        self.layers: dict[str, nn.Module] = {}  # a LoRA layer's path -> the layer
        self.saved: dict[str, str] = {}  # a modules_to_save wrapper's path -> its active adapter
        for path, sub in module.named_modules():
            if _is_lora_layer(sub):
                _check_mergeable(path, sub)
                self.layers[path] = sub
            elif hasattr(sub, "original_module") and hasattr(sub, "modules_to_save"):
                self.saved[path] = getattr(sub, "active_adapter", "default")
                if isinstance(self.saved[path], (list, tuple)):
                    self.saved[path] = self.saved[path][0]
        if not self.layers and not self.saved:
            raise ValueError(
                "named_full_parameters(merge_adapters=True): the model has no PEFT LoRA layer (a module with "
                "base_layer, lora_A, lora_B and get_delta_weight) to merge"
            )

    def rename(self, name: str) -> str | None:
        """The name ``name`` has in the merged model, or None when it leaves no entry there."""
        for path in self.layers:
            if name.startswith(f"{path}."):
                if not name.startswith(f"{path}.base_layer."):
                    return None  # the adapters' own weights
                name = f"{path}.{name[len(path) + len('.base_layer.'):]}"
                break
        for path, adapter in self.saved.items():
            if name.startswith(f"{path}.original_module."):
                return None
            kept = f"{path}.modules_to_save.{adapter}."
            if name.startswith(kept):
                name = f"{path}.{name[len(kept):]}"
            elif name.startswith(f"{path}.modules_to_save."):
                return None  # another adapter's copy
        return name[len(self.prefix):] if self.prefix and name.startswith(self.prefix) else name

    def layer_of(self, name: str) -> nn.Module | None:
        """The LoRA layer whose base weight ``name`` is, if any."""
        if name.endswith(".base_layer.weight"):
            return self.layers.get(name[: -len(".base_layer.weight")])
        return None

    def adapter_params(self, layer: nn.Module) -> list[nn.Parameter]:
        """The parameters `merged` reads: the active adapters' A and B."""
        params = []
        for adapter in _active(layer):
            for table in (layer.lora_A, layer.lora_B):
                if adapter in table:
                    params.extend(table[adapter].parameters())
        return params

    def adapter_params_of_all(self) -> list[nn.Parameter]:
        """`adapter_params` of every LoRA layer, once each."""
        return list(dict.fromkeys(param for layer in self.layers.values() for param in self.adapter_params(layer)))

    def merged(self, layer: nn.Module, base: torch.Tensor) -> torch.Tensor:
        """``base`` (the layer's full base weight, a fresh tensor) with each active adapter added,
        in place, as PEFT's ``merge`` adds it (its adapter weights whole now)."""
        with torch.no_grad():
            for adapter in _active(layer):
                if adapter in layer.lora_A:
                    base += layer.get_delta_weight(adapter).to(base.device)
        return base


def is_peft_model(module: nn.Module) -> bool:
    """PEFT's ``PeftModel`` (by its protocol: a config per adapter, a wrapped base, its own save)."""
    return all(hasattr(module, attr) for attr in ("peft_config", "get_base_model", "save_pretrained"))


def adapter_names(module: nn.Module) -> set[str]:
    """The state-dict names PEFT's ``save_pretrained`` keeps of a PEFT model: every adapter's
    weights (``lora_`` in the name, trained or not), the modules to save, and whatever else
    trains; the frozen base is left out."""
    trainable = {name for name, param in module.named_parameters(remove_duplicate=False) if param.requires_grad}
    return {
        name for name in module.state_dict()
        if name in trainable or "lora_" in name or ".modules_to_save." in name
    }


def _is_lora_layer(module: nn.Module) -> bool:
    return all(hasattr(module, attr) for attr in ("base_layer", "lora_A", "lora_B", "get_delta_weight"))


def _active(layer: nn.Module) -> Sequence[str]:
    active = getattr(layer, "active_adapters", None) or getattr(layer, "active_adapter", "default")
    return [active] if isinstance(active, str) else list(active)


def _check_mergeable(path: str, layer: nn.Module) -> None:
    """Variants whose merge is more than adding the delta to the weight are refused by name."""
    for adapter in _active(layer):
        if getattr(layer, "use_dora", {}).get(adapter):
            raise NotImplementedError(
                f"named_full_parameters(merge_adapters=True): {path!r} uses DoRA (adapter {adapter!r}), whose merge "
                "rescales the weight by its norm; export with merge_adapters=False and merge with PEFT"
            )
        if getattr(layer, "lora_bias", {}).get(adapter):
            raise NotImplementedError(
                f"named_full_parameters(merge_adapters=True): {path!r} has a LoRA bias (adapter {adapter!r}); export "
                "with merge_adapters=False and merge with PEFT"
            )
    if getattr(layer, "merged", False):
        raise ValueError(
            f"named_full_parameters(merge_adapters=True): {path!r} is merged already (PEFT's merge_adapter()): "
            "its base holds the adapters; unmerge it or export with merge_adapters=False"
        )
