"""Property-based invariants (hypothesis): aggregation means and partitioners."""

import jax
import numpy as np
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from jaxfed.core import mean_of, weighted_mean, weighted_share
from jaxfed.data import partition
from jaxfed.errors import ConfigError

FAST = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
# XLA flushes subnormals, and a tiny normal value times a weight below 1 can become one: keep
# magnitudes at 0 or above 1e-30.
values = st.floats(-100, 100, allow_nan=False, allow_subnormal=False, width=32).filter(
    lambda x: x == 0 or abs(x) > 1e-30
)


@st.composite
def stacked_clients(draw, min_clients=1):
    """``(tree, weights)``: a two-leaf pytree with a leading client axis and positive weights."""
    clients = draw(st.integers(min_clients, 6))
    shape = draw(hnp.array_shapes(min_dims=0, max_dims=2, max_side=4))
    tree = {
        "w": draw(hnp.arrays(np.float32, (clients,) + shape, elements=values)),
        "b": draw(hnp.arrays(np.float32, (clients, 3), elements=values)),
    }
    weights = draw(hnp.arrays(np.float32, (clients,), elements=st.floats(0.125, 50, width=32)))
    return tree, weights


def _close(a, b):
    for key in a:
        np.testing.assert_allclose(np.asarray(a[key]), np.asarray(b[key]), rtol=1e-5, atol=1e-4)


@FAST
@given(stacked_clients())
def test_weighted_mean_of_identical_clients_is_the_client(case):
    tree, weights = case
    same = {k: np.broadcast_to(v[:1], v.shape) for k, v in tree.items()}
    _close(weighted_mean(same, weights), {k: v[0] for k, v in tree.items()})


@FAST
@given(stacked_clients(min_clients=2), st.randoms(use_true_random=False))
def test_weighted_mean_ignores_client_order(case, random):
    tree, weights = case
    order = list(range(len(weights)))
    random.shuffle(order)
    _close(weighted_mean(tree, weights), weighted_mean({k: v[order] for k, v in tree.items()}, weights[order]))


@FAST
@given(stacked_clients(), st.floats(1e-3, 1e3))
def test_weighted_mean_ignores_weight_scale(case, scale):
    tree, weights = case
    _close(weighted_mean(tree, weights), weighted_mean(tree, weights * np.float32(scale)))


@FAST
@given(stacked_clients(), st.integers(0, 6))
def test_zero_weight_client_has_no_effect(case, position):
    tree, weights = case
    position = min(position, len(weights))
    extra = {k: np.insert(v, position, 1e4, axis=0) for k, v in tree.items()}  # a wild client...
    _close(weighted_mean(tree, weights), weighted_mean(extra, np.insert(weights, position, 0.0)))  # ...of weight 0


@st.composite
def masked_case(draw):
    tree, weights = draw(stacked_clients())
    masks = {k: draw(hnp.arrays(np.bool_, v.shape)) for k, v in tree.items()}
    previous = {k: draw(hnp.arrays(np.float32, v.shape[1:], elements=values)) for k, v in tree.items()}
    return previous, tree, masks, weights


@FAST
@given(masked_case())
def test_summed_shares_keep_the_previous_value_where_nobody_sent(case):
    """Per-position shares (a weight per position, 0 where not sent), summed over the clients in
    any order, then :func:`mean_of`: the float64 formula; positions nobody sent keep their value."""
    previous, tree, masks, weights = case
    for key in tree:
        per_position = weights.reshape((-1,) + (1,) * (tree[key].ndim - 1)) * masks[key]
        shares = [weighted_share(tree[key][k], per_position[k]) for k in range(len(weights))]
        got = np.asarray(mean_of(jax.tree.map(lambda *s: sum(s), *shares), previous[key]))
        backwards = jax.tree.map(lambda *s: sum(s), *shares[::-1])
        np.testing.assert_allclose(got, mean_of(backwards, previous[key]), rtol=1e-5, atol=1e-4)
        senders = (per_position > 0).sum(axis=0)
        np.testing.assert_array_equal(got[senders == 0], previous[key][senders == 0])
        w = per_position.astype(np.float64)
        expected = np.where(senders > 0, (w * tree[key]).sum(0) / np.maximum(w.sum(0), 1e-30), previous[key])
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-4)


@settings(max_examples=60, deadline=None)
@given(
    name=st.sampled_from(["iid", "dirichlet", "pathological", "client_dirichlet"]),
    num_clients=st.integers(1, 30),
    num_classes=st.integers(2, 12),
    alpha=st.floats(0.05, 20),
    classes_per_client=st.integers(1, 4),
    seed=st.integers(0, 2**16),
)
def test_partitioners_cover_without_duplicates(name, num_clients, num_classes, alpha, classes_per_client, seed):
    rng = np.random.default_rng(seed)
    y_train = rng.integers(0, num_classes, size=600)
    y_test = rng.integers(0, num_classes, size=150)
    sizes = {"client_train_size": 600 // num_clients, "client_test_size": 150 // num_clients}
    try:
        train, test = partition(
            name,
            y_train,
            y_test,
            num_clients,
            np.random.default_rng(seed),
            alpha=alpha,
            min_examples=1,
            classes_per_client=min(classes_per_client, num_classes),
            **sizes,
        )
    except ConfigError:
        assume(False)  # a refused configuration (too few examples for the clients) is not a case
    assert len(train) == len(test) == num_clients
    assert all(len(p) > 0 for p in train), "a client without training examples"
    for parts, labels in ((train, y_train), (test, y_test)):
        flat = np.concatenate(parts)
        assert len(flat) == len(np.unique(flat)), "an example given twice"
        assert flat.size == 0 or (flat.min() >= 0 and flat.max() < len(labels))
    held = np.unique(np.concatenate([y_train[p] for p in train]))
    if name == "client_dirichlet":  # documented: exactly the requested sizes
        assert [len(p) for p in train] == [sizes["client_train_size"]] * num_clients
        assert [len(p) for p in test] == [sizes["client_test_size"]] * num_clients
    else:  # documented: every training example of a held class, and the test examples of held classes
        assert sum(map(len, train)) == int(np.isin(y_train, held).sum())
        if name in ("iid", "dirichlet"):
            assert sum(map(len, train)) == len(y_train)
        assert sum(map(len, test)) == int(np.isin(y_test, held).sum())


def test_summed_shares_with_no_weight_keep_everything():
    previous = np.arange(4, dtype=np.float32)
    shares = [weighted_share(np.ones(4, np.float32), 0.0) for _ in range(3)]
    np.testing.assert_array_equal(mean_of(jax.tree.map(lambda *s: sum(s), *shares), previous), previous)
