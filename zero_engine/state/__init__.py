"""Model and training state in and out of the engine: checkpoints, pretrained weights, and
the safetensors reader. Uses `zero_engine.sharding` (units, pieces); never imports the engine.
"""
