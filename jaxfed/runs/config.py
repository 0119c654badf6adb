"""A run's settings: the run-level keys here, plus the chosen algorithm's own options section.

``Config`` is a frozen dataclass of run-level settings (data, partition, federation, rounds,
evaluation, checkpoints, devices, strategy) whose ``options`` field holds the selected
algorithm's options (:mod:`jaxfed.options`; each algorithm owns its class, with its paper's
defaults, and where the authors' recipe differs by dataset, that dataset's).
``Config().with_overrides(["lr=0.1", ...])`` parses the CLI's ``--set key=value`` pairs, run keys
and the algorithm's keys alike (:func:`read_config_file` reads a ``--config`` file into such
pairs); ``validate()`` turns each mistake into one :class:`ConfigError` naming the field and its
allowed values.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import os
import typing
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from jaxfed.algorithms import registry
from jaxfed.errors import ConfigError, clip, unknown_choice
from jaxfed.options import (
    Options,
    at_least,
    field_types,
    finite,
    key_of,
    non_negative,
    one_of,
    option,
    parse_value,
    positive,
    ratio,
    split_keys,
    unit_interval,
)

MAX_SEED = 2**32 - 1  # a larger seed would alias a smaller one in jax.random.key
CONFIG_FILE_LIMIT = 1 << 20  # bytes: a config file is a few lines of key = value


@dataclasses.dataclass(frozen=True)
class Config(Options):
    # what runs
    algorithm: str = option("fedavg", "algorithm name (jaxfed list; jaxfed list ALGORITHM for its options)")
    plugins: tuple[str, ...] = option(
        (), "modules or .py files imported first, whose jaxfed.register calls add algorithms (comma-separated)"
    )
    dataset: str = option(
        "digits",
        "digits (embedded), mnist, fashion_mnist, cifar10, cifar100, or the generated regression tasks "
        "synthetic_linear, synthetic_mlp",
    )
    data_dir: str = option("", "directory with <dataset>.npz files or TFDS data ($JAXFED_DATA_DIR if empty)")
    download: bool = option(False, "let TFDS download a missing dataset (needs internet)")
    model: str = option(
        "",
        "model name, or your own flax Module as module:Class (importable from sys.path or the working "
        "directory) or path/to/file.py:Class, built with num_classes= when it has that field; empty = the "
        "dataset's default (digits: mlp, mnist: cnn, ...)",
    )
    mlp_hidden: str = option(
        "", "model mlp: comma-separated hidden widths; empty = 200,200 (synthetic_mlp: 2 * synthetic_dim)"
    )
    norm: str = option("group", "normalization of resnet/vgg models: group or batch (batch stats stay on clients)")
    conv: str = option(
        "patches", "convolution implementation: patches (slices + einsum, fast in loops and vmaps) or xla"
    )
    # federation
    num_clients: int = option(20, "number of clients", check=at_least(1))
    participation: float = option(0.5, "fraction of clients sampled per round, in (0, 1]", check=ratio)
    sampling: str = option(
        "uniform",
        "uniform (new clients each round, without replacement), fixed (one cohort drawn by the seed) or first "
        "(one cohort: clients 0..n-1, n = participation x the trained clients, rounded; PFLlib's 'fix', which "
        "rounds down; not with client tiers)",
    )
    eval_clients: str = option(
        "all",
        "personalized metrics over all clients, or over the cohort (sampling=fixed or first: the clients that "
        "train; the FedCSPACK authors' protocol)",
    )
    new_clients: float = option(
        0.0,
        "fraction of clients held out of training as new clients (spread evenly over the ids, the same for "
        "every seed), evaluated with the global model and after the algorithm's own personalization on their "
        "training split (new_* metrics); in [0, 1)",
        check=unit_interval,
    )
    new_client_ids: tuple[int, ...] = option(
        (), "the ids of the clients held out as new clients (not with new_clients)"
    )
    new_client_updates: int = option(
        1, "new clients: local updates (client_update, nothing uploaded) their personalization runs", check=at_least(1)
    )
    rounds: int = option(30, "communication rounds", check=at_least(1))
    # partition
    partition: str = option(
        "dirichlet",
        "iid, dirichlet, client_dirichlet, pathological, label_groups (num_clusters disjoint label groups, "
        "client k in group k mod C) or resample (client_train_size / client_test_size examples drawn per "
        "client from the whole pool, shared between clients: throughput studies); synthetic datasets come "
        "partitioned; file: the clients of partition_file",
    )
    partition_file: str = option(
        "",
        "partition=file: an .npz of each client's example indices, integer arrays train_0..train_{K-1} and "
        "test_0..test_{K-1} for K = num_clients (jaxfed.data.save_partition writes one)",
    )
    alpha: float = option(0.5, "Dirichlet concentration (> 0); smaller = more heterogeneous", check=positive)
    min_examples: int = option(10, "dirichlet: minimum training examples per client", check=non_negative)
    classes_per_client: int = option(2, "pathological: classes each client holds", check=at_least(1))
    client_train_size: int = option(500, "client_dirichlet, resample: training examples per client", check=at_least(1))
    client_test_size: int = option(100, "client_dirichlet, resample: test examples per client", check=at_least(1))
    train_reduction: float = option(
        0.0,
        "drop this fraction of each client's training examples (keeping min_examples), in [0, 1)",
        check=unit_interval,
    )
    cluster_task: str = option(
        "none",
        "clustered task: none, rotation (cluster c rotates images by c*90 degrees: at most 4 clusters) or "
        "label_shift (labels shifted by c: at most the class count)",
    )
    num_clusters: int = option(
        4, "ground-truth clusters C of a clustered task, label_groups or a synthetic dataset; client k is in k mod C"
    )
    samples_per_client: int = option(
        0,
        "synthetic datasets: examples per client (80% train); 0 = the authors' ratio to the model's parameters",
        check=non_negative,
    )
    synthetic_dim: int = option(10, "synthetic datasets: input dimension d", check=at_least(1))
    synthetic_outputs: int = option(
        0, "synthetic datasets: outputs; 0 = 3 (synthetic_linear) or 1 (synthetic_mlp)", check=non_negative
    )
    synthetic_rank: int = option(1, "synthetic datasets: rank of each cluster's difference U_c V_c", check=at_least(1))
    synthetic_scale: float = option(
        2.0,
        "synthetic datasets: scale of the cluster differences",
        check=finite,
    )
    # run
    seed: int = option(
        0,
        f"root random seed in 0..{MAX_SEED}: partition, init, sampling and training all derive from it",
        check=lambda seed: None if 0 <= seed <= MAX_SEED else f"must be in 0..{MAX_SEED} (JAX's keys hold 32 bits)",
    )
    eval_every: int = option(5, "evaluate every this many rounds (and after the last)", check=at_least(1))
    rounds_per_call: int = option(5, "rounds per compiled call (lax.scan over rounds)", check=at_least(1))
    eval_batch_size: int = option(256, "evaluation batch size", check=at_least(1))
    devices: int = option(0, "devices to shard clients over; 0 = all visible", check=non_negative)
    host_devices: int = option(
        0,
        "CPU only: split the host into this many JAX devices (XLA_FLAGS --xla_force_host_platform_device_count, "
        "set before JAX starts); 0 = as JAX starts. 2 on a 2-core CPU runs W2 1.7x faster",
        check=non_negative,
    )
    matmul_precision: str = option(
        "default",
        "default (XLA's: TF32 matmuls and convolutions on recent NVIDIA GPUs) or highest (full float32 on "
        "every platform; CPU results are the same either way)",
        check=one_of("default", "highest"),
    )
    client_chunk: int = option(
        -1,
        "clients vmapped together: 0 = all sampled at once, k = chunks of k, -1 = auto "
        "(1 on CPU; on GPU/TPU the chunk modeled fastest for the sampled clients' sizes, narrowed until the round "
        "fits the device's memory)",
        check=at_least(-1),
    )
    client_state: str = option(
        "device",
        "where the stacked client states live: device, or host (in this process's memory; each compiled call "
        "moves the states of the clients its rounds sample to the device and back: for client states larger "
        "than the device's memory; the same numbers)",
        check=one_of("device", "host"),
    )
    member_chunk: int = option(
        -1,
        "jaxfed sweep: members run together: 0 = all vmapped, k = lax.map over chunks of k, -1 = auto "
        "(1 on CPU, 0 on GPU/TPU)",
        check=at_least(-1),
    )
    checkpoint_every: int = option(
        10, "save an orbax checkpoint every this many rounds and after the last; 0 = never", check=non_negative
    )
    keep_checkpoints: int = option(3, "checkpoints kept in the run directory (newest first)", check=at_least(1))
    nonfinite: str = option(
        "error", "a client update with NaN/inf: error (stop, last good state checkpointed) or skip (drop that client)"
    )
    # the algorithm's own options (jaxfed list ALGORITHM); None = its defaults for this dataset
    # (Options.for_dataset); a changed dataset keeps what was set and takes the new dataset's defaults
    options: Any = dataclasses.field(default=None, metadata={"help": "the algorithm's options", "source": ""})

    def __post_init__(self):
        # relative paths recorded absolute: config.json names the same files on --resume from anywhere
        from jaxfed.nn.user import recorded_spec

        if isinstance(self.model, str) and ":" in self.model:
            object.__setattr__(self, "model", recorded_spec(self.model))
        if isinstance(self.partition_file, str) and self.partition_file:
            object.__setattr__(self, "partition_file", str(Path(self.partition_file).expanduser().absolute()))
        if self.options is None:
            options_class = _options_class(self.algorithm, missing_ok=True)
            if options_class is not None:
                object.__setattr__(self, "options", options_class.for_dataset(self.dataset))
        # the options naming models (tier models, pFedAFM's extractor's): files, as model's
        recorded = {}
        if getattr(self.options, "tier_models", ()):
            recorded["tier_models"] = tuple(recorded_spec(spec) for spec in self.options.tier_models)
        if getattr(self.options, "global_model", ""):
            recorded["global_model"] = recorded_spec(self.options.global_model)
        if recorded:
            object.__setattr__(self, "options", dataclasses.replace(self.options, **recorded))

    # ----- keys ----------------------------------------------------------------------------------

    @classmethod
    def run_keys(cls) -> list[str]:
        """The run-level keys (every field but ``options``)."""
        return [key_of(f.name) for f in dataclasses.fields(cls) if f.name != "options"]

    @classmethod
    def describe(cls) -> list[tuple[str, Any, str, str]]:
        return [row for row in super().describe() if row[0] != "options"]

    # ----- parsing -------------------------------------------------------------------------------

    def with_overrides(self, pairs: Iterable[str], origins: Iterable[str | None] | None = None) -> Config:
        """A copy with ``key=value`` pairs applied: run keys and the selected algorithm's keys.
        ``algorithm=`` (and ``plugins=``) are applied first, wherever they stand, so the other
        keys are read as the final algorithm's. ``origins``: where each pair was written (a config
        file's line, :func:`read_config_lines`; None: the command line), named by its errors."""
        return self._overridden(pairs, origins)[0]

    def validated_with(self, pairs: Iterable[str], origins: Iterable[str | None] | None = None) -> Config:
        """``with_overrides(pairs, origins).validate()``: a key's value or rule found broken names
        where the key was last written, as ``with_overrides``' own errors do."""
        config, written = self._overridden(pairs, origins)
        try:
            return config.validate()
        except ConfigError as err:
            with _written_at(written.get(str(err).split(":", 1)[0])):
                raise

    def _overridden(self, pairs, origins) -> tuple[Config, dict[str, str | None]]:
        """:meth:`with_overrides`' copy, and where each key it sets was last written."""
        pairs = list(pairs)
        origins = list(origins) if origins is not None else [None] * len(pairs)
        parsed = [(*_split_pair(pair), origin) for pair, origin in zip(pairs, origins, strict=True)]
        run_types = field_types(Config)
        run_changes, written = {}, {}
        for key, raw, origin in parsed:
            if key in self.run_keys():
                with _written_at(origin):
                    run_changes[key], written[key] = parse_value(key, raw, run_types[key]), origin
        for plugin in run_changes.get("plugins", self.plugins):
            registry.import_plugin(plugin)
        algorithm = run_changes.get("algorithm", self.algorithm)
        option_values = {}  # in the pairs' order: a later pair wins, scoped (a file's section) or not
        for key, raw, origin in parsed:
            if "." in key:  # ALGORITHM.key: applies only when that algorithm runs
                scope, key = key.split(".", 1)
                with _written_at(origin):
                    _check_scoped_option(scope, key, raw)
                if scope == algorithm:
                    option_values[key], written[key] = raw, origin
            elif key not in self.run_keys():
                option_values[key], written[key] = raw, origin
        dataset = run_changes.get("dataset", self.dataset)
        with _written_at(written.get("algorithm")):
            options_class = _options_class(algorithm)
        if algorithm == self.algorithm and self.options is not None:
            options = self.options.rebased(self.dataset, dataset)
        else:
            options = options_class.for_dataset(dataset)
        for key, raw in option_values.items():
            with _written_at(written[key]):
                if options_class.field_for(key) is None:
                    raise ConfigError(_unknown_key_message(key, algorithm, options_class))
                options_class.parse(key, raw)
        config = dataclasses.replace(self, **run_changes, options=options.with_values(option_values))
        return config, written

    def tier_option(self) -> tuple[str, int]:
        """The option that sets the selected algorithm's client tiers (``tiers``, or ``model_tiers`` /
        ``tier_models`` for heterogeneous client models) and how many it gives (0 when none)."""
        for field in ("tiers", "model_tiers", "tier_models"):
            count = len(getattr(self.options, field, ()) or ())
            if count:
                return field, count
        return "tiers", 0

    def clustered(self) -> bool:
        """Whether clients have ground-truth clusters (client k in cluster ``k mod num_clusters``)."""
        from jaxfed.data import SYNTHETIC_TASKS

        return self.cluster_task != "none" or self.partition == "label_groups" or self.dataset in SYNTHETIC_TASKS

    def ground_truth_clusters(self) -> int:
        """The clients' ground-truth cluster count, 0 when the task has none (FLoRAL's oracle router,
        IFCA's default K)."""
        return self.num_clusters if self.clustered() else 0

    def held_out_ids(self) -> tuple[int, ...]:
        """The ids of the clients held out of training as new clients (``new_client_ids``, or
        ``new_clients``' fraction of them spread evenly over the ids: at least one when above 0)."""
        if self.new_client_ids:
            return tuple(self.new_client_ids)
        from jaxfed.simulation.sampling import fraction_ids

        return fraction_ids(self.new_clients, self.num_clients)

    def hidden_widths(self) -> tuple[int, ...] | None:
        """``mlp_hidden`` as widths (None when empty)."""
        if not self.mlp_hidden.strip():
            return None
        try:
            widths = tuple(int(w) for w in self.mlp_hidden.split(","))
        except ValueError:
            widths = ()
        if not widths or min(widths) < 1:
            raise ConfigError(
                f"mlp_hidden: expected comma-separated widths >= 1 such as 200,200, got '{self.mlp_hidden}'"
            )
        return widths

    def to_dict(self) -> dict:
        """The run keys and, under ``"options"``, the algorithm's (JSON-ready)."""
        values = {key: value for key, value in super().to_dict().items() if key != "options"}
        return {**values, "options": self.options.to_dict() if self.options is not None else {}}

    def ignored_partition_keys(self) -> list[str]:
        """A line for each partition setting changed from its default that this run's partition
        does not use (``client_train_size`` under ``dirichlet``, say: the run goes on without it)."""
        from jaxfed.data import SYNTHETIC_TASKS
        from jaxfed.data.partition import PARTITION_KEYS

        if self.dataset in SYNTHETIC_TASKS:  # generated already partitioned: partition keys do not apply
            return []
        defaults = {field.name: field.default for field in dataclasses.fields(self)}
        used = {key for key, users in PARTITION_KEYS.items() if self.partition in users}
        if self.train_reduction > 0:
            used.add("min_examples")  # the floor of every client's reduced training part, any partition
        return [
            f"{key}={getattr(self, key)} does not apply to partition={self.partition} (only to "
            f"{' and '.join(users)}): ignored"
            for key, users in PARTITION_KEYS.items()
            if key not in used and getattr(self, key) != defaults[key]
        ]

    def recorded(self) -> dict:
        """:meth:`to_dict` as a run directory records it (``config.json``, its checkpoints):
        ``plugins`` with the module that registered the algorithm (its file, or a package's dotted
        name) where research code imported it from Python
        (:func:`~jaxfed.algorithms.registry.plugins_to_record`), so that ``jaxfed run --out DIR
        --resume`` imports it; an empty ``data_dir`` as ``$JAXFED_DATA_DIR`` gave it, for a dataset read
        from files (a resume in a shell without it reads the same files)."""
        from jaxfed.data import SYNTHETIC_TASKS
        from jaxfed.data.datasets import DATA_DIR_ENV

        recorded = {**self.to_dict(), "plugins": list(registry.plugins_to_record(self.algorithm, self.plugins))}
        from_env = os.environ.get(DATA_DIR_ENV)
        if not self.data_dir and from_env and self.dataset not in ("digits", *SYNTHETIC_TASKS):
            recorded["data_dir"] = str(Path(from_env).expanduser().absolute())
        return recorded

    @classmethod
    def from_dict(cls, values: dict) -> Config:
        """The inverse of :meth:`to_dict` (imports the config's plugins first)."""
        run = _tuples({k: v for k, v in values.items() if k in cls.run_keys()})
        config = cls(**run, options=None)
        for plugin in config.plugins:
            registry.import_plugin(plugin)
        options = _options_class(config.algorithm).from_dict(values.get("options", {}))
        return dataclasses.replace(config, options=options)

    @classmethod
    def of(cls, values: Config | Mapping[str, Any]) -> Config:
        """``values`` as a Config: a Config as it is, or a dict of run keys and the algorithm's
        option keys (flat, or under ``"options"`` as in ``config.json``), typed values or
        ``--set`` strings alike; unknown keys and wrong types are one-line ConfigErrors."""
        if isinstance(values, Config):
            return values
        if not isinstance(values, Mapping):
            raise ConfigError(f"config: expected a jaxfed.Config or a dict of keys, got {type(values).__name__}")
        run_keys = cls.run_keys()
        options = dict(values.get("options") or {})
        options.update({k: v for k, v in values.items() if k != "options" and k not in run_keys})
        types = field_types(Config)
        run = {k: parse_value(k, v, types[k]) if isinstance(v, str) else v for k, v in values.items() if k in run_keys}
        run = _tuples(run)
        for plugin in run.get("plugins", ()):
            registry.import_plugin(plugin)
        algorithm = run.get("algorithm", cls.algorithm)
        if not isinstance(algorithm, str):
            raise ConfigError(f"algorithm: expected a name such as 'fedavg', got {clip(repr(algorithm))}")
        options_class = _options_class(algorithm)
        unknown = [key for key in options if options_class.field_for(key) is None]
        if unknown:
            raise ConfigError(_unknown_key_message(unknown[0], algorithm, options_class))
        return cls(**run, options=options_class.for_dataset(run.get("dataset", cls.dataset)).with_values(options))

    # ----- validation ----------------------------------------------------------------------------

    def validate(self):
        """As :meth:`Options.validate`; a config checked before is checked again when its
        algorithm's registered options class has changed since (``register(..., replace=True)``)."""
        if self.__dict__.get("_validated") and not isinstance(self.options, _options_class(self.algorithm)):
            object.__setattr__(self, "_validated", False)
        return super().validate()

    def check(self) -> None:
        """The run keys' choices and the rules that span several keys (the per-field checks run first)."""
        from jaxfed.data import CLUSTER_TASKS, DATASETS, FILE_PARTITION, PARTITIONERS, SYNTHETIC_TASKS
        from jaxfed.nn import CONV_IMPLS, NORMS
        from jaxfed.nn.models import check_model_name
        from jaxfed.nn.user import is_spec, load_class
        from jaxfed.simulation import COHORT_SAMPLINGS, EVAL_CLIENTS, NONFINITE_POLICIES, SAMPLINGS

        options_class = _options_class(self.algorithm)
        if not isinstance(self.options, options_class):
            raise ConfigError(
                f"options: {type(self.options).__name__} given for algorithm {self.algorithm} "
                f"(expects {options_class.__name__})"
            )
        _choice("dataset", self.dataset, [*DATASETS, *SYNTHETIC_TASKS])
        if is_spec(self.model):
            load_class(self.model)  # a user's module: found, and a flax Module class
        elif self.model:
            check_model_name(self.model)
        _choice("norm", self.norm, NORMS)
        _choice("conv", self.conv, CONV_IMPLS)
        _choice("partition", self.partition, [*PARTITIONERS, FILE_PARTITION])
        self.check_partition_file()
        _choice("sampling", self.sampling, SAMPLINGS)
        _choice("eval_clients", self.eval_clients, EVAL_CLIENTS)
        if self.eval_clients == "cohort" and self.sampling not in COHORT_SAMPLINGS:
            need = " or ".join(COHORT_SAMPLINGS)
            raise ConfigError(f"eval_clients: cohort needs sampling={need} (one cohort trains every round)")
        _choice("nonfinite", self.nonfinite, NONFINITE_POLICIES)
        _choice("cluster_task", self.cluster_task, CLUSTER_TASKS)
        task = "regression" if self.dataset in SYNTHETIC_TASKS else "classification"
        if task not in options_class.tasks:
            raise ConfigError(
                f"dataset: {self.dataset} is a {task} task; {self.algorithm} runs {', '.join(options_class.tasks)} "
                f"tasks only (e.g. digits, mnist)"
            )
        if self.dataset in SYNTHETIC_TASKS and self.cluster_task != "none":
            raise ConfigError(f"cluster_task: {self.dataset} is clustered already; use cluster_task=none")
        if self.clustered() and not 1 <= self.num_clusters <= self.num_clients:
            raise ConfigError(f"num_clusters: must be in 1..num_clients ({self.num_clients}), got {self.num_clusters}")
        self.hidden_widths()
        if self.new_clients and self.new_client_ids:
            raise ConfigError("new_client_ids: give new_clients (a fraction) or new_client_ids (a list), not both")
        from jaxfed.simulation.sampling import held_out

        held_out(self.held_out_ids(), self.num_clients, "new_client_ids" if self.new_client_ids else "new_clients")
        field, tiers = self.tier_option()
        if tiers > self.num_clients:
            raise ConfigError(
                f"{field}: {tiers} tiers for {self.num_clients} clients; every tier needs at least one client "
                f"(give {field} at most {self.num_clients} entries, or num_clients >= {tiers})"
            )
        self.options.validate()

    def check_partition_file(self) -> None:
        """``partition=file`` and ``partition_file`` go together, on an image dataset (the file
        itself is read, and checked against the data, when the run is built)."""
        from jaxfed.data import FILE_PARTITION, SYNTHETIC_TASKS

        if self.partition == FILE_PARTITION and not self.partition_file:
            raise ConfigError("partition_file: partition=file needs partition_file=PATH (an .npz of client indices)")
        if self.partition_file and self.partition != FILE_PARTITION:
            raise ConfigError(f"partition_file: applies to partition=file only, not partition={self.partition}")
        if self.partition == FILE_PARTITION and self.dataset in SYNTHETIC_TASKS:
            raise ConfigError(f"partition: {self.dataset} comes partitioned; partition=file needs an image dataset")


def read_config_file(path) -> list[str]:
    """The ``key=value`` pairs of a config file: one ``key = value`` per line, ``#`` starts a
    comment; the lines after a ``[ALGORITHM]`` header are that algorithm's options, applied only
    when it runs (returned as ``ALGORITHM.key=value``), until the next header (``[run]``: back to
    keys for every run)."""
    return [pair for pair, _ in read_config_lines(path)]


def read_config_lines(path) -> list[tuple[str, str]]:
    """:func:`read_config_file`'s pairs, each with where it was written (``--config: FILE line N``
    and its ``[section]``), for :meth:`Config.with_overrides` to name in an error."""
    text = _read_config_text(path)
    pairs, section, seen = [], "", {}
    for number, line in enumerate(text.splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        if line.startswith("[") and line.endswith("]"):
            name = line[1:-1].strip()
            if not name:
                raise ConfigError(f"--config: {path} line {number}: empty section '[]'; write [ALGORITHM] or [run]")
            section = "" if name == "run" else name + "."
            continue
        key, sep, value = line.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"--config: {path} line {number}: expected 'key = value', got '{clip(line)}'")
        scoped = section + key.strip()
        if scoped in seen:
            raise ConfigError(
                f"--config: {path} line {number}: '{key.strip()}' is set again (first on line {seen[scoped]}); "
                "keep one line per key"
            )
        seen[scoped] = number
        header = f" [{section[:-1]}]" if section else ""
        pairs.append((f"{scoped}={value.strip()}", f"--config: {path} line {number}{header}"))
    return pairs


def _read_config_text(path) -> str:
    """A config file's text: UTF-8 (a byte-order mark is dropped), at most
    :data:`CONFIG_FILE_LIMIT` bytes (``--config /dev/zero`` must not read forever)."""
    try:
        with open(path, "rb") as f:
            data = f.read(CONFIG_FILE_LIMIT + 1)
    except OSError as err:
        raise ConfigError(f"--config: cannot read '{path}': {err.strerror or err}") from None
    if len(data) > CONFIG_FILE_LIMIT:
        raise ConfigError(
            f"--config: {path} is larger than {CONFIG_FILE_LIMIT >> 20} MiB; a config file is lines of key = value"
        )
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as err:
        line, byte = data[: err.start].count(b"\n") + 1, data[err.start]
        raise ConfigError(f"--config: {path} line {line}: not UTF-8 text (byte 0x{byte:02x})") from None


def _tuples(run: dict) -> dict:
    """Run keys as read from JSON: a list given for a tuple key (``plugins``, ``new_client_ids``) as a tuple."""
    types = field_types(Config)
    return {k: tuple(v) if isinstance(v, list) and typing.get_origin(types[k]) is tuple else v for k, v in run.items()}


def _split_pair(pair: str) -> tuple[str, str]:
    key, sep, raw = pair.partition("=")
    if not sep:
        hint = " (name the algorithm before --set)" if pair.strip() in registry.names() else ""
        raise ConfigError(f"--set: expected key=value, got '{clip(pair)}'{hint}")
    return key.strip().replace("-", "_"), raw.strip()


@contextlib.contextmanager
def _written_at(origin: str | None):
    """Errors of a pair from a config file say where it was written."""
    try:
        yield
    except ConfigError as err:
        if origin is None:
            raise
        raise type(err)(f"{origin}: {err}") from None


def _check_scoped_option(scope: str, key: str, raw: str) -> None:
    """A ``[scope]`` section's ``key = raw`` is that algorithm's option with a valid value, whichever
    algorithm runs (an unknown algorithm is an error, not a silently ignored section)."""
    scoped = _options_class(scope)
    if key in Config.run_keys():  # a section holds its algorithm's options only
        raise ConfigError(
            f"{scope}.{key}: {key} is a run key, not an option of {scope}; set it outside [{scope}] (or under [run])"
        )
    if scoped.field_for(key) is None:
        raise ConfigError(_unknown_key_message(key, scope, scoped))
    scoped.parse_checked(key, raw)


def _options_class(algorithm: str, missing_ok: bool = False):
    if missing_ok and algorithm not in registry.names():
        return None
    return registry.get(algorithm).options


def _unknown_key_message(key: str, algorithm: str, options_class) -> str:
    owners = [name for name in registry.options_with(key) if name != algorithm]
    if owners:
        return f"{key}: an option of {', '.join(owners)}, not of {algorithm}; see `jaxfed list {algorithm}`"
    candidates = [*Config.run_keys(), *options_class.keys()]
    close = difflib.get_close_matches(key, candidates, n=3)
    hint = f"; did you mean {', '.join(close)}?" if close else f"; see `jaxfed list {algorithm}`"
    return f"unknown config key '{key}'{hint}"


def _choice(field: str, value: str, allowed) -> None:
    if value not in allowed:
        raise ConfigError(f"{field}: {unknown_choice(value, allowed)}")


registry.RUN_KEYS.update(Config.run_keys())  # an algorithm's option may not shadow one

__all__ = ["Config", "read_config_file", "read_config_lines", "split_keys"]
