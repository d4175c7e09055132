"""Incremental inference over the CED model family."""

from .engine import POLICIES, Cache, InferenceEngine, PrefillOutput

__all__ = ["Cache", "InferenceEngine", "PrefillOutput", "POLICIES"]
