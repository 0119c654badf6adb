"""A server that keeps one row per client: FedAMP's clients' models and cloud models, FedCAC's
customized models.

The server holds a table (every leaf stacked ``[num_clients, ...]``), writes the rows of a round's
uploads by client id, and each client reads its own row. A client knows its id (its state's
``id``, set once by ``init_client``) and sends it with its upload: a server knows who sent what.
The broadcast is the table, but each client is sent only its own row (:func:`one_row_sent`).
These servers truly need every upload of a round at once (pairwise similarities): they give a
``server_update``, not an ``aggregation``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxfed.core import scatter_clients, tree_bytes


def own_row(table, client_id):
    """Client ``client_id``'s row of ``table``. An id beyond the table (an algorithm built for
    fewer clients than the federation has) reads NaN (True where the row is bool), so that the
    run stops as non-finite instead of reading another client's row."""
    return jax.tree.map(lambda leaf: jnp.take(leaf, client_id, axis=0, mode="fill"), table)


def with_rows(table, ids, rows, weights):
    """``table`` with ``rows`` written at ``ids`` where the row carries weight (``weights > 0``);
    padding and skipped rows (weight 0) write nothing."""
    num_clients = jax.tree.leaves(table)[0].shape[0]
    return scatter_clients(table, jnp.where(weights > 0, ids, num_clients), rows)


def with_id(client_state, client_id, tier):
    """``init_client``: the client's state holding its id."""
    return client_state._replace(id=jnp.asarray(client_id, jnp.int32))


def one_row_sent(row):
    """A ``sent_bytes``: each client is sent one row the size of ``row`` (a model's parameters)."""
    size = float(tree_bytes(row))
    return lambda message_down, client_state, info: jnp.float32(size)
