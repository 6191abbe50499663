"""The config's sections: the optimizer and its schedule, precision, offload, the monitors, the
process groups, and ``zero_optimization``. Each field says what it does; DeepSpeed's keys that
change nothing here say so (`zero_engine.config.deepspeed`)."""

from __future__ import annotations

from typing import ClassVar, Any, Literal

from pydantic import Field, model_validator

from ..errors import ConfigError
from .checks import check_optimizer, check_scheduler
from .types import (
    MAX_TIMEOUT_S, BucketSize, Count, Integer, PositiveCount, Real, Refused, StageNumber, _deepspeed_option, _Section,
)


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

    # DeepSpeed's keys of this section that change nothing here, and why: named at `initialize`
    # when set, and in the key table (`zero_engine.config.deepspeed`).
    NO_EFFECT: ClassVar[dict[str, str]] = {
        "auto_cast": (
            "inputs are cast to the compute dtype and the model runs on compute-dtype copies; there is no "
            "autocast"
        ),
    }
    # What this version cannot run, refused at `initialize` (`zero_engine.config.refusals`).
    REFUSED: ClassVar[dict[str, Refused]] = {
        "fp16_master_weights_and_grads": Refused(
            lambda s: s.fp16_master_weights_and_grads,
            lambda s: "fp16_master_weights_and_grads = true (masters, gradients and optimizer state are fp32 here)",
        ),
    }


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

    # DeepSpeed's keys of this section that change nothing here, and why: named at `initialize`
    # when set, and in the key table (`zero_engine.config.deepspeed`).
    NO_EFFECT: ClassVar[dict[str, str]] = {
        "immediate_grad_update": "gradients go into their bucket or shard as each one is produced",
        "check_grad_overflow": "a non-finite gradient norm always skips the step, at every precision",
        "loss_scale": "bf16 needs no loss scaling",
        "loss_scale_window": "bf16 needs no loss scaling",
        "initial_scale_power": "bf16 needs no loss scaling",
        "hysteresis": "bf16 needs no loss scaling",
        "min_loss_scale": "bf16 needs no loss scaling",
    }
    # What this version cannot run, refused at `initialize` (`zero_engine.config.refusals`).
    REFUSED: ClassVar[dict[str, Refused]] = {
        key: Refused(
            lambda s, key=key: getattr(s, key),
            lambda s, key=key: f"{key} = true (masters, gradients and optimizer state are fp32 here)",
        )
        for key in ("bf16_master_weights_and_grads", "bf16_optimizer_states")
    }


class OffloadConfig(_Section):
    device: Literal["none", "cpu", "nvme"] = Field(
        "none", description="'cpu': keep it in host memory (see the Offload guide, docs/guides/offload.md); 'nvme': "
        "a swap file per rank under nvme_path."
    )
    pin_memory: bool = Field(
        True,
        description="Page-locked fp32 masters, so their copies overlap the GPU's work (ignored without CUDA); the "
        "host gradients and parameter shards, which cross in every pass, are pinned whatever it says. Pinned buffers "
        "round up to a power of two, which initialize's host check counts.",
    )
    nvme_path: str | None = Field(
        None, description="The directory of each rank's swap file with 'nvme' (on a disk, not tmpfs)."
    )
    buffer_count: PositiveCount = Field(
        4, description="With 'nvme': how many shards' masters and state may be in host memory at once (and as "
        "many step gradients on their way to the file); no effect with 'cpu'."
    )
    fast_init: bool = Field(False, description="DeepSpeed's fast-init switch; accepted for compatibility.")
    ratio: Real = Field(
        1.0, ge=0, le=1, description="Fraction offloaded; below 1.0 (DeepSpeed's partial offload) is refused."
    )

    # What this version cannot run, refused at `initialize` (`zero_engine.config.refusals`): a
    # partial offload of an offload that is on.
    REFUSED: ClassVar[dict[str, Refused]] = {
        "ratio": Refused(
            lambda s: s.device != "none" and s.ratio < 1.0,
            lambda s: f"ratio = {s.ratio} (partial offload, DeepSpeed's ZeRO-Offload++ twin-flow; offloading all of "
            "it, ratio 1.0, is built)",
            "honoured at 1.0 (below: refused)",
        ),
    }
    # Keys whose line in the key table says more than "no effect".
    KEY_STATUS: ClassVar[dict[str, str]] = {
        "nvme_path": "honoured with 'nvme'", "buffer_count": "honoured with 'nvme'", "fast_init": "no effect",
    }

    @model_validator(mode="after")
    def _nvme_needs_a_path(self) -> OffloadConfig:
        if self.device == "nvme" and not self.nvme_path:
            raise ValueError("device = 'nvme' needs nvme_path: the directory of each rank's swap file")
        return self


class OffloadOptimizerConfig(OffloadConfig):
    """``zero_optimization.offload_optimizer``."""

    pipeline_read: bool = _deepspeed_option(False)
    pipeline_write: bool = _deepspeed_option(False)
    super_offload: bool = Field(False, description="DeepSpeed's SuperOffload; refused when on.")
    cpuadam_cores_perc: Real = Field(0.8, gt=0, le=1, description="DeepSpeed option; accepted, no effect.")

    # DeepSpeed's keys of this section that change nothing here, and why: named at `initialize`
    # when set, and in the key table (`zero_engine.config.deepspeed`).
    NO_EFFECT: ClassVar[dict[str, str]] = {
        "pipeline_read": "with 'nvme' the next shard is always read ahead while one steps",
        "pipeline_write": "with 'nvme' each shard is always written behind the next one's step",
        "cpuadam_cores_perc": "no DeepSpeed CPU optimizer here (torch's fused CPU kernel)",
    }
    REFUSED: ClassVar[dict[str, Refused]] = {
        **OffloadConfig.REFUSED,
        "super_offload": Refused(
            lambda s: s.device != "none" and s.ratio == 1.0 and s.super_offload,
            lambda s: "super_offload = true (DeepSpeed's SuperOffload)",
        ),
    }


class OffloadParamConfig(OffloadConfig):
    """``zero_optimization.offload_param``."""

    buffer_count: PositiveCount = Field(
        5, description="With 'nvme': how many parameter shards may be read ahead of their gathers or written behind "
        "at once (host memory: that many shards); no effect with 'cpu'."
    )
    buffer_size: PositiveCount = Field(100_000_000, description="DeepSpeed's NVMe buffer size; accepted, no effect.")
    max_in_cpu: Count = Field(1_000_000_000, description="DeepSpeed's NVMe option; accepted, no effect.")

    # DeepSpeed's keys of this section that change nothing here, and why: named at `initialize`
    # when set, and in the key table (`zero_engine.config.deepspeed`).
    NO_EFFECT: ClassVar[dict[str, str]] = {
        "buffer_size": "with 'nvme' each shard is read and written whole, into a buffer of its own size",
        "max_in_cpu": "with 'nvme' no shard is kept in host memory beyond its read ahead (buffer_count bounds them)",
    }


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
    frozen_weights: Literal["shard", "replicate"] = Field(
        "shard",
        description="Ours, not DeepSpeed's: at stage 3, 'shard' (default) shards frozen parameters (requires_grad "
        "False: a LoRA base, a reference model) 1/N as trainable ones, gathered around their use and never reduced; "
        "'replicate' keeps them whole on every rank and never gathers them (spare memory, scarce bandwidth; in int8 "
        "with zero_quantized_nontrainable_weights). Below "
        "stage 3 frozen parameters are whole either way. Frozen weights are never copied to fp32: under fp16/bf16 "
        "they are stored in the compute dtype.",
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
    recompute_offload: bool = Field(
        False, description="Ours, with recompute_units: each recomputed unit's input (what the checkpoint keeps "
        "for its recomputation: its hidden states) kept in host memory, pinned, and brought back ahead of its "
        "recomputation (a side stream on CUDA), so the device keeps no activation between forward and backward. "
        "DeepSpeed's activation_checkpointing.cpu_checkpointing and Hugging Face's gradient_checkpointing_kwargs "
        "{'offload': true} ask for the same."
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
    zero_quantized_weights: bool = Field(
        False, description="ZeRO++ qwZ: stage 3's parameter all-gathers carry int8 values with one fp32 scale per "
        "block of 2048 (about a quarter of fp32's bytes, half of bf16's); each rank's own shard and the masters stay "
        "exact. No effect below stage 3 (parameters are whole there; DeepSpeed ignores it too).",
    )
    zero_quantized_gradients: bool = Field(
        False, description="ZeRO++ qgZ: gradient reduce-scatters (stages 1-3) carry int8 values (int4 with "
        "zero_quantized_gradients_bits: 4) with one fp32 scale per block of 2048, decoded and summed in fp32. With "
        "shard_group_size, only the hop across groups is quantized. No effect at stage 0.",
    )
    zero_quantized_gradients_bits: Literal[4, 8] = Field(
        8, description="Ours, not DeepSpeed's: the integer width of zero_quantized_gradients. 8 by default (within "
        "1.5% of unquantized training's loss here); 4 is DeepSpeed's width, a further half of the bytes.",
    )
    weight_wire_format: str | None = Field(
        None, description="Ours: how stage 3's parameter all-gathers travel, by the name of a wire form "
        "(zero_engine.sharding.shards.codec.GATHER_WIRE_FORMS: 'exact', 'int8'); unset: what "
        "zero_quantized_weights says. Both given and different: refused. No effect below stage 3.",
    )
    gradient_wire_format: str | None = Field(
        None, description="Ours: how gradient reduce-scatters (stages 1-3) travel, by the name of a wire form "
        "(zero_engine.sharding.shards.codec.GRAD_WIRE_FORMS: 'exact', 'int8', 'int4'); unset: what "
        "zero_quantized_gradients and its bits say. Both given and different: refused. No effect at stage 0.",
    )
    zero_quantized_nontrainable_weights: bool = Field(
        False, description="ZeRO++ int8 frozen weights, at stage 3: each frozen weight matrix is quantized once at "
        "initialize (int8, one fp32 scale per block of 2048) and kept so, each rank's shard (frozen_weights 'shard': "
        "gathered in int8 too) or the whole on every rank ('replicate': decoded around each use, never gathered): "
        "about half a bf16 base's bytes. Every rank decodes the same values into the compute dtype; exports and "
        "checkpoints hold the decoded values (the exact base is not kept). Trainable parameters, vectors (norms, "
        "biases) and the parameters of zero_quantized_nontrainable_exact stay exact. No effect below stage 3 "
        "(DeepSpeed applies it only where ZeRO-3 partitions parameters).",
    )
    zero_quantized_nontrainable_min_numel: Count = Field(
        2048, description="Ours, not DeepSpeed's: frozen weights with fewer elements than this stay exact under "
        "zero_quantized_nontrainable_weights (one block's scale would cost more than it saves)."
    )
    zero_quantized_nontrainable_exact: list[str] = Field(
        default_factory=list, description="Ours, not DeepSpeed's: frozen parameters kept exact under "
        "zero_quantized_nontrainable_weights, as fnmatch patterns of their names (e.g. ['*embed_tokens*', "
        "'*lm_head*']); a pattern matching no frozen parameter is refused at initialize."
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

    # What this version cannot run, refused at `initialize` (`zero_engine.config.refusals`).
    REFUSED: ClassVar[dict[str, Refused]] = {
        "zenflow": Refused(
            lambda s: s.zenflow is not None,
            lambda s: "zenflow (DeepSpeed's ZenFlow: stale-gradient offloaded updates)",
            "refused when given",
        ),
        "zero_hpz_partition_size": Refused(
            lambda s: s.zero_hpz_partition_size > 1,
            lambda s: f"zero_hpz_partition_size = {s.zero_hpz_partition_size} (ZeRO++ hierarchical partitioning; "
            "zero_optimization.shard_group_size shards parameters within each node instead)",
        ),
    }

    # DeepSpeed's keys of this section that change nothing here, and why: named at `initialize`
    # when set, and in the key table (`zero_engine.config.deepspeed`).
    NO_EFFECT: ClassVar[dict[str, str]] = {
        "contiguous_gradients": "gradients always live in one flat buffer per unit",
        "reduce_scatter": "stages 1-3 always reduce-scatter (comm.primitives picks how)",
        "allgather_partitions": "updated shards are always all-gathered, one unit per call",
        "allgather_bucket_size": (
            "shards are gathered one unit at a time (reduce_bucket_size or stage3_wrap_modules cut the units)"
        ),
        "round_robin_gradients": "each unit's gradient is reduce-scattered as one flat buffer",
        "memory_efficient_linear": "linear layers run as the model defines them; nothing is patched",
        "stage3_module_granularity_threshold": "stage3_wrap_modules or reduce_bucket_size pick the unit modules",
        "stage3_use_all_reduce_for_fetch_params": "parameters are always all-gathered",
        "mics_hierarchical_params_gather": "gathers run inside each shard group in one step",
        "use_multi_rank_bucket_allreduce": "gradients are reduce-scattered unit by unit",
        "log_trace_cache_warnings": "there is no trace cache; the gather order is agreed each pass",
        "sub_group_size": (
            "the optimizer steps this rank's pieces, one unit at a time in low precision; there are no optimizer "
            "sub-groups"
        ),
        "stage3_max_reuse_distance": "a unit is freed after each use and gathered again",
        "stage3_model_persistence_threshold": (
            "parameters stay whole by stage3_param_persistence_threshold alone; there is no model-wide cap"
        ),
        "stage3_gather_16bit_weights_on_model_save": (
            "checkpoints hold fp32 masters at every stage; full_state_dict() gathers them"
        ),
        "ignore_unused_parameters": "parameters without gradients are always allowed",
        "elastic_checkpoint": "checkpoints load at any stage and world size",
        "load_from_fp32_weights": "masters always load from the fp32 values in the checkpoint",
        "compute_grad_norm": "the norm is always computed: it rides on the step's one small all-reduce",
        "stage3_allgather_sequential": "each unit is gathered in one collective",
        "legacy_stage1": "stage 1 has one implementation",
        "parameter_alignment": "each unit is padded to a multiple of the shard count",
        "pipeline_loading_checkpoint": "there is no pipeline parallelism",
        "override_module_apply": "module.apply runs on the model as it is (stage 3 parameters are empty between uses)",
        "enable_sanity_checks": "the engine's checks always run",
        "save_muon_momentum_buffer_in_memory":
            "Muon's momentum is optimizer state here, sharded and offloaded with the rest",
        "leaf_module": "every stage 3 unit is a whole module already (stage3_wrap_modules names them)",
    }

    def shard_group_size_for(self, data_ranks: int, local_world_size: int | None = None) -> int:
        """Ranks per shard group for ``data_ranks`` ranks (``local_world_size``: torchrun's
        ranks per node, for ``'auto'``)."""
        key, value = "shard_group_size", self.shard_group_size
        if value is None and self.mics_shard_size != -1:
            key, value = "mics_shard_size", self.mics_shard_size
        if value is None:
            return data_ranks
        if value == "auto":
            value = local_world_size or data_ranks
            key = f"{key} = 'auto' (LOCAL_WORLD_SIZE)"
        if data_ranks % value:
            raise ConfigError(
                f"zero_optimization.{key} = {value} does not divide the world size {data_ranks}: "
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
