"""Pack primitives against a float64 numpy reference of FedCSPACK's formulas, written out."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxfed.core import packs as pk
from jaxfed.errors import ConfigError

PACK = 7


def _tree(rng, scale=1.0):
    """A parameter tree of 2*3 + 5 + 4*4 = 27 values: 4 packs of 7, the last one partial."""
    return {
        "a": {"kernel": jnp.asarray(scale * rng.normal(size=(2, 3)), jnp.float32), "bias": jnp.zeros(5)},
        "b": jnp.asarray(scale * rng.normal(size=(4, 4)), jnp.float32),
    }


def _np_packs(tree):
    flat = np.concatenate([np.asarray(x, np.float64).ravel() for x in jax.tree.leaves(tree)])
    padded = np.zeros(math.ceil(flat.size / PACK) * PACK)
    padded[: flat.size] = flat
    return padded.reshape(-1, PACK)


def _np_softmax(x):
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def _np_scores(local, reference):
    """theta_a, theta_j, beta_j = KL(softmax(reference_j) || softmax(local_j))."""
    a, b = local.ravel(), reference.ravel()
    theta_a = a @ b / (np.linalg.norm(a) * np.linalg.norm(b))
    theta = np.sum(local * reference, 1) / (np.linalg.norm(local, axis=1) * np.linalg.norm(reference, axis=1))
    p, q = _np_softmax(reference), _np_softmax(local)
    beta = np.sum(p * (np.log(p) - np.log(q)), axis=1)
    return theta_a, theta, beta


def test_pack_view_pads_the_last_pack_with_zeros_and_round_trips():
    tree = _tree(np.random.default_rng(0))
    view = pk.pack_view(tree, PACK)
    assert (view.size, view.num_packs) == (27, 4)
    packs = view.to_packs(tree)
    np.testing.assert_array_equal(packs, _np_packs(tree).astype(np.float32))
    assert np.all(np.asarray(packs).ravel()[27:] == 0)
    for a, b in zip(jax.tree.leaves(view.to_tree(packs)), jax.tree.leaves(tree)):
        np.testing.assert_array_equal(a, b)


def test_scores_match_the_formulas_including_negative_cosines():
    rng = np.random.default_rng(1)
    reference = _tree(rng)
    local = jax.tree.map(lambda x: -0.7 * x + 0.5 * jnp.asarray(rng.normal(size=x.shape), jnp.float32), reference)
    view = pk.pack_view(reference, PACK)
    lp, rp = view.to_packs(local), view.to_packs(reference)
    theta_a, theta, beta = _np_scores(_np_packs(local), _np_packs(reference))
    assert np.any(theta < 0) and theta_a < 0
    np.testing.assert_allclose(pk.cosine(lp.ravel(), rp.ravel()), theta_a, rtol=1e-5)
    np.testing.assert_allclose(pk.pack_cosine(lp, rp), theta, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(pk.pack_kl(lp, rp), beta, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("k", [1, 2, 4])
def test_selection_takes_the_lowest_cosines_below_the_threshold(k):
    theta = jnp.array([0.3, -0.2, 0.9, 0.1, -0.5, 0.95])
    threshold = 0.5
    indices, valid = pk.select_packs(theta, threshold, k)
    order = np.argsort(np.asarray(theta), kind="stable")
    np.testing.assert_array_equal(indices, order[:k])
    np.testing.assert_array_equal(valid, np.asarray(theta)[order[:k]] < threshold)
    everything, valid_all = pk.select_packs(theta, threshold, theta.shape[0])  # all_below
    assert set(np.asarray(everything)[np.asarray(valid_all)]) == {0, 1, 3, 4}


def test_top_k_count_and_errors():
    assert [pk.num_selected(569, r) for r in (0.1, 0.5, 1.0)] == [57, 285, 569]
    assert pk.num_selected(10, 0.1) == 1 and pk.num_selected(3, 0.01) == 1
    for bad in (0.0, -0.1, 1.5):
        with pytest.raises(ConfigError, match=rf"share_ratio: must be in \(0, 1\], got {bad}"):
            pk.num_selected(10, bad)
    with pytest.raises(ConfigError, match="pack_size: must be >= 1, got 0"):
        pk.pack_view({"w": jnp.zeros(3)}, 0)


@pytest.mark.parametrize("weight", ["cos_kl", "cos", "kl"])
def test_weights_are_the_absolute_double_weight(weight):
    theta, beta = jnp.array([-0.9, 0.2, 0.4]), jnp.array([0.3, 0.1, 0.05])
    expected = {"cos_kl": np.abs(theta + beta), "cos": np.abs(theta), "kl": np.abs(beta)}[weight]
    np.testing.assert_allclose(pk.pack_weights(theta, beta, weight), expected, rtol=1e-6)


def test_aggregation_is_the_weighted_mean_of_the_senders_and_keeps_unsent_packs():
    rng = np.random.default_rng(2)
    packs = rng.normal(size=(6, PACK))
    indices = np.array([[0, 3, 5], [3, 1, 2], [4, 0, 1]])
    deltas = rng.normal(size=(3, 3, PACK))
    weights = np.array([[0.5, 1.2, 0.0], [0.3, 0.7, 0.9], [0.0, 0.0, 0.0]])  # zeros: not sent
    new, mask = pk.aggregate_packs(
        jnp.asarray(packs, jnp.float32), jnp.asarray(indices), jnp.asarray(deltas, jnp.float32), jnp.asarray(weights)
    )
    expected = packs.copy()
    for j in range(6):  # PW_j += sum_k (m_kj / M_j) delta_kj over the clients that sent j
        sent = [(k, s) for k in range(3) for s in range(3) if indices[k, s] == j and weights[k, s] > 0]
        total = sum(weights[k, s] for k, s in sent)
        if total > 0:
            expected[j] += sum(weights[k, s] / total * deltas[k, s] for k, s in sent)
    np.testing.assert_allclose(new, expected, rtol=1e-5, atol=1e-5)
    totals = [sum(weights[k, s] for k in range(3) for s in range(3) if indices[k, s] == j) for j in range(6)]
    np.testing.assert_allclose(mask, totals, rtol=1e-6)  # M_j, the next global mask
    for unsent in (4, 5):  # picked only with weight 0
        np.testing.assert_array_equal(np.asarray(new)[unsent], packs[unsent].astype(np.float32))


@pytest.mark.parametrize("delta_std", [1e-5, 1e-4, 1e-3, 1e-1, 2.0])
def test_pack_kl_is_accurate_for_close_and_far_packs(delta_std):
    """Against the textbook KL in float64: the float32 textbook sum is negative for half of these
    packs at a delta of 1e-4; the stable form keeps the float64 value to about 1e-3 relative."""
    rng = np.random.default_rng(2)
    reference = rng.normal(scale=0.05, size=(64, 1024))  # packs of real-model scale
    local = reference + rng.normal(scale=delta_std, size=reference.shape)

    def log_softmax(x):
        x = x - x.max(axis=-1, keepdims=True)
        return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))

    lr, ll = log_softmax(reference), log_softmax(local)
    expected = np.sum(np.exp(lr) * (lr - ll), axis=-1)  # float64
    got = np.asarray(pk.pack_kl(jnp.asarray(local, jnp.float32), jnp.asarray(reference, jnp.float32)))
    assert np.all(got >= 0)
    # the float32 inputs themselves differ from the float64 ones by rounding: compare to their KL
    lr32, ll32 = log_softmax(np.float64(np.float32(reference))), log_softmax(np.float64(np.float32(local)))
    expected32 = np.sum(np.exp(lr32) * (lr32 - ll32), axis=-1)
    np.testing.assert_allclose(got, expected32, rtol=2e-3)
    np.testing.assert_allclose(expected32, expected, rtol=0.05)  # the inputs' rounding, not the method's
