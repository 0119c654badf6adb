"""A smaller model inside a larger one of the same layers: the larger model holding the smaller
one's parameters in its leading units, and zeros everywhere else, computes the smaller model.

This is how clients of different architectures share one shape (and one vmapped group): each
client holds the large model's parameters, its own model's embedded (:func:`nesting`). A padded
unit's incoming weights and bias are zero, so its output is zero after a ReLU, and its outgoing
weights are zero: it gets no gradient, and the client trains exactly its own model. A Dense
layer fed by a convolution's flattened output reads that output channel-fastest (NHWC), so its
rows are embedded per position. :meth:`Nesting.check` verifies both properties numerically for
the model at hand (outputs equal to the small model's, no gradient on what the small model does
not own), so a model that breaks them (an activation with ``f(0) != 0``, a layer that reads its
input another way) is refused in one line instead of training something else.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxfed.core.tree import leaves_by_path, path_name
from jaxfed.errors import ConfigError
from jaxfed.nn.layers import head_input, layers_in_call_order
from jaxfed.nn.models import Model, model_template

# The (small, large, embedding, head) whose check passed in this process (see Nesting.check).
_PASSED: set[tuple] = set()
# XLA's options for a program that runs once (Nesting.check): optimizing it took longer than running it.
_UNOPTIMIZED = {"xla_backend_optimization_level": 0}


def _model_key(model: Model) -> tuple:
    """What a model computes is its module's class and fields (its repr) and its input's shape and dtype."""
    return type(model.module), repr(model.module), tuple(model.input_shape), str(model.input_dtype)


class Nesting(NamedTuple):
    """Where a small model's parameters sit in a large one's: per parameter, the embedding's
    ``(rows, channels)`` split of a flattened conv output (``None``: the leading entries of each axis)."""

    small: Model
    large: Model
    flattened: dict[str, tuple[int, int, int] | None]  # "fc1.kernel" -> (positions, small channels, large channels)

    def embed(self, small_params):
        """``small_params`` in the large model's shapes: the small model's entries leading, zeros elsewhere."""
        large = model_template(self.large)[0]
        return jax.tree_util.tree_map_with_path(
            lambda path, p, like: _embed_leaf(p, like.shape, self.flattened[path_name(path)]), small_params, large
        )

    def owned(self):
        """The large model's parameters as float32 masks: 1 where the small model's parameters sit."""
        small = model_template(self.small)[0]
        return self.embed(jax.tree.map(lambda s: jnp.ones(s.shape, jnp.float32), small))

    def check(self, head: str, field: str, name: str) -> None:
        """A one-line ConfigError naming ``field`` unless the large model holding the small model's
        (random) parameters gives the small model's outputs, and no gradient of a loss on its
        outputs and features (the input of the layer ``head``) in training mode reaches what the
        small model does not own. (Computed now, also inside a trace, where a sweep builds its members'
        algorithms. A pair that passed is not checked again in the process: each sweep member builds the
        same tiers.)"""
        key = (_model_key(self.small), _model_key(self.large), tuple(sorted(self.flattened.items())), head)
        if key in _PASSED:
            return
        self._check(head, field, name)
        _PASSED.add(key)

    def _check(self, head: str, field: str, name: str) -> None:
        # Compiled ahead and called on a concrete seed, it runs now, also inside a trace (a sweep's),
        # where a jit call would be staged. It runs once, on this process's CPU, unoptimized.
        with jax.default_device(_host()):
            measure = jax.jit(lambda seed: self._measure(head, jax.random.key(seed)))
            compiled = measure.lower(0).compile(_UNOPTIMIZED)
            got, want, leaked = map(np.asarray, compiled(0))
        scale = float(np.max(np.abs(want))) + 1e-6
        if not np.allclose(got, want, rtol=1e-3, atol=1e-4 * scale):
            raise ConfigError(
                f"{field}: {name} does not nest in the run's model {self.large.name}: with its parameters in "
                "the leading units (zeros elsewhere) the run's model computes something else (a normalization "
                "across units, such as GroupNorm or LayerNorm?)"
            )
        if np.any(leaked):
            raise ConfigError(
                f"{field}: {name}'s units padded into the run's model {self.large.name} would train (an activation "
                "with f(0) != 0?); tiers of different architectures need units that stay zero"
            )

    def _measure(self, head: str, key):
        """``(the large model's outputs, the small model's, per parameter whether a gradient reached
        what the small model does not own)`` on random inputs and parameters."""
        key_init, key_x, key_out, key_feat = jax.random.split(key, 4)
        variables = self.small.init(key_init)
        embedded = self.embed(variables["params"])
        large_state = {k: v for k, v in self.large.init(key_init).items() if k != "params"}
        x = jax.random.normal(key_x, (2, *self.small.input_shape))
        # integer inputs are token ids: non-negative, so both models' tables read the same rows
        x = (x if jnp.issubdtype(self.small.input_dtype, jnp.floating) else jnp.abs(x)).astype(self.small.input_dtype)
        want, _ = self.small.apply(variables, x)
        got, _ = self.large.apply({"params": embedded, **large_state}, x)

        def loss(params):  # in training mode, as clients train (BatchNorm's batch statistics, dropout)
            variables = {"params": params, **large_state}
            (features, outputs), _ = head_input(self.large, head, variables, x, train=True, rng=key_out)
            r_out = jax.random.normal(key_out, outputs.shape)
            r_feat = jax.random.normal(key_feat, features.shape)
            return jnp.sum(outputs * r_out) + jnp.sum(features * r_feat)

        grads = jax.grad(loss)(embedded)
        leaked = [jnp.any((g != 0) & (m == 0)) for g, m in zip(jax.tree.leaves(grads), jax.tree.leaves(self.owned()))]
        return got, want, jnp.stack(leaked)


def _host():
    """This process's CPU device; None (the default device) where JAX_PLATFORMS leaves the CPU out."""
    try:
        return jax.local_devices(backend="cpu")[0]
    except RuntimeError:
        return None


def nesting(small: Model, large: Model, field: str, name: str) -> Nesting:
    """How ``small`` (named ``name`` in errors) sits in ``large``: the same parameter names, every
    parameter at most as large on each axis; else a one-line ConfigError naming ``field``."""
    small_paths, large_paths = leaves_by_path(model_template(small)[0]), leaves_by_path(model_template(large)[0])
    if set(small_paths) != set(large_paths):
        differ = sorted(set(small_paths) ^ set(large_paths))[0]
        raise ConfigError(
            f"{field}: {name} and the run's model {large.name} have different layers ('{differ}' is in one only); "
            "tiers of different architectures need the same layer names"
        )
    for path, leaf in small_paths.items():
        big = large_paths[path].shape
        if len(leaf.shape) != len(big) or any(s > b for s, b in zip(leaf.shape, big)):
            raise ConfigError(
                f"{field}: {name}'s {path} {tuple(leaf.shape)} does not fit the run's model {large.name}'s "
                f"{tuple(big)}; the run's model must be the largest (set model= to it)"
            )
    flattened = {path: _flattened_rows(path, small_paths, large_paths, large) for path in small_paths}
    return Nesting(small, large, flattened)


def _flattened_rows(path, small_paths, large_paths, large) -> tuple[int, int, int] | None:
    """``(positions, small channels, large channels)`` when ``path`` is the kernel of a Dense layer
    that follows a conv (in call order) whose channels differ and both row counts are a whole
    number of the same positions; ``None`` otherwise."""
    layer, leaf = path.rpartition(".")[::2]
    small, big = small_paths[path].shape, large_paths[path].shape
    if leaf != "kernel" or len(small) != 2 or small[0] == big[0]:
        return None
    order = layers_in_call_order(large)
    if layer not in order or order.index(layer) == 0:
        return None
    before = order[order.index(layer) - 1] + ".kernel"
    if before not in large_paths or len(large_paths[before].shape) != 4:
        return None
    c_small, c_large = small_paths[before].shape[-1], large_paths[before].shape[-1]
    if small[0] % c_small or big[0] % c_large or small[0] // c_small != big[0] // c_large:
        return None
    return small[0] // c_small, c_small, c_large


def _embed_leaf(param, shape, flattened):
    if flattened is not None:  # rows (position, channel), channel fastest: pad the channels per position
        positions, c_small, c_large = flattened
        cols = param.shape[1]
        param = jnp.pad(param.reshape(positions, c_small, cols), ((0, 0), (0, c_large - c_small), (0, 0)))
        param = param.reshape(positions * c_large, cols)
    return jnp.pad(param, [(0, b - s) for s, b in zip(param.shape, shape)])
