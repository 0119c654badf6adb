"""Input mistakes of research code written against the Python API (float or one-hot labels,
unscaled inputs, a model that does not fit the data): each is one line before anything compiles,
or a warning where the input may be meant (docs/reliability.md, "Research code from Python")."""

from __future__ import annotations

import re
import warnings

import flax.linen as nn
import jax
import numpy as np
import pytest

from jaxfed.algorithms.fedavg import fedavg
from jaxfed.core import tree_bytes
from jaxfed.data import Dataset, DataWarning, federate, partition, synthetic_task
from jaxfed.data.validate import DataError
from jaxfed.errors import ConfigError
from jaxfed.nn import Model
from jaxfed.simulation import Simulation

PARTS = [np.arange(20), np.arange(20, 40)], [np.arange(10), np.arange(10, 20)]


def _data(y_train, y_test, num_classes=10, x=None):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(40, 8, 8, 1)).astype(np.float32) if x is None else x
    return Dataset("mine", x, y_train, x[:20], y_test, num_classes)


def _labels(n):
    return np.arange(n) % 10


def test_class_labels_stored_as_floats_are_told_the_cast():
    floats = _data(_labels(40).astype(np.float32), _labels(20).astype(np.float32))
    expected = (
        "dataset 'mine': y_train is float32 with values 0..9: class labels must be integers "
        "(y_train.astype(np.int64)); float targets are regression (num_classes must then be 1"
    )
    with pytest.raises(DataError, match="^" + re.escape(expected)):
        federate(floats, *PARTS)
    column = _data(_labels(40)[:, None] * 1.0, _labels(20)[:, None] * 1.0)
    with pytest.raises(DataError, match=re.escape("(y_train.ravel().astype(np.int64))")):
        federate(column, *PARTS)


def test_regression_targets_need_num_classes_of_their_width():
    y = np.random.default_rng(1).normal(size=(60, 3)).astype(np.float32)
    with pytest.raises(DataError, match=re.escape("y_train has float targets of shape (40, 3): a regression with 3")):
        federate(_data(y[:40], y[40:], num_classes=10), *PARTS)
    federate(_data(y[:40], y[40:], num_classes=3), *PARTS)
    federate(_data(y[:40, 0], y[40:, 0], num_classes=1), *PARTS)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        federate(*synthetic_task("synthetic_linear", 4, 2, 20, np.random.default_rng(0)))


def test_one_hot_float_targets_warn_to_pass_the_argmax():
    onehot = _data(np.eye(10, dtype=np.float32)[_labels(40)], np.eye(10, dtype=np.float32)[_labels(20)])
    with pytest.warns(DataWarning, match=re.escape("y_train is one-hot (float32, shape (40, 10))")) as caught:
        federate(onehot, *PARTS)
    assert "y_train.argmax(1)" in str(caught[0].message) and caught[0].filename == __file__


def test_partition_refuses_float_labels_naming_the_cast():
    y = _labels(100)
    expected = "partition: y_train has dtype float32; class labels must be integers (y_train.astype(int))"
    with pytest.raises(DataError, match=re.escape(expected)):
        partition("dirichlet", y.astype(np.float32), y, 4, np.random.default_rng(0))
    with pytest.raises(DataError, match=r"^partition: y_test has dtype float64; class labels must be integers$"):
        partition("iid", y, y + 0.5, 4, np.random.default_rng(0))


def test_unscaled_inputs_warn_and_loaded_or_scaled_ones_do_not(digits):
    y = _labels(40)
    raw = np.random.default_rng(0).integers(0, 256, (40, 8, 8, 1)).astype(np.uint8)
    uint8 = r"^dataset 'mine': x_train is uint8 \(values 0\.\.25\d\), used as given .*x / 255\.0"
    with pytest.warns(DataWarning, match=uint8):
        federate(_data(y, y[:20], x=raw), *PARTS)
    with pytest.warns(DataWarning, match=r"x_train has values up to 2\d\d, used as given"):
        federate(_data(y, y[:20], x=raw.astype(np.float32)), *PARTS)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        federate(_data(y, y[:20], x=raw / 255.0), *PARTS)
        federate(_data(y, y[:20], x=raw.astype(np.int32)), *PARTS)  # token ids
        federate(_data(y, y[:20], x=raw.reshape(40, 64)), *PARTS)  # uint8 sequences: bytes, not pixels
        federate(digits, [np.arange(len(digits.y_train))], [np.arange(len(digits.y_test))])


class Flat(nn.Module):
    """A user's model of any input shape: flattens, then ``outputs`` outputs."""

    outputs: int = 10

    @nn.compact
    def __call__(self, x):
        return nn.Dense(self.outputs)(x.reshape(x.shape[0], -1))


class ConvNet(nn.Module):
    """A user's CNN whose Dense layer is sized by the image it was made for."""

    @nn.compact
    def __call__(self, x):
        return nn.Dense(10)(nn.relu(nn.Conv(4, (3, 3))(x)).reshape(x.shape[0], -1))


def _simulation(model, fed):
    return Simulation(fedavg(model), model, fed)


def _one_line(raised) -> str:
    message = str(raised.value)
    assert "\n" not in message
    return message


def test_a_wrapped_model_with_another_output_count_is_refused_at_construction(digits, digits_federation):
    with pytest.raises(
        ConfigError, match=r"^model: 'Flat' returns \(1, 5\) for a batch of 1; expected \(1, 10\)"
    ) as raised:
        _simulation(Model.wrap(Flat(5), digits.input_shape), digits_federation)
    assert "the data's num_classes" in _one_line(raised)


def test_a_wrapped_model_made_for_another_input_shape_is_refused_at_construction(digits, digits_federation):
    expected = (
        "model: 'ConvNet' was made for inputs of shape (28, 28, 1) but the data's examples have shape (8, 8, 1); "
        "wrap it for the data's: Model.wrap(module, dataset.input_shape)"
    )
    with pytest.raises(ConfigError, match="^" + re.escape(expected) + "$"):
        _simulation(Model.wrap(ConvNet(), (28, 28, 1)), digits_federation)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _simulation(Model.wrap(ConvNet(), digits.input_shape), digits_federation)
        _simulation(Model.wrap(Flat(), (64,)), digits_federation)  # a shape it takes as well as the data's


class Tokens(nn.Module):
    """A user's model of token ids: an embedding, averaged, then the classes."""

    @nn.compact
    def __call__(self, x):
        return nn.Dense(10)(nn.Embed(256, 8)(x).mean(axis=1))


def test_token_ids_of_another_dtype_than_the_models_are_named_as_a_dtype_problem():
    """Float token ids for an int32 model said the model `cannot take inputs of shape (16,)
    ...; pick another model`: the model was right, the data's dtype was not."""
    import jax.numpy as jnp

    ids = np.random.default_rng(0).integers(0, 256, (40, 16))
    model = Model.wrap(Tokens(), (16,), input_dtype=jnp.int32)
    y = _labels(40)
    expected = r"^model: 'Tokens' takes int32 inputs but the data's examples are float32 \(.*\); cast them: "
    expected += r"x.astype\(np.int32\)$"
    with pytest.raises(ConfigError, match=expected), warnings.catch_warnings():
        warnings.simplefilter("ignore", DataWarning)  # float inputs up to 255
        _simulation(model, federate(_data(y, y[:20], x=ids.astype(np.float32)), *PARTS))
    _simulation(model, federate(_data(y, y[:20], x=ids.astype(np.int32)), *PARTS))


def test_a_module_class_for_its_instance_is_one_line():
    expected = r"^model: got the class Flat, not a module; pass an instance: Model.wrap\(Flat\(\), \.\.\.\)$"
    with pytest.raises(ConfigError, match=expected):
        Model.wrap(Flat, (8, 8, 1))


def test_a_wrapped_cnn_on_channel_first_images_warns(digits):
    x_train, x_test = digits.x_train.transpose(0, 3, 1, 2), digits.x_test.transpose(0, 3, 1, 2)
    chw = Dataset("chw", x_train, digits.y_train, x_test, digits.y_test, 10)
    fed = federate(chw, [np.arange(len(x_train))], [np.arange(len(x_test))])
    with pytest.warns(UserWarning, match=re.escape("model: 'ConvNet' takes inputs of shape (1, 8, 8), images with")):
        _simulation(Model.wrap(ConvNet(), chw.input_shape), fed)


@pytest.mark.parametrize(
    "keyword, value, expected",
    [
        ("client_chunk", -2, r"^client_chunk: 0 \(every sampled client at once\), k >= 1 .* got -2$"),
        ("client_chunk", 2.5, r"^client_chunk: .* got 2\.5$"),
        ("client_chunk", "auto", r"^client_chunk: .* got 'auto'$"),
        (
            "devices",
            len(jax.devices()) + 1,
            rf"^devices: {len(jax.devices()) + 1}; allowed: 0 \(all\) to {len(jax.devices())}",
        ),
        ("devices", "cpu", r"^devices: jax devices \(jax.devices\(\)\[:2\]\) or a count; got str 'cpu'$"),
        ("devices", -1, rf"^devices: -1; allowed: 0 \(all\) to {len(jax.devices())}, the devices visible$"),
    ],
)
def test_a_strategy_keyword_of_the_wrong_kind_is_one_line_at_construction(
    keyword, value, expected, mlp, digits_federation
):
    with pytest.raises(ConfigError, match=expected):
        Simulation(fedavg(mlp), mlp, digits_federation, **{keyword: value})


def test_the_run_keys_auto_chunk_and_a_device_count_are_taken_as_the_run_keys_are(mlp, digits_federation):
    auto = Simulation(fedavg(mlp), mlp, digits_federation, client_chunk=-1)
    assert auto.client_chunk == Simulation(fedavg(mlp), mlp, digits_federation).client_chunk
    as_array = Simulation(fedavg(mlp), mlp, digits_federation, devices=np.array(jax.devices()[:1]))  # mesh.devices
    assert as_array.strategy.devices == jax.devices()[:1]
    assert Simulation(fedavg(mlp), mlp, digits_federation, client_chunk=np.int64(3)).client_chunk == 3


def test_a_runs_warnings_of_its_start_go_to_its_log(mlp, digits_federation, tmp_path):
    """The client states every device must hold in full (a client count the devices do not
    divide: 10 over 3, faked on this one device) reach ``log`` as the run's other lines do, not
    Python's warnings (``log=lambda line: None`` is silence)."""
    from jaxfed.algorithms.ditto import ditto
    from jaxfed.runs.driver import run_simulation

    sim = Simulation(ditto(mlp), mlp, digits_federation)
    sim.strategy.num_devices = 3
    lines = []
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        run_simulation(sim, tmp_path / "run", 1, progress=False, log=lines.append)
    assert [line for line in lines if "client states" in line] == [
        f"warning: client states: 10 clients do not divide over 3 devices, so every device holds all of them "
        f"({tree_bytes(sim.init(warn=print).clients) / 1e6:.1f} MB each); a multiple of 3 clients splits them"
    ]


class DropoutAlways(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(10)(nn.Dropout(0.5, deterministic=False)(nn.Dense(8)(x.reshape(x.shape[0], -1))))


class BatchNormAlways(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(10)(nn.BatchNorm(use_running_average=False)(nn.Dense(8)(x.reshape(x.shape[0], -1))))


@pytest.mark.parametrize(
    "module, layer", [(DropoutAlways, "a layer that asks for an rng (a Dropout)"), (BatchNormAlways, "a BatchNorm")]
)
def test_a_layer_stuck_in_training_mode_is_told_to_take_train(module, layer, digits, digits_federation):
    """A Dropout or BatchNorm without ``train`` was blamed on the input shape ("cannot take inputs
    of shape (8, 8, 1) ...; pick another model")."""
    with pytest.raises(ConfigError) as raised:
        _simulation(Model.wrap(module(), digits.input_shape), digits_federation)
    assert _one_line(raised).startswith(
        f"model: '{module.__name__}' runs {layer} in training mode where jaxfed initializes and evaluates it: "
        "give its __call__ a train argument"
    )
