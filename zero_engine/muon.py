"""Muon for the matrices, AdamW for the rest: DeepSpeed's ``optimizer.type: Muon``.

Muon keeps a momentum per matrix (elementwise), then replaces the update with an orthogonal
matrix near it (a few Newton-Schulz iterations on the whole matrix), as ``torch.optim.Muon``
does: Nesterov by default, 5 iterations, its coefficients and its learning-rate adjustment.
Parameters it does not take (vectors, embeddings, the output head) step with torch's own AdamW
under the same optimizer, in param groups of their own (``use_muon`` False), as DeepSpeed's
``MuonWithAuxAdam`` splits them.

On its own (one process, or stage 0 without the engine) `MuonWithAdamW` is an ordinary torch
optimizer. In the engine each rank holds only pieces of a matrix, so the step is split where
the math splits (`zero_engine.sharding.optimizer_side.compute_layout`): `step` does the elementwise
part on the pieces and leaves each piece's update in ``pending``; the engine gathers each
matrix's update on one rank, which calls `orthogonalise_matrix`; every rank then applies its
slice with `apply_orthogonal`. One difference from torch on purpose: the iteration runs in
fp32 unless ``ns_dtype: bf16`` asks for torch's bf16 (whose roundings depend on the order of a
reduction, so a distributed run cannot match one process bit for bit in it).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from .values import check_switch

DEFAULT_COEFFICIENTS = (3.4445, -4.7750, 2.0315)  # torch.optim.Muon's (Keller Jordan's quintic)
MUON_DEFAULT_LR = 0.02  # DeepSpeed's defaults for the two halves when the config names no lr
ADAM_DEFAULT_LR = 3e-4
NS_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
# DeepSpeed's ns_method values; "gram" (its default, an iteration on X X^T) is not built here.
BUILT_NS_METHODS = frozenset({"standard"})
UNBUILT_NS_METHODS = {"gram": "Gram Newton-Schulz is not built here; 'standard' is the iteration torch.optim.Muon runs"}


def newton_schulz(
    update: torch.Tensor, *, steps: int, coefficients: tuple[float, float, float], eps: float, dtype: torch.dtype
) -> torch.Tensor:
    """The orthogonaliser: ``torch.optim.Muon``'s quintic Newton-Schulz iteration on a 2-D
    ``update``, in ``dtype``. Replaceable (`MuonWithAdamW.orthogonaliser`): Muon's variants
    differ here."""
    a, b, c = coefficients
    x = update.to(dtype, copy=True)
    tall = update.size(0) > update.size(1)
    if tall:
        x = x.T
    x.div_(x.norm().clamp(min=eps))  # spectral norm at most 1
    for _ in range(steps):
        gram = x @ x.T
        gram_update = torch.addmm(gram, gram, gram, beta=b, alpha=c)
        x = torch.addmm(x, gram_update, x, beta=a)
    return x.T if tall else x


Orthogonaliser = Callable[..., torch.Tensor]


def matrix_shape(shape: torch.Size | tuple[int, ...]) -> tuple[int, int]:
    """The matrix a parameter is orthogonalised as: its first dimension by the rest (a
    convolution's filters flattened, as DeepSpeed does)."""
    return (shape[0], math.prod(shape[1:]))


def adjusted_lr(lr: float, adjust_lr_fn: str | None, shape: tuple[int, int]) -> float:
    """torch.optim.Muon's learning-rate adjustment for a ``shape`` matrix."""
    rows, cols = shape
    if adjust_lr_fn is None or adjust_lr_fn == "original":
        return lr * math.sqrt(max(1.0, rows / cols))
    if adjust_lr_fn == "match_rms_adamw":
        return lr * 0.2 * math.sqrt(max(rows, cols))
    return lr


def takes_muon(name: str, param: torch.Tensor, shape: torch.Size | None = None) -> bool:
    """Whether Muon updates ``param`` (of ``shape``, when its storage was emptied): its
    ``use_muon`` attribute when the user set one, else DeepSpeed's rule (two or more
    dimensions, and "embed" and "lm_head" not in the name)."""
    chosen = getattr(param, "use_muon", None)
    if chosen is not None:
        return check_switch(chosen, f"parameter {name!r}: use_muon")
    dims = len(shape if shape is not None else param.shape)
    return dims >= 2 and not any(word in name.lower() for word in ("embed", "lm_head"))


class MuonWithAdamW(torch.optim.Optimizer):
    """Muon over the param groups marked ``use_muon``, torch's AdamW over the others.

    ``lr`` is both halves' unless ``muon_lr`` or ``adam_lr`` says otherwise (a group's own
    ``lr``/``muon_lr``/``adam_lr`` win over these); defaults are DeepSpeed's (Muon 0.02,
    momentum 0.95; AdamW 3e-4, betas (0.9, 0.95), eps 1e-10; no weight decay)."""

    def __init__(
        self,
        params: Any,
        lr: float | None = None,
        muon_lr: float | None = None,
        adam_lr: float | None = None,
        momentum: float = 0.95,
        weight_decay: float = 0.0,
        betas: tuple[float, float] = (0.9, 0.95),
        eps: float = 1e-10,
        nesterov: bool = True,
        ns_steps: int = 5,
        ns_coefficients: tuple[float, float, float] = DEFAULT_COEFFICIENTS,
        ns_eps: float = 1e-7,
        ns_method: str = "standard",
        ns_dtype: str = "fp32",
        adjust_lr_fn: str | None = None,
        amsgrad: bool = False,
        foreach: bool | None = None,
        fused: bool | None = None,
    ) -> None:
        groups = [dict(group) for group in params]
        for index, group in enumerate(groups):
            if "use_muon" not in group:
                raise ValueError(f"param group {index} has no 'use_muon': say which half of MuonWithAdamW steps it")
            own_lr = group.pop("muon_lr" if group["use_muon"] else "adam_lr", None)
            group.pop("adam_lr" if group["use_muon"] else "muon_lr", None)
            half_lr, default = (muon_lr, MUON_DEFAULT_LR) if group["use_muon"] else (adam_lr, ADAM_DEFAULT_LR)
            group["lr"] = _first_set(own_lr, group.get("lr"), half_lr, lr, default)
        defaults = dict(
            lr=lr, momentum=momentum, weight_decay=weight_decay, betas=betas, eps=eps, nesterov=nesterov,
            ns_steps=ns_steps, ns_coefficients=tuple(ns_coefficients), ns_eps=ns_eps, ns_method=ns_method,
            ns_dtype=ns_dtype, adjust_lr_fn=adjust_lr_fn, amsgrad=amsgrad, foreach=foreach, fused=fused,
            maximize=False, capturable=False, differentiable=False,
        )
        super().__init__(groups, defaults)
        for group in self.param_groups:
            check_choices(group["ns_method"], group["ns_dtype"], group["adjust_lr_fn"])
        # The AdamW half is torch's own AdamW over the same group dicts and the same state.
        adam_groups = [group for group in self.param_groups if not group["use_muon"]]
        self._adamw = torch.optim.AdamW(adam_groups, betas=betas, eps=eps, fused=fused) if adam_groups else None
        if self._adamw is not None:
            self._adamw.state = self.state
        self.orthogonaliser: Orthogonaliser = newton_schulz
        self.defer_orthogonalisation = False  # the engine's: leave each piece's update in `pending`
        self.pending: dict[torch.Tensor, torch.Tensor] = {}
        self.orthogonalisations = 0  # whole matrices orthogonalised by this process (counted for tests)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """torch's, then the AdamW half pointed at the new groups and state again."""
        super().load_state_dict(state_dict)
        if self._adamw is not None:
            self._adamw.param_groups = [group for group in self.param_groups if not group["use_muon"]]
            self._adamw.state = self.state

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self._adamw is not None:
            self._adamw.step()
        for group in self.param_groups:
            if not group["use_muon"]:
                continue
            for param in group["params"]:
                if param.grad is None:
                    continue
                update = self._momentum_update(param, group)
                if self.defer_orthogonalisation:
                    self.pending[param] = update
                else:
                    shape = matrix_shape(param.shape)
                    self.apply_orthogonal(param, self.orthogonalise_matrix(update.reshape(shape), group), group, shape)
        return loss

    def _momentum_update(self, param: torch.Tensor, group: dict[str, Any]) -> torch.Tensor:
        """The elementwise part, as torch.optim.Muon: momentum, then Nesterov's look-ahead."""
        grad, state = param.grad, self.state[param]
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(grad)
        buffer = state["momentum_buffer"]
        buffer.lerp_(grad, 1 - group["momentum"])
        return grad.lerp(buffer, group["momentum"]) if group["nesterov"] else buffer

    def orthogonalise_matrix(self, update: torch.Tensor, group: dict[str, Any]) -> torch.Tensor:
        """The whole matrix's update orthogonalised (once per matrix per step, on one rank)."""
        self.orthogonalisations += 1
        return self.orthogonaliser(
            update, steps=group["ns_steps"], coefficients=group["ns_coefficients"], eps=group["ns_eps"],
            dtype=NS_DTYPES[group["ns_dtype"]],
        )

    @staticmethod
    def apply_orthogonal(
        param: torch.Tensor, orthogonal: torch.Tensor, group: dict[str, Any], shape: tuple[int, int]
    ) -> None:
        """Decoupled weight decay, then the orthogonalised update at the adjusted rate, on
        ``param`` (a whole matrix, or a rank's piece of one: ``orthogonal`` is then that piece)."""
        param.mul_(1 - group["lr"] * group["weight_decay"])
        param.add_(orthogonal.view(param.shape), alpha=-adjusted_lr(group["lr"], group["adjust_lr_fn"], shape))


def check_choices(ns_method: str, ns_dtype: str, adjust_lr_fn: str | None, path: str = "optimizer.params") -> None:
    """The options of Muon that choose among names."""
    if ns_method in UNBUILT_NS_METHODS:
        raise ValueError(f"{path}.ns_method = {ns_method!r}: {UNBUILT_NS_METHODS[ns_method]}")
    if ns_method not in BUILT_NS_METHODS:
        raise ValueError(f"{path}.ns_method = {ns_method!r}: one of {sorted(BUILT_NS_METHODS)}")
    if ns_dtype not in NS_DTYPES:
        raise ValueError(f"{path}.ns_dtype = {ns_dtype!r}: one of {sorted(NS_DTYPES)}")
    if adjust_lr_fn not in (None, "original", "match_rms_adamw"):
        raise ValueError(f"{path}.adjust_lr_fn = {adjust_lr_fn!r}: null, 'original' or 'match_rms_adamw'")


def _first_set(*values: float | None) -> float:
    return next(value for value in values if value is not None)
