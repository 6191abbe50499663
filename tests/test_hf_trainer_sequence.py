"""``sequence_parallel_size`` through Hugging Face's Trainer (`ZeroEngineTrainer`), TRL's
``SFTTrainer`` on it and Accelerate's own loop (zero_engine's `Accelerator`), with a PEFT LoRA
model: the same config with ``sequence_parallel_size: 2`` logs the losses, gradient norms and
rates (SFT: token accuracy, entropy and token count too) of its run with k = 1 on half the
ranks (the same global batches), within 1e-4, trains the same adapters, and evaluates the same
(``trainer.evaluate()``, split as training is: loss and a metric of the logits within 1e-5). Fast: k = 2 on 2
ranks against 1 rank; slow: k = 2 on 4 ranks against 2. TRL's GRPO and RLOO too (each group's
completions its first rank's). All share a spawn."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from harness import run_on_ranks
from tiny import llama, with_lora

pytest.importorskip("transformers", reason="the [hf] extra: pip install -e '.[hf]'")  # CI installs it

SEQ, VOCAB, SAMPLES = 15, 64, 24  # a length 2 does not divide; 24 rows: 6 steps of 2 x 2 at one data rank
TOLERANCE = 1e-4


def _lora_llama() -> Any:
    return with_lora(llama(vocab=VOCAB, attention="sdpa"), random_init=False)


class _Tokens:
    """Fixed random rows, labels the inputs but a prompt of 5 tokens without targets."""

    def __init__(self, samples: int = SAMPLES, seed: int = 3) -> None:
        import torch

        self.ids = torch.randint(0, VOCAB, (samples, SEQ), generator=torch.Generator().manual_seed(seed))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, index: int) -> dict[str, Any]:
        labels = self.ids[index].clone()
        labels[:5] = -100
        return {"input_ids": self.ids[index], "labels": labels}


def trained(rank: int, world: int, root: str, k: int) -> dict[str, Any]:
    runs = {"trainer": trainer_run(world, root, k), "accelerate": accelerate_run(k), "sft": sft_run(world, root, k),
            "dpo": dpo_run(world, root, k)}
    if k > 1:  # Hugging Face's own key, as an argument and as accelerate launch's variables
        runs["parallelism_config"] = trainer_run(world, root, k, via="argument")
        runs["launch_variables"] = trainer_run(world, root, k, via="variables")
    runs.update(rl_trained(rank, world, root, k))  # TRL's GRPO and RLOO (below)
    return runs


def sft_run(world: int, root: str, k: int) -> dict[str, Any]:
    """TRL's SFTTrainer as `test_trl` runs it (its loss and metrics computed from the model's
    outputs: at k = 2 a rank's slice's, made the micro-batch's by the engine's trainer)."""
    from trl import SFTConfig, SFTTrainer
    from trl_cases import base_model, datasets, lora, tokenizer

    from zero_engine.integrations.transformers import ZeroEngineTrainer

    args = SFTConfig(
        output_dir=f"{root}/sft{k}", per_device_train_batch_size=2, gradient_accumulation_steps=2 * k // world,
        learning_rate=3e-3, num_train_epochs=1, logging_steps=1, save_strategy="no", report_to=[], seed=0,
        use_cpu=True, disable_tqdm=True, dataloader_num_workers=0, bf16=False, max_length=16,
    )
    trainer = type("ZeroSFTTrainer", (ZeroEngineTrainer, SFTTrainer), {})(
        model=base_model(), args=args, train_dataset=datasets("sft"), processing_class=tokenizer(), peft_config=lora(),
        zero_config={"zero_optimization": {"stage": 3}, "sequence_parallel_size": k, "steps_per_print": 10**9},
    )
    trainer.train()
    keys = ("loss", "grad_norm", "learning_rate", "mean_token_accuracy", "entropy", "num_tokens")
    return {"logs": [{key: entry[key] for key in keys} for entry in trainer.state.log_history if "loss" in entry]}


def dpo_run(world: int, root: str, k: int) -> dict[str, Any]:
    """TRL's DPOTrainer with LoRA (its reference: the adapters disabled): plain TRL at k = 1, as
    `class ZeroDPOTrainer(ZeroEngineTrainer, DPOTrainer)` split over k ranks (its per-token
    log-probabilities gathered over the group, each sequence's sum through DPO's sigmoid)."""
    from trl_cases import trainer

    if k == 1:
        run = trainer("dpo", False, f"{root}/dpo{k}")
    else:
        run = trainer("dpo", True, f"{root}/dpo{k}", {"zero_optimization": {"stage": 3}, "sequence_parallel_size": k,
                                                       "steps_per_print": 10**9})
    run.args.save_strategy = "no"
    run.train()
    keys = ("loss", "grad_norm", "rewards/chosen", "rewards/rejected", "rewards/accuracies", "logps/chosen")
    logs = [{key: entry[key] for key in keys} for entry in run.state.log_history if "loss" in entry]
    if k == 1:
        adapters = {name: value.detach().clone() for name, value in run.model.named_parameters() if "lora_" in name}
    else:
        adapters = {name: value.detach().clone() for name, value in run.zero_engine.named_full_parameters()
                    if "lora_" in name}
    return {"logs": logs, "adapters": adapters}


def accelerate_run(k: int) -> dict[str, Any]:
    """A plain Accelerate loop: micro-batches of 2, accumulation 2, clipping 0.5, 6 steps."""
    import torch
    from torch.utils.data import DataLoader

    from zero_engine.integrations.accelerate import Accelerator

    config = {"zero_optimization": {"stage": 3}, "sequence_parallel_size": k, "gradient_clipping": 0.5,
              "steps_per_print": 10**9}
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=2, zero_config=config)
    model = _lora_llama()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=3e-3)
    rows = _Tokens()
    loader = DataLoader(range(SAMPLES), batch_size=2,  # sharded over the data-parallel ranks by prepare
                        collate_fn=lambda indices: {key: torch.stack([rows[i][key] for i in indices])
                                                    for key in ("input_ids", "labels")})
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    losses, norms = [], []
    for batch in loader:
        with accelerator.accumulate(model):
            loss = model(**batch).loss
            accelerator.backward(loss)
            if accelerator.sync_gradients:
                norms.append(float(accelerator.clip_grad_norm_(model.parameters(), 0.5)))
            optimizer.step()
            optimizer.zero_grad()
        losses.append(loss.item())
    adapters = {name: value.detach().clone() for name, value in accelerator.zero_engine.named_full_parameters()
                if "lora_" in name}
    accelerator.free_memory()
    return {"losses": losses, "norms": norms, "adapters": adapters}


def trainer_run(world: int, root: str, k: int, via: str = "key") -> dict[str, Any]:
    """The Trainer at ``sequence_parallel_size: k``, asked for by the config's key, or (``via``) by
    Hugging Face's own ``TrainingArguments(parallelism_config=...)`` or the variables ``accelerate
    launch`` sets for its ``parallelism_config_sp_*`` keys, the config then without the key."""
    import os

    import torch
    from accelerate.parallelism_config import ParallelismConfig
    from accelerate.utils import DeepSpeedSequenceParallelConfig
    from transformers import TrainingArguments

    from zero_engine.integrations.transformers import ZeroEngineTrainer

    torch.set_num_threads(1)
    data_ranks = world // k
    launch = {"ACCELERATE_USE_PARALLELISM_CONFIG": "true", "PARALLELISM_CONFIG_SP_SIZE": str(k),
              "PARALLELISM_CONFIG_SP_BACKEND": "deepspeed", "PARALLELISM_CONFIG_SP_ATTN_IMPLEMENTATION": "sdpa"}
    if via == "variables":
        os.environ.update(launch)
    parallelism = None
    if via == "argument":
        parallelism = ParallelismConfig(sp_backend="deepspeed", sp_size=k, sp_handler=DeepSpeedSequenceParallelConfig(
            sp_seq_length_is_variable=True, sp_attn_implementation="sdpa"))
    args = TrainingArguments(
        output_dir=f"{root}/k{k}{via}", per_device_train_batch_size=2, gradient_accumulation_steps=2 // data_ranks,
        learning_rate=3e-3, max_grad_norm=0.5, lr_scheduler_type="linear", warmup_steps=1, num_train_epochs=1,
        logging_steps=1, save_strategy="no", report_to=[], seed=0, use_cpu=True, disable_tqdm=True,
        dataloader_num_workers=0, parallelism_config=parallelism,
    )
    config = {"zero_optimization": {"stage": 3}, "steps_per_print": 10**9}
    if via == "key":
        config["sequence_parallel_size"] = k
    try:
        trainer = ZeroEngineTrainer(model=_lora_llama(), args=args, train_dataset=_Tokens(), zero_config=config,
                                    compute_metrics=_token_accuracy)
    finally:
        for name in launch if via == "variables" else ():
            del os.environ[name]
    trainer.train()
    logs = [{key: entry[key] for key in ("loss", "grad_norm", "learning_rate")}
            for entry in trainer.state.log_history if "loss" in entry]
    adapters = {name: value.detach().clone() for name, value in trainer.zero_engine.named_full_parameters()
                if "lora_" in name}
    # evaluation split as training is (the default): 10 rows in batches of 4 per data-parallel rank, so
    # the last batch is padded and cut; the metrics read the logits, gathered whole over each group
    args.per_device_eval_batch_size = 4
    evaluated = trainer.evaluate(_Tokens(EVAL_SAMPLES, seed=5))
    return {"logs": logs, "adapters": adapters, "batch": trainer.zero_engine.train_batch_size(),
            "eval": {key: evaluated[key] for key in ("eval_loss", "eval_accuracy", "eval_tokens")}}


EVAL_SAMPLES = 10


def _token_accuracy(prediction: Any) -> dict[str, float]:
    """The next-token accuracy over labelled tokens, from the whole logits (and their count)."""
    predicted = prediction.predictions[:, :-1].argmax(-1)
    labels = prediction.label_ids[:, 1:]
    valid = labels != -100
    return {"accuracy": float((predicted == labels)[valid].mean()), "tokens": float(valid.sum())}


def _compare(plain_ranks: list[dict[str, Any]], split_runs: list[dict[str, Any]]) -> None:
    import torch

    """Rank r of the split run against rank r // 2 of the plain one (the Trainer logs means over
    ranks; an Accelerate loop's losses are its rank's)."""
    plain, split = plain_ranks[0]["trainer"], [runs["trainer"] for runs in split_runs]
    assert len(plain["logs"]) == 6
    for result in split:
        assert result["batch"] == plain["batch"] == 4
        assert len(result["logs"]) == len(plain["logs"])
        for mine, theirs in zip(result["logs"], plain["logs"]):
            for key in ("loss", "grad_norm", "learning_rate"):
                assert mine[key] == pytest.approx(theirs[key], abs=TOLERANCE), (key, mine, theirs)
        for name, value in plain["adapters"].items():
            assert (result["adapters"][name] - value).abs().max().item() <= TOLERANCE, name
        assert plain["eval"]["eval_tokens"] == EVAL_SAMPLES * (SEQ - 5)  # every row once, none twice
        assert result["eval"] == pytest.approx(plain["eval"], abs=1e-5), (result["eval"], plain["eval"])
    for rank, runs in enumerate(split_runs):
        plain, result = plain_ranks[rank // 2]["accelerate"], runs["accelerate"]
        assert len(plain["losses"]) == 2 * len(plain["norms"]) >= 6  # every micro-step, every boundary
        assert result["losses"] == pytest.approx(plain["losses"], abs=TOLERANCE)
        assert result["norms"] == pytest.approx(plain["norms"], abs=TOLERANCE)
        for name, value in plain["adapters"].items():
            assert (result["adapters"][name] - value).abs().max().item() <= TOLERANCE, name
    plain = plain_ranks[0]["sft"]
    assert len(plain["logs"]) == 6
    for runs in split_runs:
        assert len(runs["sft"]["logs"]) == len(plain["logs"])
        for mine, theirs in zip(runs["sft"]["logs"], plain["logs"]):
            assert mine == pytest.approx(theirs, abs=TOLERANCE), (mine, theirs)
    plain = plain_ranks[0]["dpo"]
    assert len(plain["logs"]) >= 6
    for runs in split_runs:  # DPO split over the group: losses 1e-4, adapters 1e-5 (the bounds)
        assert len(runs["dpo"]["logs"]) == len(plain["logs"])
        for mine, theirs in zip(runs["dpo"]["logs"], plain["logs"]):
            assert mine == pytest.approx(theirs, abs=TOLERANCE), (mine, theirs)
        for name, value in plain["adapters"].items():
            key = name if name in runs["dpo"]["adapters"] else name.replace(".default", "")
            assert (runs["dpo"]["adapters"][key] - value).abs().max().item() <= 1e-5, name
    for runs in split_runs:  # Hugging Face's own key trains as the config's key, to the bit
        for via in ("parallelism_config", "launch_variables"):
            assert runs[via]["logs"] == runs["trainer"]["logs"], via
            assert runs[via]["eval"] == runs["trainer"]["eval"], via
            assert runs[via]["batch"] == runs["trainer"]["batch"], via
            for name, value in runs["trainer"]["adapters"].items():
                assert torch.equal(runs[via]["adapters"][name], value), (via, name)
    if len(plain_ranks) > 1:  # data-parallel ranks read different batches: the comparison above tells them apart
        assert plain_ranks[1]["accelerate"]["losses"] != plain_ranks[0]["accelerate"]["losses"]


def test_the_trainer_at_k2_logs_what_it_logs_at_k1_on_half_the_ranks(tmp_path: Path) -> None:
    plain = run_on_ranks(1, trained, str(tmp_path), 1, allow_numpy=True, backend=None, timeout=300)
    split = run_on_ranks(2, trained, str(tmp_path), 2, allow_numpy=True, backend=None, timeout=300)
    _compare(plain, split)
    _compare_rl(plain, split)


@pytest.mark.slow
def test_the_trainer_at_k2_on_4_ranks_logs_what_it_logs_at_k1_on_2(tmp_path: Path) -> None:
    plain = run_on_ranks(2, trained, str(tmp_path), 1, allow_numpy=True, backend=None, timeout=600)
    split = run_on_ranks(4, trained, str(tmp_path), 2, allow_numpy=True, backend=None, timeout=600)
    assert plain[0]["trainer"]["logs"] == plain[1]["trainer"]["logs"]
    assert plain[0]["grpo"]["logs"] == plain[1]["grpo"]["logs"]  # the Trainer logs means over ranks
    _compare(plain, split)
    _compare_rl(plain, split)


def test_hugging_faces_parallelism_config_is_read_as_the_configs_keys() -> None:
    """``ParallelismConfig``'s fields as the engine's keys, and what cannot be honoured refused by
    name, each naming the fields (no process needed)."""
    from accelerate.parallelism_config import ParallelismConfig
    from accelerate.utils import DeepSpeedSequenceParallelConfig

    from zero_engine import ConfigError
    from zero_engine.integrations.parallelism_config import merge_parallelism

    def merged(raw: dict[str, Any], processes: int = 4, **fields: Any) -> dict[str, Any]:
        return merge_parallelism(raw, ParallelismConfig(**fields), processes, "TrainingArguments")

    assert merged({}, sp_size=2, sp_backend="deepspeed")["sequence_parallel_size"] == 2
    assert merged({"sequence_parallel_size": 2}, sp_size=2, sp_backend="deepspeed")["sequence_parallel_size"] == 2
    with pytest.raises(ConfigError, match="sequence_parallel_size = 4 in the config and sp_size = 2 in "
                                          "TrainingArguments's ParallelismConfig"):
        merged({"sequence_parallel_size": 4}, sp_size=2, sp_backend="deepspeed")
    # HSDP: 2 replicas of shard groups of dp_shard x sp ranks
    hybrid = merged({"zero_optimization": {"stage": 3}}, 8, dp_replicate_size=2, dp_shard_size=2, sp_size=2,
                    sp_backend="deepspeed")
    assert hybrid["zero_optimization"] == {"stage": 3, "shard_group_size": 4} and hybrid["sequence_parallel_size"] == 2
    with pytest.raises(ConfigError, match="zero_optimization.shard_group_size = 2 in the config and dp_shard_size 2 x "
                                          "sp_size 2 = 4"):
        merged({"zero_optimization": {"shard_group_size": 2}}, 8, dp_replicate_size=2, dp_shard_size=2, sp_size=2,
               sp_backend="deepspeed")
    with pytest.raises(ConfigError, match=r"dp_replicate_size 2 x dp_shard_size 2 x sp_size 1 = 4 ranks, but 8"):
        merged({}, 8, dp_replicate_size=2, dp_shard_size=2)
    with pytest.raises(NotImplementedError, match="cp_size = 2: context parallelism .ring attention. is not built"):
        merged({}, cp_size=2)
    with pytest.raises(NotImplementedError, match="tp_size = 2: tensor parallelism is not built"):
        merged({}, tp_size=2)
    with pytest.raises(NotImplementedError, match="sp_attn_implementation = 'flash_attention_2'"):
        merged({}, sp_size=2, sp_backend="deepspeed",
               sp_handler=DeepSpeedSequenceParallelConfig(sp_attn_implementation="flash_attention_2"))
    fixed = DeepSpeedSequenceParallelConfig(sp_seq_length_is_variable=False, sp_seq_length=64)
    assert merged({}, sp_size=2, sp_backend="deepspeed", sp_handler=fixed)["sequence_parallel_size"] == 2


# -- TRL's GRPO and RLOO under the split ---------------------------------------------------------

# not reward_std: TRL's deviation over every rank's rewards, each group's k times (documented)
RL_KEYS = ("loss", "grad_norm", "reward", "num_tokens", "kl", "entropy", "completions/mean_length",
           "rewards/_reward/mean", "frac_reward_zero_std")


def _reward(completions: list[str], **kwargs: Any) -> list[float]:
    """A reward that tells completions apart (so advantages are not zero): some words, and length."""
    return [float(c.count("w1") + c.count("w2")) + len(c.split()) / 10 for c in completions]


def rl_run(kind: str, world: int, root: str, k: int, engine: bool = True, **options: Any) -> dict[str, Any]:
    """TRL's GRPOTrainer or RLOOTrainer with LoRA (its reference: the adapters disabled, beta
    0.04), 4 prompts' groups of 4 completions a generation, accumulation 2, stage 3: as
    `class ZeroGRPOTrainer(ZeroEngineTrainer, GRPOTrainer)` at k (each group's completions its
    first rank's, their log-probabilities gathered over the group), or plain TRL."""
    from trl import GRPOConfig, GRPOTrainer, RLOOConfig, RLOOTrainer
    from trl_cases import base_model, datasets, lora, tokenizer

    from zero_engine.integrations.transformers import ZeroEngineTrainer

    config, cls = (GRPOConfig, GRPOTrainer) if kind == "grpo" else (RLOOConfig, RLOOTrainer)
    settings = {"per_device_train_batch_size": 4, "num_generations": 4, "gradient_accumulation_steps": 2}
    args = config(
        output_dir=f"{root}/{kind}{k}{engine}", max_completion_length=6, learning_rate=3e-3, logging_steps=1, report_to=[],
        seed=0, use_cpu=True, save_strategy="no", max_steps=3, beta=0.04, bf16=False, disable_tqdm=True,
        dataloader_num_workers=0, **{**settings, **options},
    )
    arguments = {"model": base_model(), "reward_funcs": _reward, "args": args, "processing_class": tokenizer(),
                 "train_dataset": datasets("dpo").remove_columns(["chosen", "rejected"]), "peft_config": lora()}
    if not engine:
        trainer = cls(**arguments)
    else:
        zero = type(f"Zero{cls.__name__}", (ZeroEngineTrainer, cls), {})
        trainer = zero(**arguments, zero_config={"zero_optimization": {"stage": 3}, "sequence_parallel_size": k,
                                                 "steps_per_print": 10**9})
    if options:  # built only (a refusal)
        return {}
    if k > 1 and trainer.args.process_index % k:  # a draw of this rank's own (a callback's, a logger's): its
        import random  # group still shuffles and samples as its first rank

        import torch

        torch.rand(7), random.random()
    trainer.train()
    logs = [{key: entry[key] for key in RL_KEYS if key in entry} for entry in trainer.state.log_history
            if "loss" in entry]
    parameters = trainer.zero_engine.named_full_parameters() if engine else trainer.model.named_parameters()
    adapters = {name.replace(".default", ""): value.detach().clone() for name, value in parameters if "lora_" in name}
    return {"logs": logs, "adapters": adapters}


def rl_trained(rank: int, world: int, root: str, k: int) -> dict[str, Any]:
    runs: dict[str, Any] = {kind: rl_run(kind, world, root, k, engine=k > 1) for kind in ("grpo", "rloo")}
    if k == 1:  # the engine without the split: as plain TRL (TRL's own training_step runs, generating once a window)
        runs["grpo_engine"] = rl_run("grpo", world, root, 1)
    else:
        try:  # each rank's generation batch of 1 prompt x 1 micro-step cannot hold a group of 2
            rl_run("grpo", world, root, k, per_device_train_batch_size=1, num_generations=2,
                   gradient_accumulation_steps=1)
        except ValueError as error:
            runs["refused"] = str(error)
        try:  # advantages scaled by the whole (gathered) batch's deviation
            rl_run("grpo", world, root, k, scale_rewards="batch")
        except NotImplementedError as error:
            runs["refused_batch"] = str(error)
        runs["generate"], runs["shared"] = generate_after_a_split_step(rank, k)
    return runs


def generate_after_a_split_step(rank: int, k: int) -> tuple[bool, list]:
    """Whether a PEFT model's ``generate`` (which calls the model it wraps, past the engine's
    root) samples after a split training step what it sampled before (the step changes no
    weight: learning rate 0); and `share_leaders_rows` of rows each rank made apart (every
    rank of a group gets its first's), and the draws after `share_leaders_rng` (its first's)."""
    import random

    import torch
    from peft import get_peft_model
    from trl_cases import base_model, lora

    import zero_engine
    from zero_engine.sequence_loader import share_leaders_rng, share_leaders_rows

    torch.manual_seed(0)
    model = get_peft_model(base_model(), lora())
    engine = zero_engine.initialize(model, {
        "train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "SGD", "params": {"lr": 0.0}},
        "zero_optimization": {"stage": 0}, "sequence_parallel_size": k, "steps_per_print": 10**9})
    prompt = torch.tensor([[6, 63, 48, 17]] * 4)

    def generate() -> torch.Tensor:
        torch.manual_seed(5)
        with torch.no_grad():
            return model.generate(input_ids=prompt, attention_mask=torch.ones_like(prompt), do_sample=True,
                                  max_new_tokens=6, pad_token_id=0)

    engine.train()
    before = generate()
    ids = torch.randint(4, 60, (1, 10), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[:, :3] = 0
    engine.backward(engine(input_ids=ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100)).loss)
    engine.step()
    after = generate()
    shared = share_leaders_rows(engine, [[rank] * (rank + 1), [7, rank]], [[0.5] * (rank + 1), [1.5, rank]])
    random.seed(rank)  # each rank's own random state, then its group's first rank's
    if rank % 2:  # a second gauss cached on some ranks only
        random.gauss(0, 1)
    torch.manual_seed(rank)
    share_leaders_rng(engine)
    draws = [random.random(), random.gauss(0, 1), torch.rand(1).item()]
    engine.close()
    return torch.equal(before, after), [*shared, draws]


def _compare_rl(plain_ranks: list[dict[str, Any]], split_runs: list[dict[str, Any]]) -> None:
    import random

    import torch

    for runs in plain_ranks:
        assert len(runs["grpo_engine"]["logs"]) == len(runs["grpo"]["logs"]) == 3
        for mine, theirs in zip(runs["grpo_engine"]["logs"], runs["grpo"]["logs"]):
            assert mine == pytest.approx(theirs, abs=1e-6), (mine, theirs)
        for name, value in runs["grpo"]["adapters"].items():
            assert (runs["grpo_engine"]["adapters"][name] - value).abs().max().item() <= 1e-6, name
    for kind in ("grpo", "rloo"):
        for rank, runs in enumerate(split_runs):
            plain, split = plain_ranks[rank // 2][kind], runs[kind]
            assert len(plain["logs"]) == len(split["logs"]) == 3
            for mine, theirs in zip(split["logs"], plain["logs"]):
                assert mine.keys() == theirs.keys() >= {"loss", "grad_norm", "reward", "num_tokens", "kl", "entropy"}
                assert mine == pytest.approx(theirs, abs=TOLERANCE), (kind, mine, theirs)
            assert plain["adapters"].keys() == split["adapters"].keys()
            for name, value in plain["adapters"].items():
                assert (split["adapters"][name] - value).abs().max().item() <= 1e-5, (kind, name)
    for rank, runs in enumerate(split_runs):
        assert "whole prompt groups of num_generations = 2" in runs["refused"]
        assert "scale_rewards='batch'" in runs["refused_batch"]
        assert runs["generate"]
        leader = rank - rank % 2
        rows, values, draws = runs["shared"]
        assert [rows, values] == [[[leader] * (leader + 1), [7, leader]], [[0.5] * (leader + 1), [1.5, float(leader)]]]
        assert draws == split_runs[leader]["shared"][2]
        random.seed(leader)
        torch.manual_seed(leader)
        assert draws == [random.random(), random.gauss(0, 1), torch.rand(1).item()]  # the first rank's own
