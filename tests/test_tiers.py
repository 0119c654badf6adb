"""Every tier in one program (``pad_tier``): padded layers compute what the tier's own layers
compute, and a round of one group of all tiers gives the per-tier groups' numbers."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxfed.algorithms.fedara import fedara
from jaxfed.algorithms.fedhm import fedhm
from jaxfed.algorithms.fedloru import mfedloru
from jaxfed.core import lowrank
from jaxfed.nn.factorized import factorized_execution
from jaxfed.simulation import Simulation


def mfedloru_tiers(model, **options):
    """mFedLoRU with a tier per kind: the rank-r factors (1.0), and nested pairs of two ranks."""
    return mfedloru(model, tiers=(1.0, 0.5, 0.25, 0.5, 1.0), lora_rank=4, lr=0.05, **options)


RANKS = [{}, {"conv2": 6, "conv3": 10}, {"conv2": 3}]  # tier 0 whole, tier 2 keeps conv3 whole


def loss_of(model, x, y):
    def loss(params, kernel_on=None):
        with factorized_execution(kernel_on):
            logits = model.apply({"params": params}, x)
        return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), y[:, None], axis=1))

    return loss


@pytest.mark.parametrize("tier", range(len(RANKS)))
def test_a_padded_layer_computes_and_trains_as_the_tiers_own(tier, small_cnn, digits):
    """Loss and gradient of a tier's parameters padded to every tier's largest rank: the tier's
    own (a kernel or its factors), and zero on the padding (zero factor columns, a switched-off
    kernel), so SGD leaves the padding at zero; the padded upload reconstructs to the same kernels."""
    x, y = jnp.asarray(digits.x_train[:16]), jnp.asarray(digits.y_train[:16])
    params = small_cnn.module.init(jax.random.key(0), x)["params"]
    union = lowrank.union_ranks(RANKS)
    own = lowrank.factorize_layers(params, RANKS[tier])
    padded = lowrank.pad_to_union(own, union)
    loss = loss_of(small_cnn.module, x, y)
    want_value, want_grad = jax.value_and_grad(loss)(own)
    value, grad = jax.value_and_grad(loss)(padded.params, padded.kernel_on)
    np.testing.assert_allclose(value, want_value, rtol=1e-5)
    for key, rank in union.items():
        got, want = lowrank.get_layer(grad, key), lowrank.get_layer(want_grad, key)
        if key in RANKS[tier]:
            r = RANKS[tier][key]
            assert not np.any(got["kernel"])
            for f in ("u", "v"):
                np.testing.assert_allclose(got[f][..., :r], want[f], rtol=1e-4, atol=1e-6)
                assert not np.any(got[f][..., r:])
        else:
            np.testing.assert_allclose(got["kernel"], want["kernel"], rtol=1e-4, atol=1e-6)
            assert not np.any(got["u"]) and not np.any(got["v"])
    rebuilt = lowrank.reconstruct_layers(padded.params)
    for key in union:
        kernel = np.asarray(lowrank.get_layer(lowrank.reconstruct_layers(own), key)["kernel"], np.float64)
        np.testing.assert_allclose(lowrank.get_layer(rebuilt, key)["kernel"], kernel, rtol=1e-5, atol=1e-6)


def test_a_padded_layer_without_its_switch_is_one_line(small_cnn, digits):
    x = jnp.asarray(digits.x_train[:4])
    params = small_cnn.module.init(jax.random.key(0), x)["params"]
    padded = lowrank.pad_to_union(lowrank.factorize_layers(params, RANKS[1]), lowrank.union_ranks(RANKS))
    with pytest.raises(ValueError, match="conv2: a padded layer"):
        loss_of(small_cnn.module, x, jnp.zeros(4, jnp.int32))(padded.params)


# FedARA's pad_tier pads FedHM's message plus its tier's layer membership: FedHM's case is a subset.
# mFedLoRU's pads nested pairs and switches which factors train (an optimizer mask).
@pytest.mark.parametrize(
    "algorithm, model_name", [(fedara, "mlp"), (mfedloru_tiers, "mlp")], ids=["fedara", "mfedloru"]
)
def test_every_tier_in_one_group_gives_the_per_tier_groups_numbers(algorithm, model_name, digits_federation, request):
    """Five tiers (the first whole), 5 of 10 clients a round, vmapped: one group of all tiers
    against one group per tier (a padded conv's numbers: the test above). Bytes exactly (each
    tier's own message, not the padded one); losses and states up to float rounding (a padded
    sum runs over more, zero, terms). Evaluation is not compared: it reads neither ``pad_tier``
    nor the grouping (only a round's client groups do), so equal states evaluate equally."""
    model = request.getfixturevalue(model_name)
    built = algorithm(model, local_epochs=1)
    runs = {}
    for name, alg in (("one", built), ("per_tier", built._replace(pad_tier=None))):
        sim = Simulation(alg, model, digits_federation, participation=0.5, client_chunk=0)
        assert sim._tiers_in_one_group() == (name == "one")
        state, metrics = sim.run_rounds(sim.init(), 2)
        runs[name] = state, metrics
    (state, metrics), (want_state, want_metrics) = runs["one"], runs["per_tier"]
    assert metrics.keys() == want_metrics.keys()
    # one row per sampled client, against each tier's group padded to min(sampled, tier size)
    assert metrics["nonfinite_ids"].shape == (2, 5) and want_metrics["nonfinite_ids"].shape == (2, 10)
    for key, want in want_metrics.items():
        if key == "nonfinite_ids":
            assert np.all(metrics[key] == -1) and np.all(want == -1)
        elif key.startswith("bytes") or key == "nonfinite_clients":
            np.testing.assert_array_equal(metrics[key], want, err_msg=key)
        else:
            np.testing.assert_allclose(metrics[key], want, rtol=1e-5, err_msg=key)
    for got, want in zip(jax.tree.leaves(state), jax.tree.leaves(want_state), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


def test_one_client_at_a_time_runs_per_tier(mlp, digits_federation):
    """Chunks of one: per-tier groups (a padding row costs nothing there; each tier its own rank)."""
    sim = Simulation(fedhm(mlp), mlp, digits_federation, participation=0.5, client_chunk=1)
    assert not sim._tiers_in_one_group()


@pytest.mark.parametrize("num_clients, num_tiers", [(10, 5), (7, 3), (13, 4), (1000, 5)])
def test_a_clients_tier_is_the_documented_rule(num_clients, num_tiers):
    """Client k of N is in tier ``k * T // N``; a padding id (N) gets the last tier's."""
    from jaxfed.simulation import sampling

    ids = jnp.arange(num_clients + 1, dtype=jnp.int32)
    got = sampling.tier_of(ids, sampling.tier_bounds(num_clients, num_tiers))
    want = np.minimum(np.arange(num_clients + 1) * num_tiers // num_clients, num_tiers - 1)
    np.testing.assert_array_equal(got, want)
