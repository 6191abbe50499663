"""The whole configuration file (`ZeroEngineConfig`), the checks between its sections, and
DeepSpeed's batch arithmetic."""

from __future__ import annotations

from typing import ClassVar, Annotated, Any, Literal, NamedTuple

from pydantic import BeforeValidator, Field, PrivateAttr, model_validator

from ..errors import ConfigError
from .sections import (
    BF16Config, CometConfig, CommConfig, CsvMonitorConfig, FP16Config, OptimizerConfig, SchedulerConfig,
    TensorBoardConfig, WandbConfig, ZeroOptimizationConfig,
)
from .types import Count, PositiveCount, Real, Refused, _deepspeed_option, _never_when_infinite, _Section


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
        None, description="Every this many optimizer steps, rank 0 prints a progress line (logger zero_engine, "
        "INFO, on stdout unless the application configured logging): the step, rank 0's mean loss, learning rates, "
        "gradient norm, loss scale (fp16), skipped steps, samples/s and tokens/s, as DeepSpeed prints its line. "
        "null (the default, as in DeepSpeed) or infinity (Accelerate writes it): never."
    )
    wall_clock_breakdown: bool = Field(
        False, description="Add the forward, backward and step times to the progress line (mean per optimizer step "
        "since the last line; on a GPU the device is synchronized around each phase, as DeepSpeed's timers do). "
        "Needs steps_per_print."
    )
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
    sequence_parallel_size: PositiveCount = Field(
        1, description="Ulysses sequence parallelism: each sequence split over this many consecutive ranks, which "
        "read the same micro-batches; attention exchanged over them (Hugging Face models, 'sdpa' or 'eager'). "
        "train_batch_size counts the data-parallel ranks, world size / this."
    )
    expert_parallel_size: PositiveCount = Field(
        1, description="Ours: expert parallelism. Each mixture-of-experts block's experts (a Hugging Face MoE "
        "model's fused experts, found at initialize) owned by groups of this many consecutive ranks, "
        "num_experts / this on each, tokens sent to their experts' owners by all-to-all (dropless, the model's own "
        "router and expert code). Every rank still reads its own micro-batches; experts' state is sharded over "
        "the world / this ranks that own the same experts. DeepSpeed's expert_parallel.autoep_size is read as it."
    )
    sequence_parallel_eval: bool = Field(
        True, description="Ours: with sequence_parallel_size above 1, evaluation and other forwards without gradients "
        "(eval(), torch.no_grad()) are split over the sequence group as training forwards are, the loss the whole "
        "micro-batch's on every rank, the logits the rank's slice's; generate and forwards with a cache stay whole. "
        "false: every forward without gradients sees the sequence whole."
    )
    tiled_loss_tokens: Count = Field(
        0, description="Ours: a Hugging Face causal language model's training loss computed this many tokens at a "
        "time, so the whole sequence's logits (vocabulary x tokens) never exist at once; 0: off. Training forwards "
        "with labels then return no logits."
    )
    tiled_mlp_tokens: Count = Field(
        0, description="Ours: each module named 'mlp' (a Hugging Face decoder layer's MLP) computed this many tokens "
        "at a time in training forwards, each tile recomputed in backward, so its intermediate activations exist "
        "for one tile, not the whole sequence; 0: off."
    )
    checkpoint_format: str = Field(
        "zero_engine", description="Ours: the format save_checkpoint writes when its format= is not given: "
        "'zero_engine' (this engine's own, any stage and world size), 'dcp' (torch.distributed.checkpoint in "
        "torchtitan's layout, which FSDP2 loads with dcp.load), or a format registered with "
        "zero_engine.state.formats.register. load_checkpoint reads any registered format, found by its files."
    )
    managed_gradient_accumulation: bool = Field(
        True, description="DeepSpeed: false makes every step() an accumulation boundary; refused when false "
        "(set_gradient_accumulation_boundary says where a window ends)."
    )
    gradient_allreduce_op: Literal["mean", "sum"] = Field(
        "mean", description="DeepSpeed: gradients averaged over the ranks ('mean'); 'sum' is refused."
    )
    disable_python_gc: bool = _deepspeed_option(False)
    log_level: str | None = _deepspeed_option(None)
    use_data_before_expert_parallelism: bool = Field(
        False, description="DeepSpeed: expert groups of ranks far apart instead of consecutive; refused when true "
        "(expert groups are consecutive ranks here, DeepSpeed's default)."
    )
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
    # What this version cannot run, refused at `initialize` (`zero_engine.config.refusals`).
    REFUSED: ClassVar[dict[str, Refused]] = {
        "managed_gradient_accumulation": Refused(
            lambda c: not c.managed_gradient_accumulation,
            lambda c: "managed_gradient_accumulation = false (every step() a boundary; "
            "engine.set_gradient_accumulation_boundary says where a window ends)",
            "refused when false",
        ),
        "gradient_allreduce_op": Refused(
            lambda c: c.gradient_allreduce_op != "mean",
            lambda c: f"gradient_allreduce_op = {c.gradient_allreduce_op!r} (gradients are averaged over the ranks)",
            "refused when 'sum'",
        ),
        "expert_parallel": Refused(
            lambda c: bool(_autoep_refusals(c.expert_parallel)),
            lambda c: "; ".join(_autoep_refusals(c.expert_parallel)),
        ),
        "use_data_before_expert_parallelism": Refused(
            lambda c: c.use_data_before_expert_parallelism,
            lambda c: "use_data_before_expert_parallelism = true (expert groups are consecutive ranks here)",
        ),
        "sparse_gradients": Refused(
            lambda c: c.sparse_gradients,
            lambda c: "sparse_gradients = true (sparse embedding gradients; gradients are dense flat buffers here)",
        ),
        **{
            section: Refused(
                lambda c, section=section: bool((getattr(c, section) or {}).get("enabled")),
                lambda c, section=section: f"{section}.enabled = true (use bf16 or fp16 instead)",
            )
            for section in ("amp", "torch_autocast")
        },
        "pipeline": Refused(
            lambda c: _pipeline_size(c.pipeline) > 1,
            lambda c: f"pipeline.pipeline_parallel_size = {_pipeline_size(c.pipeline)} (pipeline parallelism)",
        ),
        "tensor_parallel": Refused(
            lambda c: bool(_tensor_parallel_sizes(c.tensor_parallel)),
            lambda c: "; ".join(
                f"tensor_parallel.{key} = {size} (tensor parallelism; data parallelism with ZeRO is built)"
                for key, size in _tensor_parallel_sizes(c.tensor_parallel)
            ),
        ),
    }

    # DeepSpeed's keys of this section that change nothing here, and why: named at `initialize`
    # when set, and in the key table (`zero_engine.config.deepspeed`).
    NO_EFFECT: ClassVar[dict[str, str]] = {
        "zero_allow_untested_optimizer": "every torch.optim optimizer is allowed (stages 1-3: elementwise ones)",
        "prescale_gradients": (
            "gradients are always averaged over the ranks; dividing before or after the sum is the same "
            "arithmetic up to rounding (sums are fp32 unless communication_data_type says otherwise)"
        ),
        "gradient_predivide_factor": (
            "gradients are always averaged over the ranks; splitting the division around the sum is the same "
            "arithmetic up to rounding (sums are fp32 unless communication_data_type says otherwise)"
        ),
        "zero_force_ds_cpu_optimizer": "there is no DeepSpeed CPU optimizer here; torch.optim's optimizers are used",
        "memory_breakdown": "engine.memory_report() gives the bytes of model state each rank holds",
        "dump_state": "no state dump; the resolved config is engine.config (zero-engine validate prints it)",
        "disable_allgather": "updated shards are always all-gathered",
        "dataloader_drop_last": "the engine builds no data loader",
        "graph_harvesting": "no CUDA graphs are captured",
        "seq_parallel_communication_data_type": "there is no sequence parallelism",
        "disable_python_gc": "the engine leaves Python's garbage collector as it is",
        "log_level": "the engine logs through Python's logging (logger zero_engine); set its level there",
        "vocabulary_size": "nothing here depends on the vocabulary size",
        "dist_backend": (
            "DeepSpeed 0.19.8 does not read it either; comm.backend picks the backend (auto: NCCL on CUDA, gloo "
            "on CPU)"
        ),
        "cuda_visible_devices": (
            "DeepSpeed does not read it either; each rank trains on cuda:LOCAL_RANK (set CUDA_VISIBLE_DEVICES in "
            "the environment)"
        ),
    }

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
        if zero.recompute_offload and not zero.recompute_units:
            raise ValueError(
                "zero_optimization.recompute_offload = true needs zero_optimization.recompute_units = true: it "
                "offloads what each recomputed unit keeps"
            )
        autoep = _autoep_size(self.expert_parallel)
        if autoep is not None:
            if "expert_parallel_size" in self.model_fields_set and self.expert_parallel_size != autoep:
                raise ValueError(
                    f"expert_parallel_size = {self.expert_parallel_size} and DeepSpeed's expert_parallel.autoep_size "
                    f"= {autoep} disagree: set one of them"
                )
            self.__dict__["expert_parallel_size"] = autoep  # not an assignment: that would validate again
        if self.expert_parallel_size > 1 and self.sequence_parallel_size > 1:
            raise ValueError(
                f"expert_parallel_size = {self.expert_parallel_size} with sequence_parallel_size = "
                f"{self.sequence_parallel_size}: expert parallelism under the sequence split is not built (set one)"
            )
        if zero.mics_shard_size == 0:
            raise ValueError("zero_optimization.mics_shard_size = 0: use -1 (unset) or a number of ranks per group")
        if zero.shard_group_size is not None and zero.mics_shard_size not in (-1, zero.shard_group_size):
            raise ValueError(
                f"zero_optimization.shard_group_size = {zero.shard_group_size!r} and its DeepSpeed alias "
                f"mics_shard_size = {zero.mics_shard_size} disagree: set one of them"
            )
        return self

    def batch_sizes(self, data_ranks: int) -> BatchSizes:
        """Fill in the batch triple for ``data_ranks``; any two keys determine the third."""
        return resolve_batch_sizes(
            self.train_batch_size, self.train_micro_batch_size_per_gpu, self.gradient_accumulation_steps, data_ranks
        )


def resolve_batch_sizes(total: int | None, micro: int | None, accum: int | None, data_ranks: int) -> BatchSizes:
    """DeepSpeed's batch arithmetic: ``total = micro * accum * data_ranks``."""
    if total is None:
        micro, accum = micro or 1, accum or 1
        return BatchSizes(micro * accum * data_ranks, micro, accum)
    if micro is None and accum is None:
        accum = 1
    if micro is None:
        assert accum is not None
        if total % (accum * data_ranks):
            raise ConfigError(
                f"train_batch_size = {total} is not divisible by gradient_accumulation_steps ({accum}) x "
                f"world size ({data_ranks}) = {accum * data_ranks}: set train_micro_batch_size_per_gpu"
            )
        return BatchSizes(total, total // (accum * data_ranks), accum)
    if accum is None:
        if total % (micro * data_ranks):
            raise ConfigError(
                f"train_batch_size = {total} is not divisible by train_micro_batch_size_per_gpu ({micro}) x "
                f"world size ({data_ranks}) = {micro * data_ranks}: set gradient_accumulation_steps"
            )
        return BatchSizes(total, micro, total // (micro * data_ranks))
    if micro * accum * data_ranks != total:
        raise ConfigError(
            f"train_batch_size = {total} but train_micro_batch_size_per_gpu ({micro}) x "
            f"gradient_accumulation_steps ({accum}) x world size ({data_ranks}) = {micro * accum * data_ranks}: "
            "give two of the three and the third is derived"
        )
    return BatchSizes(total, micro, accum)


# DeepSpeed's AutoEP keys (``expert_parallel``) and what each means here: read, or of no effect
# (the model's own router and expert code run, found by structure).
_AUTOEP_READ = {"enabled", "autoep_size"}
_AUTOEP_NO_EFFECT = {"preset_model", "use_grouped_mm"}


def _autoep_size(section: dict[str, Any] | None) -> int | None:
    """DeepSpeed's ``expert_parallel.autoep_size`` when its section is enabled (1 when enabled
    without one), else None."""
    section = section or {}
    if not section.get("enabled"):
        return None
    size = section.get("autoep_size", 1)
    return size if isinstance(size, int) and not isinstance(size, bool) and size >= 1 else None


def _autoep_refusals(section: dict[str, Any] | None) -> list[str]:
    """What of an enabled ``expert_parallel`` section this engine cannot honour, by key."""
    section = section or {}
    if not section.get("enabled"):
        return []
    found = []
    size = section.get("autoep_size", 1)
    if not (isinstance(size, int) and not isinstance(size, bool) and size >= 1):
        found.append(f"expert_parallel.autoep_size = {size!r} (a positive number of ranks)")
    if section.get("load_balance_coeff") is not None:
        found.append(f"expert_parallel.load_balance_coeff = {section['load_balance_coeff']!r} (the model's own "
                     "auxiliary loss applies: its config's router_aux_loss_coef)")
    for key in sorted(set(section) - _AUTOEP_READ - _AUTOEP_NO_EFFECT - {"load_balance_coeff"}):
        found.append(f"expert_parallel.{key} (not read here: expert_parallel_size and the model's own router decide)")
    return found


def _pipeline_size(section: dict[str, Any] | None) -> int:
    size = (section or {}).get("pipeline_parallel_size", 1)
    return size if isinstance(size, int) else 1


def _tensor_parallel_sizes(section: dict[str, Any] | None) -> list[tuple[str, int]]:
    """DeepSpeed's spellings of the tensor-parallel size above 1 (``autotp_size``, ``tp_size``,
    ``tp.tp_size``)."""
    section = section or {}
    sizes = [(key, section[key]) for key in ("autotp_size", "tp_size") if isinstance(section.get(key), int)]
    nested = section.get("tp")
    if isinstance(nested, dict) and isinstance(nested.get("tp_size"), int):
        sizes.append(("tp.tp_size", nested["tp_size"]))
    return [(key, size) for key, size in sizes if size > 1]
