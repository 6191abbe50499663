"""Hugging Face's own way of asking for sequence parallelism, read as the engine's keys.

Users of the Trainer, TRL and Accelerate ask for Ulysses with Accelerate's ``ParallelismConfig``
(``TrainingArguments(parallelism_config=ParallelismConfig(sp_backend="deepspeed", sp_size=k,
sp_handler=DeepSpeedSequenceParallelConfig(...)))``, ``Accelerator(parallelism_config=...)``, or
``accelerate launch``'s ``parallelism_config_*`` keys, which reach the processes as
``PARALLELISM_CONFIG_*`` variables with ``ACCELERATE_USE_PARALLELISM_CONFIG=true``). Accelerate
itself refuses it outside DeepSpeed, FSDP2 or a multi-device launch; here it is taken off the
Trainer's (or Accelerator's) hands before Accelerate sees it and read as the config's keys:

- ``sp_size``: ``sequence_parallel_size`` (the same training to the bit as the key itself); the
  config's own ``sequence_parallel_size`` set to another value: a `ConfigError` naming both;
- ``dp_replicate_size`` above 1 (HSDP): hybrid sharding, shard groups of ``dp_shard_size x
  sp_size`` ranks (``zero_optimization.shard_group_size``; another value there: a `ConfigError`
  naming both); sizes whose product is not the number of processes: a `ConfigError`;
- ``cp_size`` and ``tp_size`` above 1: refused by name (ring attention and tensor parallelism are
  not built);
- the ``sp_handler``: ``sp_attn_implementation`` ``sdpa`` or ``eager`` sets the model's attention
  implementation (others, flash attention's kernels, refused: the split routes ``sdpa`` and
  ``eager``); ``sp_seq_length_is_variable`` and ``sp_seq_length`` change nothing (the split
  takes any length at every step, and a fixed one is a length like any other).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

from torch import nn

from ..errors import ConfigError

USE_VARIABLE = "ACCELERATE_USE_PARALLELISM_CONFIG"  # set by `accelerate launch` with parallelism_config_* keys
SPLIT_ATTENTION = ("sdpa", "eager")


def parallelism_from(given: Any) -> Any:
    """The ``ParallelismConfig`` a Trainer or Accelerator would hand to Accelerate: ``given``, or
    one read from ``accelerate launch``'s variables; None when neither."""
    if given is not None:
        return given
    if os.environ.get(USE_VARIABLE, "false").lower() != "true":
        return None
    from accelerate.parallelism_config import ParallelismConfig

    return ParallelismConfig()


@contextlib.contextmanager
def accelerate_without_parallelism() -> Iterator[None]:
    """Accelerate built without ``accelerate launch``'s ParallelismConfig (the engine has read it)."""
    saved = os.environ.get(USE_VARIABLE)
    os.environ[USE_VARIABLE] = "false"
    try:
        yield
    finally:
        if saved is None:
            del os.environ[USE_VARIABLE]
        else:
            os.environ[USE_VARIABLE] = saved


def merge_parallelism(raw: dict[str, Any], parallelism: Any, processes: int, where: str) -> dict[str, Any]:
    """``raw`` (a config mapping) with what ``parallelism`` asks for as the engine's keys (see the
    module docstring); raises `ConfigError` or `NotImplementedError` naming the field."""
    if parallelism is None:
        return raw
    name = f"{where}'s ParallelismConfig"
    for field, what in (("cp_size", "context parallelism (ring attention) is not built; ask for Ulysses with "
                                    "sp_size (sp_backend='deepspeed')"),
                        ("tp_size", "tensor parallelism is not built")):
        if (getattr(parallelism, field, 1) or 1) > 1:
            raise NotImplementedError(f"{name}: {field} = {getattr(parallelism, field)}: {what}")
    raw = {**raw, "zero_optimization": dict(raw.get("zero_optimization") or {})}
    sp = parallelism.sp_size or 1
    if sp > 1:
        asked = raw.get("sequence_parallel_size")
        if asked is not None and asked != sp:
            raise ConfigError(
                f"sequence_parallel_size = {asked} in the config and sp_size = {sp} in {name}: give one of them, or "
                "the same value in both"
            )
        raw["sequence_parallel_size"] = sp
    replicate, shard = parallelism.dp_replicate_size or 1, parallelism.dp_shard_size or 1
    if replicate > 1 or shard > 1:
        if replicate * shard * sp != processes:
            raise ConfigError(
                f"{name}: dp_replicate_size {replicate} x dp_shard_size {shard} x sp_size {sp} = "
                f"{replicate * shard * sp} ranks, but {processes} processes run"
            )
    if replicate > 1:  # HSDP: shard groups replicated, each holding whole sequence groups
        size = shard * sp
        asked = raw["zero_optimization"].get("shard_group_size")
        if asked is not None and asked != size:
            raise ConfigError(
                f"zero_optimization.shard_group_size = {asked} in the config and dp_shard_size {shard} x sp_size {sp} "
                f"= {size} in {name}: give one of them, or the same value in both"
            )
        raw["zero_optimization"]["shard_group_size"] = size
    attention = getattr(parallelism.sp_handler, "sp_attn_implementation", None) if sp > 1 else None
    if attention is not None and attention not in SPLIT_ATTENTION:
        raise NotImplementedError(
            f"{name}: sp_handler.sp_attn_implementation = {attention!r}: the split routes the model's 'sdpa' or "
            "'eager' attention, not flash attention's kernels; ask for 'sdpa'"
        )
    return raw


def set_attention(model: nn.Module, parallelism: Any) -> None:
    """The model's attention implementation as ``sp_handler.sp_attn_implementation`` asks (Accelerate
    sets it likewise), before the engine routes it."""
    if parallelism is None or (parallelism.sp_size or 1) == 1:
        return
    attention = getattr(parallelism.sp_handler, "sp_attn_implementation", None)
    base = model.get_base_model() if callable(getattr(model, "get_base_model", None)) else model
    if attention is not None and getattr(getattr(base, "config", None), "_attn_implementation", attention) != attention:
        base.set_attn_implementation(attention)
