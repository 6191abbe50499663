"""Models built on the meta device, and the initial values the engine must give them, written
independently of the engine: the whole model materialized in one process, each module that owns
tensors seeded with ``module_seed(base, path)`` and initialized as a whole, in reverse
``named_modules()`` order (`reference_init`)."""

from __future__ import annotations

import torch

from models import TrapModel
from zero_engine.sharding.building.deferred_init import draw_base_seed, module_seed

SEED = 1234


def meta_trap_model() -> TrapModel:
    torch.manual_seed(SEED)  # the base seed comes from rank 0's generator state
    with torch.device("meta"):
        return TrapModel()


def reference_init(model_fn, init_fn) -> dict[str, torch.Tensor]:
    """One process: materialize everything, then each owning module seeded and initialized."""
    torch.manual_seed(SEED)
    base = draw_base_seed()
    model = model_fn()
    model.to_empty(device="cpu")
    seen: set[int] = set()
    owners = []
    for path, module in model.named_modules():
        own = [t for t in [*module._parameters.values(), *module._buffers.values()] if t is not None]
        if any(id(t) not in seen for t in own):
            owners.append((path, module))
        seen.update(id(t) for t in own)
    for path, module in reversed(owners):
        torch.manual_seed(module_seed(base, path))
        with torch.no_grad():
            init_fn(module)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}
