"""The memory check: a model too large for the machine is refused from its shapes, in one line."""

import jax
import pytest

from jaxfed.algorithms.fedavg import fedavg
from jaxfed.cli import main
from jaxfed.core import tree_bytes
from jaxfed.errors import ConfigError
from jaxfed.nn import get_model
from jaxfed.runs import memory
from jaxfed.simulation import Simulation

CPU = jax.devices("cpu")[0]


def test_the_default_cnn_on_1024_pixel_images_is_refused_from_its_shapes():
    """A 2.1 G-parameter dense layer after the convs: only its shapes are ever made."""
    model = get_model("cnn", (1024, 1024, 1), 10)
    state = jax.eval_shape(fedavg(model).init, jax.random.key(0))
    params = jax.eval_shape(model.init, jax.random.key(0))["params"]
    assert memory.round_bytes(state, params) == 3 * 2_097_504_650 * 4
    message = (
        r"^model: cnn at 1024 px has 2,097,504,650 parameters \(8\.4 GB\); a round needs at least 25\.2 GB "
        r"\(the state in and out, and a client's copy of the model\) but the cpu has 16\.0 GB available: "
        r"use a smaller model or smaller images$"
    )
    with pytest.raises(ConfigError, match=message):
        memory.check_fits(state, params, "cnn at 1024 px", CPU, available=16 * 10**9)


def test_a_simulation_that_fits_passes_and_one_byte_less_is_refused(mlp, digits_federation):
    sim = Simulation(fedavg(mlp), mlp, digits_federation, participation=0.5)
    params = jax.eval_shape(mlp.init, jax.random.key(0))["params"]
    needed = 2 * tree_bytes(jax.eval_shape(sim.init_pure)) + tree_bytes(params)
    memory.check_memory(sim, CPU, available=needed)
    with pytest.raises(ConfigError, match=r"^model: mlp on \(8, 8, 1\) inputs has 55,210 parameters"):
        memory.check_memory(sim, CPU, available=needed - 1)


def test_the_host_reports_its_available_memory():
    available = memory.available_bytes(CPU)
    assert available is not None and 0 < available <= memory._physical_memory()


def test_the_cli_refuses_before_anything_runs(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(memory, "available_bytes", lambda device: 10**5)
    out = tmp_path / "r"
    assert main(["run", "fedavg", "--set", "rounds=1", "--out", str(out), "--quiet"]) == 2
    err = capsys.readouterr().err.strip()
    assert (
        len(err.splitlines()) == 1
        and "model: mlp on (8, 8, 1) inputs has" in err
        and "but the cpu has 100.0 KB available" in err
    )
    assert not (out / "metrics.jsonl").exists()
