"""Client tiers of different architectures (``tier_models``): each tier's model nested in the run's
model (jaxfed.nn.nesting) against the tier's model run on its own, and the htcnn family.

The reference for "a client trains its tier's model" is the plain algorithm built on the tier's
model itself; the reference embedding is written out index by index in numpy."""

from __future__ import annotations

from pathlib import Path

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import client_accuracy, make_federation, one_client, round_info

from jaxfed.algorithms.fedkd import fedkd
from jaxfed.algorithms.fedproto import Prototypes, fedproto
from jaxfed.algorithms.fedtgp import fedtgp
from jaxfed.algorithms.global_head import fedgh
from jaxfed.algorithms.local import local
from jaxfed.algorithms.pfedes import pfedes
from jaxfed.errors import ConfigError
from jaxfed.nn import get_model, model_template, nesting
from jaxfed.runs.config import Config
from jaxfed.simulation import Simulation, sampling

SMALL_MODELS = Path(__file__).with_name("small_models.py")


def spec(name: str) -> str:
    return f"{SMALL_MODELS}:{name}"


LARGE = spec("TinyHtCNN")
FAMILY = (LARGE, spec("TinyHtCNNNarrowConv"), spec("TinyHtCNNNarrowDense"))
OPTIONS = {"lr": 0.1, "local_epochs": 2, "batch_size": 16}


@pytest.fixture(scope="module")
def models(digits):
    return {
        name: get_model(name, digits.input_shape, digits.num_classes)
        for name in (*FAMILY, spec("TinyHtCNNFewerFeatures"))
    }


def place(small_shape, large_shape, path, conv_channels):
    """Index by index (numpy), where each entry of a small parameter sits in the large one: a Dense
    kernel fed by a flattened conv output of ``conv_channels = (small, large)`` channels has rows
    ``position * channels + channel``; every other axis keeps its leading entries."""
    index = np.indices(small_shape).reshape(len(small_shape), -1).T
    if path == "fc1/kernel" and conv_channels[0] != conv_channels[1]:
        small_c, large_c = conv_channels
        rows = index[:, 0]
        index = index.copy()
        index[:, 0] = (rows // small_c) * large_c + rows % small_c
    assert np.all(index < np.asarray(large_shape))
    return index


def path_of(path) -> str:
    return "/".join(str(k.key) for k in path)


def reference_embed(small_params, large):
    """``small_params`` (numpy float64) written into zeros of ``large``'s shapes (a tree of arrays;
    the models' convs are conv1, conv2, conv2 feeds fc1)."""
    channels = (small_params["conv2"]["kernel"].shape[-1], large["conv2"]["kernel"].shape[-1])

    def embed(path, value, like):
        value, target = np.asarray(value, np.float64), np.zeros(like.shape)
        index = place(value.shape, target.shape, path_of(path), channels)
        target[tuple(index.T)] = value.reshape(-1)
        return target

    return jax.tree_util.tree_map_with_path(embed, small_params, large)


def reference_unembed(large_params, small_model, small=None):
    """The small model's parameters read back out of ``large_params`` (the inverse of
    reference_embed; ``small``: the small model's tree of shapes, default its params')."""
    small = model_template(small_model)[0] if small is None else small
    small_channels = model_template(small_model)[0]["conv2"]["kernel"].shape[-1]
    # (a tree of statistics has no conv2, and no fc1 rows to place)
    large_channels = large_params["conv2"]["kernel"].shape[-1] if "conv2" in large_params else small_channels
    channels = (small_channels, large_channels)

    def unembed(path, shape, big):
        big = np.asarray(big)
        index = place(shape.shape, big.shape, path_of(path), channels)
        return jnp.asarray(big[tuple(index.T)].reshape(shape.shape))

    return jax.tree_util.tree_map_with_path(unembed, small, large_params)


def not_owned(large_params, small_model):
    """Every entry of ``large_params`` outside the small model's place (numpy, flattened)."""
    ones = jax.tree.map(lambda s: np.ones(s.shape), model_template(small_model)[0])
    owned = reference_embed(ones, large_params)
    return np.concatenate(
        [
            np.asarray(p).reshape(-1)[np.asarray(m).reshape(-1) == 0]
            for p, m in zip(jax.tree.leaves(large_params), jax.tree.leaves(owned))
        ]
    )


def test_the_htcnn_family_has_yi_et_als_layers():
    """htcnn1..htcnn5 on 32x32x3 images: conv 5x5 16, conv 5x5 32 (16 in CNN-2), fc1 of
    2000 / 2000 / 1000 / 800 / 500 on the 5x5 map, fc2 500, head 10 (the torch definitions)."""
    for name, conv2, fc1 in [
        ("htcnn1", 32, 2000),
        ("htcnn2", 16, 2000),
        ("htcnn3", 32, 1000),
        ("htcnn4", 32, 800),
        ("htcnn5", 32, 500),
    ]:
        params = model_template(get_model(name, (32, 32, 3), 10))[0]
        shapes = {layer: tuple(leaves["kernel"].shape) for layer, leaves in params.items()}
        assert shapes == {
            "conv1": (5, 5, 3, 16),
            "conv2": (5, 5, 16, conv2),
            "fc1": (25 * conv2, fc1),
            "fc2": (fc1, 500),
            "head": (500, 10),
        }, name
    # on Fashion-MNIST's images htcnn2's fc1 rows sit per position of the 4x4 map (16 of 32 channels
    # each; that the rule computes the smaller model: the TinyHtCNNNarrowConv case below)
    nested = nesting.nesting(get_model("htcnn2", (28, 28, 1), 10), get_model("htcnn1", (28, 28, 1), 10), "m", "htcnn2")
    assert nested.flattened["fc1.kernel"] == (16, 16, 32)


@pytest.mark.parametrize("name", FAMILY[1:] + (spec("TinyHtCNNFewerFeatures"),))
def test_a_smaller_model_embedded_in_the_larger_computes_itself(models, digits, name):
    small, large = models[name], models[LARGE]
    params = small.init(jax.random.key(3))["params"]
    embedded = nesting.nesting(small, large, "tier_models", name).embed(params)
    chex.assert_trees_all_close(
        embedded, reference_embed(jax.tree.map(np.asarray, params), model_template(large)[0]), rtol=0, atol=0
    )
    x = jnp.asarray(digits.x_test[:32])
    want, _ = small.apply({"params": params}, x)
    got, _ = large.apply({"params": embedded}, x)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def prototypes(width=12, seed=1):
    return Prototypes(jax.random.normal(jax.random.key(seed), (10, width)), jnp.ones((10,), bool))


def global_head(width=12, seed=2):
    kernel, bias = jax.random.split(jax.random.key(seed))
    return {"kernel": jax.random.normal(kernel, (width, 10)), "bias": jax.random.normal(bias, (10,))}


# LG-FedAvg: FedGH's client; pFedES's proxy extractor trains through the client's model
TIERED = [(fedproto, 0), (fedproto, 1), (fedproto, 2), (fedtgp, 1), (fedgh, 2), (pfedes, 2)]


@pytest.mark.parametrize("build, tier", TIERED, ids=lambda v: getattr(v, "__name__", str(v)))
def test_a_clients_update_is_its_tier_model_trained_on_its_own(models, digits_federation, build, tier):
    """FedProto's (FedTGP's, FedGH's, pFedES's) client of each tier against the plain algorithm
    built on the tier's model, from the same start: the same trained model (read back out of the
    run's model), the same upload, and the padding still exactly zero."""
    large, small = models[LARGE], models[FAMILY[tier]]
    alg, plain = build(large, tier_models=FAMILY, **OPTIONS), build(small, **OPTIONS)
    _, template = alg.init(jax.random.key(0))
    client = alg.init_client(template, jnp.int32(3), jnp.int32(tier))
    _, own = plain.init(jax.random.key(0))
    if plain.init_client is not None:  # FedTGP's clients carry their id
        own = plain.init_client(own, jnp.int32(3), jnp.int32(0))
    own = own._replace(params=reference_unembed(client.inner.params, small))
    assert np.all(not_owned(client.inner.params, small) == 0)
    data, rng = one_client(digits_federation, 3), jax.random.key(5)
    message = {fedgh: global_head, pfedes: lambda: plain.init(jax.random.key(0))[0]}.get(build, prototypes)()
    new, upload, _ = jax.jit(alg.client_update)(message, client, data, rng, round_info(tier=None))
    want, want_upload, _ = jax.jit(plain.client_update)(message, own, data, rng, round_info())
    trained = reference_unembed(new.inner.params, small)
    chex.assert_trees_all_close(trained, want.params, rtol=1e-4, atol=1e-6)
    chex.assert_trees_all_close(upload, want_upload, rtol=1e-4, atol=1e-6)
    assert np.all(not_owned(new.inner.params, small) == 0)
    assert not np.allclose(trained["fc1"]["kernel"], own.params["fc1"]["kernel"], atol=1e-3)


def test_each_tier_starts_at_its_own_models_initialization(models):
    """A tier's start is a draw of its own model's initialization (its fan-in's scale, e.g. fc2 of
    the narrow-Dense tier), one per tier and run: other tiers and another seed draw another."""
    large = models[LARGE]
    alg = local(large, tier_models=FAMILY)
    starts = {}
    for seed in (0, 1):
        _, template = alg.init(jax.random.key(seed))
        for tier in range(3):
            a, b = (alg.init_client(template, jnp.int32(c), jnp.int32(tier)) for c in (0, 7))
            chex.assert_trees_all_equal(a.inner.variables["params"], b.inner.variables["params"])
            starts[seed, tier] = reference_unembed(a.inner.variables["params"], models[FAMILY[tier]])
    assert not np.allclose(starts[0, 0]["fc1"]["kernel"][:, :8], starts[0, 2]["fc1"]["kernel"])
    assert not np.allclose(starts[0, 2]["fc1"]["kernel"], starts[1, 2]["fc1"]["kernel"])
    # flax's default (LeCun normal): std 1/sqrt(fan_in) of the tier's own model: fc2's fan-in is 8, not 24
    fc2 = np.concatenate([np.asarray(starts[s, 2]["fc2"]["kernel"]).reshape(-1) for s in (0, 1)])
    assert abs(fc2.std() * np.sqrt(8) - 1) < 0.25


# plain SGD, and an adaptive optimizer with weight decay (coupled, into the gradient) and clipping
OPTIMIZERS = [{}, {"client_optimizer": "adam", "lr": 0.01, "weight_decay": 1e-3, "clip_norm": 1.0}]


@pytest.mark.parametrize("optimizer", OPTIMIZERS, ids=["sgd", "adam"])
def test_the_padding_stays_exactly_zero_under_every_client_optimizer(models, digits_federation, optimizer):
    """FedKD's mentors (trained beside the mentee, its projection and both distillation terms; the
    other algorithms' clients: the tests above): what the tier's model does not own never moves,
    what it owns does."""
    large = models[LARGE]
    alg = fedkd(large, tier_models=FAMILY, **{**OPTIONS, **optimizer})
    server, template = alg.init(jax.random.key(0))
    message = alg.broadcast(server, round_info())
    data = one_client(digits_federation, 0)
    update = jax.jit(alg.client_update)  # as the engine runs it; the tiers share shapes: one compile
    for tier in (1, 2):
        client = alg.init_client(template, jnp.int32(0), jnp.int32(tier))
        new, _, _ = update(message, client, data, jax.random.key(1), round_info())
        before, after = (alg.eval_params(server, c)["params"] for c in (client, new))
        assert np.all(not_owned(after, models[FAMILY[tier]]) == 0)
        assert not np.allclose(after["fc1"]["kernel"], before["fc1"]["kernel"])


def test_the_engine_gives_each_client_its_tier_and_evaluates_its_own_model(models, digits):
    """Local over 6 clients and three architectures: equal contiguous tiers, each client evaluated
    on its own tier's model (the small model with the parameters read back out)."""
    fed = make_federation(digits, num_clients=6, alpha=0.5)
    large = models[LARGE]
    sim = Simulation(local(large, tier_models=FAMILY, **OPTIONS), large, fed, seed=0)
    state, _ = sim.run_rounds(sim.init(), 1)
    tiers = np.asarray(sampling.tier_of(jnp.arange(6), sampling.tier_bounds(6, 3)))
    assert tiers.tolist() == [0, 0, 1, 1, 2, 2]
    accuracies = []
    for client, tier in enumerate(tiers):
        params = jax.tree.map(lambda x, c=client: x[c], state.clients.inner.variables["params"])
        small = models[FAMILY[tier]]
        assert np.all(not_owned(params, small) == 0)
        accuracies.append(client_accuracy(small, {"params": reference_unembed(params, small)}, fed, client))
    np.testing.assert_allclose(sim.evaluate(state)["personalized_acc_mean"], np.mean(accuracies), rtol=1e-6)


def test_a_wrong_embedding_is_caught_by_the_check(models, monkeypatch):
    """The check is real: with the flattened conv output read as plain leading rows (wrong for
    fc1 after a narrower conv2), the run's model computes something else and the build refuses."""
    monkeypatch.setattr(nesting, "_flattened_rows", lambda *args: None)
    with pytest.raises(ConfigError, match="^tier_models: .*TinyHtCNNNarrowConv does not nest in the run's model"):
        local(models[LARGE], tier_models=FAMILY)


def one_line_error(build, match):
    with pytest.raises(ConfigError, match=match) as caught:
        build()
    assert "\n" not in str(caught.value)


def test_mistakes_are_one_line(models, digits):
    large = models[LARGE]
    sigmoid = get_model(spec("SigmoidNet"), digits.input_shape, digits.num_classes)
    one_line_error(
        lambda: local(large, model_tiers=(1.0, 0.5), tier_models=FAMILY), "^model_tiers, tier_models: set one"
    )
    one_line_error(
        lambda: local(models[FAMILY[1]], tier_models=FAMILY),
        r"^tier_models: .*TinyHtCNN's conv2.bias \(8,\) does not fit",
    )
    one_line_error(
        lambda: local(large, tier_models=("mlp",)), "^tier_models: mlp and the run's model .* have different layers"
    )
    one_line_error(lambda: local(large, tier_models=("nonexistent",)), "^tier_models: every model must be a built-in")
    one_line_error(lambda: local(large, tier_models=("missing.py:Net",)), "^tier_models: no file 'missing.py'")
    one_line_error(
        lambda: local(sigmoid, tier_models=(spec("SigmoidNet"), spec("NarrowSigmoidNet"))),
        "^tier_models: .*NarrowSigmoidNet's units padded into the run's model .* would train",
    )
    fewer = (LARGE, spec("TinyHtCNNFewerFeatures"))
    for build in (fedproto, fedkd):  # prototypes, FedKD's projection: both span the run's features
        one_line_error(
            lambda build=build: build(large, tier_models=fewer),
            "^tier_models: .*TinyHtCNNFewerFeatures gives its head 6 features",
        )
    group_norm = get_model(spec("TinyGroupNormCNN"), digits.input_shape, digits.num_classes)
    one_line_error(
        lambda: local(group_norm, tier_models=(spec("TinyGroupNormCNN"), spec("TinyGroupNormCNNNarrow"))),
        "^tier_models: .*TinyGroupNormCNNNarrow does not nest .* GroupNorm",
    )
    assert local(large, tier_models=fewer).num_tiers == 2  # Local exchanges nothing: any widths


def test_the_config_counts_tier_models_as_tiers():
    config = Config(algorithm="local").with_overrides([f"model={LARGE}", f"tier_models={','.join(FAMILY)}"]).validate()
    assert config.tier_option() == ("tier_models", 3)
    with pytest.raises(ConfigError, match="^tier_models: 3 tiers for 2 clients"):
        config.with_overrides(["num_clients=2"]).validate()
    with pytest.raises(ConfigError, match="^tier_models: every model must be a built-in"):
        Config(algorithm="fedproto").with_overrides(["tier_models=htcnn1,no such model"]).validate()


def test_the_algorithm_builds_inside_a_trace(models, digits, monkeypatch):
    """A sweep builds each member's algorithm inside a trace (its seed traced): the build's check
    runs there (not skipped as passed earlier in the process) and refuses there too, and the start
    key is the traced seed's."""
    monkeypatch.setattr(nesting, "_PASSED", set())
    shapes = jax.eval_shape(lambda key: local(models[LARGE], tier_models=FAMILY).init(key)[1], jax.random.key(0))
    assert shapes.start_key.dtype == jnp.uint32
    group_norm = get_model(spec("TinyGroupNormCNN"), digits.input_shape, digits.num_classes)
    tiers = (spec("TinyGroupNormCNN"), spec("TinyGroupNormCNNNarrow"))
    one_line_error(
        lambda: jax.eval_shape(lambda key: local(group_norm, tier_models=tiers).init(key)[1], jax.random.key(0)),
        "^tier_models: .*TinyGroupNormCNNNarrow does not nest",
    )


def test_a_batchnorm_tier_trains_its_own_model_and_statistics(digits, digits_federation):
    """BatchNorm normalizes each unit alone: a narrower tier's client takes Local's step on its own
    model, statistics included (GroupNorm, whose groups span units, is refused:
    test_mistakes_are_one_line). One step over the client's whole data: over many small batches
    the two drift apart by float rounding alone (ReLU kinks and max-pool near-ties of 8x8 digits'
    flat backgrounds flip on 1e-8 differences), the same from an identical start at any step."""
    large, small = (
        get_model(spec(n), digits.input_shape, digits.num_classes) for n in ("TinyNormCNN", "TinyNormCNNNarrow")
    )
    one_step = {"lr": 0.1, "local_epochs": 1, "batch_size": 256}
    alg = local(large, tier_models=(spec("TinyNormCNN"), spec("TinyNormCNNNarrow")), **one_step)
    plain = local(small, **one_step)
    _, template = alg.init(jax.random.key(0))
    client = alg.init_client(template, jnp.int32(1), jnp.int32(1))
    stats_shapes = model_template(small)[1]["batch_stats"]
    unembed = {
        "params": lambda v: reference_unembed(v["params"], small),
        "batch_stats": lambda v: reference_unembed(v["batch_stats"], small, stats_shapes),
    }
    own = plain.init(jax.random.key(0))[1]._replace(
        variables={k: f(client.inner.variables) for k, f in unembed.items()}
    )
    data, rng = one_client(digits_federation, 1), jax.random.key(4)
    new, _, _ = jax.jit(alg.client_update)((), client, data, rng, round_info(tier=None))
    want, _, _ = jax.jit(plain.client_update)((), own, data, rng, round_info())
    for collection, read in unembed.items():
        chex.assert_trees_all_close(read(new.inner.variables), want.variables[collection], rtol=1e-4, atol=1e-6)
    assert np.all(not_owned(new.inner.variables["params"], small) == 0)
    assert not np.allclose(want.variables["batch_stats"]["norm2"]["BatchNorm_0"]["mean"], 0.0)


def test_a_tier_model_file_is_recorded_absolute_and_fingerprinted(tmp_path, monkeypatch):
    """A relative ``path.py:Class`` tier model names the same file from anywhere on --resume, and
    its file joins the fingerprint's user code (an edit is warned of), as the run's model's."""
    import shutil

    from jaxfed.runs.build import build
    from jaxfed.runs.fingerprint import code_files

    for name in ("run_model.py", "tier_models.py"):
        shutil.copy(SMALL_MODELS, tmp_path / name)
    monkeypatch.chdir(tmp_path)
    config = Config(algorithm="local").with_overrides(
        ["model=run_model.py:TinyHtCNN", "tier_models=run_model.py:TinyHtCNN,tier_models.py:TinyHtCNNNarrowDense"]
    )
    assert config.validate().options.tier_models == (
        f"{tmp_path}/run_model.py:TinyHtCNN",
        f"{tmp_path}/tier_models.py:TinyHtCNNNarrowDense",
    )
    assert str((tmp_path / "tier_models.py").resolve()) in code_files(build(config.validate()).simulation)
