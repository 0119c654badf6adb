"""Build a :class:`~jaxfed.simulation.Simulation` from a :class:`~jaxfed.Config`: the dataset and
its partition, the model, the registered algorithm built from the config's options, the engine.

``build(config)`` is the first of the run driver's three public pieces (then
:mod:`jaxfed.runs.rundir` and :mod:`jaxfed.runs.driver`).
"""

from __future__ import annotations

import dataclasses
import os
from typing import NamedTuple

import jax
import numpy as np

from jaxfed.algorithms import registry
from jaxfed.data import (
    SYNTHETIC_TASKS,
    apply_cluster_task,
    auto_samples_per_client,
    default_model,
    federate,
    load_dataset,
    partition,
    reduce_parts,
    summarize,
    synthetic_task,
)
from jaxfed.data.synthetic import DEFAULT_OUTPUTS
from jaxfed.errors import ConfigError
from jaxfed.nn import get_model, model_template
from jaxfed.runs.config import Config
from jaxfed.runs.memory import check_memory
from jaxfed.simulation import Simulation


class Built(NamedTuple):
    config: Config
    simulation: Simulation
    partition_summary: dict


def build(config: Config) -> Built:
    """Dataset, partition, model, algorithm (the registry's builder with ``config.options``) and
    engine for ``config`` (validated; a model that cannot fit in memory is refused here)."""
    config.validate()
    if config.host_devices:
        split_host(config.host_devices)
    jax.config.update("jax_default_matmul_precision", None if config.matmul_precision == "default" else "highest")
    pooled_eval_model = None
    if config.dataset in SYNTHETIC_TASKS:
        dataset, model, train_parts, test_parts = _synthetic_task(config)
    else:
        dataset, model, train_parts, test_parts = _image_task(config)
        if config.conv != "xla":  # the global model's passes over the whole test set: XLA's conv is faster there
            pooled_eval_model = _model(
                dataclasses.replace(config, conv="xla"), dataset.input_shape, dataset.num_classes
            )
    check_batch_size(config.options, len(dataset.x_train))
    algorithm = registry.get(config.algorithm).build(model, config.options, config)
    available = jax.devices()
    if config.devices > len(available):
        raise ConfigError(f"devices: {config.devices} requested but {len(available)} visible")
    devices = available[: config.devices or None]
    simulation = Simulation(
        algorithm,
        model,
        federate(dataset, train_parts, test_parts),
        participation=config.participation,
        sampling_mode=config.sampling,
        eval_clients=config.eval_clients,
        seed=config.seed,
        devices=devices,
        eval_batch_size=config.eval_batch_size,
        client_chunk=None if config.client_chunk < 0 else config.client_chunk,
        pooled_eval_model=pooled_eval_model,
        nonfinite=config.nonfinite,
    )
    check_memory(simulation, devices[0])
    return Built(config, simulation, summarize(train_parts, dataset.y_train))


def check_batch_size(options, train_examples: int) -> None:
    """A ConfigError, before anything compiles, for a batch larger than the whole training set
    (it could only be a typo, and would allocate that many examples per client)."""
    batch = getattr(options, "batch_size", None)
    if batch is not None and batch > train_examples:
        raise ConfigError(
            f"batch_size: {batch} is larger than the {train_examples} training examples of the whole dataset"
        )


def split_host(count: int) -> None:
    """Make the CPU show ``count`` JAX devices (``host_devices``). XLA reads the flag when JAX
    starts its backend, so this must run first; a ConfigError says so otherwise."""
    flag = "--xla_force_host_platform_device_count"
    kept = [f for f in os.environ.get("XLA_FLAGS", "").split() if not f.startswith(flag)]
    os.environ["XLA_FLAGS"] = " ".join([*kept, f"{flag}={count}"])
    cpus = jax.devices("cpu")
    if len(cpus) != count:
        raise ConfigError(
            f"host_devices: JAX had started with {len(cpus)} CPU device(s) before {count} could be set; "
            f"set XLA_FLAGS={flag}={count} before starting Python instead"
        )


def _model(config: Config, input_shape, outputs: int, default_hidden=None):
    name = config.model or default_model(config.dataset)
    hidden = config.hidden_widths() or (default_hidden if name == "mlp" else None)
    return get_model(name, input_shape, outputs, config.norm, config.conv, hidden)


def _image_task(config: Config):
    """A dataset of images, partitioned, with its clustered-task transform applied."""
    dataset = load_dataset(config.dataset, config.data_dir or None, config.download)
    model = _model(config, dataset.input_shape, dataset.num_classes)
    train_parts, test_parts = partition(
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
    train_parts = reduce_parts(
        train_parts, config.train_reduction, config.min_examples, np.random.default_rng([config.seed, 1])
    )
    dataset = apply_cluster_task(dataset, train_parts, test_parts, config.cluster_task, config.num_clusters)
    return dataset, model, train_parts, test_parts


def _synthetic_task(config: Config):
    """FLoRAL's generated regression task; its client size defaults to the authors' ratio to the
    model's parameter count."""
    outputs = config.synthetic_outputs or DEFAULT_OUTPUTS[config.dataset]
    model = _model(config, (config.synthetic_dim,), outputs, default_hidden=(2 * config.synthetic_dim,))
    samples = config.samples_per_client or auto_samples_per_client(config.dataset, count_parameters(model))
    dataset, train_parts, test_parts = synthetic_task(
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
    return dataset, model, train_parts, test_parts


def count_parameters(model) -> int:
    shapes, _ = model_template(model)
    return sum(int(np.prod(leaf.shape)) for leaf in jax.tree.leaves(shapes))
