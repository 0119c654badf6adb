"""Flax models by name and the pure ``Model`` wrapper algorithms see."""

from jaxfed.nn.models import MODELS, NORMS, Model, get_model

__all__ = ["MODELS", "NORMS", "Model", "get_model"]
