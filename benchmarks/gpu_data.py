"""The GPU suite's data for a machine that takes only a size-limited copy of the working tree:
``pack`` writes MNIST and an evenly spread subset of CIFAR-10's JPEG files (the form the offline
data ships in) into a folder small enough to travel; ``unpack``, on the GPU machine, decodes it
into the plain ``.npz`` files ``benchmarks/gpu.sh DATA`` reads (numpy and Pillow).

    python benchmarks/gpu_data.py pack SHARED_DATA .gpudata      # here: mnist.npz, cifar10_jpeg.npz
    python benchmarks/gpu_data.py unpack .gpudata /tmp/d         # there: mnist.npz, cifar10.npz

The CIFAR-10 files are sorted by class, so the subset takes every example but each fifth of the
training split (40 000, 4 000 a class) and the whole test split by default: w4 draws 40 clients
of 500 training examples and 100 test examples from it. Timings match the whole data's; the
drawn examples, hence accuracies, differ.
"""

from __future__ import annotations

import argparse
import io
import shutil
from pathlib import Path

import numpy as np

JPEG_FILE = "cifar10_jpeg.npz"


def spread(count: int, keep: int) -> np.ndarray:
    """``keep`` indices of ``range(count)``, evenly spread (``count`` sorted by class: balanced)."""
    if not 0 < keep <= count:
        raise SystemExit(f"--cifar-train/--cifar-test: {keep} is not in 1..{count}")
    return np.floor(np.arange(keep) * (count / keep)).astype(np.int64)


def subset_jpegs(source: dict, split: str, keep: np.ndarray) -> dict:
    """The ``split``'s JPEG blob, offsets and labels for the examples ``keep``."""
    blob, offsets = source[f"{split}_jpeg"], source[f"{split}_offsets"]
    parts = [blob[offsets[i] : offsets[i + 1]] for i in keep]
    sizes = np.array([len(p) for p in parts], np.int64)
    return {
        f"{split}_jpeg": np.concatenate(parts),
        f"{split}_offsets": np.concatenate([[0], np.cumsum(sizes)]),
        f"y_{split}": source[f"y_{split}"][keep],
    }


def pack(shared: Path, out: Path, train: int, test: int) -> None:
    out.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(shared / "mnist.npz", out / "mnist.npz")
    source = np.load(shared / JPEG_FILE)
    arrays = {"class_names": source["class_names"]}
    for split, keep in (("train", train), ("test", test)):
        arrays.update(subset_jpegs(source, split, spread(len(source[f"y_{split}"]), keep)))
    np.savez(out / JPEG_FILE, **arrays)
    total = sum(p.stat().st_size for p in out.iterdir())
    print(f"wrote {', '.join(sorted(p.name for p in out.iterdir()))} to {out}: {total / 2**20:.1f} MiB")


def decode(source, split: str) -> np.ndarray:
    from PIL import Image

    blob, offsets = source[f"{split}_jpeg"], source[f"{split}_offsets"]
    images = [
        np.asarray(Image.open(io.BytesIO(blob[offsets[i] : offsets[i + 1]].tobytes())).convert("RGB"))
        for i in range(len(offsets) - 1)
    ]
    return np.stack(images)  # uint8, as Pillow decodes RGB


def unpack(packed: Path, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(packed / "mnist.npz", out / "mnist.npz")
    source = np.load(packed / JPEG_FILE)
    arrays = {"class_names": source["class_names"]}
    for split in ("train", "test"):
        arrays[f"x_{split}"], arrays[f"y_{split}"] = decode(source, split), source[f"y_{split}"]
    np.savez(out / "cifar10.npz", **arrays)
    print(f"wrote mnist.npz, cifar10.npz ({len(arrays['y_train'])} / {len(arrays['y_test'])}) to {out}")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    packing = commands.add_parser("pack", help="the data folder (mnist.npz, cifar10_jpeg.npz) -> a small copy")
    packing.add_argument("shared", type=Path)
    packing.add_argument("out", type=Path)
    packing.add_argument("--cifar-train", type=int, default=40_000)
    packing.add_argument("--cifar-test", type=int, default=10_000)
    unpacking = commands.add_parser("unpack", help="a packed copy -> mnist.npz and cifar10.npz")
    unpacking.add_argument("packed", type=Path)
    unpacking.add_argument("out", type=Path)
    args = parser.parse_args(argv)
    if args.command == "pack":
        pack(args.shared, args.out, args.cifar_train, args.cifar_test)
    else:
        unpack(args.packed, args.out)


if __name__ == "__main__":
    main()
