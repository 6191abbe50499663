"""DeepSpeed's keys that are accepted so that its configs load, and why each changes nothing
here: named at `initialize` when set (`no_effect_settings`), and listed with every other key in
the table of ``docs/config.md`` (`key_reference`)."""

from __future__ import annotations

from pydantic import BaseModel

from .schema import ZeroEngineConfig


def _declared(model: type[BaseModel], prefix: str = "") -> dict[str, str]:
    """Every section's ``NO_EFFECT`` (declared beside its fields), by key path."""
    found = {prefix + key: why for key, why in getattr(model, "NO_EFFECT", {}).items()}
    for name, field in model.model_fields.items():
        for member in getattr(field.annotation, "__args__", (field.annotation,)):
            if isinstance(member, type) and issubclass(member, BaseModel):
                found.update(_declared(member, f"{prefix}{name}."))
    return found


# DeepSpeed keys accepted so that its configs load unchanged, with why none of them changes
# anything here, by key path: each section declares its own (``NO_EFFECT`` beside its fields).
# At a non-default value each is named in a warning at `initialize`.
NO_EFFECT: dict[str, str] = _declared(ZeroEngineConfig)

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
    "zero_optimization.recompute_units recomputes each unit instead (or use torch.utils.checkpoint in the model), "
    "and with it cpu_checkpointing = true keeps each unit's input in host memory (recompute_offload)",
    "aio": "NVMe offload here reads and writes with os.preadv/os.pwrite on one I/O thread per rank, not libaio",
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
    "expert_parallel": "AutoEP: enabled with autoep_size is read as expert_parallel_size (preset_model and "
    "use_grouped_mm change nothing: the model's own router and expert code run); load_balance_coeff and other keys "
    "are refused at initialize",
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
    if config.wall_clock_breakdown and config.steps_per_print is None:
        messages.append(
            "wall_clock_breakdown = true has no effect without steps_per_print: the times are shown in the progress "
            "line printed every steps_per_print optimizer steps"
        )
    zero = config.zero_optimization
    if zero.stage != "auto" and zero.memory_budget_gib is not None:
        messages.append(
            f"zero_optimization.memory_budget_gib = {zero.memory_budget_gib} has no effect: it is the budget of "
            "stage: auto, and the stage is set"
        )
    if zero.stage != "auto" and zero.stage < 3 and zero.zero_quantized_weights:
        messages.append(
            f"zero_optimization.zero_quantized_weights = True has no effect at stage {zero.stage}: parameters are "
            "whole on every rank below stage 3, nothing is gathered for compute (DeepSpeed ignores it there too)"
        )
    if zero.zero_quantized_nontrainable_weights and zero.stage != "auto" and zero.stage < 3:
        messages.append(
            f"zero_optimization.zero_quantized_nontrainable_weights = True has no effect at stage {zero.stage}: "
            "frozen weights are whole and exact below stage 3, where nothing decodes them around their use "
            "(DeepSpeed applies it only where ZeRO-3 partitions parameters)"
        )
    if zero.stage == 0 and zero.zero_quantized_gradients:
        messages.append(
            "zero_optimization.zero_quantized_gradients = True has no effect at stage 0: gradients are all-reduced "
            "there, not reduce-scattered"
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
            default = repr(field.default_factory() if field.default_factory is not None else field.default)
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
