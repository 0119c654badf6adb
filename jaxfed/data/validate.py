"""Checks of a dataset's arrays before anything is built or compiled.

Every problem is one :class:`DataError` line naming where the data came from, the array and what
is wrong with it: a file that is not an ``.npz`` (or is truncated or corrupt), a missing array,
a non-numeric dtype, inconsistent lengths or image shapes, channel-first or flattened images,
NaN or inf values, labels that are not integers in ``[0, classes)``, an empty split.
:func:`read_npz` and :func:`check_arrays` serve the loaders (``jaxfed run --data-dir``);
:func:`check_dataset` serves data passed from Python (:func:`jaxfed.data.federate`), where float
targets are a regression's: one row of ``num_classes`` outputs per example (class labels stored
as floats are refused); one-hot targets and inputs left unscaled (uint8, or values beyond
:data:`LARGE_INPUT`) are a :class:`DataWarning`.
"""

from __future__ import annotations

import warnings
import zipfile
from pathlib import Path

import jax.numpy as jnp
import numpy as np

from jaxfed.errors import ConfigError, channels_first, first_line

SPLITS = (("x_train", "y_train"), ("x_test", "y_test"))
ARRAYS = tuple(name for pair in SPLITS for name in pair)
ZIP_MAGIC = b"PK\x03\x04"
LARGE_INPUT = 10.0  # normalized inputs (jaxfed's loaders: per-channel standardized) stay well below


class DataError(ConfigError):
    """A dataset that cannot be used as it is (one line; the CLI exits with code 2)."""


class DataWarning(UserWarning):
    """Data that runs but is likely not what was meant (one-hot targets, unscaled inputs)."""


def read_npz(path: Path) -> dict[str, np.ndarray]:
    """The four arrays of an ``.npz`` file, read without pickles; a DataError for a file that is
    not an npz, is truncated or corrupt (zip CRC), or lacks an array."""
    where = f"data_dir: {path}"
    try:
        f = open(path, "rb")
    except IsADirectoryError:
        raise DataError(f"{where}: is a directory, not an .npz file") from None
    except OSError as err:
        raise DataError(f"{where}: cannot be read ({err.strerror or err})") from None
    with f:
        if f.read(4) != ZIP_MAGIC:
            raise DataError(
                f"{where}: not an .npz file (a zip of .npy arrays written by numpy.savez); "
                "write x_train, y_train, x_test, y_test with numpy.savez"
            )
    try:
        with np.load(path, allow_pickle=False) as f:
            missing = [name for name in ARRAYS if name not in f.files]
            if missing:
                raise DataError(f"{where}: lacks {', '.join(missing)}; needs x_train, y_train, x_test, y_test")
            return {name: f[name] for name in ARRAYS}
    except DataError:
        raise
    except ValueError as err:
        if "pickle" in str(err):
            raise DataError(f"{where}: holds object arrays (pickles), which are never loaded; save numeric arrays")
        raise DataError(f"{where}: unreadable ({first_line(err)})") from None
    except (zipfile.BadZipFile, OSError, EOFError, KeyError) as err:
        raise DataError(f"{where}: truncated or corrupt ({first_line(err)})") from None


def check_arrays(source: str, arrays: dict[str, np.ndarray], num_classes: int | None, *, images: bool = True) -> None:
    """Raise a DataError for the first problem of ``arrays`` (``x_train, y_train, x_test,
    y_test``). ``num_classes`` None: regression (float targets); else integer labels in
    ``[0, num_classes)``. ``images``: x must be ``(N, H, W)`` or ``(N, H, W, C)``, channels last
    (otherwise features of any shape: a model that cannot take them says so when it is built)."""
    for name in ARRAYS:
        a = arrays[name]
        if not (jnp.issubdtype(a.dtype, jnp.number) or a.dtype == np.bool_):  # jnp's: bfloat16 too
            raise DataError(f"{source}: {name} has dtype {a.dtype}; expected numbers")
        if np.issubdtype(a.dtype, np.complexfloating):
            raise DataError(f"{source}: {name} has dtype {a.dtype}; expected real numbers (complex values are not)")
        if a.ndim == 0:
            raise DataError(f"{source}: {name} is a single value (shape ()); expected one entry per example")
    for x_name, y_name in SPLITS:
        x, y = arrays[x_name], arrays[y_name]
        if x.ndim < 2 or len(x) == 0:
            raise DataError(f"{source}: {x_name} is empty (shape {x.shape}); every split needs examples")
        if len(y) != len(x):
            raise DataError(f"{source}: {y_name} has {len(y)} entries for the {len(x)} examples of {x_name}")
        if images:
            _check_image_shape(source, x_name, x.shape)
        _check_targets(source, y_name, y, num_classes)
        if jnp.issubdtype(x.dtype, jnp.floating) and not np.isfinite(x).all():
            bad = int(np.count_nonzero(~np.isfinite(x)))
            raise DataError(f"{source}: {x_name} has {bad} NaN or inf value(s); every input must be finite")
    if arrays["x_train"].shape[1:] != arrays["x_test"].shape[1:]:
        raise DataError(
            f"{source}: x_test examples have shape {arrays['x_test'].shape[1:]}, "
            f"x_train's {arrays['x_train'].shape[1:]}; both splits need one shape"
        )


def check_dataset(dataset, source: str | None = None) -> None:
    """:func:`check_arrays` for a :class:`~jaxfed.data.Dataset` (float targets: regression)."""
    arrays = {name: np.asarray(getattr(dataset, name)) for name in ARRAYS}
    source = source or f"dataset '{dataset.name}'"
    regression = jnp.issubdtype(arrays["y_train"].dtype, jnp.floating)
    numeric = all(jnp.issubdtype(arrays[y].dtype, jnp.number) for y in ("y_train", "y_test"))
    if numeric and regression != jnp.issubdtype(arrays["y_test"].dtype, jnp.floating):
        kinds = {True: "float (regression targets)", False: "not float (class labels)"}
        raise DataError(
            f"{source}: y_train has dtype {arrays['y_train'].dtype}, {kinds[regression]}, but y_test "
            f"{arrays['y_test'].dtype}, {kinds[not regression]}; give both splits one kind of target"
        )
    check_arrays(source, arrays, None if regression else dataset.num_classes, images=False)
    if regression:
        for name in ("y_train", "y_test"):
            _check_regression_width(source, name, arrays[name], dataset.num_classes)
        _warn_one_hot(source, arrays["y_train"])
    _warn_unscaled(source, arrays["x_train"])


def _check_regression_width(source: str, name: str, y: np.ndarray, num_classes: int) -> None:
    """Float targets are a regression's: ``num_classes`` outputs per example. Whole numbers in
    ``[0, num_classes)`` one per example are class labels stored as floats."""
    width = int(np.prod(y.shape[1:]))
    if width == num_classes:
        return
    low, high = float(y.min()), float(y.max())
    if width == 1 and np.all(y == np.round(y)) and low >= 0 and high < num_classes:
        fix = f"{name}.astype(np.int64)" if y.ndim == 1 else f"{name}.ravel().astype(np.int64)"
        raise DataError(
            f"{source}: {name} is {y.dtype} with values {low:g}..{high:g}: class labels must be integers ({fix}); "
            f"float targets are regression (num_classes must then be {width}, the targets per example)"
        )
    raise DataError(
        f"{source}: {name} has float targets of shape {y.shape}: a regression with {width} output(s) per example, "
        f"but num_classes is {num_classes}; set num_classes={width} (class labels must be integers)"
    )


def _warn_one_hot(source: str, y: np.ndarray) -> None:
    """A :class:`DataWarning` for float targets that are exactly one-hot: class labels meant,
    most likely, though they train as a regression (squared error, no accuracy)."""
    if y.ndim != 2 or y.shape[1] < 2 or not np.all((y == 0) | (y == 1)) or not np.all(y.sum(axis=1) == 1):
        return
    warnings.warn(
        f"{source}: y_train is one-hot ({y.dtype}, shape {y.shape}): it trains as a {y.shape[1]}-output regression "
        "(squared error, no accuracy); for classification pass integer labels: y_train.argmax(1), y_test.argmax(1)",
        DataWarning,
        stacklevel=4,
    )


def _warn_unscaled(source: str, x: np.ndarray) -> None:
    """A :class:`DataWarning` for inputs used as given that look unscaled: uint8 images (raw
    pixels: examples of two or more axes), or floats beyond :data:`LARGE_INPUT` (other integers
    pass, and uint8 sequences: token ids, bytes)."""
    if x.dtype == np.uint8 and x.ndim >= 3:
        found = f"is uint8 (values {int(x.min())}..{int(x.max())})"
    elif jnp.issubdtype(x.dtype, jnp.floating) and (top := float(np.abs(x).max())) > LARGE_INPUT:
        found = f"has values up to {top:g}"
    else:
        return
    warnings.warn(
        f"{source}: x_train {found}, used as given (data from Python is not normalized): scale it, "
        "e.g. x / 255.0 for pixels, or standardize ((x - mean) / std), or SGD may diverge",
        DataWarning,
        stacklevel=4,
    )


def check_parts(
    source: str, parts, size: int, split: str, *, allow_empty: bool = True, empty_hint: str = "", array_names=None
) -> None:
    """Every client's example indices are one list of integers in ``[0, size)``; an empty list is
    refused (with ``empty_hint``) unless ``allow_empty``. ``array_names``: what a message calls
    client k's list, where it has a name of its own (a partition file's ``train_k``)."""
    if len(parts) == 0:
        raise DataError(f"{source}: no {split} parts; give one list of example indices per client")
    for k, part in enumerate(parts):
        what = f"client {k}'s {split} indices" + (f" ({array_names(k)})" if array_names else "")
        part = np.asarray(part)
        if part.size and not np.issubdtype(part.dtype, np.integer):
            raise DataError(f"{source}: {what} have dtype {part.dtype}; expected integers")
        if part.ndim != 1:
            raise DataError(f"{source}: {what} have shape {part.shape}; expected one list")
        if not part.size:
            if allow_empty:
                continue
            raise DataError(f"{source}: {what} are empty; every client needs {split} examples{empty_hint}")
        if part.min() < 0 or part.max() >= size:
            raise DataError(f"{source}: {what} run {part.min()}..{part.max()}; the {split} split has {size} examples")


def _check_image_shape(source: str, name: str, shape: tuple[int, ...]) -> None:
    if len(shape) == 2:
        raise DataError(
            f"{source}: {name} has shape {shape}: flattened; expected images (N, H, W) or (N, H, W, C), "
            f"e.g. x.reshape(-1, 28, 28)"
        )
    if len(shape) not in (3, 4):
        raise DataError(f"{source}: {name} has shape {shape}; expected images (N, H, W) or (N, H, W, C)")
    if len(shape) == 4 and channels_first(shape[1:]):
        raise DataError(
            f"{source}: {name} has shape {shape}: channels first; expected channels last (N, H, W, C), "
            f"e.g. x.transpose(0, 2, 3, 1)"
        )


def check_integer_labels(source: str, name: str, y: np.ndarray) -> None:
    """A DataError unless ``y`` has an integer dtype (labels stored as whole-number floats are
    told the cast)."""
    if np.issubdtype(y.dtype, np.integer):
        return
    whole = np.issubdtype(y.dtype, np.floating) and y.size and np.all(y == np.round(y))
    fix = f" ({name}.astype(int))" if whole else ""
    raise DataError(f"{source}: {name} has dtype {y.dtype}; class labels must be integers{fix}")


def _check_targets(source: str, name: str, y: np.ndarray, num_classes: int | None) -> None:
    if num_classes is None:  # regression
        if not jnp.issubdtype(y.dtype, jnp.floating):
            raise DataError(f"{source}: {name} has dtype {y.dtype}; regression targets are floats")
        if not np.isfinite(y).all():
            raise DataError(f"{source}: {name} has NaN or inf targets")
        return
    if y.ndim != 1:
        hint = f" ({name}.ravel())" if y.ndim == 2 and y.shape[1] == 1 else ""
        raise DataError(f"{source}: {name} has shape {y.shape}; expected one integer label per example (N,){hint}")
    check_integer_labels(source, name, y)
    low, high = int(y.min()), int(y.max())
    if low < 0 or high >= num_classes:
        raise DataError(f"{source}: {name} has labels {low}..{high}; this dataset's are 0..{num_classes - 1}")
