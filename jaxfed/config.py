"""Every run setting in one place, with its default and meaning (``jaxfed list`` prints them).

``Config`` is a frozen dataclass; ``Config().with_overrides(["lr=0.1", ...])`` parses the CLI's
``--set key=value`` pairs (:func:`read_config_file` reads a ``--config`` file into such pairs),
and ``validate()`` turns each user mistake into one clear :class:`ConfigError` naming the field
and its allowed values.
"""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Iterable

from jaxfed.errors import ConfigError


def _field(default, help: str):
    return dataclasses.field(default=default, metadata={"help": help})


@dataclasses.dataclass(frozen=True)
class Config:
    # what runs
    algorithm: str = _field("fedavg", "algorithm name (jaxfed list)")
    dataset: str = _field(
        "digits",
        "digits (embedded), mnist, fashion_mnist, cifar10, cifar100, or the generated regression tasks "
        "synthetic_linear, synthetic_mlp",
    )
    data_dir: str = _field("", "directory with <dataset>.npz files or TFDS data ($JAXFED_DATA_DIR if empty)")
    download: bool = _field(False, "let TFDS download a missing dataset (needs internet)")
    model: str = _field("", "model name; empty = the dataset's default (digits: mlp, mnist: cnn, ...)")
    mlp_hidden: str = _field(
        "", "model mlp: comma-separated hidden widths; empty = 200,200 (synthetic_mlp: 2 * synthetic_dim)"
    )
    norm: str = _field("group", "normalization of resnet/vgg models: group or batch (batch stats stay on clients)")
    conv: str = _field(
        "patches", "convolution implementation: patches (slices + einsum, fast in loops and vmaps) or xla"
    )
    # federation
    num_clients: int = _field(20, "number of clients")
    participation: float = _field(0.5, "fraction of clients sampled per round, in (0, 1]")
    sampling: str = _field("uniform", "uniform (new clients each round, without replacement) or fixed (one cohort)")
    rounds: int = _field(30, "communication rounds")
    # partition
    partition: str = _field(
        "dirichlet",
        "iid, dirichlet, client_dirichlet, pathological, label_groups (num_clusters disjoint label groups, "
        "client k in group k mod C) or resample (client_train_size / client_test_size examples drawn per "
        "client from the whole pool, shared between clients: throughput studies); synthetic datasets come "
        "partitioned",
    )
    alpha: float = _field(0.5, "Dirichlet concentration (> 0); smaller = more heterogeneous")
    min_examples: int = _field(10, "dirichlet: minimum training examples per client")
    classes_per_client: int = _field(2, "pathological: classes each client holds")
    client_train_size: int = _field(500, "client_dirichlet, resample: training examples per client")
    client_test_size: int = _field(100, "client_dirichlet, resample: test examples per client")
    train_reduction: float = _field(
        0.0, "drop this fraction of each client's training examples (keeping min_examples), in [0, 1)"
    )
    cluster_task: str = _field(
        "none", "clustered task: none, rotation (cluster c rotates images by c*90 degrees) or label_shift"
    )
    num_clusters: int = _field(
        4, "ground-truth clusters C of a clustered task, label_groups or a synthetic dataset; client k is in k mod C"
    )
    samples_per_client: int = _field(
        0, "synthetic datasets: examples per client (80% train); 0 = the authors' ratio to the model's parameters"
    )
    synthetic_dim: int = _field(10, "synthetic datasets: input dimension d")
    synthetic_outputs: int = _field(0, "synthetic datasets: outputs; 0 = 3 (synthetic_linear) or 1 (synthetic_mlp)")
    synthetic_rank: int = _field(1, "synthetic datasets: rank of each cluster's difference U_c V_c")
    synthetic_scale: float = _field(2.0, "synthetic datasets: scale of the cluster differences")
    # local training
    local_epochs: int = _field(2, "local epochs per round")
    batch_size: int = _field(32, "local batch size")
    drop_last: bool = _field(False, "drop each client's last partial batch (PFLlib's convention)")
    lr: float = _field(0.05, "client SGD learning rate")
    momentum: float = _field(0.0, "client SGD momentum")
    weight_decay: float = _field(0.0, "client weight decay (added to the gradient)")
    # server
    server_optimizer: str = _field("none", "fedavg/fedprox server optimizer: none (plain average), sgd or adam")
    server_lr: float = _field(1.0, "server optimizer learning rate")
    server_momentum: float = _field(0.0, "server SGD momentum")
    mu: float = _field(0.01, "fedprox proximal coefficient")
    # low-rank
    lora_rank: int = _field(16, "fedlora/fedloru: rank r of every LoRA update (at most the layer's matricized min dim)")
    lora_alpha: float = _field(
        0.0, "LoRA alpha of fedlora/fedloru and feddecomp's private part: scale = alpha / r; 0 = scale 1"
    )
    accumulate_every: int = _field(50, "fedloru: fold the LoRA updates into the global model every this many rounds")
    reinit: bool = _field(True, "fedloru: restart the LoRA factors after accumulating (false: continue them)")
    personal_rank: int = _field(8, "pfedloru: rank of the personal LoRA pair (the global pair has lora_rank)")
    personal_epochs: int = _field(1, "pfedloru: epochs on the personal pair each round, before the global pair")
    global_epochs: int = _field(1, "pfedloru: epochs on the global pair (and the full-rank layers) each round")
    rank_dense: float = _field(0.6, "feddecomp: rank ratio R_l of the private part of Dense kernels, in (0, 1]")
    rank_conv: float = _field(0.6, "feddecomp: rank ratio R_c of the private part of Conv kernels, in (0, 1]")
    lora_epochs: int = _field(
        -1, "feddecomp: epochs on the private low-rank part before the shared part; -1 = round(0.4 * local_epochs)"
    )
    schedule: str = _field("alternating", "feddecomp: alternating (private part, then shared) or simultaneous")
    decomp_aggregation: str = _field("uniform", "feddecomp: server mean over uploads, uniform (paper) or samples")
    pack_size: int = _field(1024, "fedcspack: parameters per pack (the flattened model is zero-padded to packs)")
    share_ratio: float = _field(0.1, "fedcspack: top_k shares K = ceil(share_ratio * packs) packs, in (0, 1]")
    select: str = _field("top_k", "fedcspack: top_k (paper) or all_below (every pack below the cosine threshold)")
    weight: str = _field("cos_kl", "fedcspack: pack weight |cos + KL| (cos_kl), |cos| (cos) or |KL| (kl)")
    merge: str = _field("masked", "fedcspack: masked (global packs where the global mask is set) or full")
    lambda_: float = _field(
        2.0, "fedara: anchor alignment weight lambda (key 'lambda'; paper: 10 homogeneous, 2 CIFAR-10)"
    )
    lambda_warmup_rounds: int = _field(10, "fedara: lambda ramps linearly from 0 (round 1) over this many rounds")
    mu_fro: float = _field(1e-3, "fedara: Frobenius decay of the decomposed layers, mu * sum ||U V^T||_F^2")
    anchor_loss: str = _field(
        "mean", "fedara: anchor MSE averaged over feature dimensions (mean) or summed over them (sum)"
    )
    decompose_layers: str = _field(
        "", "fedara: comma-separated feature-extractor layers to decompose; empty = all but the first"
    )
    num_adaptors: int = _field(4, "floral: adaptors C per adapted layer (mixture components); ensemble: models C")
    rho: float = _field(0.01, "floral: adaptor rank from this relative parameter budget per adaptor, in (0, 1]")
    adaptor_rank: int = _field(0, "floral: a fixed adaptor rank instead of rho; 0 = from rho")
    conv_adaptor: str = _field("balanced_2d", "floral: conv adaptor kind: balanced_2d, channel, in_layer or out_layer")
    adaptor_alpha: float = _field(1.0, "floral: scale alpha of the kernel adaptors")
    router_lr: float = _field(0.1, "floral, ensemble: learning rate of the private router logits")
    router_noise: float = _field(
        0.0, "floral, ensemble: router training noise, softmax((w + noise * U[0,1)) / T), fresh every step"
    )
    router_temperature: float = _field(1.0, "floral, ensemble: router softmax temperature T (> 0)")
    precondition: bool = _field(True, "floral: LoRA gradient preconditioning of the adaptors")
    stateful: bool = _field(True, "floral, ensemble: clients keep their router between rounds (false: restart at 0)")
    router: str = _field(
        "learned", "floral, ensemble: learned (private trained logits) or oracle (one-hot on the client's cluster)"
    )
    tiers: str = _field(
        "",
        "tiered algorithms (fedhm, mfedloru, fedara): one rank ratio in (0, 1] per client tier, e.g. 0.5,0.25 "
        "(mfedloru: relative to lora_rank); clients split into equal contiguous id blocks; "
        "empty = the algorithm's default",
    )
    # run
    seed: int = _field(0, "root random seed: partition, init, sampling and training all derive from it")
    eval_every: int = _field(5, "evaluate every this many rounds (and after the last)")
    rounds_per_call: int = _field(5, "rounds per compiled call (lax.scan over rounds)")
    eval_batch_size: int = _field(256, "evaluation batch size")
    devices: int = _field(0, "devices to shard clients over; 0 = all visible")
    host_devices: int = _field(
        0,
        "CPU only: split the host into this many JAX devices (XLA_FLAGS --xla_force_host_platform_device_count, "
        "set before JAX starts); 0 = as JAX starts. 2 on a 2-core CPU runs W2 1.7x faster",
    )
    client_chunk: int = _field(
        -1,
        "clients vmapped together: 0 = all sampled at once, k = lax.map over chunks of k, -1 = auto "
        "(1 on CPU, 0 on GPU/TPU)",
    )
    member_chunk: int = _field(
        -1,
        "jaxfed sweep: members run together: 0 = all vmapped, k = lax.map over chunks of k, -1 = auto "
        "(1 on CPU, 0 on GPU/TPU)",
    )
    checkpoint_every: int = _field(10, "save an orbax checkpoint every this many rounds and after the last; 0 = never")
    keep_checkpoints: int = _field(3, "checkpoints kept in the run directory (newest first)")
    nonfinite: str = _field(
        "error", "a client update with NaN/inf: error (stop, last good state checkpointed) or skip (drop that client)"
    )

    # ----- parsing ---------------------------------------------------------------------------

    @classmethod
    def keys(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls)]

    @classmethod
    def describe(cls) -> list[tuple[str, object, str]]:
        """``(key, default, help)`` of every field; a key is its field's name without a trailing
        underscore (``lambda`` is the field ``lambda_``)."""
        return [(f.name.rstrip("_"), f.default, f.metadata["help"]) for f in dataclasses.fields(cls)]

    def with_overrides(self, pairs: Iterable[str]) -> Config:
        """A copy with ``key=value`` pairs applied (values parsed to the field's type)."""
        fields = {f.name.rstrip("_"): f for f in dataclasses.fields(self)}
        fields.update({f.name: f for f in dataclasses.fields(self)})
        changes = {}
        for pair in pairs:
            key, sep, raw = pair.partition("=")
            key = key.strip().replace("-", "_")
            if not sep:
                raise ConfigError(f"--set: expected key=value, got '{pair}'")
            if key not in fields:
                close = difflib.get_close_matches(key, [k for k in fields if not k.endswith("_")], n=3)
                hint = f"; did you mean {', '.join(close)}?" if close else "; see `jaxfed list`"
                raise ConfigError(f"unknown config key '{key}'{hint}")
            changes[fields[key].name] = _parse(key, raw.strip(), type(fields[key].default))
        return dataclasses.replace(self, **changes)

    def tier_ratios(self, default: tuple[float, ...]) -> tuple[float, ...]:
        """The ``tiers`` list as floats, or ``default`` when it is empty."""
        return parse_tiers(self.tiers) if self.tiers.strip() else tuple(default)

    def clustered(self) -> bool:
        """Whether clients have ground-truth clusters (client k in cluster ``k mod num_clusters``)."""
        from jaxfed.data import SYNTHETIC_TASKS

        return self.cluster_task != "none" or self.partition == "label_groups" or self.dataset in SYNTHETIC_TASKS

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
        return dataclasses.asdict(self)

    # ----- validation ------------------------------------------------------------------------

    def validate(self) -> Config:
        """Raise :class:`ConfigError` on the first invalid field; return self otherwise."""
        from jaxfed.algorithms import ALGORITHMS
        from jaxfed.algorithms.fedara import ANCHOR_LOSSES
        from jaxfed.algorithms.fedavg import SERVER_OPTIMIZERS
        from jaxfed.algorithms.fedcspack import MERGES, SELECTIONS
        from jaxfed.algorithms.feddecomp import AGGREGATIONS, SCHEDULES
        from jaxfed.core.adaptors import CONV_ADAPTORS
        from jaxfed.core.packs import WEIGHTS
        from jaxfed.core.routing import ROUTERS
        from jaxfed.data import CLUSTER_TASKS, DATASETS, PARTITIONERS, SYNTHETIC_TASKS
        from jaxfed.nn import CONV_IMPLS, MODELS, NORMS
        from jaxfed.simulation import NONFINITE_POLICIES, SAMPLINGS

        _choice("algorithm", self.algorithm, ALGORITHMS)
        _choice("dataset", self.dataset, [*DATASETS, *SYNTHETIC_TASKS])
        if self.model:
            _choice("model", self.model, MODELS)
        _choice("norm", self.norm, NORMS)
        _choice("conv", self.conv, CONV_IMPLS)
        _choice("partition", self.partition, PARTITIONERS)
        _choice("sampling", self.sampling, SAMPLINGS)
        _choice("server_optimizer", self.server_optimizer, SERVER_OPTIMIZERS)
        _choice("nonfinite", self.nonfinite, NONFINITE_POLICIES)
        _choice("schedule", self.schedule, SCHEDULES)
        _choice("decomp_aggregation", self.decomp_aggregation, AGGREGATIONS)
        _choice("select", self.select, SELECTIONS)
        _choice("weight", self.weight, WEIGHTS)
        _choice("merge", self.merge, MERGES)
        _choice("anchor_loss", self.anchor_loss, ANCHOR_LOSSES)
        _choice("conv_adaptor", self.conv_adaptor, CONV_ADAPTORS)
        _choice("cluster_task", self.cluster_task, CLUSTER_TASKS)
        _choice("router", self.router, ROUTERS)
        if self.dataset in SYNTHETIC_TASKS and self.cluster_task != "none":
            raise ConfigError(f"cluster_task: {self.dataset} is clustered already; use cluster_task=none")
        if self.clustered() and not 1 <= self.num_clusters <= self.num_clients:
            raise ConfigError(f"num_clusters: must be in 1..num_clients ({self.num_clients}), got {self.num_clusters}")
        if self.router == "oracle" and not self.clustered():
            raise ConfigError(
                "router: oracle needs ground-truth clusters "
                "(a cluster_task, partition=label_groups or a synthetic dataset)"
            )
        if not 0 < self.rho <= 1:
            raise ConfigError(f"rho: must be in (0, 1], got {self.rho}")
        if not self.router_temperature > 0:
            raise ConfigError(f"router_temperature: must be > 0, got {self.router_temperature}")
        if not 0 < self.share_ratio <= 1:
            raise ConfigError(f"share_ratio: must be in (0, 1], got {self.share_ratio}")
        for name in ("rank_dense", "rank_conv"):
            if not 0 < getattr(self, name) <= 1:
                raise ConfigError(f"{name}: a rank ratio must be in (0, 1], got {getattr(self, name)}")
        if not -1 <= self.lora_epochs <= self.local_epochs:
            raise ConfigError(
                f"lora_epochs: must be -1 (auto) or in 0..local_epochs ({self.local_epochs}), got {self.lora_epochs}"
            )
        if not 0 < self.participation <= 1:
            raise ConfigError(f"participation: must be in (0, 1], got {self.participation}")
        if not 0 <= self.train_reduction < 1:
            raise ConfigError(f"train_reduction: must be in [0, 1), got {self.train_reduction}")
        if not self.alpha > 0:
            raise ConfigError(f"alpha: must be > 0, got {self.alpha}")
        for name in (
            "num_clients",
            "rounds",
            "local_epochs",
            "batch_size",
            "eval_every",
            "rounds_per_call",
            "eval_batch_size",
            "keep_checkpoints",
            "lora_rank",
            "accumulate_every",
            "personal_rank",
            "pack_size",
            "num_adaptors",
            "synthetic_dim",
            "synthetic_rank",
        ):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name}: must be >= 1, got {getattr(self, name)}")
        for name in ("lr", "server_lr"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"{name}: must be > 0, got {getattr(self, name)}")
        if self.member_chunk < -1:
            raise ConfigError(
                f"member_chunk: must be -1 (auto), 0 (vmap all) or a chunk size >= 1, got {self.member_chunk}"
            )
        if self.client_chunk < -1:
            raise ConfigError(
                f"client_chunk: must be -1 (auto), 0 (vmap all) or a chunk size >= 1, got {self.client_chunk}"
            )
        for name in (
            "momentum",
            "server_momentum",
            "weight_decay",
            "mu",
            "min_examples",
            "devices",
            "host_devices",
            "checkpoint_every",
            "lora_alpha",
            "personal_epochs",
            "global_epochs",
            "lambda_",
            "lambda_warmup_rounds",
            "mu_fro",
            "adaptor_rank",
            "router_noise",
            "router_lr",
            "samples_per_client",
            "synthetic_outputs",
        ):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name.rstrip('_')}: must be >= 0, got {getattr(self, name)}")
        self.hidden_widths()
        if self.tiers.strip() and len(parse_tiers(self.tiers)) > self.num_clients:
            raise ConfigError(
                f"tiers: {len(parse_tiers(self.tiers))} tiers for {self.num_clients} clients; "
                "every tier needs at least one client"
            )
        return self


def read_config_file(path) -> list[str]:
    """The ``key=value`` pairs of a config file: one ``key = value`` per line, ``#`` starts a comment."""
    from pathlib import Path

    try:
        text = Path(path).read_text()
    except OSError as err:
        raise ConfigError(f"--config: cannot read '{path}': {err.strerror or err}") from None
    pairs = []
    for number, line in enumerate(text.splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        key, sep, value = line.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"--config: {path} line {number}: expected 'key = value', got '{line}'")
        pairs.append(f"{key.strip()}={value.strip()}")
    return pairs


def parse_tiers(text: str) -> tuple[float, ...]:
    """``"0.5,0.25"`` -> ``(0.5, 0.25)``; every ratio must be in (0, 1]."""
    ratios = []
    for part in text.split(","):
        try:
            ratio = float(part)
        except ValueError:
            raise ConfigError(f"tiers: expected comma-separated rank ratios in (0, 1] such as 0.5,0.25, got '{text}'")
        if not 0 < ratio <= 1:
            raise ConfigError(f"tiers: every rank ratio must be in (0, 1], got {ratio} in '{text}'")
        ratios.append(ratio)
    return tuple(ratios)


def _choice(field: str, value: str, allowed) -> None:
    if value not in allowed:
        close = difflib.get_close_matches(value, list(allowed), n=1)
        hint = f" (did you mean '{close[0]}'?)" if close else ""
        raise ConfigError(f"{field}: unknown '{value}'{hint}; allowed: {', '.join(allowed)}")


def _parse(key: str, raw: str, kind: type):
    try:
        if kind is bool:
            lowered = raw.lower()
            if lowered in ("1", "true", "yes", "on"):
                return True
            if lowered in ("0", "false", "no", "off"):
                return False
            raise ValueError
        return kind(raw)
    except ValueError:
        raise ConfigError(f"{key}: expected {kind.__name__}, got '{raw}'") from None
