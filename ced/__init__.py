"""ced: a research harness for the Causal Encoder-Decoder of DeepSeek-V4.1.

Public API (stable): ModelConfig, CEDModel, InferenceEngine, exact_replay_length.
"""

from .config import (ModelConfig, build_plan, exact_encoder_replay_length, exact_replay_length,
                     paper_replay_length)
from .inference import Cache, InferenceEngine, PrefillOutput
from .model import CEDModel

__all__ = ["ModelConfig", "CEDModel", "InferenceEngine", "PrefillOutput", "Cache",
           "exact_replay_length", "exact_encoder_replay_length", "paper_replay_length",
           "build_plan"]
