"""A checkpoint as a plain ``state_dict``, in one process, without torch.distributed: what
``zero-engine consolidate``, ``zero_engine.load_consolidated`` and the integrations' exports read.
This engine's checkpoints and DeepSpeed's alike (`zero_engine.state.sources`)."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from ..errors import CheckpointError
from .formats import open_source
from .storage import write_atomically

def load_consolidated(directory: str | Path, tag: str | None = None) -> dict[str, torch.Tensor]:
    """The checkpoint's full model as a plain fp32 ``state_dict`` (every alias of a tied
    parameter included), without torch.distributed."""
    checkpoint, index, extra, _, _ = open_source(directory, tag)
    left_out = excluded_frozen(checkpoint.manifest)
    if left_out:
        warnings.warn(
            f"{checkpoint.path}: {trainable_only_message(left_out)}: the state dict holds the trainable tensors and "
            "buffers alone", stacklevel=2,
        )
    state: dict[str, torch.Tensor] = {}
    for name, entry in checkpoint.manifest["params"].items():
        numel = 1
        for dim in entry["shape"]:
            numel *= dim
        full = index.assemble(name, 0, numel)
        if full is None:
            raise CheckpointError(f"parameter {name!r}: no saved values")
        for alias in entry["aliases"]:
            state[alias] = full.view(entry["shape"]).to(torch.float32)
    for name, value in extra["module"].items():
        state[name] = value.clone()
    return state


def excluded_frozen(manifest: dict[str, Any]) -> list[str]:
    """The frozen parameters a checkpoint saved with ``exclude_frozen_parameters=True`` left out
    (none known for an older DeepSpeed checkpoint that did not list its frozen parameters)."""
    return [name for name in manifest.get("excluded_frozen") or () if name != "*"]


def trainable_only_message(left_out: list[str]) -> str:
    named = f"{len(left_out)} frozen parameter(s) ({', '.join(left_out[:4])}{', ...' if len(left_out) > 4 else ''})"
    return (
        f"this checkpoint holds the trainable state only (saved with exclude_frozen_parameters=True): {named} "
        "are not in it; its base comes from the model it was trained on"
    )


def load_client_state(directory: str | Path, tag: str | None = None) -> Any:
    """The ``client_state`` the checkpoint was saved with, without torch.distributed."""
    return open_source(directory, tag).extra["client_state"]


def write_state_dict(state: dict[str, torch.Tensor], out: str | Path) -> None:
    """Save ``state`` as ``.pt`` or ``.safetensors``, by the suffix of ``out``."""
    out = Path(out)
    if out.suffix == ".safetensors":
        unshared = {k: v.contiguous().clone() for k, v in state.items()}  # safetensors refuses shared storage
        write_atomically(out, lambda staging: save_file(unshared, str(staging)))
    elif out.suffix == ".pt":
        write_atomically(out, lambda staging: torch.save(state, staging))
    else:
        raise ValueError(f"{out}: unknown suffix {out.suffix!r}; use .pt or .safetensors")
