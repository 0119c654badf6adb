"""Pure, model-agnostic building blocks on pytrees shared by every algorithm."""

from jaxfed.core.tree import (
    WeightedSum,
    all_finite,
    concat_clients,
    gather_clients,
    human_bytes,
    mean_of,
    scatter_clients,
    stack_clients,
    stack_trees,
    tree_add,
    tree_bytes,
    tree_select,
    uniform_mean,
    weighted_mean,
    weighted_share,
)

__all__ = [
    "WeightedSum",
    "all_finite",
    "mean_of",
    "tree_add",
    "weighted_share",
    "concat_clients",
    "gather_clients",
    "human_bytes",
    "scatter_clients",
    "stack_clients",
    "stack_trees",
    "tree_bytes",
    "tree_select",
    "uniform_mean",
    "weighted_mean",
]
