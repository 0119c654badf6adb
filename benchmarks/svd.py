"""The server's truncated SVDs on this device: every SVD route on each kernel a tiered algorithm
factorizes, and the algorithm's whole broadcast (every tier's factors, as a round computes them)
with ``factorization=svd`` and ``gram``, on the server's kernels after ``--train-rounds`` rounds.

    python benchmarks/svd.py --data-dir DIR [--algorithms fedhm,fedara] [--train-rounds 5]
        [--routes svd,gram,gram_eigh,svd_polar,qdwh] [--set KEY=VALUE ...] [--json FILE]

Routes: ``svd`` (``jnp.linalg.svd``: LAPACK's gesdd on CPU; on CUDA cuSOLVER's Jacobi gesvdj up to
1024 x 1024, QR-based gesvd above), ``svd_qr`` / ``svd_jacobi`` / ``svd_polar`` /
``svd_divide_and_conquer`` (``lax.linalg.svd``'s algorithms; the ones a platform lacks are listed
with their error), ``gram`` (:func:`jaxfed.core.lowrank.decompose`'s Gram route) and ``qdwh``
(JAX's QDWH polar-decomposition SVD, its TPU algorithm, from a private module: skipped if it
moved), ``gram_eigh`` (the Gram route without its condition check,
:func:`jaxfed.core.lowrank.gram_eigendecomposition`). Each kernel is timed as the server holds it
after ``--train-rounds`` rounds of the algorithm (matricized as it factorizes it; 0: at
initialization, where the kernels are well conditioned and the Gram route skips its fallback:
the 2026-11-27 H100 run timed gram at 3.5x faster there, while W1's FedHM round with it was
slower, its trained fc1 above the condition bound), and its accuracy is measured against numpy's
float64 SVD: the relative error of the full product ``U S V^T``, of the singular values (against
the largest) and the departure of ``U`` from orthonormal columns. Workload: W1's (``jaxfed bench
w3``), MNIST CNN.
Why: FedHM's W1 round on an H100 took 39.6 ms against mFedLoRU's 10.5 ms at about the same FLOPs
(XLA counts no FLOPs in a cuSOLVER call), and FedHM's server runs one SVD per factorized layer a
round.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxfed.cli.bench import workload_config
from jaxfed.contract import RoundInfo
from jaxfed.core import lowrank
from jaxfed.runs.build import build

SVD_ALGORITHMS = ("QR", "JACOBI", "POLAR", "DIVIDE_AND_CONQUER")


def routes() -> dict:
    """``name -> f(matrix) -> (U, s, V)`` (thin, ``s`` descending)."""

    def from_svd(svd):
        def run(matrix):
            left, singular, right_t = svd(matrix)
            return left, singular, right_t.T

        return run

    found = {
        "svd": from_svd(functools.partial(jnp.linalg.svd, full_matrices=False)),
        "gram": lambda matrix: tuple(lowrank.decompose(matrix, "gram")),
        "gram_eigh": lambda matrix: tuple(lowrank.gram_eigendecomposition(matrix)),
    }
    for name in SVD_ALGORITHMS:
        algorithm = getattr(jax.lax.linalg.SvdAlgorithm, name)
        found[f"svd_{name.lower()}"] = from_svd(
            functools.partial(jax.lax.linalg.svd, full_matrices=False, algorithm=algorithm)
        )
    try:
        from jax._src.tpu.linalg.svd import svd as qdwh_svd
    except ImportError:
        return found
    found["qdwh"] = from_svd(functools.partial(qdwh_svd, full_matrices=False))
    return found


def median_seconds(fn, arg, repeats: int) -> float:
    jax.block_until_ready(fn(arg))
    seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(arg))
        seconds.append(time.perf_counter() - start)
    return statistics.median(seconds)


TRUNCATIONS = (0.5, 0.25, 0.125, 0.0625)  # the default tiers' rank ratios below 1


def accuracy(matrix: np.ndarray, left, singular, right) -> dict:
    """Against numpy's float64 SVD of the same float32 matrix; ``truncation_excess``: what a
    tier's factors lose beyond the best approximation of their rank (Eckart-Young), the largest
    over :data:`TRUNCATIONS`, ``(||A - A_r|| - ||A - A_r*||) / ||A||``."""
    a = matrix.astype(np.float64)
    exact = np.linalg.svd(a, compute_uv=False)
    left, singular, right = (np.asarray(x, np.float64) for x in (left, singular, right))
    product = (left * singular) @ right.T
    norm = np.linalg.norm(a)
    excess = []
    for ratio in TRUNCATIONS:
        r = max(1, int(ratio * len(exact)))
        got = np.linalg.norm(a - (left[:, :r] * singular[:r]) @ right[:, :r].T)
        excess.append((got - np.sqrt(np.sum(exact[r:] ** 2))) / norm)
    return {
        "product_error": float(np.linalg.norm(product - a) / norm),
        "singular_error": float(np.abs(singular - exact).max() / exact[0]),
        "orthonormality_error": float(np.abs(left.T @ left - np.eye(left.shape[1])).max()),
        "truncation_excess": float(max(excess)),
        "condition": float(exact[0] / exact[-1]),
    }


def layers(tree, holding: tuple[str, ...]) -> dict[str, dict]:
    """``{dotted key: layer dict}`` for the dicts of ``tree`` (a server state or a broadcast: named
    tuples of parameter trees) that hold every name in ``holding``."""
    found = {}

    def visit(node, prefix):
        if isinstance(node, dict):
            if all(name in node for name in holding):
                found[".".join(prefix)] = node
            for name, child in node.items():
                visit(child, (*prefix, name))
        elif isinstance(node, tuple):
            for child in node:
                visit(child, prefix)

    visit(tree, ())
    return found


def trained_server(name: str, data_dir: str, overrides: list[str], rounds: int):
    """The server state of ``name`` at W1 after ``rounds`` rounds (``factorization=svd``)."""
    config = workload_config("w3", [f"algorithm={name}", f"data_dir={data_dir}", *overrides, "factorization=svd"])
    sim = build(config).simulation
    state = sim.init()
    if rounds:
        state, _ = sim.run_rounds(state, rounds)
    return jax.block_until_ready(state.server)


def measure_algorithm(name: str, data_dir: str, overrides: list[str], repeats: int, rounds: int, wanted) -> dict:
    result = {"train_rounds": rounds, "kernels": {}, "broadcast_seconds": {}}
    server = trained_server(name, data_dir, overrides, rounds)
    for factorization in lowrank.FACTORIZATIONS:
        config = workload_config(
            "w3", [f"algorithm={name}", f"data_dir={data_dir}", f"factorization={factorization}", *overrides]
        )
        sim = build(config).simulation
        tiers = range(len(sim.tiers or [None]))
        every_tier = jax.jit(
            lambda s: [sim.algorithm.broadcast(s, RoundInfo(round=jnp.int32(0), tier=t)) for t in tiers]
        )
        result["broadcast_seconds"][factorization] = median_seconds(every_tier, server, repeats)
    kernels = layers(server, ("kernel",))
    for key in layers(sim.algorithm.broadcast(server, RoundInfo(round=jnp.int32(0), tier=tiers[-1])), ("u", "v")):
        matrix = lowrank.matricize(kernels[key]["kernel"])
        row = {"shape": list(matrix.shape)}
        for route, fn in routes().items():
            if wanted and route not in wanted:
                continue
            compiled = jax.jit(fn)
            try:
                row[route] = {"seconds": median_seconds(compiled, matrix, repeats)}
            except Exception as error:  # a route this platform lacks (Jacobi and polar on CPU)
                row[route] = {"error": str(error).split("\n")[0][:200]}
                continue
            row[route].update(accuracy(np.asarray(matrix), *compiled(matrix)))
        result["kernels"][key] = row
    return result


def summary(results: dict) -> list[str]:
    lines = [f"device: {results['device']}"]
    for name, result in results["algorithms"].items():
        times = ", ".join(f"{k} {1e3 * v:.2f} ms" for k, v in result["broadcast_seconds"].items())
        lines.append(f"{name} after {result['train_rounds']} rounds: every tier's broadcast: {times}")
        for key, row in result["kernels"].items():
            lines.append(f"  {key} {tuple(row['shape'])}:")
            for route, r in row.items():
                if route == "shape":
                    continue
                if "error" in r:
                    lines.append(f"    {route:24s} unavailable: {r['error'][:90]}")
                    continue
                lines.append(
                    f"    {route:24s} {1e3 * r['seconds']:8.2f} ms  product {r['product_error']:.1e}  "
                    f"singular {r['singular_error']:.1e}  U^T U - I {r['orthonormality_error']:.1e}  "
                    f"truncated {r['truncation_excess']:.1e}  "
                    f"(condition {r['condition']:.1f})"
                )
    return lines


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data-dir", required=True)
    parser.add_argument("--algorithms", default="fedhm,fedara")
    parser.add_argument("--set", nargs="*", default=[], dest="overrides")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--train-rounds", type=int, default=5, help="rounds the server trains before the timing")
    parser.add_argument(
        "--routes", default="", help="comma-separated routes to time, svd and gram always (default: every one)"
    )
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    results = {"device": str(jax.devices()[0]), "overrides": args.overrides, "algorithms": {}}
    wanted = set(filter(None, args.routes.split(",")))
    unknown = wanted - set(routes())
    if unknown:
        parser.error(f"--routes: unknown {', '.join(sorted(unknown))}; allowed: {', '.join(routes())}")
    wanted = wanted and wanted | {"svd", "gram"}  # the table compares every route with these two
    for name in args.algorithms.split(","):
        results["algorithms"][name] = measure_algorithm(
            name, args.data_dir, args.overrides, args.repeats, args.train_rounds, wanted
        )
    print("\n".join(summary(results)))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return results


if __name__ == "__main__":
    main()
