"""The hackable GPT: config.py (presets), model.py (the network, from warpforge.nn modules), data.py, train.py,
checkpoint.py, sample.py."""
from .config import PRESETS, GPTConfig, TrainConfig, preset
from .model import GPT

__all__ = ["GPT", "GPTConfig", "TrainConfig", "PRESETS", "preset"]
