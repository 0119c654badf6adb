import jax.numpy as jnp
import numpy as np

from jaxfed.core import gather_clients, scatter_clients, stack_clients, tree_bytes, uniform_mean, weighted_mean


def test_weighted_mean_matches_formula():
    rng = np.random.default_rng(0)
    tree = {"a": rng.normal(size=(5, 3, 2)).astype(np.float32), "b": rng.normal(size=(5,)).astype(np.float32)}
    w = np.array([1.0, 0.0, 3.0, 2.0, 4.0], np.float32)
    got = weighted_mean(tree, w)
    for key in tree:
        expected = np.einsum("k,k...->...", w.astype(np.float64), tree[key].astype(np.float64)) / w.sum()
        np.testing.assert_allclose(got[key], expected, rtol=1e-6, atol=1e-6)


def test_uniform_mean_counts_each_kept_row_once():
    rng = np.random.default_rng(1)
    tree = {"a": rng.normal(size=(4, 3)).astype(np.float32)}
    w = np.array([10.0, 0.0, 1.0, 0.5], np.float32)  # the row of weight 0 (padding, skipped) drops out
    np.testing.assert_allclose(uniform_mean(tree, w)["a"], tree["a"][[0, 2, 3]].mean(0), rtol=1e-6)
    np.testing.assert_array_equal(uniform_mean(tree, np.zeros(4, np.float32))["a"], np.zeros(3))


def test_gather_scatter_drop_padding_ids():
    stacked = {"w": jnp.arange(12.0).reshape(4, 3)}
    ids = jnp.array([2, 0, 4])  # 4 is a padding id (out of range)
    rows = gather_clients(stacked, ids)
    assert rows["w"].shape == (3, 3)
    np.testing.assert_array_equal(rows["w"][:2], np.array([[6, 7, 8], [0, 1, 2]]))
    updated = scatter_clients(stacked, ids, {"w": rows["w"] + 100})
    expected = np.arange(12.0).reshape(4, 3)
    expected[[2, 0]] += 100
    np.testing.assert_array_equal(updated["w"], expected)  # the padding row wrote nothing


def test_stack_and_bytes():
    stacked = stack_clients({"w": jnp.ones((2, 3)), "b": jnp.zeros((3,), jnp.int8)}, 4)
    assert stacked["w"].shape == (4, 2, 3)
    assert tree_bytes(stacked) == 4 * (6 * 4 + 3 * 1)
