"""Which module transforms an engine applies: one table from the settings to the transforms,
in the seam's order (`seam.ModuleTransform.ORDER`), so that a new transform is one class and one
row here, and the engine names none of them.

Rows, in the order they are made (the seam sorts them by ``ORDER``, keeping this order within
one): no key/value cache in training forwards (a Hugging Face model's ``use_cache``), attention
exchanged over the sequence group (``sequence_parallel_size``), experts owned per rank and tokens
exchanged over the expert group (``expert_parallel_size``), the loss and the MLPs in tiles
(``tiled_loss_tokens``, ``tiled_mlp_tokens``), each unit recomputed in backward
(``recompute_units``, its input kept on the host with ``recompute_offload``). ``compile()``
adds its own later (`unit_forwards.Compile`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

from .experts import ExpertParallel
from .no_cache import NoCacheInTraining
from .seam import ModuleTransform, ModuleTransforms
from .tiled_loss import TiledLoss
from .tiled_mlp import TiledMLP
from .ulysses import UlyssesAttention
from .unit_forwards import Compile, Recompute


class TransformSettings(NamedTuple):
    """The module transforms the config asks for (`zero_engine.engine_settings`)."""

    split_eval: bool  # sequence_parallel_eval: forwards without gradients split too
    tiled_loss_tokens: int  # 0: the loss whole
    tiled_mlp_tokens: int  # 0: each MLP whole
    recompute: bool  # each unit recomputed in backward (``recompute_units``)
    recompute_offload: bool = False  # its kept input in host memory (recompute_offload, DeepSpeed's cpu_checkpointing)
    sequence: int = 1  # sequence_parallel_size: the ranks that split each sequence (the mesh's sequence axis)
    expert: int = 1  # expert_parallel_size: the ranks that own different experts (the mesh's expert axis)


class Row(NamedTuple):
    """One transform: its key (what the config says), whether the settings ask for it, how it is made."""

    key: str
    wanted: Callable[[TransformSettings], bool]
    make: Callable[[TransformSettings], ModuleTransform]


TABLE: list[Row] = [
    Row("(always)", lambda s: True, lambda s: NoCacheInTraining()),
    Row("sequence_parallel_size", lambda s: s.sequence > 1, lambda s: UlyssesAttention(split_eval=s.split_eval)),
    Row("expert_parallel_size", lambda s: s.expert > 1, lambda s: ExpertParallel(s.expert)),
    Row("tiled_loss_tokens", lambda s: s.tiled_loss_tokens > 0, lambda s: TiledLoss(s.tiled_loss_tokens)),
    Row("tiled_mlp_tokens", lambda s: s.tiled_mlp_tokens > 0, lambda s: TiledMLP(s.tiled_mlp_tokens)),
    Row("recompute_units", lambda s: s.recompute, lambda s: Recompute(offload=s.recompute_offload)),
]


def compiled(options: dict) -> ModuleTransform:
    """``engine.compile(**options)``: torch.compile over each unit's forward (`unit_forwards.Compile`)."""
    return Compile(options)


def planned_transforms(settings: TransformSettings) -> ModuleTransforms:
    """The transforms ``settings`` ask for, planned: converted before the module plan
    (`ModuleTransforms.convert`), applied once the units are built (`ModuleTransforms.apply_planned`)."""
    return ModuleTransforms(planned=[row.make(settings) for row in TABLE if row.wanted(settings)])
