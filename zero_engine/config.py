"""The zero_engine configuration: one validated pydantic model for the whole file.

Key names follow DeepSpeed's wherever the feature is the same, so a ``ds_config.json`` that
uses only supported features loads unchanged. The whole schema is validated up front, even
for features a later release implements; `zero_engine.features` decides at `initialize`
which switched-on features are not built yet.

Every error is a `ConfigError` whose lines each name a key path, the offending value and
the fix (an unknown key suggests the closest known one).
"""

from __future__ import annotations

import inspect
import json
import math
from pathlib import Path
from typing import Annotated, Any, Literal, NamedTuple

import hjson
import torch
import yaml
from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PrivateAttr,
    AfterValidator,
    ValidationError,
    model_validator,
)

from .deepspeed_compat import translate
from .errors import ConfigError, suggest
from .schedules import check_schedule_param, check_schedule_params, scheduler_class
from .values import check_value_type


def _parse_count(value: Any) -> Any:
    """Accept DeepSpeed's float-style counts (``5e8`` in JSON, ``"5e8"`` in YAML 1.1)."""
    _not_boolean(value)
    if isinstance(value, str):
        try:
            value = float(value)
        except ValueError:
            return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


def _not_boolean(value: Any) -> Any:
    """YAML reads ``yes``/``on``/``true`` as booleans, and pydantic would take them as 1."""
    if isinstance(value, bool):
        raise ValueError("a number is expected, not a boolean")
    return value


def _never_when_infinite(value: Any) -> Any:
    """Infinity as "never" (Accelerate writes ``steps_per_print: inf`` into every config)."""
    if isinstance(value, float) and value == math.inf or isinstance(value, str) and value.lower() in ("inf", "infinity"):
        return None
    return value


# The longest process-group timeout every backend takes: gloo refuses 9.3e12 s (its microseconds
# overflow an int64); torch turns 1e15 s into an OverflowError when it builds the timedelta.
MAX_TIMEOUT_S = 1e12
Count = Annotated[int, BeforeValidator(_parse_count), Field(ge=0)]
PositiveCount = Annotated[int, BeforeValidator(_parse_count), Field(ge=1)]
# DeepSpeed allows a bucket of 0 elements: every gradient flushes at once, as a bucket of 1 does.
BucketSize = Annotated[int, BeforeValidator(_parse_count), Field(ge=0), AfterValidator(lambda size: max(size, 1))]
Integer = Annotated[int, BeforeValidator(_not_boolean)]
Real = Annotated[float, BeforeValidator(_not_boolean)]
StageNumber = Annotated[int, BeforeValidator(_not_boolean), Field(ge=0, le=3)]


def _deepspeed_option(default: Any) -> Any:
    """A DeepSpeed key accepted so that its configs load; `NO_EFFECT` says why it changes nothing."""
    return Field(default, description="DeepSpeed option; accepted, no effect.")


class _Section(BaseModel):
    # Infinity and NaN are refused in every number (an infinite timeout overflowed at
    # initialize, an infinite static loss scale skipped every step).
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)


class OptimizerConfig(_Section):
    type: str = Field("AdamW", description="A torch.optim class, case-insensitive (AdamW, Adam, SGD, ...).")
    params: dict[str, Any] = Field(
        default_factory=lambda: {"lr": 1e-3, "weight_decay": 0.0},
        description="Keyword arguments of that optimizer, checked against its signature. Adam and AdamW as DeepSpeed "
        "builds them: type Adam is AdamW unless adam_w_mode: false, weight_decay left out is 0 (DeepSpeed's fused "
        "Adam) unless torch_adam: true (torch's defaults); bias_correction: false is refused.",
    )

    @model_validator(mode="after")
    def _check(self) -> OptimizerConfig:
        check_optimizer(self)  # beside the other sections' errors, not after them
        return self


class SchedulerConfig(_Section):
    type: str = Field(description="WarmupLR, WarmupDecayLR, WarmupCosineLR or a torch.optim.lr_scheduler class.")
    params: dict[str, Any] = Field(default_factory=dict, description="Keyword arguments of that scheduler.")

    @model_validator(mode="after")
    def _check(self) -> SchedulerConfig:
        check_scheduler(self)
        return self


class FP16Config(_Section):
    enabled: bool = Field(False, description="Compute in float16 with fp32 master weights.")
    fp16_master_weights_and_grads: bool = Field(
        False, description="DeepSpeed: fp16 masters and gradients (no fp32 copy); refused when on."
    )
    auto_cast: bool = Field(False, description="DeepSpeed's autocast switch; accepted for compatibility.")
    loss_scale: Real = Field(0.0, ge=0, description="0 = dynamic loss scaling; any other value a static scale.")
    initial_scale_power: Integer = Field(16, ge=0, le=64, description="Dynamic scaling starts at 2**this.")
    loss_scale_window: PositiveCount = Field(1000, description="Clean steps before the scale grows.")
    hysteresis: PositiveCount = Field(2, description="Overflows tolerated before the scale drops.")
    consecutive_hysteresis: bool = Field(False, description="Refill hysteresis on every clean step.")
    min_loss_scale: Real = Field(1.0, gt=0, description="The dynamic scale never drops below this.")


class BF16Config(_Section):
    enabled: bool = Field(False, description="Compute in bfloat16 with fp32 master weights.")
    # fp16's loss-scaling keys, which DeepSpeed configs often copy into bf16 (DeepSpeed ignores them).
    loss_scale: Real = Field(0.0, ge=0, description="Accepted; bf16 needs no loss scaling.")
    loss_scale_window: PositiveCount = Field(1000, description="Accepted; bf16 needs no loss scaling.")
    initial_scale_power: Integer = Field(16, ge=0, le=64, description="Accepted; bf16 needs no loss scaling.")
    hysteresis: PositiveCount = Field(2, description="Accepted; bf16 needs no loss scaling.")
    min_loss_scale: Real = Field(1.0, gt=0, description="Accepted; bf16 needs no loss scaling.")
    immediate_grad_update: bool = _deepspeed_option(False)
    check_grad_overflow: bool = _deepspeed_option(True)
    bf16_master_weights_and_grads: bool = Field(
        False, description="DeepSpeed: bf16 masters and gradients (no fp32 copy); refused when on."
    )
    bf16_optimizer_states: bool = Field(False, description="DeepSpeed: bf16 optimizer state; refused when on.")


class OffloadConfig(_Section):
    device: Literal["none", "cpu", "nvme"] = Field(
        "none", description="'cpu': keep it in host memory (see Offload in the README); 'nvme' is refused (not built)."
    )
    pin_memory: bool = Field(
        False, description="Page-locked host buffers, so copies overlap the GPU's work (ignored without CUDA)."
    )
    nvme_path: str | None = Field(None, description="NVMe directory for 'nvme' offload (not built).")
    buffer_count: PositiveCount = Field(4, description="DeepSpeed's NVMe buffer count; accepted, no effect with 'cpu'.")
    fast_init: bool = Field(False, description="DeepSpeed's fast-init switch; accepted for compatibility.")
    ratio: Real = Field(
        1.0, ge=0, le=1, description="Fraction offloaded; below 1.0 (DeepSpeed's partial offload) is refused."
    )


class OffloadOptimizerConfig(OffloadConfig):
    """``zero_optimization.offload_optimizer``."""

    pipeline_read: bool = _deepspeed_option(False)
    pipeline_write: bool = _deepspeed_option(False)
    super_offload: bool = Field(False, description="DeepSpeed's SuperOffload; refused when on.")
    cpuadam_cores_perc: Real = Field(0.8, gt=0, le=1, description="DeepSpeed option; accepted, no effect.")


class OffloadParamConfig(OffloadConfig):
    """``zero_optimization.offload_param``."""

    buffer_count: PositiveCount = Field(5, description="DeepSpeed's NVMe buffer count; accepted, no effect with 'cpu'.")
    buffer_size: PositiveCount = Field(100_000_000, description="DeepSpeed's NVMe buffer size; accepted, no effect.")
    max_in_cpu: Count = Field(1_000_000_000, description="DeepSpeed's NVMe option; accepted, no effect.")


class _FileMonitorConfig(_Section):
    enabled: bool = Field(False, description="Write the training events (rank 0).")
    output_path: str = Field("", description="Directory for the files (empty: DeepSpeed's default under ~).")
    job_name: str = Field("DeepSpeedJobName", description="Subdirectory of output_path for this run.")


class TensorBoardConfig(_FileMonitorConfig):
    """DeepSpeed's ``tensorboard`` section (needs the tensorboard package)."""


class CsvMonitorConfig(_FileMonitorConfig):
    """DeepSpeed's ``csv_monitor`` section: one CSV file per event."""


class WandbConfig(_Section):
    enabled: bool = Field(False, description="Log the training events to Weights & Biases (rank 0; needs wandb).")
    team: str | None = Field(None, description="wandb entity.")
    group: str | None = Field(None, description="wandb run group.")
    project: str = Field("deepspeed", description="wandb project.")


class CometConfig(_Section):
    enabled: bool = Field(False, description="Log the training events to Comet (rank 0; needs comet_ml).")
    samples_log_interval: PositiveCount = Field(100, description="Log every this many samples.")
    project: str | None = Field(None, description="Comet project.")
    workspace: str | None = Field(None, description="Comet workspace.")
    api_key: str | None = Field(None, description="Comet API key (else Comet's own configuration).")
    experiment_name: str | None = Field(None, description="Comet experiment name.")
    experiment_key: str | None = Field(None, description="Resume this Comet experiment.")
    online: bool | None = Field(None, description="Comet online mode.")
    mode: str | None = Field(None, description="Comet mode (get, create, get_or_create).")


class ZeroOptimizationConfig(_Section):
    stage: StageNumber | Literal["auto"] = Field(
        0, description="0 replicate, 1 shard optimizer state, 2 + gradients, 3 + parameters. 'auto': the lowest "
        "stage, then stage 3 with offload, whose per-rank memory fits memory_budget_gib, chosen at initialize "
        "(the table is logged; zero-engine estimate prints it)."
    )
    memory_budget_gib: Real | None = Field(
        None, gt=0, description="stage: auto: device memory per rank for model states, the largest gathered unit "
        "and activation_memory_gib. unset: on a GPU its free memory less memory_margin_gib; on CPU required."
    )
    activation_memory_gib: Real = Field(
        1.0, ge=0, description="stage: auto: the allowance for activations counted in every candidate."
    )
    memory_margin_gib: Real = Field(
        2.0, ge=0, description="stage: auto on a GPU without memory_budget_gib: free device memory less this "
        "(the CUDA context, the allocator's fragmentation, other processes)."
    )
    overlap_comm: bool = Field(True, description="Launch gradient reductions during backward, bucket by bucket.")
    contiguous_gradients: bool = Field(True, description="Gradients live in one flat buffer (always true here).")
    reduce_scatter: bool = Field(True, description="DeepSpeed option; stages 1-2 always reduce-scatter (fastest primitive per backend).")
    reduce_bucket_size: BucketSize = Field(
        2_000_000, description="Elements per gradient-reduction bucket (and per shard unit at stages 1-2; at stage 3 "
        "without stage3_wrap_modules, the parameter count that makes a module a unit)."
    )
    allgather_partitions: bool = Field(True, description="DeepSpeed option; updated shards are always all-gathered, one unit per call.")
    allgather_bucket_size: PositiveCount = Field(
        500_000_000, description="DeepSpeed option; accepted (shards are gathered per reduce_bucket_size unit)."
    )
    reduce_scatter_each_micro_step: bool = Field(
        True,
        description="Stage 2: reduce-scatter every micro-step into the gradient shard (memory 4Ψ/N); "
        "false: accumulate full gradients and reduce once per step (memory 4Ψ, k times less traffic). "
        "Stage 3 always reduce-scatters every micro-step.",
    )
    round_robin_gradients: bool = Field(False, description="DeepSpeed stage 1-2 option; accepted, no effect.")
    offload_optimizer: OffloadOptimizerConfig | None = Field(
        None, description="Stages 1-3: this rank's fp32 master, gradient and optimizer state live on the host, "
        "where the optimizer steps."
    )
    offload_param: OffloadParamConfig | None = Field(
        None, description="Stage 3: the parameter shards live on the host and go to the device just before "
        "their all-gather (no effect at stages 1-2)."
    )
    sub_group_size: Count = Field(
        1_000_000_000, description="DeepSpeed stage 3 option (optimizer sub-groups); accepted, no effect."
    )
    stage3_prefetch_bucket_size: Count = Field(
        50_000_000,
        description="Stage 3: the next unit (in recorded order) is gathered ahead of use if it has at most this "
        "many elements; the gathers agreed ahead in one exchange (a window of up to 4 units) hold at most this many.",
    )
    stage3_param_persistence_threshold: Count = Field(
        100_000,
        description="Stage 3: trainable parameters with fewer elements stay whole on every rank "
        "(their gradients and optimizer state are still sharded, as at stage 2).",
    )
    stage3_model_persistence_threshold: Count = Field(
        2**63 - 1, description="DeepSpeed option (a model-wide cap on parameters kept whole); accepted, no effect."
    )
    stage3_max_live_parameters: Count = Field(
        1_000_000_000,
        description="Stage 3: no prefetch or window of gathers agreed ahead may raise the gathered elements "
        "above this (units in use are always gathered).",
    )
    stage3_max_reuse_distance: Count = Field(
        1_000_000_000,
        description="DeepSpeed option; accepted, no effect (a unit is freed after each use and gathered again).",
    )
    stage3_gather_16bit_weights_on_model_save: bool = Field(
        False, description="DeepSpeed option; accepted, no effect: checkpoints hold fp32 masters at every stage, "
        "and full_state_dict() gathers them."
    )
    recompute_units: bool = Field(
        False, description="Recompute each unit's activations in backward instead of keeping them (torch's "
        "non-reentrant checkpoint around each unit module: stage 3's units, the same modules at stages 0-2; units "
        "holding other units are left whole). At stage 3 the backward's gather serves the recomputation."
    )
    stage3_wrap_modules: list[str] | None = Field(
        None,
        description="Stage 3: class names whose modules become units (e.g. [Block]); unset: the classes a Hugging "
        "Face model declares in _no_split_modules (e.g. GPT2Block), else every module whose not yet wrapped "
        "parameters reach reduce_bucket_size elements. The rest form the root unit.",
    )
    shard_group_size: PositiveCount | Literal["auto"] | None = Field(
        None,
        description="Hybrid sharding: shard over groups of this many consecutive ranks (one node, usually) and "
        "replicate across the groups; gradient shards are all-reduced across groups, parameters gathered inside a "
        "group only. Must divide the world size. unset: one group of every rank; 'auto': LOCAL_WORLD_SIZE (the "
        "ranks torchrun starts per node). FSDP's HYBRID_SHARD / a 2-D (replicate, shard) device mesh.",
    )
    mics_shard_size: Integer = Field(
        -1, ge=-1, description="DeepSpeed MiCS's name for shard_group_size; -1: unset."
    )
    zero_hpz_partition_size: PositiveCount = Field(
        1, description="ZeRO++ hierarchical partitioning: a secondary parameter copy per group of this many ranks; "
        "not built, refused above 1 (shard_group_size gives node-local gathers)."
    )
    zero_quantized_weights: bool = Field(False, description="ZeRO++ int8 weight gathers; not built, refused when on.")
    zero_quantized_gradients: bool = Field(False, description="ZeRO++ int4 gradient reductions; not built, refused when on.")
    zero_quantized_nontrainable_weights: bool = Field(
        False, description="ZeRO++ int8 frozen weights; not built, refused when on."
    )
    memory_efficient_linear: bool = Field(True, description="DeepSpeed stage 3 option; accepted, no effect.")
    stage3_module_granularity_threshold: Count = Field(0, description="DeepSpeed stage 3 option; accepted, no effect.")
    stage3_use_all_reduce_for_fetch_params: bool = _deepspeed_option(False)
    mics_hierarchical_params_gather: bool = Field(False, description="DeepSpeed MiCS option; accepted, no effect.")
    use_multi_rank_bucket_allreduce: bool = _deepspeed_option(True)
    log_trace_cache_warnings: bool = _deepspeed_option(False)
    ignore_unused_parameters: bool = Field(True, description="DeepSpeed option; parameters without gradients are always allowed.")
    elastic_checkpoint: bool = Field(False, description="DeepSpeed option; checkpoints here are always elastic.")
    load_from_fp32_weights: bool = Field(True, description="DeepSpeed option; masters always load from fp32.")
    compute_grad_norm: bool = _deepspeed_option(True)
    stage3_allgather_sequential: bool = _deepspeed_option(False)
    legacy_stage1: bool = _deepspeed_option(False)
    parameter_alignment: bool = _deepspeed_option(False)
    pipeline_loading_checkpoint: bool = _deepspeed_option(False)
    override_module_apply: bool = _deepspeed_option(True)
    enable_sanity_checks: bool = _deepspeed_option(False)
    save_muon_momentum_buffer_in_memory: bool = _deepspeed_option(False)
    leaf_module: dict[str, Any] | None = Field(
        None, description="DeepSpeed stage 3 leaf modules (gathered whole); accepted, no effect: every unit is a "
        "whole module here, and stage3_wrap_modules names them."
    )
    zenflow: dict[str, Any] | None = Field(None, description="DeepSpeed's ZenFlow section; refused when given.")

    def shard_group_size_for(self, world_size: int, local_world_size: int | None = None) -> int:
        """Ranks per shard group for ``world_size`` ranks (``local_world_size``: torchrun's
        ranks per node, for ``'auto'``)."""
        key, value = "shard_group_size", self.shard_group_size
        if value is None and self.mics_shard_size != -1:
            key, value = "mics_shard_size", self.mics_shard_size
        if value is None:
            return world_size
        if value == "auto":
            value = local_world_size or world_size
            key = f"{key} = 'auto' (LOCAL_WORLD_SIZE)"
        if world_size % value:
            raise ConfigError(
                f"zero_optimization.{key} = {value} does not divide the world size {world_size}: "
                "every shard group must hold the same number of ranks"
            )
        return value


class CommConfig(_Section):
    backend: Literal["auto", "nccl", "gloo"] = Field("auto", description="auto: NCCL on CUDA, gloo on CPU.")
    timeout_s: Real = Field(
        1800.0, gt=0, le=MAX_TIMEOUT_S, description="Seconds before a collective that never completes fails (at most "
        "1e12: gloo keeps a group's timeout in microseconds of a 64-bit integer, about 9.2e12 s)."
    )
    primitives: Literal["auto", "native", "per_shard"] = Field(
        "auto",
        description="How reduce-scatter and all-gather run. native: reduce_scatter_tensor / all_gather_into_tensor; "
        "per_shard: one reduce / broadcast per shard, all in flight (faster on gloo); auto: per_shard on gloo, "
        "native otherwise.",
    )
    force_collectives: bool = Field(
        False,
        description="For testing: issue every collective even at world size 1 (a process group of one rank, "
        "as torchrun --nproc_per_node=1 makes), so that one GPU runs the asynchronous NCCL path; otherwise "
        "world size 1 skips them.",
    )


class BatchSizes(NamedTuple):
    train_batch_size: int
    micro_batch_size: int
    gradient_accumulation_steps: int


class ZeroEngineConfig(_Section):
    """The whole configuration file."""

    train_batch_size: PositiveCount | None = Field(None, description="Global batch: micro x accumulation x ranks.")
    train_micro_batch_size_per_gpu: PositiveCount | None = Field(None, description="Samples per rank per micro-step.")
    gradient_accumulation_steps: PositiveCount | None = Field(None, description="Micro-steps per optimizer step.")
    optimizer: OptimizerConfig = Field(default_factory=OptimizerConfig, description="The torch optimizer.")
    scheduler: SchedulerConfig | None = Field(None, description="The learning-rate schedule.")
    gradient_clipping: Real = Field(
        1.0, ge=0, description="Clip the global gradient norm to this; 0 = off. 1.0 when left out, as in DeepSpeed "
        "(initialize logs the clipping in effect)."
    )
    fp16: FP16Config = Field(default_factory=FP16Config, description="float16 mixed precision.")
    bf16: BF16Config = Field(default_factory=BF16Config, description="bfloat16 mixed precision.")
    communication_data_type: Literal["fp32", "fp16", "bf16"] | None = Field(
        None, description="dtype of gradient reductions; unset: fp32 (DeepSpeed: the compute dtype)."
    )
    zero_optimization: ZeroOptimizationConfig = Field(
        default_factory=ZeroOptimizationConfig, description="What is sharded, and how gradients are reduced."
    )
    comm: CommConfig = Field(default_factory=CommConfig, description="Process group settings (ours).")
    steps_per_print: Annotated[PositiveCount | None, BeforeValidator(_never_when_infinite)] = Field(
        None, description="Every this many optimizer steps, rank 0 logs the step, learning rates, gradient norm, "
        "loss scale and skipped steps (logger zero_engine, INFO), as DeepSpeed prints them. null (the default, as in "
        "DeepSpeed) or infinity (Accelerate writes it): never."
    )
    wall_clock_breakdown: bool = _deepspeed_option(False)
    zero_allow_untested_optimizer: bool = _deepspeed_option(False)
    prescale_gradients: bool = _deepspeed_option(False)
    gradient_predivide_factor: Real = Field(1.0, gt=0, description="DeepSpeed option; accepted, no effect.")
    zero_force_ds_cpu_optimizer: bool = _deepspeed_option(True)
    memory_breakdown: bool = _deepspeed_option(False)
    dump_state: bool = _deepspeed_option(False)
    disable_allgather: bool = _deepspeed_option(False)
    dataloader_drop_last: bool = _deepspeed_option(False)
    graph_harvesting: bool = _deepspeed_option(False)
    seq_parallel_communication_data_type: str = _deepspeed_option("fp32")
    sparse_gradients: bool = Field(False, description="DeepSpeed option: sparse embedding gradients; refused when on.")
    sequence_parallel_size: PositiveCount = Field(1, description="DeepSpeed option: Ulysses sequence parallelism; "
                                                  "refused above 1.")
    managed_gradient_accumulation: bool = Field(
        True, description="DeepSpeed: false makes every step() an accumulation boundary; refused when false "
        "(set_gradient_accumulation_boundary says where a window ends)."
    )
    gradient_allreduce_op: Literal["mean", "sum"] = Field(
        "mean", description="DeepSpeed: gradients averaged over the ranks ('mean'); 'sum' is refused."
    )
    disable_python_gc: bool = _deepspeed_option(False)
    log_level: str | None = _deepspeed_option(None)
    use_data_before_expert_parallelism: bool = _deepspeed_option(False)
    vocabulary_size: PositiveCount | None = _deepspeed_option(None)
    # Read by no part of DeepSpeed 0.19.8 (its accelerator picks the backend and the device), but
    # found in configs written for it, DeepSpeed's own examples among them.
    dist_backend: str | None = _deepspeed_option(None)
    cuda_visible_devices: Any = _deepspeed_option(None)
    # DeepSpeed-only sections: accepted whole, logged at initialize unless switched off.
    # Monitors, DeepSpeed's keys and event names (zero_engine.monitor).
    tensorboard: TensorBoardConfig | None = Field(None, description="TensorBoard event files (needs tensorboard).")
    csv_monitor: CsvMonitorConfig | None = Field(None, description="One CSV file per training event.")
    wandb: WandbConfig | None = Field(None, description="Weights & Biases (needs wandb).")
    comet: CometConfig | None = Field(None, description="Comet (needs comet_ml).")
    monitor_config: dict[str, Any] | None = Field(None, description="DeepSpeed section.")
    flops_profiler: dict[str, Any] | None = Field(None, description="DeepSpeed section.")
    comms_logger: dict[str, Any] | None = Field(None, description="DeepSpeed section.")
    comms_config: dict[str, Any] | None = Field(None, description="DeepSpeed section.")
    activation_checkpointing: dict[str, Any] | None = Field(None, description="DeepSpeed section.")
    aio: dict[str, Any] | None = Field(None, description="DeepSpeed section.")
    compile: dict[str, Any] | None = Field(None, description="DeepSpeed section.")
    data_types: dict[str, Any] | None = Field(None, description="DeepSpeed section.")
    checkpoint: dict[str, Any] | None = Field(None, description="DeepSpeed section.")
    tensor_parallel: dict[str, Any] | None = Field(None, description="DeepSpeed section.")
    pipeline: dict[str, Any] | None = Field(None, description="DeepSpeed section.")
    amp: dict[str, Any] | None = Field(None, description="DeepSpeed section.")
    torch_autocast: dict[str, Any] | None = Field(None, description="DeepSpeed section.")
    elasticity: dict[str, Any] | None = Field(None, description="DeepSpeed section.")
    autotuning: dict[str, Any] | None = Field(None, description="DeepSpeed section.")
    sparse_attention: dict[str, Any] | None = Field(None, description="DeepSpeed section.")
    curriculum_learning: dict[str, Any] | None = Field(None, description="DeepSpeed section.")
    data_efficiency: dict[str, Any] | None = Field(None, description="DeepSpeed section.")
    compression_training: dict[str, Any] | None = Field(None, description="DeepSpeed section.")
    quantize_training: dict[str, Any] | None = Field(None, description="DeepSpeed section.")
    weight_quantization: dict[str, Any] | None = Field(None, description="DeepSpeed section.")
    progressive_layer_drop: dict[str, Any] | None = Field(None, description="DeepSpeed section.")
    eigenvalue: dict[str, Any] | None = Field(None, description="DeepSpeed section.")
    hybrid_engine: dict[str, Any] | None = Field(None, description="DeepSpeed section.")
    nebula: dict[str, Any] | None = Field(None, description="DeepSpeed section.")
    timers: dict[str, Any] | None = Field(None, description="DeepSpeed section.")
    datastates_ckpt: dict[str, Any] | None = Field(None, description="DeepSpeed section.")
    expert_parallel: dict[str, Any] | None = Field(None, description="DeepSpeed section.")
    _notes: list[str] = PrivateAttr(default_factory=list)  # from translating DeepSpeed's spellings
    _auto: list[str] = PrivateAttr(default_factory=list)  # "auto" keys initialize fills (deepspeed_compat)

    @model_validator(mode="after")
    def _check_cross_fields(self) -> ZeroEngineConfig:
        if self.fp16.enabled and self.bf16.enabled:
            raise ValueError("fp16.enabled and bf16.enabled are both true: enable at most one")
        low = self.communication_data_type
        if low in ("fp16", "bf16") and not getattr(self, low).enabled:
            raise ValueError(
                f"communication_data_type = {low!r} reduces in {low}, which needs {low}.enabled = true "
                "(gradients are computed in the compute dtype)"
            )
        zero = self.zero_optimization
        for key in ("offload_optimizer", "offload_param"):
            section = getattr(zero, key)
            if zero.stage == 0 and section is not None and section.device != "none":
                raise ValueError(
                    f"zero_optimization.{key}.device = {section.device!r} needs zero_optimization.stage 1-3 "
                    "(stage 0 replicates every state on every rank; offloading starts from a shard)"
                )
        if zero.mics_shard_size == 0:
            raise ValueError("zero_optimization.mics_shard_size = 0: use -1 (unset) or a number of ranks per group")
        if zero.shard_group_size is not None and zero.mics_shard_size not in (-1, zero.shard_group_size):
            raise ValueError(
                f"zero_optimization.shard_group_size = {zero.shard_group_size!r} and its DeepSpeed alias "
                f"mics_shard_size = {zero.mics_shard_size} disagree: set one of them"
            )
        return self

    def batch_sizes(self, world_size: int) -> BatchSizes:
        """Fill in the batch triple for ``world_size``; any two keys determine the third."""
        return resolve_batch_sizes(
            self.train_batch_size, self.train_micro_batch_size_per_gpu, self.gradient_accumulation_steps, world_size
        )


def resolve_batch_sizes(total: int | None, micro: int | None, accum: int | None, world_size: int) -> BatchSizes:
    """DeepSpeed's batch arithmetic: ``total = micro * accum * world_size``."""
    if total is None:
        micro, accum = micro or 1, accum or 1
        return BatchSizes(micro * accum * world_size, micro, accum)
    if micro is None and accum is None:
        accum = 1
    if micro is None:
        assert accum is not None
        if total % (accum * world_size):
            raise ConfigError(
                f"train_batch_size = {total} is not divisible by gradient_accumulation_steps ({accum}) x "
                f"world size ({world_size}) = {accum * world_size}: set train_micro_batch_size_per_gpu"
            )
        return BatchSizes(total, total // (accum * world_size), accum)
    if accum is None:
        if total % (micro * world_size):
            raise ConfigError(
                f"train_batch_size = {total} is not divisible by train_micro_batch_size_per_gpu ({micro}) x "
                f"world size ({world_size}) = {micro * world_size}: set gradient_accumulation_steps"
            )
        return BatchSizes(total, micro, total // (micro * world_size))
    if micro * accum * world_size != total:
        raise ConfigError(
            f"train_batch_size = {total} but train_micro_batch_size_per_gpu ({micro}) x "
            f"gradient_accumulation_steps ({accum}) x world size ({world_size}) = {micro * accum * world_size}: "
            "give two of the three and the third is derived"
        )
    return BatchSizes(total, micro, accum)


# ---------------------------------------------------------------------------------------------
# Optimizer checks: the class by name, its keywords by signature, its numbers by range.

_ENGINE_OWNED_OPTIMIZER_ARGS = {"params", "self"}
_NON_NEGATIVE = {"lr", "weight_decay", "momentum", "dampening", "lr_decay", "alpha", "lambd", "momentum_decay"}
_POSITIVE = {"eps"}
# Switches whose default is None (the implementation picks): true, false or null.
_OPTIONAL_FLAGS = {"foreach", "fused", "capturable", "differentiable", "maximize"}


def optimizer_classes() -> dict[str, type[torch.optim.Optimizer]]:
    """Every torch.optim optimizer, by lower-case class name."""
    return {
        name.lower(): cls
        for name, cls in vars(torch.optim).items()
        if isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer) and cls is not torch.optim.Optimizer
    }


# DeepSpeed's own optimizers, and the nearest torch.optim one to use instead.
DEEPSPEED_OPTIMIZERS = {
    "lamb": "LAMB's layer-wise trust ratio is not in torch.optim; the nearest is AdamW (lower the learning rate)",
    "onebitadam": "1-bit Adam compresses its communication, which is not built; AdamW is the same update",
    "zerooneadam": "0/1 Adam compresses its communication, which is not built; AdamW is the same update",
    "onebitlamb": "1-bit LAMB is not built; the nearest is AdamW",
    "lion": "Lion is not in torch.optim; the nearest is AdamW",
    "muadam": "MuAdam (muP) is not built; use AdamW with per-group learning rates (param_groups)",
    "muadamw": "MuAdamW (muP) is not built; use AdamW with per-group learning rates (param_groups)",
    "musgd": "MuSGD (muP) is not built; use SGD with per-group learning rates (param_groups)",
}


def optimizer_class(name: str) -> type[torch.optim.Optimizer]:
    classes = optimizer_classes()
    try:
        return classes[name.lower()]
    except KeyError:
        if name.lower() in DEEPSPEED_OPTIMIZERS:
            raise ValueError(f"optimizer.type = {name!r} is DeepSpeed's own: {DEEPSPEED_OPTIMIZERS[name.lower()]}") from None
        known = sorted(cls.__name__ for cls in classes.values())
        raise ValueError(f"optimizer.type = {name!r} is not a torch.optim optimizer{suggest(name, known)}") from None


def optimizer_options(cls: type[torch.optim.Optimizer]) -> frozenset[str]:
    """The keywords an optimizer class takes besides its parameters: what a param group may set."""
    return frozenset(inspect.signature(cls.__init__).parameters) - {"self", "params"}


def check_optimizer(section: OptimizerConfig) -> None:
    cls = optimizer_class(section.type)
    signature = inspect.signature(cls.__init__).parameters
    accepted = [k for k in signature if k not in _ENGINE_OWNED_OPTIMIZER_ARGS]
    for key, value in section.params.items():
        path = f"optimizer.params.{key}"
        if key not in accepted:
            raise ValueError(
                f"{path} = {value!r}: {cls.__name__} takes no keyword {key!r}{suggest(key, accepted)}"
            )
        default = signature[key].default
        if isinstance(default, int) and not isinstance(default, bool):
            default = float(default)  # an optimizer's numbers are real (momentum=0 takes 0.9)
        section.params[key] = check_value_type(path, value, default, flag=key in _OPTIONAL_FLAGS)
        if key in _NON_NEGATIVE | _POSITIVE:
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ValueError(f"{path} = {value!r}: must be a finite number")
            if value < 0 or (key in _POSITIVE and value == 0):
                raise ValueError(f"{path} = {value!r}: must be {'positive' if key in _POSITIVE else 'non-negative'}")
        if key == "betas":
            if not (
                isinstance(value, (list, tuple))
                and len(value) == 2
                and all(isinstance(b, (int, float)) and not isinstance(b, bool) and 0 <= b < 1 for b in value)
            ):
                raise ValueError(f"{path} = {value!r}: must be two numbers in [0, 1)")


def check_scheduler(section: SchedulerConfig) -> None:
    """The scheduler exists and takes these keywords (the optimizer is supplied by the engine),
    each of the right kind and range; counts written as ``1e4`` (a string in YAML) become
    integers. `zero_engine.schedules.dry_run` then runs it at `initialize`."""
    cls = scheduler_class(section.type)
    signature = inspect.signature(cls.__init__).parameters
    accepted = [k for k in signature if k not in ("self", "optimizer")]
    for key in accepted:
        if signature[key].default is inspect.Parameter.empty and key not in section.params:
            raise ValueError(f"scheduler.params.{key}: required by {cls.__name__}")
    for key, value in section.params.items():
        path = f"scheduler.params.{key}"
        if key not in accepted:
            raise ValueError(f"{path} = {value!r}: {cls.__name__} takes no keyword {key!r}{suggest(key, accepted)}")
        section.params[key] = check_schedule_param(path, key, value, signature[key].default)
    check_schedule_params(cls.__name__, section.params)


# ---------------------------------------------------------------------------------------------
# Loading and error reporting.


# DeepSpeed keys accepted so that its configs load unchanged, with why none of them changes
# anything here. At a non-default value each is named in a warning at `initialize`.
NO_EFFECT: dict[str, str] = {
    "fp16.auto_cast": "inputs are cast to the compute dtype and the model runs on compute-dtype copies; "
    "there is no autocast",
    "zero_optimization.contiguous_gradients": "gradients always live in one flat buffer per unit",
    "zero_optimization.reduce_scatter": "stages 1-3 always reduce-scatter (comm.primitives picks how)",
    "zero_optimization.allgather_partitions": "updated shards are always all-gathered, one unit per call",
    "zero_optimization.allgather_bucket_size": "shards are gathered one unit at a time (reduce_bucket_size or "
    "stage3_wrap_modules cut the units)",
    "zero_optimization.round_robin_gradients": "each unit's gradient is reduce-scattered as one flat buffer",
    "zero_optimization.memory_efficient_linear": "linear layers run as the model defines them; nothing is patched",
    "zero_optimization.stage3_module_granularity_threshold": "stage3_wrap_modules or reduce_bucket_size pick the "
    "unit modules",
    "zero_optimization.stage3_use_all_reduce_for_fetch_params": "parameters are always all-gathered",
    "zero_optimization.mics_hierarchical_params_gather": "gathers run inside each shard group in one step",
    "zero_optimization.use_multi_rank_bucket_allreduce": "gradients are reduce-scattered unit by unit",
    "zero_optimization.log_trace_cache_warnings": "there is no trace cache; the gather order is agreed each pass",
    "zero_optimization.sub_group_size": "the optimizer steps this rank's pieces, one unit at a time in low "
    "precision; there are no optimizer sub-groups",
    "zero_optimization.stage3_max_reuse_distance": "a unit is freed after each use and gathered again",
    "zero_optimization.stage3_model_persistence_threshold": "parameters stay whole by "
    "stage3_param_persistence_threshold alone; there is no model-wide cap",
    "zero_optimization.stage3_gather_16bit_weights_on_model_save": "checkpoints hold fp32 masters at every "
    "stage; full_state_dict() gathers them",
    "zero_optimization.ignore_unused_parameters": "parameters without gradients are always allowed",
    "zero_optimization.elastic_checkpoint": "checkpoints load at any stage and world size",
    "zero_optimization.load_from_fp32_weights": "masters always load from the fp32 values in the checkpoint",
    "wall_clock_breakdown": "no timers are kept; comm_report() gives the bytes moved",
    "zero_allow_untested_optimizer": "every torch.optim optimizer is allowed (stages 1-3: elementwise ones)",
    "prescale_gradients": "gradients are always averaged over the ranks; dividing before or after the sum is the "
    "same arithmetic up to rounding (sums are fp32 unless communication_data_type says otherwise)",
    "gradient_predivide_factor": "gradients are always averaged over the ranks; splitting the division around the "
    "sum is the same arithmetic up to rounding (sums are fp32 unless communication_data_type says otherwise)",
    "zero_force_ds_cpu_optimizer": "there is no DeepSpeed CPU optimizer here; torch.optim's optimizers are used",
    "memory_breakdown": "engine.memory_report() gives the bytes of model state each rank holds",
    "dump_state": "no state dump; the resolved config is engine.config (zero-engine validate prints it)",
    "disable_allgather": "updated shards are always all-gathered",
    "dataloader_drop_last": "the engine builds no data loader",
    "graph_harvesting": "no CUDA graphs are captured",
    "seq_parallel_communication_data_type": "there is no sequence parallelism",
    "disable_python_gc": "the engine leaves Python's garbage collector as it is",
    "log_level": "the engine logs through Python's logging (logger zero_engine); set its level there",
    "use_data_before_expert_parallelism": "there is no expert parallelism; experts are sharded as any module",
    "vocabulary_size": "nothing here depends on the vocabulary size",
    "dist_backend": "DeepSpeed 0.19.8 does not read it either; comm.backend picks the backend (auto: NCCL on CUDA, "
    "gloo on CPU)",
    "cuda_visible_devices": "DeepSpeed does not read it either; each rank trains on cuda:LOCAL_RANK (set "
    "CUDA_VISIBLE_DEVICES in the environment)",
    "bf16.immediate_grad_update": "gradients go into their bucket or shard as each one is produced",
    "bf16.check_grad_overflow": "a non-finite gradient norm always skips the step, at every precision",
    "zero_optimization.compute_grad_norm": "the norm is always computed: it rides on the step's one small "
    "all-reduce",
    "zero_optimization.stage3_allgather_sequential": "each unit is gathered in one collective",
    "zero_optimization.legacy_stage1": "stage 1 has one implementation",
    "zero_optimization.parameter_alignment": "each unit is padded to a multiple of the shard count",
    "zero_optimization.pipeline_loading_checkpoint": "there is no pipeline parallelism",
    "zero_optimization.override_module_apply": "module.apply runs on the model as it is (stage 3 parameters are "
    "empty between uses)",
    "zero_optimization.enable_sanity_checks": "the engine's checks always run",
    "zero_optimization.save_muon_momentum_buffer_in_memory": "there is no Muon optimizer here",
    "zero_optimization.leaf_module": "every stage 3 unit is a whole module already (stage3_wrap_modules names them)",
    **{f"zero_optimization.offload_optimizer.{key}": "no NVMe offload or DeepSpeed CPU optimizer here" for key in (
        "pipeline_read", "pipeline_write", "cpuadam_cores_perc"
    )},
    **{f"zero_optimization.offload_param.{key}": "no NVMe offload here" for key in ("buffer_size", "max_in_cpu")},
    **{f"bf16.{key}": "bf16 needs no loss scaling" for key in (
        "loss_scale", "loss_scale_window", "initial_scale_power", "hysteresis", "min_loss_scale"
    )},
}

_MONITORS = "DeepSpeed's internal wrapper of the monitor sections: give tensorboard, csv_monitor, wandb or comet at the top level"
# DeepSpeed-only sections, with why each changes nothing here; logged at initialize unless
# switched off (``enabled: false``). `zero_engine.features` refuses what asks for more.
DEEPSPEED_SECTIONS: dict[str, str] = {
    "monitor_config": _MONITORS,
    "flops_profiler": "no FLOPs profiler here: use torch.profiler (with_flops=True)",
    "comms_logger": "no communication logger: engine.comm_report() gives each step's bytes per collective",
    "comms_config": "DeepSpeed's communication backend options; collectives here go through torch.distributed "
    "(comm.* keys)",
    "activation_checkpointing": "it configures deepspeed.checkpointing, which a model calls itself; "
    "zero_optimization.recompute_units recomputes each unit instead (or use torch.utils.checkpoint in the model)",
    "aio": "asynchronous I/O for NVMe offload, which is not built",
    "compile": "the engine does not compile from the config; apply torch.compile to the model's blocks",
    "data_types": "gradients accumulate in the dtype each stage keeps them in; it is not configurable",
    "checkpoint": "checkpoints here always load at any stage and world size, and their tags are agreed between ranks",
    "tensor_parallel": "there is no tensor parallelism here (a size above 1 is refused at initialize)",
    "pipeline": "there is no pipeline parallelism here (pipeline_parallel_size above 1 is refused at initialize)",
    "amp": "NVIDIA Apex AMP is refused when enabled: use bf16 or fp16, which keep fp32 masters",
    "torch_autocast": "autocast is refused when enabled: bf16 or fp16 run the model on low-precision copies",
    "elasticity": "the batch triple is fixed by the config; checkpoints load at any world size",
    "autotuning": "no autotuner; zero-engine estimate gives per-rank memory by the formula",
    "sparse_attention": "DeepSpeed's sparse attention kernels are not part of this engine",
    "curriculum_learning": "the engine does not touch data or sequence lengths",
    "data_efficiency": "the engine does not touch data sampling or routing",
    "compression_training": "no compression of the model",
    "quantize_training": "no quantization of the model",
    "weight_quantization": "no quantization of the model",
    "progressive_layer_drop": "layers run as the model defines them",
    "eigenvalue": "no eigenvalue computation",
    "hybrid_engine": "no inference engine here",
    "nebula": "checkpoints are written by save_checkpoint in their own format",
    "timers": "no timers are kept; comm_report() gives the bytes moved",
    "datastates_ckpt": "checkpoints are written by save_checkpoint in their own format",
    "expert_parallel": "there is no expert parallelism; experts are sharded as any module (enabling it is refused "
    "at initialize)",
}


def auto_keys(config: ZeroEngineConfig) -> list[str]:
    """The keys given as ``"auto"`` that `initialize` fills (`zero_engine.auto_values`)."""
    return list(config._auto)


def no_effect_settings(config: ZeroEngineConfig) -> list[str]:
    """One message for each `NO_EFFECT` key set to something other than its default, each
    DeepSpeed-only section given and not switched off, and each note from translating
    DeepSpeed's spellings."""
    messages = list(config._notes)
    for name, why in DEEPSPEED_SECTIONS.items():
        section = getattr(config, name)
        if section is not None and section.get("enabled", True) is not False:
            messages.append(f"the {name} section has no effect here: {why}")
    for path, why in NO_EFFECT.items():
        *sections, key = path.split(".")
        section: BaseModel | None = config
        for name in sections:
            section = getattr(section, name)
        if section is None:  # an optional section left out (offload_param, ...)
            continue
        value, default = getattr(section, key), type(section).model_fields[key].default
        if value != default:
            messages.append(f"{path} = {value!r} has no effect here: {why}")
    zero = config.zero_optimization
    if zero.stage != "auto" and zero.memory_budget_gib is not None:
        messages.append(
            f"zero_optimization.memory_budget_gib = {zero.memory_budget_gib} has no effect: it is the budget of "
            "stage: auto, and the stage is set"
        )
    offload_param = zero.offload_param is not None and zero.offload_param.device != "none"
    if zero.stage != "auto" and zero.stage < 3 and offload_param:
        messages.append(
            f"zero_optimization.offload_param.device = {zero.offload_param.device!r} has no effect at stage "
            f"{zero.stage}: parameters are whole on every rank below stage 3 (DeepSpeed ignores it there too)"
        )
    return messages


def load_config(source: str | Path | dict[str, Any] | ZeroEngineConfig) -> ZeroEngineConfig:
    """A validated config from a ``.yaml``/``.yml``/``.json`` path, a dict, or a config object."""
    if isinstance(source, ZeroEngineConfig):
        return source
    raw, origin = read_config_mapping(source)
    translated = translate(raw)
    try:
        config = ZeroEngineConfig.model_validate(translated.config)
    except ValidationError as err:
        raise ConfigError(_format_errors(origin, translated.problems, err)) from None
    if translated.problems:
        raise ConfigError(_format_errors(origin, translated.problems))
    config._notes = translated.notes
    config._auto = translated.auto
    return config


def read_config_mapping(source: str | Path | dict[str, Any]) -> tuple[dict[str, Any], str]:
    """The raw mapping of a config file or dict, not yet translated or validated (integrations
    fill Hugging Face's ``"auto"`` in it first), and where it came from, for error messages."""
    origin = "config dict"
    if isinstance(source, (str, Path)):
        origin = str(source)
        source = _read_file(Path(source))
    if not isinstance(source, dict):
        raise ConfigError(f"{origin}: expected a mapping of keys at the top level, got {type(source).__name__}")
    return source, origin


def _read_file(path: Path) -> Any:
    if not path.is_file():
        raise ConfigError(f"{path}: no such config file")
    text = path.read_text()
    try:
        if path.suffix in (".yaml", ".yml"):
            data = yaml.load(text, Loader=_UniqueKeyLoader)  # noqa: S506 (a SafeLoader)
            if data is None:
                raise ConfigError(f"{path}: the config file is empty (nothing but comments or blank lines)")
            return data
        if path.suffix in (".json", ".hjson"):
            return _read_json(text)
    except _DuplicateKey as err:
        raise ConfigError(f"{path}:{err}") from None
    except (yaml.YAMLError, hjson.HjsonDecodeError) as err:
        raise ConfigError(f"{path}: not valid {path.suffix[1:].upper()}: {err}") from None
    raise ConfigError(f"{path}: unknown config suffix {path.suffix!r}; use .yaml, .yml or .json")


def _read_json(text: str) -> Any:
    """Strict JSON first (it reads ``Infinity``, which Accelerate writes); else hjson, as
    DeepSpeed reads its config: comments, trailing and missing commas. Errors name the line."""
    try:
        return json.loads(text, object_pairs_hook=_unique_pairs)
    except json.JSONDecodeError:
        return hjson.loads(text, object_pairs_hook=_unique_pairs)


class _DuplicateKey(ValueError):
    """A key given twice in one mapping: YAML and JSON parsers keep the last one silently (a
    second ``zero_optimization:`` block turned stage 3 into stage 1)."""


class _UniqueKeyLoader(yaml.SafeLoader):
    """``yaml.safe_load`` that refuses a key given twice in one mapping."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        first_line: dict[Any, int] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # ``<<: *anchor``: its keys may be overridden
                continue
            key = self.construct_object(key_node, deep=deep)
            line = key_node.start_mark.line + 1
            if key in first_line:
                raise _DuplicateKey(f"{line}: key {key!r} given twice in one mapping (first on line {first_line[key]})")
            first_line[key] = line
        return super().construct_mapping(node, deep=deep)


def _unique_pairs(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """``json.loads`` hook: one object's keys, refusing a key given twice."""
    result: dict[str, Any] = {}
    for key, value in pairs:
        if key in result:
            raise _DuplicateKey(f" key {key!r} given twice in one object")
        result[key] = value
    return result


def _format_errors(origin: str, problems: list[str], err: ValidationError | None = None) -> str:
    """One message for every problem of a config: translation problems, then field errors."""
    items = _merged_union_errors(err.errors() if err is not None else [])
    lines = [f"{origin}: {len(problems) + len(items)} invalid setting(s)"]
    lines += [f"  {problem}" for problem in problems]
    for item in items:
        loc = item["loc"]
        path = ".".join(str(part) for part in loc)
        message = item["msg"].removeprefix("Value error, ")
        if item["type"] == "extra_forbidden":
            known = list(_model_at(loc[:-1]).model_fields)
            lines.append(f"  {path}: unknown key{suggest(str(loc[-1]), known)}")
        elif path:
            lines.append(f"  {path} = {item['input']!r}: {message}")
        else:
            lines.append(f"  {message}")
    return "\n".join(lines)


# pydantic's names for the members of a union (``int``, ``literal['auto']``, ``function-after[...]``).
_UNION_TAGS = {"int", "str", "float", "bool", "none", "list", "dict"}


def _merged_union_errors(items: list[Any]) -> list[Any]:
    """One error per key for a value that fits no member of a union (``stage: 4`` against
    ``0-3 | 'auto'``), the members' messages joined, without pydantic's member names in the path."""
    merged: dict[tuple[Any, ...], dict[str, Any]] = {}
    for item in items:
        loc = tuple(part for part in item["loc"] if not _is_union_tag(part))
        key = (loc, repr(item.get("input")))
        if key in merged:
            merged[key]["msg"] += f"; or {item['msg'].removeprefix('Value error, ')}"
        else:
            merged[key] = {**item, "loc": loc}
    return list(merged.values())


def _is_union_tag(part: Any) -> bool:
    return isinstance(part, str) and ("[" in part or "(" in part or part in _UNION_TAGS)


def _model_at(loc: tuple[Any, ...]) -> type[BaseModel]:
    """The pydantic section class found at a key path, for listing its known keys."""
    model: type[BaseModel] = ZeroEngineConfig
    for part in loc:
        annotation = model.model_fields[str(part)].annotation
        candidates = getattr(annotation, "__args__", (annotation,))
        model = next(c for c in candidates if isinstance(c, type) and issubclass(c, BaseModel))
    return model


def key_reference(model: type[BaseModel] = ZeroEngineConfig, prefix: str = "") -> list[tuple[str, str, str]]:
    """Every key path with its default and description, for ``docs/config.md``."""
    rows = []
    for name, field in model.model_fields.items():
        annotation = field.annotation
        sections = [a for a in getattr(annotation, "__args__", (annotation,)) if isinstance(a, type)
                    and issubclass(a, BaseModel)]
        if sections:
            rows.append((prefix + name, "section", field.description or ""))
            rows.extend(key_reference(sections[0], prefix + name + "."))
        else:
            default = "{}" if field.default_factory is not None else repr(field.default)
            text = field.description or ""
            if prefix + name in NO_EFFECT:
                text = f"DeepSpeed option, no effect here: {NO_EFFECT[prefix + name]}. Logged at `initialize` when set."
            elif not prefix and name in DEEPSPEED_SECTIONS:
                text = (
                    f"DeepSpeed section, accepted whole, no effect here: {DEEPSPEED_SECTIONS[name]}. Logged at "
                    "`initialize` unless `enabled: false`."
                )
            rows.append((prefix + name, default, text))
    return rows
