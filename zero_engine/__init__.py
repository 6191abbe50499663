"""zero_engine: ZeRO-style sharded data parallelism for PyTorch, behind one config file.

    engine = zero_engine.initialize(model, "configs/zero1.yaml")
    loss = engine(x, y); engine.backward(loss); engine.step()
"""

from .config import ZeroEngineConfig, load_config
from .engine import Engine
from .entry import initialize
from .errors import CheckpointError, ConfigError, DivergedRanksError, ShardedParameterError, SwapError
from .sequence_loader import SequenceGroupLoader
from .transforms.ulysses import SequenceParallelAttention
from .state.consolidate import load_consolidated

__all__ = [
    "CheckpointError",
    "ConfigError",
    "DivergedRanksError",
    "Engine",
    "SequenceGroupLoader",
    "SequenceParallelAttention",
    "ShardedParameterError",
    "SwapError",
    "ZeroEngineConfig",
    "initialize",
    "load_config",
    "load_consolidated",
]
__version__ = "0.1.0"
