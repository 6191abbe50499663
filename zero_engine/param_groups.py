"""The user's param groups, checked against the model and resolved to named parameters."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from .config import optimizer_options


@dataclass
class ParamGroup:
    """One optimizer param group: its options and its trainable parameters, by name."""

    options: dict[str, Any]
    names: list[str] = field(default_factory=list)
    params: list[nn.Parameter] = field(default_factory=list)


def resolve_param_groups(
    model: nn.Module, param_groups: Iterable[Any] | None, optimizer_cls: type[torch.optim.Optimizer]
) -> list[ParamGroup]:
    """Groups of the model's own trainable parameters, each parameter in one group at most.

    ``param_groups`` is what a torch optimizer takes: an iterable of parameters or of dicts
    with ``params`` and per-group options. ``None`` means all trainable parameters.
    Frozen parameters are dropped (torch.optim would never update them either).
    """
    names = {}
    for name, param in model.named_parameters():
        names.setdefault(param, name)
    if param_groups is None:
        raw: list[dict[str, Any]] = [{"params": list(model.parameters())}]
    else:
        raw = list(param_groups)
        if not raw:
            raise ValueError("param_groups is empty: pass None to optimize every trainable parameter")
        if all(isinstance(item, torch.Tensor) for item in raw):
            raw = [{"params": raw}]
    accepted = optimizer_options(optimizer_cls)
    groups: list[ParamGroup] = []
    seen: dict[nn.Parameter, int] = {}
    for index, item in enumerate(raw):
        if not isinstance(item, dict) or "params" not in item:
            raise TypeError(f"param_groups[{index}]: expected a parameter or a dict with 'params', got {type(item).__name__}")
        options = {k: v for k, v in item.items() if k != "params"}
        for key in options:
            if key not in accepted:
                raise ValueError(f"param_groups[{index}][{key!r}]: {optimizer_cls.__name__} has no option {key!r}")
        params = item["params"]
        group = ParamGroup(options)
        for param in [params] if isinstance(params, torch.Tensor) else list(params):
            if param not in names:
                raise ValueError(
                    f"param_groups[{index}]: a tensor of shape {tuple(param.shape)} is not a parameter of the model"
                )
            if param in seen:
                raise ValueError(
                    f"param_groups[{index}]: parameter {names[param]!r} is already in param_groups[{seen[param]}]"
                )
            seen[param] = index
            if param.requires_grad:
                group.names.append(names[param])
                group.params.append(param)
        groups.append(group)
    return groups
