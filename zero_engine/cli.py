"""The ``zero-engine`` console script.

    zero-engine validate CONFIG [--world-size N]        print the resolved config, or its errors
    zero-engine estimate CONFIG --params N [--frozen-params N] [--world-size N] [--shard-group-size G]
                                [--largest-unit N] [--model-config config.json --seq-len S [--micro-batch B]]
                                                         per-rank model-state bytes by the formula,
                                                         host and device apart with offload; with
                                                         stage: auto, every candidate and the choice;
                                                         with a decoder's config.json, its activations
                                                         for one micro-batch, with and without
                                                         recompute_units
    zero-engine consolidate CHECKPOINT OUT [--tag T]     write a plain fp32 state_dict (.pt, .safetensors)
    zero-engine consolidate CHECKPOINT OUT --format hf [--max-shard-size S] [--dtype D]
                                                         write Hugging Face's sharded safetensors
                                                         layout into the directory OUT, streamed
    zero-engine convert SOURCE OUT_DIR [--tag T] [--to zero_engine|dcp]
                                                         a checkpoint (DeepSpeed's, DCP's, ours) in this
                                                         engine's format or DCP's (torchtitan's layout,
                                                         for FSDP2): optimizer state, step and schedule kept
"""

from __future__ import annotations

import argparse
import json
import sys
import warnings
from typing import Any

from . import __version__
from .comm import Mesh
from .config import ZeroEngineConfig, load_config, read_config_mapping
from .errors import ConfigError
from .activations import DecoderShape, activation_bytes
from .accounting import Counted, tier_lines, tier_notes
from .memory import MemoryReport, estimate_from_config
from .optimizer_kinds import state_note
from .stage import stage_for
from .stage_choice import candidates, choose, format_table
from .state.consolidate import load_consolidated, write_state_dict
from .state.convert import convert_checkpoint
from .state.export import export_checkpoint
from .validation import check_config, summary, trainer_stand_ins
from .values import as_count


def _positive_count(text: str) -> int:
    """An argument that counts something: a positive integer, ``7e9`` included."""
    count = as_count(text)
    if count is None or count < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive integer")
    return count


def _non_negative_count(text: str) -> int:
    count = as_count(text)
    if count is None or count < 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a non-negative integer")
    return count


def _validate(args: argparse.Namespace) -> int:
    """initialize's own checks of the config (`zero_engine.validation`): a one-line summary and
    the notes on stderr, the resolved config as JSON on stdout; exit 1 with every problem named."""
    filled: list[str] = []
    try:
        source: Any = args.config
        if args.trainer:
            source, filled = trainer_stand_ins(read_config_mapping(args.config)[0])
        loaded = load_config(source)
        if args.world_size is None:  # one sequence group (a single rank without sequence parallelism)
            args.world_size = loaded.sequence_parallel_size
        checked = check_config(loaded, ranks=args.world_size, hidden_size=args.hidden_size)
    except (ConfigError, NotImplementedError) as err:
        print(f"invalid: {err}", file=sys.stderr)
        if not args.trainer and "TrainingArguments" in str(err):
            print("note: a config for Hugging Face's Trainer, TRL or Lightning (their 'auto' values): check it as "
                  "they use it with --trainer", file=sys.stderr)
        return 1
    config, batch = checked.config, checked.batch
    assert batch is not None
    print(summary(config, batch, args.world_size), file=sys.stderr)
    for key in filled:
        print(f"note: {key} is 'auto': the Trainer fills it from its TrainingArguments (checked with a stand-in)",
              file=sys.stderr)
    for note in checked.notes:
        print(f"note: {note}", file=sys.stderr)
    resolved = config.model_dump(mode="json")
    resolved.update(
        train_batch_size=batch.train_batch_size,
        train_micro_batch_size_per_gpu=batch.micro_batch_size,
        gradient_accumulation_steps=batch.gradient_accumulation_steps,
    )
    print(json.dumps(resolved, indent=2))
    return 0


def _estimate(args: argparse.Namespace) -> int:
    try:
        config = load_config(args.config)
        shape = _decoder_shape(args, config)
        if config.zero_optimization.stage == "auto":
            code = _estimate_auto(config, args)
            if code == 0 and shape is not None:
                _print_activations(config, args, shape)
            return code
        group = args.shard_group_size or config.zero_optimization.shard_group_size_for(args.world_size)
        counted: list[Counted] = []
        report = estimate_from_config(
            config, args.params, args.world_size, group, frozen_params=args.frozen_params,
            matrix_params=args.matrix_params, terms=counted, expert_params=args.expert_params,
        )
    except (ConfigError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    _print_states(config, args, group, report, counted)
    if shape is not None:
        _print_activations(config, args, shape)
    return 0


def _decoder_shape(args: argparse.Namespace, config: ZeroEngineConfig) -> DecoderShape | None:
    """The model's shape from ``--model-config``, which also settles ``--params`` (and the
    micro-batch, from the config, when not given)."""
    args.matrix_params = 0  # a whole-matrix optimizer's matrices, known from a model's shape alone
    if args.model_config is None:
        for flag, value in (("--seq-len", args.seq_len), ("--micro-batch", args.micro_batch)):
            if value is not None:
                raise ValueError(f"{flag} counts activations of the model that --model-config describes: give it")
        if args.params is None:
            raise ValueError("--params N (trainable parameters) or --model-config config.json is required")
        return None
    if args.seq_len is None:
        raise ValueError("--model-config counts activations: give the sequence length, --seq-len S")
    shape = DecoderShape.from_file(args.model_config)
    args.matrix_params = shape.matrix_params
    if args.params is None:
        args.params = shape.num_params
    if args.micro_batch is None:
        micro = config.train_micro_batch_size_per_gpu
        if not isinstance(micro, int):
            raise ValueError("train_micro_batch_size_per_gpu is not set in the config: give --micro-batch B")
        args.micro_batch = micro
    return shape


def _print_activations(config: ZeroEngineConfig, args: argparse.Namespace, shape: DecoderShape) -> None:
    """One micro-batch's activations, with and without recompute_units (`zero_engine.activations`)."""
    compute_bytes = 2 if config.fp16.enabled or config.bf16.enabled else 4
    on = config.zero_optimization.recompute_units
    group = Mesh.of(sequence=config.sequence_parallel_size)  # each rank holds its slice of every sequence
    tokens = group.slice_length(args.seq_len)
    split = f", {tokens} of them on each rank (sequence_parallel_size {group.world})" if group.world > 1 else ""
    print(f"activations of one micro-batch ({args.micro_batch} x {args.seq_len} tokens{split}; a Llama-style decoder "
          f"of {shape.layers} layers, hidden {shape.hidden}, vocabulary {shape.vocab}), not sharded by any stage:")
    tiles, mlp_tiles = config.tiled_loss_tokens, config.tiled_mlp_tokens
    counts = {recompute: activation_bytes(shape, args.micro_batch, tokens, compute_bytes, recompute, tiles, mlp_tiles)
              for recompute in (False, True)}
    mine = counts[on]
    for recompute, counted in counts.items():
        which = "recompute_units: true " if recompute else "recompute_units: false"
        chosen = "  <- this config" if recompute == on else ""
        print(f"  {which} kept for backward {counted.kept / 2**30:8.3f} GiB, step peak "
              f"{counted.peak / 2**30:8.3f} GiB{chosen}")
    if tiles:
        whole = activation_bytes(shape, args.micro_batch, tokens, compute_bytes, on)
        print(f"  of the peak, the loss's one tile of {tiles} tokens (tiled_loss_tokens): "
              f"{mine.loss / 2**30:.3f} GiB; untiled, the logits and their fp32 log-softmax and gradients "
              f"would take {whole.loss / 2**30:.3f} GiB")
    else:
        print("  of the peak, the loss's logits and their fp32 log-softmax and gradients: "
              f"{mine.loss / 2**30:.3f} GiB")
    if mlp_tiles:
        whole = activation_bytes(shape, args.micro_batch, tokens, compute_bytes, on, tiles)
        print(f"  the MLPs in tiles of {mlp_tiles} tokens (tiled_mlp_tokens): step peak {mine.peak / 2**30:.3f} GiB; "
              f"untiled MLPs {whole.peak / 2**30:.3f} GiB")
    print("  (the peak adds to the model states; stage 3 adds its gathered units; docs/guides/out-of-memory.md)")


def _print_states(
    config: ZeroEngineConfig, args: argparse.Namespace, group: int, report: MemoryReport, counted: list[Counted]
) -> None:
    """The formula's states per rank (``report``, summed from the terms ``counted``), with each
    tier's note and line and the optimizer's note."""
    zero = config.zero_optimization
    stage = stage_for(zero.stage)
    dtype = "fp16" if config.fp16.enabled else "bf16" if config.bf16.enabled else "fp32"
    sharding = ""
    if group < args.world_size:
        sharding = f" (sharded over groups of {group}, {args.world_size // group} replicas)"
    frozen = f" and {args.frozen_params:,} frozen" if args.frozen_params else ""
    print(f"stage {zero.stage}, {dtype}, {config.optimizer.type}, {args.world_size} rank(s){sharding}, "
          f"{args.params:,} trainable{frozen} parameters; per rank, without padding and activations:")
    if zero.shard_group_size == "auto" and not args.shard_group_size:
        print("  (shard_group_size: auto is settled at launch, one group per node of LOCAL_WORLD_SIZE ranks; "
              f"estimated here for one group of all {args.world_size}: --shard-group-size G for nodes of G ranks)")
    note = state_note(config.optimizer.type, config.optimizer.params, args.matrix_params)
    if note:
        print(f"  ({note}" + ("; --model-config counts the matrices)" if args.model_config is None else ")"))
    for line in tier_notes(counted, stage):
        print(f"  {line}")
    for key in ("parameters", "gradients", "optimizer_states", "master_parameters"):
        print(f"  {key:18s} {getattr(report, key) / 2**30:10.3f} GiB")
        if key == "parameters" and args.frozen_params:
            print(f"  {'  of which frozen':18s} {report.frozen_parameters / 2**30:10.3f} GiB")
    total = report.model_states
    print(f"  {'total':18s} {total / 2**30:10.3f} GiB")
    for line in tier_lines(counted, total):
        print(f"  {line}")
    if stage.shard_gradients and not stage.shard_parameters:  # stage 2: a bucket filling, one reducing
        print(f"  + during backward up to two gradient buckets: "
              f"{2 * zero.reduce_bucket_size * 4 / 2**30:.3f} GiB (reduce_bucket_size)")


def _estimate_auto(config: ZeroEngineConfig, args: argparse.Namespace) -> int:
    """``stage: auto``: every candidate as `initialize` weighs it (stage_choice), the largest
    stage 3 unit given by ``--largest-unit`` (initialize measures it on the model)."""
    if args.shard_group_size:
        config = config.model_copy(update={"zero_optimization": config.zero_optimization.model_copy(
            update={"shard_group_size": args.shard_group_size})})
    table = candidates(config, args.params, args.world_size, args.largest_unit, args.frozen_params, args.matrix_params)
    zero = config.zero_optimization
    unit = f"{args.largest_unit:,} parameters" if args.largest_unit else "not given: --largest-unit N"
    print(f"stage auto, {args.params:,} trainable parameters, {args.world_size} rank(s); per rank, on the device "
          f"(the largest stage 3 unit: {unit}):")
    if zero.memory_budget_gib is None:
        print(format_table(table, None, None))
        print("memory_budget_gib is unset: on a GPU, initialize uses its free memory less "
              f"memory_margin_gib ({zero.memory_margin_gib} GiB)")
        return 0
    budget = int(zero.memory_budget_gib * 2**30)
    try:
        chosen = choose(table, budget)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    print(format_table(table, budget, chosen))
    print(f"initialize would choose {chosen.name} (budget {zero.memory_budget_gib} GiB per rank)")
    return 0


def _consolidate(args: argparse.Namespace) -> int:
    if args.format == "hf":
        return _export(args)
    try:
        with warnings.catch_warnings(record=True) as noted:
            warnings.simplefilter("always")
            state = load_consolidated(args.checkpoint, args.tag)
        for note in noted:  # a checkpoint of the trainable state only says so
            print(f"note: {note.message}", file=sys.stderr)
        write_state_dict(state, args.out)
    except (OSError, ValueError, RuntimeError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    numel = sum(t.numel() for t in state.values())
    print(f"wrote {args.out}: {len(state)} tensors, {numel:,} elements")
    return 0


def _export(args: argparse.Namespace) -> int:
    """A checkpoint in Hugging Face's layout, one parameter at a time (`state.export`)."""
    try:
        out = export_checkpoint(args.checkpoint, args.out, args.tag, args.max_shard_size, args.dtype)
    except (OSError, ValueError, RuntimeError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    files = sorted(path.name for path in out.glob("model*.safetensors"))
    print(f"wrote {out}: {len(files)} safetensors file(s)")
    return 0


def _convert(args: argparse.Namespace) -> int:
    try:
        written, found = convert_checkpoint(args.source, args.out_dir, args.tag, args.to)
    except (OSError, ValueError, RuntimeError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    manifest = found.checkpoint.manifest
    stage = f" stage {manifest['stage']}" if manifest.get("stage") is not None else ""
    print(f"wrote {written}: a {found.writer}{stage} checkpoint as {args.to}, {len(manifest['params'])} tensors, "
          f"step {found.extra['global_step']}; "
          + ("load_checkpoint reads it at any stage and world size" if args.to == "zero_engine"
             else "dcp.load reads it into FSDP2 (torchtitan's layout), load_checkpoint here"))
    if found.ignored:
        print(f"not carried over (this engine has no such state): {', '.join(found.ignored)}")
    return 0


def _shard_size(text: str) -> int | str:
    return int(text) if text.isdigit() else text


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="zero-engine",
        description="zero_engine's command line: check a config, estimate per-rank memory, turn a checkpoint into "
        "a state dict or Hugging Face's layout, convert a DeepSpeed checkpoint. COMMAND --help for each.",
    )
    parser.add_argument("--version", action="version", version=f"zero-engine {__version__} (zero-sharding-engine)")
    verbs = parser.add_subparsers(dest="verb", required=True, metavar="COMMAND")
    validate = verbs.add_parser(
        "validate", help="check a config as initialize does and print it resolved (a summary and notes on stderr)"
    )
    validate.add_argument("config", help="a .yaml, .yml or .json config file")
    validate.add_argument(
        "--world-size", type=_positive_count,
        help="ranks to resolve the batch sizes for (default: 1, or one sequence group: sequence_parallel_size)",
    )
    validate.add_argument(
        "--trainer", action="store_true",
        help="a config for Hugging Face's Trainer (ZeroEngineTrainer, TRL): its 'auto' values, which the Trainer fills "
        "from TrainingArguments, are checked with stand-ins",
    )
    validate.add_argument(
        "--hidden-size", type=_positive_count,
        help="the model's config.hidden_size, to fill the bucket sizes given as 'auto' as initialize would",
    )
    validate.set_defaults(run=_validate)
    estimate = verbs.add_parser("estimate", help="per-rank model-state memory by the ZeRO formula")
    estimate.add_argument("config", help="a .yaml, .yml or .json config file")
    estimate.add_argument(
        "--params", type=_positive_count,
        help="trainable parameters, e.g. 7e9 (default with --model-config: the decoder's, all trainable)",
    )
    estimate.add_argument(
        "--frozen-params", type=_non_negative_count, default=0,
        help="frozen parameters (a LoRA base, a reference model), e.g. 7e9: their storage alone, sharded at stage 3 "
        "(in int8 there with zero_quantized_nontrainable_weights)",
    )
    estimate.add_argument(
        "--expert-params", type=_non_negative_count, default=0,
        help="of --params, the experts' (a MoE model's): with expert_parallel_size E each rank holds 1/E of them",
    )
    estimate.add_argument("--world-size", type=_positive_count, default=1, help="data-parallel ranks")
    estimate.add_argument(
        "--shard-group-size", type=_positive_count, help="ranks per shard group (hybrid sharding); default: the config's"
    )
    estimate.add_argument(
        "--largest-unit", type=_positive_count, default=0,
        help="stage: auto: parameters of the largest stage 3 unit (initialize measures it on the model)",
    )
    estimate.add_argument(
        "--model-config", metavar="CONFIG_JSON",
        help="a decoder's Hugging Face config.json (Llama, Mistral, Qwen...): count its activations too",
    )
    estimate.add_argument("--seq-len", type=_positive_count, help="with --model-config: tokens per sequence")
    estimate.add_argument(
        "--micro-batch", type=_positive_count,
        help="with --model-config: sequences per micro-batch (default: the config's train_micro_batch_size_per_gpu)",
    )
    estimate.set_defaults(run=_estimate)
    consolidate = verbs.add_parser("consolidate", help="turn a checkpoint into a plain state_dict file")
    consolidate.add_argument("checkpoint", help="the directory given to save_checkpoint")
    consolidate.add_argument("out", help="output file: .pt or .safetensors (with --format hf: a directory)")
    consolidate.add_argument("--tag", help="which checkpoint (default: the latest)")
    consolidate.add_argument(
        "--format", choices=("file", "hf"), default="file",
        help="file: one state_dict file (default); hf: model.safetensors or shards and their index, "
        "as save_pretrained writes them (weights only: the checkpoint holds no model config)",
    )
    consolidate.add_argument(
        "--max-shard-size", type=_shard_size, default="5GB", help="with --format hf: bytes per shard file, e.g. 5GB"
    )
    consolidate.add_argument("--dtype", help="with --format hf: write the weights in this dtype (default: fp32)")
    consolidate.set_defaults(run=_consolidate)
    convert = verbs.add_parser(
        "convert", help="rewrite a checkpoint (DeepSpeed's, DCP's, this engine's) in this engine's format or DCP's"
    )
    convert.add_argument("source", help="the checkpoint directory (holding 'latest', or the tag with --tag)")
    convert.add_argument("out_dir", help="the checkpoint directory to write (the same tag)")
    convert.add_argument("--tag", help="which tag (default: its latest)")
    convert.add_argument("--to", choices=["zero_engine", "dcp"], default="zero_engine",
                         help="the format to write: this engine's (default) or DCP's, torchtitan's layout, for FSDP2")
    convert.set_defaults(run=_convert)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
