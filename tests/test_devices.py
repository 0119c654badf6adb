"""1 device vs 4 CPU devices (``host_devices=4``): the same numbers to float tolerance, the client
states split over the devices (subprocesses)."""

import json
import os
import re
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from conftest import metrics_rows

from jaxfed.cli.commands import main
from jaxfed.runs import distributed

SCRIPT = textwrap.dedent(
    """
    import json, sys, warnings
    import jax, numpy as np
    from jaxfed.runs.config import Config
    from jaxfed.runs.build import build
    from jaxfed.runs.distributed import split_host

    devices, out = int(sys.argv[1]), sys.argv[2]
    if devices > 1:  # the process entry splits the host, before JAX starts its backend
        split_host(devices)
    # stateful clients (FedDecomp's private tau), 12 of them: split evenly over 4 devices
    host_devices = devices if devices > 1 else 0
    config = Config(algorithm="feddecomp", num_clients=12, participation=0.5, host_devices=host_devices)
    config = config.with_overrides(["local_epochs=2"])
    sim = build(config).simulation
    assert jax.device_count() == devices, jax.devices()
    with warnings.catch_warnings(record=True) as divided:
        warnings.simplefilter("always")
        start = sim.init()
    state, metrics = sim.run_rounds(start, 3)
    with warnings.catch_warnings(record=True) as undivided:  # 10 clients over 4 devices stay replicated
        warnings.simplefilter("always")
        build(config.with_overrides(["num_clients=10"])).simulation.init()
    told = [str(w.message) for w in divided + undivided if "client states" in str(w.message)]
    if devices > 1:  # the run key's count: the first N visible
        assert build(config.with_overrides(["devices=2"])).simulation.num_devices == 2
    leaves = jax.tree.leaves(state.server) + jax.tree.leaves(state.clients)
    arrays = {f"leaf_{i}": np.asarray(x) for i, x in enumerate(leaves)}
    arrays["loss"] = np.asarray(metrics["train_loss"])
    np.savez(out, **arrays)
    per_client = jax.tree.leaves(state.clients) + [sim.data.train_idx, sim.data.test_idx]
    first = jax.devices()[0]
    on_first = lambda leaves: sum(s.data.nbytes for x in leaves for s in x.addressable_shards if s.device == first)
    sizes = {"client_bytes": sum(x.nbytes for x in per_client), "client_bytes_on_device_0": on_first(per_client)}
    if devices > 1:  # a sweep's members' client states are split from the start, as a run's
        from jaxfed.runs.sweep import Sweep, sweep_configs
        sweep = Sweep(sweep_configs(config.with_overrides(["member_chunk=0"]), seeds=[0, 1]))
        states = sweep.init()
        sizes["sweep_client_bytes"] = sum(x.nbytes for x in jax.tree.leaves(states.clients))
        sizes["sweep_client_bytes_on_device_0"] = on_first(jax.tree.leaves(states.clients))
        sweep.run_rounds(states, 1)  # vmapped members run from states placed on the mesh
    summaries = {k: v for k, v in sim.evaluate(state).items() if k != "clients"}
    print(json.dumps({"devices": sim.num_devices, "sharded": sim.mesh is not None, **sizes, **summaries, "told": told}))
    """
)


def _run_together(tmp_path, device_counts):
    """The script with each device count, as concurrent subprocesses: ``[(info, arrays)]``."""
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if "device_count" not in f]
    env = dict(os.environ, XLA_FLAGS=" ".join(flags), JAX_PLATFORMS="cpu")
    outs = [tmp_path / f"devices_{n}.npz" for n in device_counts]
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", SCRIPT, str(n), str(out)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for n, out in zip(device_counts, outs)
    ]
    results = []
    for proc, out in zip(procs, outs):
        stdout, stderr = proc.communicate(timeout=300)
        assert proc.returncode == 0, stderr[-3000:]
        with np.load(out) as f:
            results.append((json.loads(stdout.strip().splitlines()[-1]), {k: f[k] for k in f.files}))
    return results


def test_one_vs_four_devices(tmp_path):
    (one_info, one), (four_info, four) = _run_together(tmp_path, (1, 4))
    assert one.keys() == four.keys()
    for key in one:
        np.testing.assert_allclose(one[key], four[key], rtol=2e-4, atol=2e-5, err_msg=key)
    assert (one_info["devices"], one_info["sharded"]) == (1, False)
    assert (four_info["devices"], four_info["sharded"]) == (4, True)  # 6 sampled clients padded to 8 over 4 devices
    # client states and per-client index tables split over the devices: each holds a quarter
    assert one_info["client_bytes_on_device_0"] == one_info["client_bytes"] == four_info["client_bytes"]
    assert four_info["client_bytes_on_device_0"] == four_info["client_bytes"] // 4
    assert four_info["sweep_client_bytes_on_device_0"] == four_info["sweep_client_bytes"] // 4
    assert one_info["personalized_acc_mean"] == pytest.approx(four_info["personalized_acc_mean"], abs=0.01)
    # 10 clients do not divide over 4 devices: replicated, and said so once (12 do; one device has nothing to split)
    assert one_info["told"] == [] and len(four_info["told"]) == 1
    assert re.fullmatch(
        r"client states: 10 clients do not divide over 4 devices, so every device holds all of them "
        r"\(\d+\.\d MB each\); a multiple of 4 clients splits them",
        four_info["told"][0],
    )


def test_host_devices_after_jax_started_is_a_one_line_error(monkeypatch):
    import jax

    from jaxfed.errors import ConfigError
    from jaxfed.runs.build import build
    from jaxfed.runs.config import Config
    from jaxfed.runs.distributed import split_host

    monkeypatch.setenv("XLA_FLAGS", os.environ.get("XLA_FLAGS", ""))  # restored after the test
    started = len(jax.devices("cpu"))
    with pytest.raises(ConfigError, match=f"host_devices: JAX had started with {started} CPU device"):
        split_host(started + 1)
    # build leaves the process alone: it says where the split belongs
    with pytest.raises(ConfigError, match=f"host_devices: {started + 1} requested but the CPU shows {started} dev"):
        build(Config(host_devices=started + 1))


def test_matmul_precision_is_the_simulations_own_not_the_processes():
    import jax

    from jaxfed.runs.build import build
    from jaxfed.runs.config import Config

    small = ["num_clients=4", "rounds=1"]
    highest = build(Config().with_overrides([*small, "matmul_precision=highest"])).simulation
    default = build(Config().with_overrides(small)).simulation
    assert jax.config.jax_default_matmul_precision is None  # building changed nothing global

    def lowered(sim):
        with sim.precision():
            return jax.jit(sim.rounds_pure, static_argnums=2).lower(sim.init(), sim.data, 1).as_text()

    assert "HIGHEST" in lowered(highest) and "HIGHEST" not in lowered(default)
    highest.run_rounds(highest.init(), 1)
    assert jax.config.jax_default_matmul_precision is None  # nor did running


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _jaxfed_processes(out, args, count=2):
    """``jaxfed run`` as ``count`` processes on loopback (one CPU device each)."""
    import subprocess
    import sys

    coordinator = f"127.0.0.1:{_free_port()}"
    shared = {**os.environ, "JAXFED_COORDINATOR": coordinator, "JAXFED_NUM_PROCESSES": str(count)}
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "jaxfed.cli", "run", "--quiet", "--out", str(out), *args],
            env={**shared, "JAXFED_PROCESS_ID": str(i)},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(count)
    ]
    outputs = [p.communicate(timeout=300) for p in procs]
    for p, (_, err) in zip(procs, outputs):
        assert p.returncode == 0, err[-2000:]
    return outputs


@pytest.mark.slow  # a multi-process campaign (README: Run the tests)
def test_two_processes_run_as_one_process_with_two_devices_and_resume(tmp_path):
    """jax.distributed on loopback: the same rows, bit for bit, as one process over two host
    devices (the same mesh); stopped at round 4 and resumed by both processes, the same again."""
    import json
    import subprocess
    import sys

    run = ["--set", "num_clients=8", "eval_every=2", "checkpoint_every=2"]
    env = dict(os.environ)  # the suite's XLA_FLAGS, as the processes below have
    one = subprocess.run(
        [sys.executable, "-m", "jaxfed.cli", "run", "--quiet", "--out", str(tmp_path / "one"), *run]
        + ["--set", "rounds=6", "host_devices=2"],
        env=env,
        capture_output=True,
        text=True,
    )
    assert one.returncode == 0, one.stderr[-2000:]
    outputs = _jaxfed_processes(tmp_path / "two", [*run, "--set", "rounds=4"])
    assert "fedavg on digits" in outputs[0][0] and "fedavg on digits" not in outputs[1][0]  # the primary reports
    _jaxfed_processes(tmp_path / "two", ["--resume", "--set", "rounds=6"])

    assert metrics_rows(tmp_path / "two") == metrics_rows(tmp_path / "one")
    assert [r["round"] for r in metrics_rows(tmp_path / "two")] == [2, 4, 6]
    assert json.loads((tmp_path / "two" / "summary.json").read_text())["devices"] == 2


def test_only_process_zero_prints_in_a_run_across_processes(tmp_path, monkeypatch, capsys):
    """docs/devices.md: across processes, "process 0 alone writes config.json, metrics.jsonl,
    summary.json and the plots, holds the lock and prints". Another process prints nothing."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setitem(distributed._process, "id", 1)  # this process plays process 1 of a run
    assert main(["run", "--set", "rounds=1", "--out", "shared"]) == 0
    out = capsys.readouterr()
    assert out.out == "" and out.err == "", (out.out, out.err)
