"""A function that breaks the contract is named in one line where the engine traces it: a client
state or server state of another structure or shape, a metric that is not a scalar, variables
without ``"params"``; each caught from shapes alone, before anything computes."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from conftest import make_federation

import jaxfed
from jaxfed.algorithms import Aggregation
from jaxfed.algorithms.ditto import ditto
from jaxfed.contract import first_difference
from jaxfed.errors import ConfigError
from jaxfed.simulation import Simulation


@pytest.fixture(scope="module")
def federation(digits):
    return make_federation(digits, num_clients=4)


@pytest.fixture(scope="module")
def base(mlp):
    return ditto(mlp, local_epochs=1)


def _with_client_update(algorithm, change):
    """``algorithm`` whose ``client_update``'s result passes through ``change(state, up, metrics)``."""

    def client_update(*args):
        return change(*algorithm.client_update(*args))

    return algorithm._replace(client_update=client_update)


def _one_round(algorithm, mlp, federation):
    sim = Simulation(algorithm, mlp, federation, participation=0.5, seed=0)
    return sim.run_rounds(sim.init(), 1)


@pytest.mark.parametrize(
    "change, message",
    [
        (
            lambda state, up, metrics: (state.personal, up, metrics),
            "client_update: the client state it returns differs from the one it was given (init's) at the top: "
            "a dict with keys fc1, fc2, head, not ClientState(personal, personal_state, model_state)",
        ),
        (
            lambda state, up, metrics: (
                state._replace(personal=jax.tree.map(lambda a: a[None], state.personal)),
                up,
                metrics,
            ),
            "client_update: the client state it returns differs from the one it was given (init's) at "
            ".personal['fc1']['bias']: shape (1, 200), not (200,)",
        ),
        (
            lambda state, up, metrics: (state, up, dict(metrics, vec=jnp.ones(3))),
            "client_update: metric 'vec' has shape (3,); metrics must be scalars",
        ),
        (
            lambda state, up, metrics: (state, up, [metrics["train_loss"]]),
            "client_update: its metrics must be a dict of scalars, got a list of 1",
        ),
        (lambda state, up, metrics: (state, up), "client_update: must return (client_state, message_up, metrics)"),
    ],
    ids=["state structure", "state shape", "vector metric", "metrics list", "pair"],
)
def test_a_client_update_breaking_the_contract_is_named_when_the_round_is_traced(
    change, message, base, mlp, federation
):
    with pytest.raises(ConfigError) as caught:
        _one_round(_with_client_update(base, change), mlp, federation)
    assert str(caught.value).startswith(message) and "\n" not in str(caught.value)


def test_the_run_driver_refuses_a_vector_metric_before_any_round_is_written(base, mlp, federation, tmp_path):
    vector = _with_client_update(base, lambda state, up, metrics: (state, up, dict(metrics, vec=jnp.ones(3))))
    sim = Simulation(vector, mlp, federation, participation=0.5, seed=0)
    with pytest.raises(ConfigError, match="^client_update: metric 'vec' has shape"):
        jaxfed.run_simulation(sim, tmp_path / "run", jaxfed.LoopSettings(rounds=2, eval_every=1), progress=False)
    assert not (tmp_path / "run" / "summary.json").exists()


def test_a_server_step_returning_another_server_state_is_named(base, mlp, federation):
    wrong_apply = base._replace(aggregation=Aggregation(base.aggregation.contribute, lambda s, t, i: {"p": s}))
    with pytest.raises(ConfigError, match=r"^aggregation\.apply: the server state it returns differs .* at the top"):
        _one_round(wrong_apply, mlp, federation)
    wrong_update = base._replace(aggregation=None, server_update=lambda s, m, w, i: s.params)
    with pytest.raises(ConfigError, match=r"^server_update: the server state it returns differs"):
        _one_round(wrong_update, mlp, federation)
    server = base.init(jax.random.key(0))[0]
    uploads = jax.tree.map(lambda p: jnp.stack([p, p]), server.params)
    with pytest.raises(ConfigError, match=r"^aggregation\.apply: "):  # jaxfed.server_step shares the rule
        jaxfed.server_step(wrong_apply, server, uploads, jnp.ones(2))


@pytest.mark.parametrize(
    "field, function, message",
    [
        ("eval_params", lambda s, c: c.personal, "eval_params: must return Flax variables {'params': ..., "),
        ("eval_params", lambda s, c: c, "eval_params: must return Flax variables {'params': ..., **collections}, got "
         "ClientState(personal, personal_state, model_state)"),
        ("global_params", lambda s: s.params, "global_params: must return Flax variables"),
    ],
    ids=["eval_params dict", "eval_params record", "global_params"],
)  # fmt: skip
def test_variables_without_params_are_named_when_evaluation_is_traced(field, function, message, base, mlp, federation):
    sim = Simulation(base._replace(**{field: function}), mlp, federation, participation=0.5, seed=0)
    with pytest.raises(ConfigError) as caught:
        sim.evaluate(sim.init())
    assert str(caught.value).startswith(message)


def test_first_difference_names_the_first_path_that_differs():
    tree = {"a": jnp.zeros(2), "b": (jnp.zeros(()), None)}
    assert first_difference(tree, {"a": jnp.ones(2), "b": (jnp.ones(()), None)}) is None
    assert first_difference(tree, {"a": jnp.zeros(3), "b": (jnp.zeros(()), None)}) == "at ['a']: shape (3,), not (2,)"
    assert first_difference(tree, {"a": jnp.zeros(2), "b": (jnp.zeros(()), 1.0)}) == (
        "at ['b'][1]: an array of shape (), not None"
    )
    assert first_difference(tree, {"a": jnp.zeros(2)}) == "at the top: a dict with keys a, not a dict with keys a, b"
