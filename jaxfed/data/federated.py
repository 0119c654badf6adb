"""The on-device federated dataset: global example arrays plus per-client index tables.

Examples are put on the device once. Client k's training examples are
``x_train[train_idx[k, :train_count[k]]]``; rows are padded to the largest client and the padding
is masked, so a client computes exactly what it would compute alone.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jaxfed.data.validate import DataError, check_dataset, check_parts


class Batch(NamedTuple):
    x: jax.Array
    y: jax.Array
    mask: jax.Array  # bool [batch]: False for padding
    key: jax.Array | None = None  # a fresh PRNG key per training step (see training.run_epochs)


@struct.dataclass
class ClientData:
    """One client's view of the global arrays: its example indices and how many are real."""

    x: jax.Array  # global examples (shared by all clients, not vmapped)
    y: jax.Array
    indices: jax.Array  # [max_examples] int32, padded
    count: jax.Array  # scalar int32

    def batch(self, positions) -> Batch:
        """Examples at ``positions`` of this client's list; positions >= count are padding."""
        mask = positions < self.count
        idx = jnp.take(self.indices, positions, mode="clip")
        return Batch(jnp.take(self.x, idx, axis=0), jnp.take(self.y, idx, axis=0), mask)

    @staticmethod
    def vmap_axes():
        """``in_axes`` for vmapping a stacked ClientData: index tables per client, arrays shared."""
        return ClientData(x=None, y=None, indices=0, count=0)


@struct.dataclass
class FederatedData:
    x_train: jax.Array
    y_train: jax.Array
    train_idx: jax.Array  # [num_clients, max_train]
    train_count: jax.Array  # [num_clients]
    x_test: jax.Array
    y_test: jax.Array
    test_idx: jax.Array  # [num_clients, max_test]
    test_count: jax.Array  # [num_clients]
    num_classes: int = struct.field(pytree_node=False)
    name: str = struct.field(pytree_node=False, default="")  # the dataset's, as run directories record it

    @property
    def num_clients(self) -> int:
        return self.train_idx.shape[0]

    def train_data(self, ids) -> ClientData:
        """Stacked training views of clients ``ids`` (padding ids give count 0)."""
        return self._view(self.x_train, self.y_train, self.train_idx, self.train_count, ids)

    def test_data(self, ids) -> ClientData:
        return self._view(self.x_test, self.y_test, self.test_idx, self.test_count, ids)

    def _view(self, x, y, table, counts, ids):
        real = ids < table.shape[0]
        return ClientData(
            x=x,
            y=y,
            indices=jnp.take(table, ids, axis=0, mode="clip"),
            count=jnp.where(real, jnp.take(counts, ids, mode="clip"), 0),
        )


def index_table(parts) -> tuple[np.ndarray, np.ndarray]:
    """Pad a list of index arrays into ``[len(parts), max_len]`` plus counts."""
    counts = np.array([len(p) for p in parts], np.int32)
    table = np.zeros((len(parts), max(int(counts.max()), 1)), np.int32)
    for k, p in enumerate(parts):
        table[k, : len(p)] = p
    return table, counts


def federate(dataset, train_parts, test_parts, *, allow_empty_train: bool = False) -> FederatedData:
    """Put ``dataset`` on the device with the clients' index tables, after checking both
    (:mod:`jaxfed.data.validate`: a DataError names the first problem).

    ``train_parts[k]`` and ``test_parts[k]`` are client k's example indices (1-D integer arrays
    into the training and test split): as many test parts as training parts, every index in
    range. A client with an empty test part counts in no personalized metric (the partitioners
    give one to a client too small to get a test example of its classes). An empty training
    part is refused unless ``allow_empty_train``: such a client trains on nothing and has
    weight 0 in every aggregation."""
    check_dataset(dataset)
    source = f"dataset '{dataset.name}'"
    if len(train_parts) != len(test_parts):
        raise DataError(
            f"{source}: {len(train_parts)} training parts and {len(test_parts)} test parts; give one of each per client"
        )
    hint = " (federate(..., allow_empty_train=True) keeps such a client, with weight 0)"
    check_parts(source, train_parts, len(dataset.x_train), "training", allow_empty=allow_empty_train, empty_hint=hint)
    check_parts(source, test_parts, len(dataset.x_test), "test")
    train_idx, train_count = index_table(train_parts)
    test_idx, test_count = index_table(test_parts)
    return FederatedData(
        x_train=jnp.asarray(dataset.x_train),
        y_train=jnp.asarray(dataset.y_train),
        train_idx=jnp.asarray(train_idx),
        train_count=jnp.asarray(train_count),
        x_test=jnp.asarray(dataset.x_test),
        y_test=jnp.asarray(dataset.y_test),
        test_idx=jnp.asarray(test_idx),
        test_count=jnp.asarray(test_count),
        num_classes=dataset.num_classes,
        name=dataset.name,
    )
