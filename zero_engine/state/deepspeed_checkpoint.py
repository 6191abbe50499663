"""A DeepSpeed ZeRO checkpoint, as DeepSpeed 0.19's ``save_checkpoint`` writes it, read into this
engine's terms: the pieces of every parameter (fp32 masters and optimizer state by element
range), the loose entries, the counters, the schedule's position and the loss scaler, so that
loading, consolidation and export treat it as one of this engine's own checkpoints.

The layouts (``DIR/latest`` names the tag; ``DIR/TAG`` holds the files):

- stage 0: ``mp_rank_00_model_states.pt`` holds everything: the module, and the optimizer's own
  ``state_dict`` (one state per parameter; DeepSpeed's FusedAdam counts a group's steps in its
  last parameter's state only), or with fp16/bf16 DeepSpeed's wrapper's (``fp32_groups_flat``:
  one flat fp32 buffer per group, the moments flat alike).
- stages 1-2: ``mp_rank_00_model_states.pt`` (module, shapes, counters) and one
  ``[bf16_]zero_pp_rank_R_mp_rank_00_optim_states.pt`` per rank: rank R's partition of each
  group's flat buffer (``single_partition_of_fp32_groups``), the moments of that partition
  (``base_optimizer_state``), and where each parameter's slice of it lies
  (``param_slice_mappings``), which places every element without re-deriving the padding.
- stage 3: ``zero_pp_rank_R_mp_rank_00_model_states.pt`` and ``..._optim_states.pt`` per rank:
  each parameter is split on its own into ``ceil(numel / world)`` elements per rank (the last
  rank's tail padded), rank R's splits back to back in ``fp32_flat_groups`` in the order of
  ``param_shapes`` (as DeepSpeed's ``zero_to_fp32.py`` reads them).

Every file is read without running code (`deepspeed_pickle`); pieces are views into the
memory-mapped files. What DeepSpeed saved that this engine does not restore (its data
sampler, random-LTD state) is listed in `Translated.ignored`.
"""

from __future__ import annotations

import math
from collections import OrderedDict, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..errors import CheckpointError
from ..sharding.optimizer_side.optimizer_shard import SavedPiece, saved_piece
from . import storage
from .deepspeed_pickle import read_deepspeed_file
from .payload import PieceIndex
from .storage import Checkpoint

MODEL_STATES = "mp_rank_00_model_states.pt"

# DeepSpeed's own keys of a model-states file; the rest is the user's client_state.
DEEPSPEED_KEYS = frozenset({
    "module", "buffer_names", "optimizer", "param_shapes", "frozen_param_shapes", "shared_params",
    "frozen_param_fragments", "lr_scheduler", "data_sampler", "random_ltd", "sparse_tensor_module_names",
    "skipped_steps", "global_steps", "global_samples", "dp_world_size", "mp_world_size", "ds_config",
    "ds_version", "checkpoint_parallel_dimensions", "universal_checkpoint_info", "pp_degree", "tp_degree",
})
# Param-group options that mean the same in torch's Adam/AdamW (DeepSpeed's FusedAdam adds
# bias_correction, always on in torch, and a group step of its own).
GROUP_OPTIONS = ("lr", "betas", "eps", "weight_decay", "amsgrad")


def zero_model_file(rank: int) -> str:
    return f"zero_pp_rank_{rank}_mp_rank_00_model_states.pt"


def optim_file_names(rank: int) -> tuple[str, str]:
    return f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt", f"bf16_zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"


@dataclass
class Translated:
    """A DeepSpeed checkpoint in this engine's terms (see `zero_engine.state.checkpoint`)."""

    checkpoint: Checkpoint  # its directory, and a manifest with the parameters' shapes and aliases
    pieces_by_rank: list[list[SavedPiece]]  # DeepSpeed rank R's pieces
    extra: dict[str, Any]  # what extra.pt holds: loose entries, counters, options, schedule, scaler
    stage: int
    ignored: list[str] = field(default_factory=list)

    def piece_index(self) -> PieceIndex:
        return PieceIndex(piece for pieces in self.pieces_by_rank for piece in pieces)


def find_deepspeed_tag(directory: str | Path, tag: str | None) -> Path | None:
    """The tag directory when ``directory`` holds a DeepSpeed checkpoint there (its model-states
    file, no manifest of ours); None otherwise (errors are left to the reader of our format)."""
    root = Path(directory)
    try:
        path = root / storage.resolve_tag(root, tag)
    except (OSError, CheckpointError):
        return None
    if (path / storage.MANIFEST).exists():
        return None
    return path if (path / MODEL_STATES).is_file() or (path / zero_model_file(0)).is_file() else None


def read_deepspeed(directory: str | Path, tag: str | None = None) -> Translated:
    """Read the DeepSpeed checkpoint ``directory`` (tag: what ``latest`` names)."""
    root = Path(directory)
    path = root / storage.resolve_tag(root, tag)
    stage3 = (path / zero_model_file(0)).is_file()
    model = read_deepspeed_file(path / (zero_model_file(0) if stage3 else MODEL_STATES))
    _refuse_unsupported(model, path)
    world = int(model["dp_world_size"])
    if stage3:
        stage, shapes = 3, _param_shapes(model)
        optims = [_optimizer_state(path, rank) for rank in range(world)]
        pieces, groups = _stage3_pieces(shapes, _group_sizes(model), optims, world, path)
        loose = _stage3_loose(model, path, world)
        scaler = optims[0].get("loss_scaler")
    elif model.get("optimizer") is not None or model.get("param_shapes") is None:
        stage, shapes, shared = 0, *_stage0_parameters(model)
        pieces, groups, scaler = _stage0_pieces(model, shapes, path)
        loose = {name: model["module"][name] for name in model.get("buffer_names") or ()}
    else:
        shapes = _param_shapes(model)
        optims = [_optimizer_state(path, rank) for rank in range(world)]
        stage = int(optims[0].get("zero_stage", 2))
        pieces, groups = _partitioned_pieces(shapes, optims, path)
        loose = _loose_from_module(model, shapes)
        scaler = optims[0].get("loss_scaler")
    aliases = _aliases(shapes, shared if stage == 0 else model.get("shared_params") or {})
    manifest = {
        "format": "deepspeed", "stage": stage, "world_size": world, "optimizer": None,
        "config": {"deepspeed": model.get("ds_config"), "deepspeed_version": model.get("ds_version")},
        "params": {name: {"shape": list(shape), "aliases": aliases[name]} for name, shape in shapes.items()},
        # Stage 3 frozen parameters saved with exclude_frozen_parameters: the model as built gives
        # them. DeepSpeed 0.19.8 then records no frozen shapes at all ("*": any frozen parameter).
        "excluded_frozen": _excluded_frozen(model, loose) if stage3 else [],
    }
    extra = {
        "module": loose,
        "param_groups": groups,
        "lr_scheduler": model.get("lr_scheduler"),
        "loss_scaler": translate_loss_scaler(scaler),
        "global_step": int(model.get("global_steps", 0)),
        "skipped_steps": int(model.get("skipped_steps", 0)),
        "client_state": {key: value for key, value in model.items() if key not in DEEPSPEED_KEYS},
    }
    ignored = [
        f"{key} ({what})" for key, what in (("data_sampler", "the data sampler's position"),
                                            ("random_ltd", "random-LTD's layer schedule"))
        if model.get(key) is not None
    ]
    return Translated(Checkpoint(path, manifest), pieces, extra, stage, ignored)


def _refuse_unsupported(model: dict[str, Any], path: Path) -> None:
    if int(model.get("mp_world_size", 1)) != 1 or any(path.glob("*mp_rank_01*")):
        raise CheckpointError(f"{path}: a DeepSpeed checkpoint with tensor (model) parallelism: not readable here")
    if any(path.glob("layer_*-model_states.pt")):
        raise CheckpointError(f"{path}: a DeepSpeed pipeline-parallel checkpoint: not readable here")
    if "dp_world_size" not in model or "module" not in model:
        raise CheckpointError(f"{path}: not a DeepSpeed model-states file (no dp_world_size or module)")


def _param_shapes(model: dict[str, Any]) -> OrderedDict[str, tuple[int, ...]]:
    """Every trainable parameter's shape, in the order of DeepSpeed's flat groups."""
    shapes: OrderedDict[str, tuple[int, ...]] = OrderedDict()
    for group in model["param_shapes"]:
        shapes.update((name, tuple(shape)) for name, shape in group.items())
    return shapes


def _group_sizes(model: dict[str, Any]) -> list[int]:
    return [len(group) for group in model["param_shapes"]]


def _optimizer_state(path: Path, rank: int) -> dict[str, Any]:
    plain, bf16 = (path / name for name in optim_file_names(rank))
    file = plain if plain.is_file() else bf16
    if not file.is_file():
        raise CheckpointError(f"{plain}: missing (nor {bf16.name}): a DeepSpeed ZeRO checkpoint has one per rank")
    return read_deepspeed_file(file)["optimizer_state_dict"]


def _aliases(shapes: dict[str, Any], shared: dict[str, str]) -> dict[str, list[str]]:
    """Each parameter's names: its own, then those DeepSpeed records as sharing it."""
    aliases = {name: [name] for name in shapes}
    for alias, owner in shared.items():
        if owner in aliases:
            aliases[owner].append(alias)
    return aliases


def _piece(name: str, start: int, numel: int, master: torch.Tensor, state: dict[str, Any]) -> SavedPiece:
    return saved_piece(name, start, numel, master.float(), state)


def _step(value: Any) -> torch.Tensor:
    """Adam's step count as torch keeps it (a float tensor on the host)."""
    return torch.tensor(float(value.item() if torch.is_tensor(value) else value))


def _moments(state: dict[str, Any], numel: int, lo: int, hi: int, where: str = "") -> dict[str, Any]:
    """Elements ``[lo, hi)`` of the state tensors of a buffer of ``numel`` elements (Adam's
    moments); scalars as they are, ``step`` as torch keeps it."""
    out: dict[str, Any] = {}
    for key, value in state.items():
        if key == "step":
            out[key] = _step(value)
        elif torch.is_tensor(value) and value.numel() == numel:
            out[key] = value.reshape(-1)[lo:hi]
        elif torch.is_tensor(value) and value.dim() > 0:
            raise CheckpointError(f"{where or 'a flat group'}: optimizer state {key!r} has {value.numel()} elements, "
                                  f"not {numel}: not elementwise (or not in the module's order), not readable")
        else:
            out[key] = value
    return out


def _group_options(groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{key: group[key] for key in GROUP_OPTIONS if key in group} for group in groups]


# -- stage 0 -----------------------------------------------------------------------------------


def _stage0_parameters(model: dict[str, Any]) -> tuple[OrderedDict[str, tuple[int, ...]], dict[str, str]]:
    """Stage 0 records no parameter list: the trainable parameters are the module's entries that
    are not buffers, a tied one once (its names share storage: the later ones are aliases)."""
    buffers = set(model.get("buffer_names") or ())
    shapes: OrderedDict[str, tuple[int, ...]] = OrderedDict()
    shared: dict[str, str] = {}
    seen: dict[tuple[int, int], str] = {}
    for name, tensor in model["module"].items():
        if name in buffers:
            continue
        key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset())
        if key in seen and tensor.numel():
            shared[name] = seen[key]
            continue
        seen[key] = name
        shapes[name] = tuple(tensor.shape)
    return shapes, shared


def _stage0_pieces(model: dict[str, Any], shapes: dict[str, tuple[int, ...]], path: Path) -> tuple[Any, ...]:
    """Each parameter whole, in the optimizer's order: from the fp16/bf16 wrapper's flat fp32
    group, or the module's fp32 values and the optimizer's per-parameter state."""
    module = model["module"]
    optimizer = model.get("optimizer") or {}
    file = path / MODEL_STATES
    if "fp32_groups_flat" in optimizer:  # DeepSpeed's fp16/bf16 wrapper: flat fp32 groups
        flats, inner = optimizer["fp32_groups_flat"], optimizer["optimizer_state_dict"]
        if len(flats) != 1:
            raise CheckpointError(f"{file}: stage 0 in fp16/bf16 with {len(flats)} param groups: not readable here "
                                  "(which parameters each flat group holds is not recorded)")
        flat, state = flats[0], inner["state"].get(0, {})
        total = sum(math.prod(shape) for shape in shapes.values())
        if flat.numel() != total:
            raise CheckpointError(f"{file}: the flat fp32 group holds {flat.numel()} elements, the module's "
                                  f"non-buffer entries {total}: frozen parameters at stage 0 are not readable here")
        pieces, offset = [], 0
        for name, shape in shapes.items():
            numel = math.prod(shape)
            pieces.append(_piece(name, 0, numel, flat[offset : offset + numel], _moments(state, flat.numel(), offset, offset + numel)))
            offset += numel
        return [pieces], _group_options(inner["param_groups"]), _wrapper_scaler(optimizer)
    # a torch-style state_dict: one state per parameter index, groups listing their indices
    indices = [index for group in optimizer.get("param_groups", []) for index in group["params"]]
    if len(indices) != len(shapes):
        raise CheckpointError(f"{file}: the optimizer holds {len(indices)} parameters, the module {len(shapes)} "
                              "(not buffers): frozen parameters at stage 0 are not readable here")
    name_of = dict(zip(indices, shapes))  # the optimizer took the parameters in the module's order
    pieces = []
    states = optimizer.get("state", {})
    for group in optimizer["param_groups"]:
        # DeepSpeed's FusedAdam advances only its group's last parameter's step: the group's count
        step = max((_step(states[i]["step"]).item() for i in group["params"] if "step" in states.get(i, {})), default=0)
        for index in group["params"]:
            name = name_of[index]
            numel = math.prod(shapes[name])
            state = _moments(states.get(index, {}), numel, 0, numel, f"{file}: parameter {index} ({name}, {shapes[name]})")
            if "step" in state:
                state["step"] = _step(step)
            pieces.append(_piece(name, 0, numel, module[name].reshape(-1), state))
    return [pieces], _group_options(optimizer["param_groups"]), None


def _wrapper_scaler(optimizer: dict[str, Any]) -> dict[str, Any] | None:
    """The fp16 wrapper keeps its scaler's fields at its top level (no hysteresis)."""
    if not optimizer.get("dynamic_loss_scale"):
        return None
    return {"dynamic": True, **{key: optimizer[key] for key in ("cur_scale", "cur_iter", "last_overflow_iter") if key in optimizer}}


# -- stages 1-2 --------------------------------------------------------------------------------


def _partitioned_pieces(shapes: dict[str, Any], optims: list[dict[str, Any]], path: Path) -> tuple[list, list]:
    """Each rank's slices of each parameter, placed by ``param_slice_mappings``: a slice at
    ``start`` of rank R's partition of ``P`` elements is the group's flat elements from
    ``R * P + start``; a parameter's first slice starts at its element 0."""
    by_rank: list[list[SavedPiece]] = []
    flat_start: dict[str, int] = {}
    for rank, optim in enumerate(optims):
        pieces = []
        for group, mapping in enumerate(optim["param_slice_mappings"]):
            partition = optim["single_partition_of_fp32_groups"][group]
            state = optim["base_optimizer_state"]["state"].get(group, {})
            size = partition.numel()
            for name, fragment in mapping.items():
                lo, numel = int(fragment["start"]), int(fragment["numel"])
                flat = rank * size + lo
                flat_start[name] = min(flat_start.get(name, flat), flat)
                pieces.append(_piece(name, flat, numel, partition[lo : lo + numel], _moments(state, size, lo, lo + numel)))
        by_rank.append(pieces)
    for pieces in by_rank:
        for piece in pieces:
            piece["start"] -= flat_start[piece["name"]]
    _check_coverage(shapes, by_rank, path)
    return by_rank, _group_options(optims[0]["base_optimizer_state"]["param_groups"])


def _loose_from_module(model: dict[str, Any], shapes: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Stages 1-2 save the whole module: what is not a trainable parameter (or its tied name)."""
    shared = model.get("shared_params") or {}
    return {name: value for name, value in model["module"].items() if name not in shapes and name not in shared}


# -- stage 3 -----------------------------------------------------------------------------------


def _stage3_pieces(
    shapes: dict[str, Any], group_sizes: list[int], optims: list[dict[str, Any]], world: int, path: Path
) -> tuple[list, list]:
    """Rank R holds elements ``[R * s, (R + 1) * s)`` of each parameter (``s = ceil(numel /
    world)``), back to back in its sub-groups' flat buffers, in the order of ``param_shapes``."""
    by_rank = []
    first_sub_group: dict[str, int] = {}
    for rank, optim in enumerate(optims):
        flats = optim["fp32_flat_groups"]
        states = optim["optimizer_state_dict"]["state"]
        slots = _flat_slots(flats)
        pieces = []
        for name, shape in shapes.items():
            numel = math.prod(shape)
            split = math.ceil(numel / world)
            sub_group, lo = slots.take(split, name, path)
            first_sub_group.setdefault(name, sub_group)
            held = max(0, min(split, numel - rank * split))
            if held:
                size = flats[sub_group].numel()
                state = _moments(states.get(sub_group, {}), size, lo, lo + held)
                pieces.append(_piece(name, rank * split, held, flats[sub_group][lo : lo + held], state))
        slots.finish(path, rank)
        by_rank.append(pieces)
    _check_coverage(shapes, by_rank, path)
    # The base optimizer has a group per sub-group; a user group's options are those of the
    # sub-group its first parameter is in (sub-groups never span two user groups).
    sub_groups = optims[0]["optimizer_state_dict"]["param_groups"]
    names, firsts, at = list(shapes), [], 0
    for size in group_sizes:
        if size:
            firsts.append(sub_groups[first_sub_group[names[at]]])
        at += size
    return by_rank, _group_options(firsts)


class _flat_slots:
    """Consecutive ranges of a rank's sub-group buffers."""

    def __init__(self, flats: list[torch.Tensor]) -> None:
        self.flats, self.sub_group, self.offset = flats, 0, 0

    def take(self, numel: int, name: str, path: Path) -> tuple[int, int]:
        while self.sub_group < len(self.flats) and self.offset + numel > self.flats[self.sub_group].numel():
            if self.offset != self.flats[self.sub_group].numel():
                raise CheckpointError(f"{path}: parameter {name!r} does not fit the flat buffers as param_shapes "
                                      "orders them: an unexpected stage 3 layout")
            self.sub_group, self.offset = self.sub_group + 1, 0
        if self.sub_group == len(self.flats):
            raise CheckpointError(f"{path}: the flat buffers end before parameter {name!r}")
        at = (self.sub_group, self.offset)
        self.offset += numel
        return at

    def finish(self, path: Path, rank: int) -> None:
        left = sum(flat.numel() for flat in self.flats[self.sub_group :]) - self.offset
        if left:
            raise CheckpointError(f"{path}: rank {rank}'s flat buffers hold {left} elements beyond the parameters "
                                  "param_shapes lists: an unexpected stage 3 layout")


def _excluded_frozen(model: dict[str, Any], loose: dict[str, torch.Tensor]) -> list[str]:
    shapes = model.get("frozen_param_shapes")
    return ["*"] if shapes is None else [name for name in shapes if name not in loose]


def _stage3_loose(model: dict[str, Any], path: Path, world: int) -> dict[str, torch.Tensor]:
    """Buffers from rank 0's module; frozen parameters from every rank's fragment of them (none
    of a frozen parameter's: saved with ``exclude_frozen_parameters``, `excluded_frozen`)."""
    loose = {name: model["module"][name] for name in model.get("buffer_names") or () if name in model["module"]}
    shapes = model.get("frozen_param_shapes") or {}
    if not shapes:
        return loose
    fragments = defaultdict(list)
    for rank in range(world):
        states = model if rank == 0 else read_deepspeed_file(path / zero_model_file(rank))
        for name, fragment in (states.get("frozen_param_fragments") or {}).items():
            fragments[name].append(fragment.reshape(-1))
    for name, shape in shapes.items():
        if not fragments[name]:  # left out by exclude_frozen_parameters
            continue
        numel = math.prod(shape)
        values = torch.cat(fragments[name])[:numel]
        if values.numel() != numel:
            raise CheckpointError(f"{path}: frozen parameter {name!r}: the ranks' fragments hold {values.numel()} of {numel} elements")
        loose[name] = values.view(shape)
    return loose


# -- shared ------------------------------------------------------------------------------------


def _check_coverage(shapes: dict[str, Any], by_rank: list[list[SavedPiece]], path: Path) -> None:
    covered: dict[str, int] = defaultdict(int)
    for pieces in by_rank:
        for piece in pieces:
            covered[piece["name"]] += piece["numel"]
    wrong = [f"{name} ({covered[name]} of {math.prod(shape)})" for name, shape in shapes.items()
             if covered[name] != math.prod(shape)]
    if wrong:
        raise CheckpointError(f"{path}: the ranks' partitions do not cover these parameters: {', '.join(wrong)}")


def translate_loss_scaler(saved: dict[str, Any] | None) -> dict[str, Any] | None:
    """DeepSpeed's dynamic loss scaler as this engine's `LossScaler` state (a static scaler:
    None, nothing to carry over). A field DeepSpeed did not save is left out (the fp16
    wrapper at stage 0 saves no hysteresis): the resuming engine keeps its own."""
    if not saved or not saved.get("dynamic"):
        return None
    names = {"cur_scale": "scale", "cur_hysteresis": "remaining_hysteresis", "cur_iter": "iteration",
             "last_overflow_iter": "last_overflow"}
    return {ours: saved[theirs] for theirs, ours in names.items() if theirs in saved}
