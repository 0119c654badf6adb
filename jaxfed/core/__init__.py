"""Pure, model-agnostic building blocks on pytrees shared by every algorithm."""

from jaxfed.core.tree import (
    gather_clients,
    scatter_clients,
    stack_clients,
    tree_bytes,
    tree_select,
    weighted_mean,
)

__all__ = [
    "gather_clients",
    "scatter_clients",
    "stack_clients",
    "tree_bytes",
    "tree_select",
    "weighted_mean",
]
