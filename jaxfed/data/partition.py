"""Partitioners: split a dataset's examples over clients, test split following the train split.

Each partitioner returns ``(train_parts, test_parts)``: one int array of example indices per
client. All randomness comes from the ``np.random.Generator`` passed in. A partition of one's
own is a file (``partition=file``): :func:`save_partition` writes one, :func:`load_partition`
reads and checks it.
"""

from __future__ import annotations

import re
import zipfile
from pathlib import Path

import numpy as np

from jaxfed.data.validate import ZIP_MAGIC, DataError, check_integer_labels, check_parts
from jaxfed.errors import ConfigError, first_line, unknown_choice

MAX_DIRICHLET_TRIES = 1000


def partition(
    name: str,
    y_train: np.ndarray,
    y_test: np.ndarray,
    num_clients: int,
    rng: np.random.Generator,
    *,
    alpha: float = 0.5,
    min_examples: int = 10,
    classes_per_client: int = 2,
    client_train_size: int = 500,
    client_test_size: int = 100,
    num_groups: int = 10,
):
    """Split train and test examples over ``num_clients`` clients with partitioner ``name``
    (``y_train``, ``y_test``: integer class labels)."""
    y_train, y_test = np.asarray(y_train), np.asarray(y_test)
    check_integer_labels("partition", "y_train", y_train)
    check_integer_labels("partition", "y_test", y_test)
    num_classes = int(max(y_train.max(), y_test.max())) + 1
    if num_clients < 1:
        raise ConfigError(f"num_clients: must be >= 1, got {num_clients}")
    if num_clients > len(y_train) and name != "resample":
        raise ConfigError(f"num_clients: {num_clients} clients but only {len(y_train)} training examples")
    if name in ("dirichlet", "client_dirichlet") and not alpha > 0:
        raise ConfigError(f"alpha: must be > 0, got {alpha}")
    if name == "iid":
        train = iid(y_train, num_clients, rng)
    elif name == "dirichlet":
        train = dirichlet(y_train, num_clients, rng, alpha=alpha, min_examples=min_examples)
    elif name == "pathological":
        train = pathological(y_train, num_clients, rng, classes_per_client=classes_per_client, num_classes=num_classes)
    elif name == "client_dirichlet":
        return client_dirichlet(
            y_train, y_test, num_clients, rng, alpha=alpha, train_size=client_train_size, test_size=client_test_size
        )
    elif name == "resample":
        return resample(y_train, y_test, num_clients, rng, train_size=client_train_size, test_size=client_test_size)
    elif name == "label_groups":
        return label_groups(y_train, y_test, num_clients, rng, num_groups=num_groups, num_classes=num_classes)
    else:
        raise ConfigError(f"partition: {unknown_choice(name, PARTITIONERS)}")
    _check_non_empty(train)
    return train, test_like_train(train, y_train, y_test, rng, num_classes)


def iid(labels, num_clients, rng):
    return [np.sort(part) for part in np.array_split(rng.permutation(len(labels)), num_clients)]


def dirichlet(labels, num_clients, rng, *, alpha, min_examples):
    """Per class, proportions over clients ~ Dir(alpha) (PFLlib / FL-bench convention).

    A client already holding its fair share (n / num_clients) gets no more of the next class;
    the draw repeats until every client has ``min_examples``.
    """
    n = len(labels)
    if num_clients * min_examples > n:
        raise ConfigError(f"min_examples: {num_clients} clients x {min_examples} exceeds {n} training examples")
    classes = np.unique(labels)
    for _ in range(MAX_DIRICHLET_TRIES):
        parts = [[] for _ in range(num_clients)]
        for c in classes:
            members = rng.permutation(np.flatnonzero(labels == c))
            proportions = rng.dirichlet(np.full(num_clients, alpha))
            sizes = np.array([len(p) for p in parts])
            proportions = proportions * (sizes < n / num_clients)
            total = proportions.sum()
            proportions = proportions / total if total > 0 else np.full(num_clients, 1.0 / num_clients)
            cuts = (np.cumsum(proportions) * len(members)).astype(int)[:-1]
            for part, chunk in zip(parts, np.split(members, cuts)):
                part.extend(chunk.tolist())
        if min(len(p) for p in parts) >= max(min_examples, 1):
            return [np.sort(np.array(p, np.int64)) for p in parts]
    raise ConfigError(
        f"alpha: dirichlet partition with alpha={alpha} could not give all {num_clients} clients "
        f"min_examples={min_examples} in {MAX_DIRICHLET_TRIES} draws; raise alpha or lower min_examples"
    )


def pathological(labels, num_clients, rng, *, classes_per_client, num_classes):
    """Each client holds exactly ``classes_per_client`` classes; a class is split evenly among its holders."""
    present = np.unique(labels)  # the classes with training examples: labels need not be 0..num_classes-1
    if not 1 <= classes_per_client <= len(present):
        raise ConfigError(f"classes_per_client: must be in [1, {len(present)}], got {classes_per_client}")
    order = rng.permutation(present)  # all of 0..num_classes-1 present: the same draw as permutation(num_classes)
    holders = {int(c): [] for c in present}
    for k in range(num_clients):
        for j in range(classes_per_client):
            holders[int(order[(k * classes_per_client + j) % len(present)])].append(k)
    parts = [[] for _ in range(num_clients)]
    for c, clients in holders.items():
        if not clients:
            continue
        members = rng.permutation(np.flatnonzero(labels == c))
        for k, chunk in zip(clients, np.array_split(members, len(clients))):
            parts[k].extend(chunk.tolist())
    return [np.sort(np.array(p, np.int64)) for p in parts]


def client_dirichlet(y_train, y_test, num_clients, rng, *, alpha, train_size, test_size):
    """Each client draws q_k ~ Dir(alpha * 1) and gets ``train_size`` / ``test_size`` examples
    following q_k, without replacement (FedDecomp's convention). An exhausted class's share is
    redrawn from the client's remaining classes."""
    num_classes = int(max(y_train.max(), y_test.max())) + 1
    for field, size, pool in (("client_train_size", train_size, y_train), ("client_test_size", test_size, y_test)):
        if size < 1 or num_clients * size > len(pool):
            raise ConfigError(f"{field}: {num_clients} clients x {size} must be between 1 and {len(pool)} examples")
    q = rng.dirichlet(np.full(num_classes, alpha), size=num_clients)
    train = _draw_by_proportions(y_train, q, train_size, rng)
    test = _draw_by_proportions(y_test, q, test_size, rng)
    return train, test


def resample(y_train, y_test, num_clients, rng, *, train_size, test_size):
    """Each client draws ``train_size`` / ``test_size`` examples at random from the whole pool;
    different clients may share examples. For throughput studies with more clients than a
    dataset can split (e.g. 10 000 clients on digits), not for accuracy claims."""
    for field, size, pool in (("client_train_size", train_size, y_train), ("client_test_size", test_size, y_test)):
        if not 1 <= size <= len(pool):
            raise ConfigError(f"{field}: resample needs 1..{len(pool)} examples per client, got {size}")
    train = [np.sort(rng.choice(len(y_train), train_size, replace=False)) for _ in range(num_clients)]
    test = [np.sort(rng.choice(len(y_test), test_size, replace=False)) for _ in range(num_clients)]
    return train, test


def label_groups(y_train, y_test, num_clients, rng, *, num_groups, num_classes):
    """FLoRAL's CIFAR-100 task: the labels in ``num_groups`` disjoint random groups (group c is a
    ground-truth cluster); client k is in group ``k mod num_groups`` and gets an equal random share
    of its group's training and test examples."""
    if not 1 <= num_groups <= min(num_clients, num_classes):
        raise ConfigError(
            f"num_groups (the run key num_clusters): label_groups needs 1..min(num_clients, classes) = "
            f"{min(num_clients, num_classes)}, "
            f"got {num_groups}"
        )
    groups = np.array_split(rng.permutation(num_classes), num_groups)
    members = [np.flatnonzero(np.arange(num_clients) % num_groups == g) for g in range(num_groups)]
    split = []
    for labels in (y_train, y_test):
        parts = [np.zeros(0, np.int64)] * num_clients
        for group, clients in zip(groups, members):
            examples = rng.permutation(np.flatnonzero(np.isin(labels, group)))
            for k, chunk in zip(clients, np.array_split(examples, len(clients))):
                parts[k] = np.sort(chunk)
        split.append(parts)
    _check_non_empty(split[0])
    return split[0], split[1]


def _draw_by_proportions(labels, q, size, rng):
    num_classes = q.shape[1]
    pools = [list(rng.permutation(np.flatnonzero(labels == c))) for c in range(num_classes)]
    parts = []
    for q_k in q:
        taken = []
        while len(taken) < size:
            available = np.array([len(p) > 0 for p in pools], float)
            weights = q_k * available
            weights = weights / weights.sum() if weights.sum() > 0 else available / available.sum()
            counts = rng.multinomial(size - len(taken), weights)
            for c, count in enumerate(counts):
                take = min(count, len(pools[c]))
                taken.extend(pools[c][:take])
                del pools[c][:take]
        parts.append(np.sort(np.array(taken, np.int64)))
    return parts


def reduce_parts(parts, reduction: float, min_examples: int, rng):
    """Drop the fraction ``reduction`` of each client's examples at random, keeping at least
    ``min_examples`` (or all it has): FLoRAL's low-data "reduced" tasks."""
    if not 0 <= reduction < 1:
        raise ConfigError(f"train_reduction: must be in [0, 1), got {reduction}")
    if reduction == 0:
        return parts
    kept = []
    for part in parts:
        keep = min(len(part), max(round((1 - reduction) * len(part)), min_examples))
        kept.append(np.sort(rng.choice(part, size=keep, replace=False)))
    return kept


def test_like_train(train_parts, y_train, y_test, rng, num_classes):
    """Give each client test examples of each class in proportion to its training examples of
    that class (largest remainder), so its test split follows its training distribution and the
    clients' test splits together are the whole test set (minus classes no client trains on)."""
    counts = np.stack([np.bincount(y_train[p], minlength=num_classes) for p in train_parts])
    parts = [[] for _ in train_parts]
    for c in range(num_classes):
        members = rng.permutation(np.flatnonzero(y_test == c))
        share = counts[:, c].astype(np.float64)
        if share.sum() == 0 or len(members) == 0:
            continue
        exact = share / share.sum() * len(members)
        alloc = np.floor(exact).astype(int)
        remainder = len(members) - alloc.sum()
        alloc[np.argsort(-(exact - alloc), kind="stable")[:remainder]] += 1
        for k, chunk in enumerate(np.split(members, np.cumsum(alloc)[:-1])):
            parts[k].extend(chunk.tolist())
    return [np.sort(np.array(p, np.int64)) for p in parts]


def _check_non_empty(parts):
    empty = [k for k, p in enumerate(parts) if len(p) == 0]
    if empty:
        raise ConfigError(
            f"partition: leaves {len(empty)} client(s) empty (e.g. client {empty[0]}); "
            "use fewer clients or another partition"
        )


def summarize(train_parts, labels) -> dict:
    """Clients, examples per client (min/median/max) and classes per client (min/median/max)."""
    sizes = np.array([len(p) for p in train_parts])
    summary = {"clients": len(train_parts), "examples": (int(sizes.min()), float(np.median(sizes)), int(sizes.max()))}
    if not np.issubdtype(labels.dtype, np.floating):  # regression targets have no classes
        classes = np.array([len(np.unique(labels[p])) for p in train_parts])
        summary["classes"] = (int(classes.min()), float(np.median(classes)), int(classes.max()))
    return summary


def describe(summary: dict) -> str:
    e = summary["examples"]
    text = f"{summary['clients']} clients; examples per client min/median/max {e[0]}/{e[1]:g}/{e[2]}"
    if "classes" in summary:
        c = summary["classes"]
        text += f"; classes per client {c[0]}/{c[1]:g}/{c[2]}"
    return text


PARTITIONERS = ("iid", "dirichlet", "client_dirichlet", "pathological", "label_groups", "resample")
FILE_PARTITION = "file"  # the config's partition=file: the clients of partition_file
# The partitioners each setting of a partition applies to (the others ignore it).
PARTITION_KEYS = {
    "alpha": ("dirichlet", "client_dirichlet"),
    "min_examples": ("dirichlet",),
    "classes_per_client": ("pathological",),
    "client_train_size": ("client_dirichlet", "resample"),
    "client_test_size": ("client_dirichlet", "resample"),
}
SPLIT_PREFIXES = {"train": "training", "test": "test"}  # array name prefix -> split
PART_NAME = re.compile(r"^(train|test)_(0|[1-9][0-9]*)$")


def save_partition(path, train_parts, test_parts) -> Path:
    """Write a partition for ``partition=file``: an ``.npz`` with client k's training indices as
    the integer array ``train_k`` and its test indices as ``test_k`` (k = 0..K-1)."""
    if len(train_parts) != len(test_parts):
        raise ConfigError(f"partition_file: {len(train_parts)} training parts and {len(test_parts)} test parts")
    arrays = {
        f"{prefix}_{k}": np.asarray(part) if len(part) else np.zeros(0, np.int64)  # as given: checked when read
        for prefix, parts in (("train", train_parts), ("test", test_parts))
        for k, part in enumerate(parts)
    }
    path = Path(path)
    with open(path, "wb") as f:  # np.savez would append .npz to a name without it
        np.savez(f, **arrays)
    return path


def load_partition(path, num_clients: int, train_examples: int, test_examples: int):
    """``(train_parts, test_parts)`` of a :func:`save_partition` file, for a dataset of
    ``train_examples`` / ``test_examples`` examples. Each problem is one DataError naming
    ``partition_file``: not a readable .npz, arrays other than ``train_k`` / ``test_k``, a part
    missing, a client count other than ``num_clients``, and every check of
    :func:`~jaxfed.data.validate.check_parts` (integer 1-D indices in range; a training part
    may not be empty, a test part may)."""
    source = f"partition_file: {path}"
    arrays = _read_parts(path, source)
    counts = {}
    for prefix in SPLIT_PREFIXES:
        numbers = sorted(int(name.split("_")[1]) for name in arrays if name.startswith(prefix + "_"))
        missing = sorted(set(range(len(numbers))) - set(numbers))
        if missing or not numbers:
            lacks = f"{prefix}_{missing[0]}" if missing else f"{prefix}_0"
            raise DataError(f"{source}: lacks {lacks}; expected train_0..train_{{K-1}} and test_0..test_{{K-1}}")
        counts[prefix] = len(numbers)
    if counts["train"] != counts["test"]:
        raise DataError(
            f"{source}: {counts['train']} training parts and {counts['test']} test parts; give one of each per client"
        )
    if counts["train"] != num_clients:
        raise DataError(
            f"{source}: holds {counts['train']} clients, the config {num_clients}; set num_clients={counts['train']}"
        )
    parts = {prefix: [arrays[f"{prefix}_{k}"] for k in range(num_clients)] for prefix in SPLIT_PREFIXES}
    hint = "; leave a client without training examples out of the file"
    check_parts(
        source,
        parts["train"],
        train_examples,
        "training",
        allow_empty=False,
        empty_hint=hint,
        array_names="train_{}".format,
    )
    check_parts(source, parts["test"], test_examples, "test", array_names="test_{}".format)
    return parts["train"], parts["test"]


def _read_parts(path, source: str) -> dict[str, np.ndarray]:
    """The arrays of a partition file, read without pickles; only ``train_k`` / ``test_k`` names."""
    try:
        with open(path, "rb") as f:
            magic = f.read(len(ZIP_MAGIC))
    except OSError as err:
        raise DataError(f"{source}: cannot be read ({err.strerror or err})") from None
    if magic != ZIP_MAGIC:
        raise DataError(f"{source}: not an .npz file; write one with jaxfed.data.save_partition")
    try:
        with np.load(path, allow_pickle=False) as f:
            unexpected = [name for name in f.files if not PART_NAME.match(name)]
            if unexpected:
                raise DataError(
                    f"{source}: holds an array named '{unexpected[0]}'; expected only train_0..train_{{K-1}} "
                    "and test_0..test_{K-1}"
                )
            return {name: f[name] for name in f.files}
    except DataError:
        raise
    except ValueError as err:
        if "pickle" in str(err):
            raise DataError(
                f"{source}: holds object arrays (pickles), which are never loaded; save integer arrays"
            ) from None
        raise DataError(f"{source}: unreadable ({first_line(err)})") from None
    except (zipfile.BadZipFile, OSError, EOFError, KeyError) as err:
        raise DataError(f"{source}: truncated or corrupt ({first_line(err)})") from None
