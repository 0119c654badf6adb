"""What one trace of a model tells without computing anything (its variables' shapes, the
modules its forward pass calls), traced once per model in a process.

Building a run asks the same model the same questions many times: each algorithm sizes its
states by the model's parameters, layer discovery watches a forward pass, tiers of another
architecture check how they nest. Each answer is a trace of the model's ``init`` (tens of
milliseconds for a small model); :func:`once_per_model` keeps it for the process.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TypeVar

import jax

T = TypeVar("T")
_MODELS_KEPT = 256  # answers per question kept: each is a small tree of shapes or a few modules


def once_per_model(answer: Callable[..., T]) -> Callable[..., T]:
    """``answer(model, *arguments)`` computed once per model, arguments and x64 mode (a model is
    what it computes: its module's class and fields, its input's shape and dtype; models compare
    and hash by them). A model that cannot be hashed (a module field holding an array) is asked
    each time; an error is not kept. Callers share the answer: they must not edit it
    (:func:`abstract_variables` hands out copies)."""
    kept = functools.lru_cache(maxsize=_MODELS_KEPT)(lambda x64, *question: answer(*question))

    @functools.wraps(answer)
    def cached(model, *arguments):
        try:
            hash((model, *arguments))
        except TypeError:
            return answer(model, *arguments)
        return kept(jax.config.jax_enable_x64, model, *arguments)

    return cached


@once_per_model
def _variables(model) -> dict:
    return jax.eval_shape(model.init, jax.random.key(0))


def abstract_variables(model) -> dict:
    """``model.init``'s variables as shapes (``jax.ShapeDtypeStruct``), computed once per model:
    a copy of the tree the caller may edit."""
    return jax.tree.map(lambda leaf: leaf, _variables(model))
