"""DeepSpeed's keys that are accepted so that its configs load, and why each changes nothing
here: named at `initialize` when set (`no_effect_settings`), and listed with every other key in
the table of ``docs/config.md`` (`key_reference`)."""

from __future__ import annotations

from pydantic import BaseModel

from .schema import ZeroEngineConfig


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
