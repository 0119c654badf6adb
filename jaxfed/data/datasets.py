"""Datasets as numpy arrays: the embedded default (`digits`), local ``.npz`` files and TFDS.

Every loader returns a :class:`Dataset` with images in NHWC float32, normalized per channel with
the training set's mean and standard deviation, and int32 labels, after
:mod:`jaxfed.data.validate` has checked the arrays. Nothing downloads unless the caller passes
``download=True``.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
from pathlib import Path

import numpy as np

from jaxfed.data.validate import ARRAYS, DataError, check_arrays, read_npz
from jaxfed.errors import ConfigError, unknown_choice

DATA_DIR_ENV = "JAXFED_DATA_DIR"
DATA_HELP = "the README's Data section shows how to write the .npz files"


@dataclasses.dataclass(frozen=True)
class Dataset:
    name: str
    x_train: np.ndarray
    y_train: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray
    num_classes: int

    @property
    def input_shape(self) -> tuple[int, ...]:
        return tuple(self.x_train.shape[1:])


# name -> (number of classes, default model)
DATASETS = {
    "digits": (10, "mlp"),
    "mnist": (10, "cnn"),
    "fashion_mnist": (10, "cnn"),
    "cifar10": (10, "cnn"),
    "cifar100": (100, "resnet10"),
}


def default_model(dataset: str) -> str:
    """The dataset's default model (the generated regression tasks: linear and mlp)."""
    return {"synthetic_linear": "linear", "synthetic_mlp": "mlp"}.get(dataset) or DATASETS[dataset][1]


def load_dataset(name: str, data_dir: str | None = None, download: bool = False) -> Dataset:
    """Load ``name``: ``digits`` from scikit-learn, else ``DATA_DIR/<name>.npz``, else TFDS."""
    if name not in DATASETS:
        raise ConfigError(f"dataset: {unknown_choice(name, DATASETS)}")
    if name == "digits":
        source, arrays = "digits", _load_digits()
    else:
        data_dir = resolve_data_dir(data_dir or os.environ.get(DATA_DIR_ENV), created=download)
        npz = _npz_in(data_dir, name) if data_dir else None
        if npz is not None:
            source, arrays = f"data_dir: {npz}", read_npz(npz)
        else:
            source, arrays = f"tfds '{name}'", _load_tfds(name, data_dir, download)
    check_arrays(source, arrays, DATASETS[name][0])
    x_train, y_train, x_test, y_test = (arrays[k] for k in ARRAYS)
    x_train, x_test = _as_nhwc(x_train), _as_nhwc(x_test)
    mean = x_train.mean(axis=(0, 1, 2), dtype=np.float64)
    std = x_train.std(axis=(0, 1, 2), dtype=np.float64) + 1e-8
    return Dataset(
        name=name,
        x_train=((x_train - mean) / std).astype(np.float32),
        y_train=y_train.astype(np.int32),
        x_test=((x_test - mean) / std).astype(np.float32),
        y_test=y_test.astype(np.int32),
        num_classes=DATASETS[name][0],
    )


def resolve_data_dir(data_dir: str | None, created: bool = False) -> str | None:
    """``data_dir`` with ``~`` expanded; a DataError naming it when it is not a readable
    directory (a file, a dangling symlink, a symlink loop; missing, unless a download will
    ``create`` it)."""
    if not data_dir:
        return None
    path = Path(data_dir).expanduser()
    try:
        if path.is_dir():
            return str(path)
        path.stat()
    except FileNotFoundError:
        pass
    except OSError as err:
        raise DataError(f"data_dir: {data_dir} cannot be read ({err.strerror or err})") from None
    if path.exists():
        raise DataError(f"data_dir: {data_dir} is a file; name the directory that holds <dataset>.npz")
    if created and not path.is_symlink():
        return str(path)
    link = " (a symbolic link to a missing target)" if path.is_symlink() else ""
    where = "" if path.is_absolute() else f" (from {Path.cwd()}: {path.absolute()})"  # relative to the working dir
    raise DataError(f"data_dir: {data_dir}{where} does not exist{link}; {DATA_HELP}")


def _npz_in(data_dir: str, name: str) -> Path | None:
    """``DATA_DIR/<name>.npz`` when it is there (None: look in TFDS's files instead); a DataError
    for a symbolic link that leads nowhere or loops."""
    npz = Path(data_dir) / f"{name}.npz"
    try:
        npz.stat()
        return npz
    except FileNotFoundError:
        if npz.is_symlink():
            raise DataError(f"data_dir: {npz} is a symbolic link to a missing file ({os.readlink(npz)})") from None
        return None
    except OSError as err:
        raise DataError(f"data_dir: {npz} cannot be read ({err.strerror or err})") from None


def _as_nhwc(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, np.float32)
    return x[..., None] if x.ndim == 3 else x


def _digits_images_and_labels() -> tuple[np.ndarray, np.ndarray]:
    """scikit-learn's 8x8 digits as ``load_digits`` gives them (images ``[1797, 8, 8]``, labels),
    read from the file scikit-learn ships without importing scikit-learn (about 1 s of a CLI run's
    start: it imports scipy); through ``load_digits`` where that file is not where it was."""
    spec = importlib.util.find_spec("sklearn")
    shipped = Path(spec.origin).parent / "datasets" / "data" / "digits.csv.gz" if spec and spec.origin else None
    if shipped is None or not shipped.exists():
        from sklearn.datasets import load_digits

        bunch = load_digits()
        return bunch.images, bunch.target
    table = np.loadtxt(shipped, delimiter=",")
    return table[:, :-1].reshape(-1, 8, 8), table[:, -1].astype(int)


def _load_digits():
    """scikit-learn's 8x8 digits (ships with scikit-learn): a fixed stratified 80/20 split."""
    images, y = _digits_images_and_labels()
    x = images.astype(np.float32) / 16.0
    rng = np.random.default_rng(0)
    test = np.zeros(len(y), bool)
    for c in np.unique(y):
        members = rng.permutation(np.flatnonzero(y == c))
        test[members[: len(members) // 5]] = True
    return dict(zip(ARRAYS, (x[~test], y[~test], x[test], y[test])))


def _load_tfds(name: str, data_dir: str | None, download: bool):
    searched = f"no {name}.npz in {data_dir} and no TFDS copy there" if data_dir else "no data directory given"
    how = (
        f"dataset: '{name}' is not available offline ({searched}); put {name}.npz (x_train, y_train, x_test, "
        f"y_test) in a directory and pass it (--data-dir DIR; from Python data_dir=DIR), or download once "
        f"(--set download=true; download=True) on a machine with internet; {DATA_HELP}"
    )
    try:
        import tensorflow_datasets as tfds
    except ImportError as err:  # pragma: no cover - tfds is a dependency
        raise ConfigError(how) from err
    builder = tfds.builder(name, data_dir=data_dir, file_format="array_record")
    prepared = (Path(str(builder.data_dir)) / "dataset_info.json").exists()
    if not prepared:
        if not download:
            raise ConfigError(how)
        check_can_download(name)
        builder.download_and_prepare()
    source = builder.as_data_source()

    def split(split_name):
        records = source[split_name]
        examples = [records[i] for i in range(len(records))]
        return np.stack([e["image"] for e in examples]), np.array([e["label"] for e in examples])

    return dict(zip(ARRAYS, (*split("train"), *split("test"))))


DOWNLOAD_HOST = ("storage.googleapis.com", 443)  # where TFDS fetches these datasets from


def check_can_download(name: str, timeout: float = 5.0) -> None:
    """Fail in seconds, not after minutes of retries: TFDS needs TensorFlow to prepare image
    datasets, and a reachable download host."""
    npz_hint = f"or put {name}.npz (x_train, y_train, x_test, y_test) in --data-dir (README: Data)"
    if not tensorflow_installed():
        raise ConfigError(
            f"download: TFDS needs TensorFlow to prepare '{name}': pip install 'jaxfed[tfds]', {npz_hint}"
        )
    import socket

    try:
        socket.create_connection(DOWNLOAD_HOST, timeout=timeout).close()
    except OSError as err:
        raise ConfigError(
            f"download: {DOWNLOAD_HOST[0]} is unreachable ({err.strerror or err}); no internet? {npz_hint}"
        ) from None


def tensorflow_installed() -> bool:
    import importlib.util

    return importlib.util.find_spec("tensorflow") is not None
