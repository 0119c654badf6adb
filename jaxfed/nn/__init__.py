"""Flax models by name and the pure ``Model`` wrapper algorithms see."""

from jaxfed.nn.conv import CONV_IMPLS, Conv, conv2d
from jaxfed.nn.models import MODELS, NORMS, Model, built_in_setting, get_model, model_template, split_variables

__all__ = [
    "CONV_IMPLS",
    "MODELS",
    "NORMS",
    "Conv",
    "Model",
    "built_in_setting",
    "conv2d",
    "get_model",
    "model_template",
    "split_variables",
]
