"""Flax models by name and the pure ``Model`` wrapper algorithms see."""

from jaxfed.nn.conv import CONV_IMPLS, Conv, conv2d
from jaxfed.nn.models import MODELS, NORMS, Model, get_model, model_template, split_variables

__all__ = ["CONV_IMPLS", "MODELS", "NORMS", "Conv", "Model", "conv2d", "get_model", "model_template", "split_variables"]
