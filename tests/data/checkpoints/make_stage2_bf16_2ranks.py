"""Run from the repository root: python tests/data/checkpoints/make_stage2_bf16_2ranks.py

Written at commit 1ddbd9b (before the structural change of issue 42): a 2-rank stage 2 run of
the trap model (tests/models.py), AdamW with decay groups, bf16, 3 steps, saved; the step's
consolidated values saved beside it to compare with."""
import sys, torch
sys.path.insert(0, "tests")
import zero_engine
from harness import run_on_ranks
from models import make_model, decay_groups, train_engine
from configs import engine_config

def save(rank, world_size, directory):
    model = make_model()
    engine = zero_engine.initialize(model, engine_config(2, micro=2, lr=0.05, accum=2, dtype="bf16", reduce_bucket_size=40), param_groups=decay_groups(model))
    train_engine(engine, rank, world_size, range(3), 2, 2)
    engine.save_checkpoint(directory, client_state={"note": "written before issue 42"})
    state = engine.full_state_dict()
    engine.close()
    return state

if __name__ == "__main__":
    out = "tests/data/checkpoints/stage2_bf16_2ranks"
    states = run_on_ranks(2, save, out)
    from safetensors.torch import save_file
    save_file({k: v.contiguous() for k, v in states[0].items() if k != "head.weight"}, "tests/data/checkpoints/stage2_bf16_2ranks.expected.safetensors")
