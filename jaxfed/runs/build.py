"""Build a :class:`~jaxfed.simulation.Simulation` from a :class:`~jaxfed.Config`: the dataset and
its partition, the model, the registered algorithm built from the config's options, the engine.

``build(config)`` is the first of the run driver's three public pieces (then
:mod:`jaxfed.runs.rundir` and :mod:`jaxfed.runs.driver`).
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import numpy as np

from jaxfed.algorithms import registry
from jaxfed.data import (
    FILE_PARTITION,
    SYNTHETIC_TASKS,
    FederatedData,
    apply_cluster_task,
    auto_samples_per_client,
    default_model,
    federate,
    load_dataset,
    load_partition,
    partition,
    reduce_parts,
    summarize,
    synthetic_task,
)
from jaxfed.data.synthetic import DEFAULT_OUTPUTS
from jaxfed.errors import ConfigError
from jaxfed.nn import get_model, model_template
from jaxfed.nn.user import is_spec
from jaxfed.runs.config import Config
from jaxfed.runs.memory import check_memory
from jaxfed.simulation import Simulation


class Built(NamedTuple):
    config: Config
    simulation: Simulation
    partition_summary: dict


class DataPart(NamedTuple):
    """The data part of a build: the on-device federated dataset and what the model is sized by."""

    data: FederatedData
    input_shape: tuple
    outputs: int  # classes (targets of a regression task)
    train_examples: int
    partition_summary: dict


def build(config: Config) -> Built:
    """Dataset, partition, model, algorithm (the registry's builder with ``config.options``) and
    engine for ``config`` (validated here unless it was; a model that cannot fit in memory is
    refused here). The four parts are public: :func:`build_data`, :func:`build_model`,
    :func:`build_algorithm`, :func:`build_simulation` (a sweep builds its shared parts once)."""
    config = config.validate()
    part = build_data(config)
    model = build_model(config, part)
    simulation = build_simulation(config, build_algorithm(config, model), model, part)
    return Built(config, simulation, part.partition_summary)


def build_data(config: Config, load=None) -> DataPart:
    """The federated dataset of ``config`` (a validated config): loaded (``load``: a function of
    ``config`` giving the :class:`~jaxfed.data.Dataset`, e.g. one that caches, default
    :func:`load_config_dataset`), partitioned by ``config.seed``, placed on the device."""
    config = config.validate()
    if config.dataset in SYNTHETIC_TASKS:
        dataset, train_parts, test_parts = _synthetic_task(config)
    else:
        dataset, train_parts, test_parts = _image_task(config, (load or load_config_dataset)(config))
    check_batch_size(config.options, len(dataset.x_train))
    # A partitioner gives every client training examples; train_reduction with min_examples=0 may
    # leave a small client none, which then trains with weight 0 (a file's parts are checked when read).
    data = federate(dataset, train_parts, test_parts, allow_empty_train=True)
    summary = summarize(train_parts, dataset.y_train)
    return DataPart(data, tuple(dataset.input_shape), _outputs(config, dataset), len(dataset.x_train), summary)


def load_config_dataset(config: Config):
    """The image dataset ``config`` names, as loaded from ``data_dir`` (or TFDS, or embedded)."""
    return load_dataset(config.dataset, config.data_dir or None, config.download)


def build_model(config: Config, part: DataPart):
    """The model of ``config`` for the inputs and outputs of ``part``."""
    return _model(config.validate(), part.input_shape, part.outputs)


def build_algorithm(config: Config, model):
    """The registered algorithm of ``config``, built with its options."""
    config = config.validate()
    return registry.get(config.algorithm).build(model, config.options, config)


def build_simulation(config: Config, algorithm, model, part: DataPart) -> Simulation:
    """The engine running ``algorithm`` on ``part``'s data with ``config``'s run settings, on the
    first ``config.devices`` devices; refused here if its state cannot fit in memory."""
    config = config.validate()
    if config.host_devices and len(jax.devices("cpu")) != config.host_devices:
        raise ConfigError(
            f"host_devices: {config.host_devices} requested but the CPU shows {len(jax.devices('cpu'))} device(s); "
            "call jaxfed.runs.distributed.split_host(N) when the process starts, before JAX does"
        )
    pooled_eval_model = None
    if config.dataset not in SYNTHETIC_TASKS and config.conv != "xla" and not is_spec(config.model):
        # the global model's passes over the whole test set: XLA's conv is faster there
        pooled_eval_model = _model(dataclasses.replace(config, conv="xla"), part.input_shape, part.outputs)
    simulation = Simulation(
        algorithm,
        model,
        part.data,
        participation=config.participation,
        sampling=config.sampling,
        eval_clients=config.eval_clients,
        seed=config.seed,
        devices=config.devices,
        eval_batch_size=config.eval_batch_size,
        client_chunk=config.client_chunk,
        pooled_eval_model=pooled_eval_model,
        nonfinite=config.nonfinite,
        matmul_precision=config.matmul_precision,
        client_state=config.client_state,
        new_clients=config.held_out_ids(),
        new_client_updates=config.new_client_updates,
    )
    check_memory(simulation, simulation.strategy.devices[0])
    return simulation


def _outputs(config: Config, dataset) -> int:
    if config.dataset in SYNTHETIC_TASKS:
        return config.synthetic_outputs or DEFAULT_OUTPUTS[config.dataset]
    return dataset.num_classes


def check_batch_size(options, train_examples: int) -> None:
    """A ConfigError, before anything compiles, for a batch larger than the whole training set
    (it could only be a typo, and would allocate that many examples per client)."""
    batch = getattr(options, "batch_size", None)
    if batch is not None and batch > train_examples:
        raise ConfigError(
            f"batch_size: {batch} is larger than the {train_examples} training examples of the whole dataset"
        )


def _model(config: Config, input_shape, outputs: int):
    """The model ``config`` names (default: the dataset's) for ``input_shape`` and ``outputs``; a
    synthetic task's MLP defaults to one hidden layer twice the input's width."""
    name = config.model or default_model(config.dataset)
    synthetic_hidden = (2 * config.synthetic_dim,) if config.dataset in SYNTHETIC_TASKS else None
    hidden = config.hidden_widths() or (synthetic_hidden if name == "mlp" else None)
    return get_model(name, input_shape, outputs, config.norm, config.conv, hidden)


def _image_task(config: Config, dataset):
    """``dataset`` partitioned (or as ``partition_file`` says), with its clustered-task transform applied."""
    if config.partition == FILE_PARTITION:
        sizes = len(dataset.y_train), len(dataset.y_test)
        train_parts, test_parts = load_partition(config.partition_file, config.num_clients, *sizes)
    else:
        train_parts, test_parts = _partition(config, dataset)
    train_parts = reduce_parts(
        train_parts, config.train_reduction, config.min_examples, np.random.default_rng([config.seed, 1])
    )
    dataset = apply_cluster_task(dataset, train_parts, test_parts, config.cluster_task, config.num_clusters)
    return dataset, train_parts, test_parts


def _partition(config: Config, dataset):
    """``dataset``'s examples split over the clients by the partitioner ``config`` names."""
    return partition(
        config.partition,
        dataset.y_train,
        dataset.y_test,
        config.num_clients,
        np.random.default_rng(config.seed),
        alpha=config.alpha,
        min_examples=config.min_examples,
        classes_per_client=config.classes_per_client,
        client_train_size=config.client_train_size,
        client_test_size=config.client_test_size,
        num_groups=config.num_clusters,
    )


def _synthetic_task(config: Config):
    """FLoRAL's generated regression task; its client size defaults to the authors' ratio to the
    model's parameter count."""
    outputs = config.synthetic_outputs or DEFAULT_OUTPUTS[config.dataset]
    samples = config.samples_per_client
    if not samples:
        model = _model(config, (config.synthetic_dim,), outputs)
        samples = auto_samples_per_client(config.dataset, count_parameters(model))
    return synthetic_task(
        config.dataset,
        config.num_clients,
        config.num_clusters,
        samples,
        np.random.default_rng(config.seed),
        dim=config.synthetic_dim,
        outputs=outputs,
        rank=config.synthetic_rank,
        scale=config.synthetic_scale,
    )


def count_parameters(model) -> int:
    shapes, _ = model_template(model)
    return sum(int(np.prod(leaf.shape)) for leaf in jax.tree.leaves(shapes))
