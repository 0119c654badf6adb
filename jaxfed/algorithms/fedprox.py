"""FedProx (Li et al., 2020): FedAvg plus ``mu/2 ||w - w_global||^2`` in each client's loss."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxfed.algorithms.fedavg import FedAvgOptions, fedavg
from jaxfed.algorithms.registry import builtin
from jaxfed.options import non_negative, option, resolve


@dataclasses.dataclass(frozen=True)
class FedProxOptions(FedAvgOptions):
    """FedAvg's options plus the proximal coefficient."""

    mu: float = option(0.01, "proximal coefficient mu", source="ALGORITHMS.md (FedProx baseline)", check=non_negative)


def proximal_term(mu: float):
    """``penalty(params, global_params) = mu/2 * ||params - global_params||^2``."""

    def penalty(params, global_params):
        diffs = jax.tree.map(lambda p, g: jnp.sum(jnp.square(p - jax.lax.stop_gradient(g))), params, global_params)
        return 0.5 * mu * sum(jax.tree.leaves(diffs))

    return penalty


def fedprox(model, options: FedProxOptions | None = None, **overrides):
    options = resolve(FedProxOptions, options, overrides)
    return fedavg(model, options, penalty=proximal_term(options.mu), name="fedprox")


builtin("fedprox", FedProxOptions, lambda model, options, config: fedprox(model, options))
