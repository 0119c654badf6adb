"""Federated algorithms, one module each, every one a :class:`FederatedAlgorithm` built from its
own options (a frozen dataclass with the paper's defaults) and registered by name.

``registry.get(name)`` gives its ``AlgorithmSpec`` (name, options class, builder, summary) and
imports the algorithm's module the first time; ``jaxfed.register`` adds one from research code.
Every constructor has the form ``name(model, options=None, **overrides)``.
"""

from jaxfed.algorithms.registry import get, names, register
from jaxfed.contract import Aggregation, FederatedAlgorithm, RoundInfo

__all__ = ["Aggregation", "FederatedAlgorithm", "RoundInfo", "get", "names", "register"]
