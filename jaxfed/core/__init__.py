"""Pure, model-agnostic building blocks on pytrees shared by every algorithm."""

from jaxfed.core.tree import (
    concat_clients,
    finite_rows,
    gather_clients,
    masked_weighted_mean,
    scatter_clients,
    select_rows,
    stack_clients,
    tree_bytes,
    tree_select,
    uniform_mean,
    weighted_mean,
)

__all__ = [
    "concat_clients",
    "finite_rows",
    "gather_clients",
    "masked_weighted_mean",
    "scatter_clients",
    "select_rows",
    "stack_clients",
    "tree_bytes",
    "tree_select",
    "uniform_mean",
    "weighted_mean",
]
