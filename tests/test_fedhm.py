"""FedHM: exact at full rank, per-tier ranks and bytes, reconstruction-then-average, tier errors."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import make_federation, round_info

from jaxfed.algorithms.fedhm import fedhm
from jaxfed.cli import main
from jaxfed.core import lowrank
from jaxfed.errors import ConfigError
from jaxfed.nn.factorized import factorized_execution
from jaxfed.nn.layers import interior_layers
from jaxfed.runs.config import Config
from jaxfed.simulation import Simulation, server_step


def _fedhm(model, lr=0.05, **options):
    return fedhm(model, lr=lr, local_epochs=1, batch_size=32, **options)


@pytest.mark.parametrize("model_name", ["mlp", "small_cnn"])
def test_full_rank_factors_reproduce_the_global_model(digits, model_name, request):
    model = request.getfixturevalue(model_name)
    alg = _fedhm(model, tiers=(1.0, 0.25))
    server, _ = alg.init(jax.random.key(0))
    broadcast = jax.jit(alg.broadcast)  # the tier is static in the RoundInfo
    x = jnp.asarray(digits.x_test[:32])

    @jax.jit
    def logits(params):
        with factorized_execution():
            return model.apply({"params": params}, x)[0]

    full = broadcast(server, round_info(0, 0))  # ratio 1.0: every layer travels as its kernel, unfactorized
    chex.assert_trees_all_equal(full, server.params)
    expected = logits(server.params)
    factorized = lowrank.factorize_layers(
        server.params,
        {k: lowrank.max_rank(lowrank.get_layer(server.params, k)["kernel"].shape) for k in interior_layers(model)},
    )
    np.testing.assert_allclose(logits(factorized), expected, rtol=1e-4, atol=1e-4)  # full-rank factors: the same model
    truncated = logits(broadcast(server, round_info(0, 1)))  # the rank-0.25 tier is a different model
    assert float(jnp.abs(truncated - expected).max()) > 1e-3


def test_a_round_with_lr_zero_leaves_the_global_model_unchanged(small_cnn, digits):
    fed = make_federation(digits, num_clients=4, alpha=0.5)
    sim = Simulation(_fedhm(small_cnn, lr=0.0, tiers=(1.0,)), small_cnn, fed, participation=1.0)
    start = sim.init()
    state, _ = sim.run_rounds(start, 1)
    for before, after in zip(jax.tree.leaves(start.server), jax.tree.leaves(state.server)):
        np.testing.assert_allclose(after, before, rtol=1e-4, atol=1e-5)


def test_server_reconstructs_each_upload_then_averages_with_sample_weights(mlp):
    alg = _fedhm(mlp, tiers=(0.5, 0.25))
    server, _ = alg.init(jax.random.key(0))
    rng = np.random.default_rng(0)

    def noisy(tree, n):  # n clients' uploads: the broadcast factors plus client-specific noise
        return jax.tree.map(lambda a: jnp.asarray(a + rng.normal(size=(n,) + a.shape), jnp.float32), tree)

    messages = (noisy(alg.broadcast(server, round_info(0, 0)), 2), noisy(alg.broadcast(server, round_info(0, 1)), 1))
    weights = jnp.array([10.0, 30.0, 60.0])
    new = server_step(alg, server, list(messages), [weights[:2], weights[2:]])  # one stack per tier

    uploads = [jax.tree.map(lambda a, i=i: np.float64(a[i]), m) for m, n in zip(messages, (2, 1)) for i in range(n)]
    fc2 = [m["fc2"]["u"] @ m["fc2"]["v"].T for m in uploads]  # each client's kernel, then the mean
    expected = (10 * fc2[0] + 30 * fc2[1] + 60 * fc2[2]) / 100
    np.testing.assert_allclose(new.params["fc2"]["kernel"], expected, rtol=1e-4, atol=1e-4)
    head = [m["head"]["kernel"] for m in uploads]
    expected = (10 * head[0] + 30 * head[1] + 60 * head[2]) / 100
    np.testing.assert_allclose(new.params["head"]["kernel"], expected, rtol=1e-5, atol=1e-6)


def test_fedhm_learns_with_upload_bytes_falling_with_the_tier_ratio(mlp, digits):
    fed = make_federation(digits, num_clients=9, alpha=0.5)
    alg = _fedhm(mlp, tiers=(1.0, 0.5, 0.25))
    server, _ = alg.init(jax.random.key(0))
    fc2 = alg.broadcast(server, round_info(0, 2))["fc2"]  # 200 x 200 at ratio 0.25
    assert fc2["u"].shape == (200, 50) and fc2["v"].shape == (200, 50)
    sim = Simulation(alg, mlp, fed, participation=1.0)
    state, metrics = sim.run_rounds(sim.init(), 8)
    per_client = [float(metrics[f"bytes_up_client_tier{t}"][0]) for t in range(3)]
    fc2_bytes = [4 * 200 * 200, 4 * 2 * 200 * 100, 4 * 2 * 200 * 50]  # ratio 1.0 sends the kernel itself
    assert per_client[0] - per_client[1] == fc2_bytes[0] - fc2_bytes[1]
    assert per_client[1] - per_client[2] == fc2_bytes[1] - fc2_bytes[2]
    assert float(metrics["bytes_up"][0]) == 3 * sum(per_client)  # 3 clients per tier, all sampled
    assert sim.evaluate(state)["global_acc"] > 0.8


def test_tier_errors_are_clear(mlp, digits, capsys, tmp_path):
    fed = make_federation(digits, num_clients=3, alpha=0.5)
    with pytest.raises(ConfigError, match=r"tiers: 4 tiers for 3 clients; allowed 1..3"):
        Simulation(_fedhm(mlp, tiers=(1.0, 0.5, 0.25, 0.1)), mlp, fed)
    with pytest.raises(ConfigError, match=r"tiers: every rank ratio must be in \(0, 1\], got 1.5 in '1.5'"):
        _fedhm(mlp, tiers=(1.5,))
    with pytest.raises(ConfigError, match=r"tiers: every rank ratio must be in \(0, 1\], got 0.0"):
        Config(algorithm="fedhm").with_overrides(["tiers=0.5,0"]).validate()
    with pytest.raises(ConfigError, match=r"tiers: expected float, got 'half'"):
        Config(algorithm="fedhm").with_overrides(["tiers=half"]).validate()
    with pytest.raises(ConfigError, match=r"tiers: 3 tiers for 2 clients"):
        Config(algorithm="fedhm").with_overrides(["tiers=1,0.5,0.25", "num_clients=2"]).validate()
    assert main(["run", "fedhm", "--quiet", "--out", str(tmp_path / "r"), "--set", "tiers=0.5,2"]) == 2
    assert "tiers: every rank ratio must be in (0, 1], got 2.0 in '0.5,2.0'" in capsys.readouterr().err


def _broadcast_ranks(alg, tier):
    """``{layer: rank}`` of what ``alg`` sends tier ``tier`` (shapes only: nothing is computed)."""
    server, _ = jax.eval_shape(alg.init, jax.random.key(0))
    message = jax.eval_shape(lambda s: alg.broadcast(s, round_info(0, tier)), server)
    return {key: layer["u"].shape[-1] for key, layer in lowrank.layers_with_factors(message).items()}


def test_the_authors_rank_rule_is_a_share_of_the_output_channels_and_shortcuts_stay_full(digits):
    from jaxfed.nn.models import get_model

    resnet = get_model("resnet8", digits.input_shape, digits.num_classes)
    template = jax.eval_shape(resnet.init, jax.random.key(0))["params"]
    kernels = {key: lowrank.get_layer(template, key)["kernel"].shape for key in interior_layers(resnet)}
    shortcuts = {key for key, shape in kernels.items() if shape[:2] == (1, 1)}
    assert shortcuts and all(key.endswith("shortcut") for key in shortcuts)
    for ratio in (0.5, 0.125):
        got = _broadcast_ranks(_fedhm(resnet, tiers=(ratio,), rank_rule="cout"), 0)
        # the authors' LowRankBasicBlockConv1x1: rank = max(1, round(planes / rank_factor)), rank_factor = 1 / ratio
        expected = {}
        for key, (kh, kw, cin, cout) in kernels.items():
            rank = max(1, round(cout * ratio))
            if key not in shortcuts and rank < min(kh * cin, kw * cout):
                expected[key] = rank
        assert got == expected
    default = _broadcast_ranks(_fedhm(resnet, tiers=(0.5,)), 0)
    assert set(default) == set(kernels) - shortcuts  # min_dim rule, shortcuts full
    assert all(
        rank == round(0.5 * min(kh * cin, kw * cout))
        for key, rank in default.items()
        for kh, kw, cin, cout in [kernels[key]]
    )
    assert shortcuts <= set(_broadcast_ranks(_fedhm(resnet, tiers=(0.5,), pointwise=True), 0))


def test_the_gram_factorization_broadcasts_the_svds_factors(small_cnn):
    """conv2 (24 x 48 matricized) takes the Gram route, conv3 (48 x 48, ill-conditioned at init)
    the SVD: either way each tier's factors multiply to the SVD route's."""
    svd, gram = (_fedhm(small_cnn, tiers=(1.0, 0.5), factorization=m) for m in ("svd", "gram"))
    server, _ = svd.init(jax.random.key(0))
    for tier in range(2):
        exact, routed = (jax.jit(a.broadcast)(server, round_info(0, tier)) for a in (svd, gram))
        chex.assert_trees_all_close(lowrank.reconstruct_layers(routed), lowrank.reconstruct_layers(exact), atol=2e-5)
    assert not np.array_equal(routed["conv2"]["u"], exact["conv2"]["u"])  # the option reached the server


def test_a_bad_factorization_is_a_one_line_error(mlp):
    with pytest.raises(ConfigError, match="factorization: unknown 'qr'; allowed: svd, gram"):
        _fedhm(mlp, factorization="qr")


def test_a_bad_rank_rule_is_a_one_line_error(mlp):
    with pytest.raises(ConfigError, match="rank_rule: unknown 'authors'; allowed: min_dim, cout"):
        _fedhm(mlp, rank_rule="authors")
