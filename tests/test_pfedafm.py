"""pFedAFM against its round written out: the mixed model's momentum SGD steps (torch's, written
out) on the local model and the weights alpha (projected onto [0, 1]), then the global extractor's
steps under the client's trained head (G the run's model, or another with BatchNorm statistics the
client keeps); its personalized model as the mixture computed from the modules' own features; an
engine round as its clients one by one, then the sample-weighted mean of the extractors."""

from __future__ import annotations

from pathlib import Path

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import (
    clients_one_by_one,
    cross_entropy,
    make_federation,
    module_features,
    one_client,
    round_info,
    torch_sgd,
)

from jaxfed.algorithms.pfedafm import PFedAFMOptions, pfedafm
from jaxfed.errors import ConfigError
from jaxfed.nn import get_model
from jaxfed.runs.config import Config
from jaxfed.simulation import Simulation


def extractor_features(extractor_model, params, stats, x, *, train):
    """``(G's features, its new statistics)`` from its module itself (``features=True``): in
    training mode normalized by the batch and its statistics moved, else by its statistics."""
    features, moved = extractor_model.module.apply(
        {"params": params, **stats}, x, train=train, features=True, mutable=["batch_stats"]
    )
    return features, (moved if train else stats)


def mixture_logits(model, local, mix, extractor_model, extractor, stats, x):
    """``h(alpha f(x) + (1 - alpha) g(x))``, G in inference mode."""
    shared, _ = extractor_features(extractor_model, extractor, stats, x, train=False)
    mixed = mix * module_features(model, local, x) + (1 - mix) * shared
    return mixed @ local["head"]["kernel"] + local["head"]["bias"]


SMALL_MODELS = Path(__file__).with_name("small_models.py")


@pytest.mark.parametrize("other", [False, True], ids=["g_is_the_run_model", "g_another_model_with_batchnorm"])
def test_a_client_trains_the_mixture_then_the_extractor_under_its_head(other, digits, digits_federation):
    """One batch holds every example, torch's momentum SGD with weight decay: ``local_epochs`` steps
    on the local model (its gradient clipped, binding) and alpha (unclipped, at ``mix_lr``, then
    projected onto [0, 1]: large enough that some weights hit a bound), G frozen in inference mode;
    then ``local_epochs`` steps on G alone with the trained head (clipped), G in training mode, its
    BatchNorm statistics (G of another architecture: a 16-wide BatchNorm net beside a 16-wide MLP)
    moved on each batch and kept by the client; each phase's optimizer fresh; the upload is G
    without a head. The personalized model is the mixture with the server's G."""
    lr, mix_lr, epochs, momentum, decay, clip = 0.3, 40.0, 3, 0.9, 0.01, 0.1
    model = get_model("mlp", digits.input_shape, digits.num_classes, hidden=(16,) if other else None)
    global_model = f"{SMALL_MODELS}:BatchNormNet" if other else ""
    alg = pfedafm(model, lr=lr, mix_lr=mix_lr, local_epochs=epochs, batch_size=512, momentum=momentum,
                  weight_decay=decay, clip_norm=clip, global_model=global_model)  # fmt: skip
    g_model = get_model(global_model, digits.input_shape, digits.num_classes) if other else model
    server, client = alg.init(jax.random.key(0))
    assert "head" not in server.params and np.all(np.asarray(client.mix) == 1.0)
    assert ("batch_stats" in client.extractor_state) == other
    # statistics of the client's own, not an initialization's: phase 1 and phase 2 start from them
    client = client._replace(extractor_state=jax.tree.map(lambda s: 1.5 * s + 0.25, client.extractor_state))
    data = one_client(digits_federation, 2)
    new, upload, metrics = jax.jit(alg.client_update)(server, client, data, jax.random.key(1), round_info())
    idx = np.asarray(data.indices[: int(data.count)])
    x, y = jnp.asarray(np.asarray(data.x)[idx]), jnp.asarray(np.asarray(data.y)[idx])

    local, mix, extractor, stats = client.params, client.mix, server.params, client.extractor_state
    grad = jax.jit(
        jax.grad(
            lambda local, mix: cross_entropy(mixture_logits(model, local, mix, g_model, extractor, stats, x), y),
            argnums=(0, 1),
        )
    )
    step, mix_step = jax.jit(torch_sgd(lr, momentum, decay, clip)), jax.jit(torch_sgd(mix_lr, momentum, decay, jnp.inf))
    velocity, mix_velocity, norms = jax.tree.map(jnp.zeros_like, local), jnp.zeros_like(mix), []
    for _ in range(epochs):
        g_local, g_mix = grad(local, mix)
        local, velocity, norm = step(local, g_local, velocity)
        mix, mix_velocity, _ = mix_step(mix, g_mix, mix_velocity)
        mix, norms = jnp.clip(mix, 0.0, 1.0), norms + [norm]
    head = local["head"]

    def extractor_loss(g, kept):
        shared, kept = extractor_features(g_model, g, kept, x, train=True)
        return cross_entropy(shared @ head["kernel"] + head["bias"], y), kept

    grad_g = jax.jit(jax.grad(extractor_loss, has_aux=True))
    velocity, g, kept = jax.tree.map(jnp.zeros_like, extractor), extractor, stats
    for _ in range(epochs):
        g_grad, kept = grad_g(g, kept)
        g, velocity, norm = step(g, g_grad, velocity)
        norms.append(norm)
    assert min(norms) > clip  # the clipping bound every step

    chex.assert_trees_all_close(new.params, local, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(new.mix, mix, rtol=1e-4, atol=1e-5)
    at_bounds = np.mean((np.asarray(mix) == 0.0) | (np.asarray(mix) == 1.0))
    assert 0 < np.mean(np.asarray(mix) == 0.0) and at_bounds < 1  # the projection acted, not on every weight
    chex.assert_trees_all_close(upload, g, rtol=1e-4, atol=1e-5)
    chex.assert_trees_all_close(new.extractor_state, kept, rtol=1e-4, atol=1e-6)
    moved = [not np.allclose(a, b) for a, b in zip(jax.tree.leaves(kept), jax.tree.leaves(stats))]
    assert len(moved) == (2 if other else 0) and all(moved)  # G's mean and variance moved in phase 2, kept
    assert float(metrics["steps"]) == 2 * epochs

    x_test = jnp.asarray(digits_federation.x_test[:40])
    got, _ = alg.eval_model.apply(alg.eval_params(server, new), x_test)
    want = mixture_logits(model, new.params, new.mix, g_model, server.params, new.extractor_state, x_test)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


def test_an_engine_round_is_the_clients_one_by_one_then_the_weighted_mean_of_the_extractors(mlp, digits):
    fed = make_federation(digits, num_clients=5, alpha=0.5)
    alg = pfedafm(mlp, lr=0.05, batch_size=16, local_epochs=1)
    sim = Simulation(alg, mlp, fed, participation=0.6)
    state = sim.init()
    ids, results = clients_one_by_one(sim, state, fed)
    weights = np.asarray(fed.train_count[ids], np.float64)
    extractors = [upload for _, upload in results]
    share = weights / weights.sum()
    want = jax.tree.map(lambda *g: np.tensordot(share, np.asarray(g, np.float64), axes=1), *extractors)
    new_state, _ = jax.jit(sim.round)(state, fed)
    chex.assert_trees_all_close(new_state.server.params, want, rtol=1e-4, atol=1e-5)
    for i, (client, _) in zip(ids, results):
        np.testing.assert_allclose(new_state.clients.mix[i], client.mix, rtol=1e-5, atol=1e-6)
    assert alg.global_params is None  # the heads are private


def test_a_tiered_local_model_mixes_with_the_whole_extractor(mlp, digits_federation):
    """With ``model_tiers`` a tier-1 client's local model is its rank level (rank 50 of 200 in the
    decomposed layer, after training too) while the extractor it uploads stays the run's whole one."""
    alg = pfedafm(mlp, model_tiers=(1.0, 0.25), lr=0.1, batch_size=16, local_epochs=1)
    server, template = alg.init(jax.random.key(0))
    client = alg.init_client(template, jnp.int32(3), jnp.int32(1))
    new, extractor, _ = jax.jit(alg.client_update)(server, client, one_client(digits_federation, 3),
                                                   jax.random.key(5), round_info(tier=None))  # fmt: skip
    local = np.asarray(alg.eval_params(server, new)["params"]["local"]["fc2"]["kernel"])
    assert np.linalg.matrix_rank(local, tol=1e-4) == 50
    assert np.linalg.matrix_rank(np.asarray(extractor["fc2"]["kernel"]), tol=1e-4) == 200
    assert not np.allclose(extractor["fc2"]["kernel"], server.params["fc2"]["kernel"], atol=1e-4)


def test_an_extractor_of_another_width_is_one_line(mlp):
    with pytest.raises(ConfigError, match="global_model: linear gives 64 features.*takes 200") as err:
        pfedafm(mlp, global_model="linear")
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("setting", ["global_model=nosuch", "mix_lr=-1"])
def test_a_bad_option_is_one_line(setting):
    with pytest.raises(ConfigError, match=setting.split("=")[0]) as err:
        Config(algorithm="pfedafm").with_overrides([setting]).validate()
    assert "\n" not in str(err.value)


def test_the_defaults_are_the_authors_code():
    options = PFedAFMOptions()
    training = (options.lr, options.momentum, options.weight_decay, options.clip_norm)
    assert training == (0.01, 0.9, 0.001, 50.0)
    assert (options.batch_size, options.local_epochs, options.mix_lr, options.global_model) == (512, 10, 0.01, "")


def test_a_global_model_file_is_recorded_absolute_and_fingerprinted(tmp_path, monkeypatch):
    """A relative ``path.py:Class`` global_model names the same file from anywhere on --resume, and
    its file joins the fingerprint's user code (an edit is warned of), as the run's model's."""
    import shutil

    from jaxfed.runs.build import build
    from jaxfed.runs.fingerprint import code_files

    for name in ("run_model.py", "extractor.py"):
        shutil.copy(SMALL_MODELS, tmp_path / name)
    monkeypatch.chdir(tmp_path)
    config = Config(algorithm="pfedafm").with_overrides(
        ["model=run_model.py:TinyHtCNN", "global_model=extractor.py:TinyHtCNN", "num_clients=2"]
    )
    assert config.validate().options.global_model == f"{tmp_path}/extractor.py:TinyHtCNN"
    assert str((tmp_path / "extractor.py").resolve()) in code_files(build(config.validate()).simulation)
