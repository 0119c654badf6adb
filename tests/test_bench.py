"""jaxfed bench: the harness's bookkeeping against numbers written out, and a tiny end-to-end run."""

import json
from types import SimpleNamespace

import jax
import numpy as np
import pytest

from jaxfed.cli import main
from jaxfed.cli.bench import (
    examples_per_round,
    measure,
    profile_rounds,
    sequential_steps,
    time_rounds,
    useful_step_fraction,
    workload_config,
)
from jaxfed.cli.bench.flops import model_step_flops
from jaxfed.cli.bench.profile import summarize
from jaxfed.nn import get_model
from jaxfed.runs.build import build
from jaxfed.simulation.engine import Simulation


@pytest.fixture(autouse=True)
def small_peak(monkeypatch):
    """The matmul peak on 256-wide matrices: these tests check what a bench reports, not the
    machine (2048 took 3 s of each bench here)."""
    monkeypatch.setattr(measure, "CPU_PEAK_SIDE", 256)


TINY_W2 = ["num_clients=40", "participation=0.25", "client_train_size=40", "rounds_per_call=1"]


def test_examples_and_useful_steps_follow_the_sampled_clients():
    config = workload_config("w2", [*TINY_W2, "partition=dirichlet", "alpha=0.3", "min_examples=5"])
    sim = build(config).simulation
    counts = np.asarray(sim.data.train_count)
    examples, real, all_together, in_threes, sequence_of_threes = [], 0, 0, 0, []
    for t in range(3):
        n = counts[sim.sampled_ids(t)]
        examples.append(((n // 32) * 32).sum())  # w2 drops the last partial batch
        steps = np.sort(n // 32)[::-1]
        real += steps.sum()
        all_together += steps.max() * len(steps)
        in_threes += sum(steps[i] * len(steps[i : i + 3]) for i in range(0, len(steps), 3))  # as long as their first
        sequence_of_threes.append(sum(steps[i] for i in range(0, len(steps), 3)))
    assert examples_per_round(sim, config, range(3)) == pytest.approx(np.mean(examples))
    assert useful_step_fraction(sim, config, range(3), 0) == pytest.approx(real / all_together)
    assert useful_step_fraction(sim, config, range(3), 3) == pytest.approx(real / in_threes)
    assert useful_step_fraction(sim, config, range(3), 1) == 1.0
    assert sequential_steps(sim, config, range(3), 3) == pytest.approx(np.mean(sequence_of_threes))
    assert sequential_steps(sim, config, range(3), 1) == pytest.approx(real / 3)


def _trace(device_threads: dict, events: list) -> list[dict]:
    """A Perfetto trace's events: a host process (pid 1), a device process (pid 2) with
    ``device_threads`` ({tid: name}), and ``events`` as (pid, tid, name, start us, duration us)."""
    meta = [{"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "/host:CPU"}},
            {"ph": "M", "name": "process_name", "pid": 2, "args": {"name": "/device:GPU:0"}}]  # fmt: skip
    meta += [
        {"ph": "M", "name": "thread_name", "pid": 2, "tid": t, "args": {"name": n}} for t, n in device_threads.items()
    ]
    return meta + [{"ph": "X", "pid": p, "tid": t, "name": n, "ts": ts, "dur": d} for p, t, n, ts, d in events]


def test_a_profile_counts_the_kernels_on_the_devices_streams_per_round():
    """Two rounds, 1 ms of wall time, 3 local steps a round in sequence, counted by hand: the
    kernels are the stream threads' events, less copies (a module-level event and host events are
    not kernels); the busy time is the union of the kernels' intervals over the two streams."""
    lines = {10: "Stream #14(Compute)", 11: "Stream #15(MemcpyH2D,Compute)", 12: "XLA Modules"}
    events = [(2, 10, "gemm", 100 * i, 10.0) for i in range(4)]  # at 0, 100, 200, 300: 40 us
    events += [(2, 10, "fusion", 100 * i + 50, 2.0) for i in range(6)]  # at 50 .. 550: 12 us
    events += [(2, 11, "fusion", 5, 10.0), (2, 11, "fusion", 600, 4.0)]  # 5 us past gemm's first, 4 alone
    events += [(2, 11, "fusion", 102, 3.0)]  # within gemm's second: no busy time of its own
    events += [(2, 11, "MemcpyH2D", 700, 5.0)] * 2 + [(2, 12, "jit_round", 0, 900.0)] * 2
    events += [(1, 5, "PjitFunction", 0, 500.0)]
    got = summarize(_trace(lines, events), rounds=2, wall_seconds=1e-3, sequential_steps=3)
    assert got["kernels_per_round"] == 6.5  # (4 + 6 + 3) / 2
    assert got["kernel_ms_per_round"] == pytest.approx((40 + 12 + 17) / 2 / 1e3)
    assert got["busy_ms_per_round"] == pytest.approx((40 + 12 + 5 + 4) / 2 / 1e3)
    assert got["device_busy_fraction"] == pytest.approx(61e-6 / 1e-3)
    assert (got["copies_per_round"], got["copy_ms_per_round"]) == (1, pytest.approx(5 / 1e3))
    assert got["kernels_per_sequential_step"] == pytest.approx(6.5 / 3)
    assert got["device_events"] == 17  # every device thread's, the module line's too
    assert [k["name"] for k in got["top_kernels"]] == ["gemm", "fusion"]
    assert got["top_kernels"][0] == {"name": "gemm", "per_round": 2, "us_per_round": 20, "us_each": 10}
    assert got["threads"]["/device:GPU:0 / XLA Modules"] == {"events": 2, "ms": 1.8}
    assert not got["truncated"]
    # a device that names no streams (a TPU): its op line's events are its kernels, not the module line's
    ops = summarize(_trace({10: "XLA Ops", 12: "XLA Modules"}, [events[0], events[-2]]), 1, 1e-3, 0)
    assert ops["kernels_per_round"] == 1 and ops["kernels_per_sequential_step"] is None
    assert summarize(_trace({}, [(1, 5, "PjitFunction", 0, 500.0)]), 1, 1e-3, 1)["device_events"] == 0


def test_a_profile_counts_the_local_steps_of_the_rounds_it_traced(monkeypatch):
    """``jaxfed bench --profile`` traces the timed calls again from a warm-up call: the local steps
    in sequence it divides by are those of the traced rounds (here rounds 1-5 of one round a call,
    clients one at a time: all their steps), each client's written out from its examples (clients
    of different sizes, so that other rounds would give another count)."""
    from jaxfed.cli.bench import profile as profiling

    traced = []

    def trace_calls(call, calls, directory):
        traced.extend(int(call()[0].round) for _ in range(calls))
        return _trace({10: "Stream #1"}, [(2, 10, "gemm", 0, 10.0)] * 10), 1e-3

    monkeypatch.setattr(profiling, "trace_calls", trace_calls)
    config = workload_config("w2", [*TINY_W2, "partition=dirichlet", "alpha=0.3", "min_examples=5"])
    sim = build(config).simulation
    timed = {"rounds_per_timed_call": 1, "timed_calls": 5, "round_seconds_median": 4e-3}
    profile = profile_rounds(sim, config, timed, directory="unused")
    assert traced == [2, 3, 4, 5, 6]  # the round counter after each call: rounds 1-5 ran
    counts = np.asarray(sim.data.train_count)
    steps = [(counts[sim.sampled_ids(t)] // 32).sum() for t in range(7)]
    assert profile["sequential_steps_per_round"] == pytest.approx(np.mean(steps[1:6]))
    assert np.mean(steps[1:6]) not in (np.mean(steps[0:5]), np.mean(steps[2:7]))
    assert profile["kernels_per_round"] == 2
    assert profile["kernel_share_of_timed_round"] == pytest.approx(20e-6 / 4e-3)  # 20 us of kernels a 4 ms round


def test_bench_runs_a_small_workload_and_reports_every_measure(tmp_path, capsys):
    out = tmp_path / "bench.json"
    args = ["bench", "w2", "--rounds", "2", "--baseline", "none", "--json", str(out)]
    assert main([*args, *(x for pair in TINY_W2 for x in ("--set", pair))]) == 0
    result = json.loads(out.read_text())
    for key in ("compile_seconds", "round_seconds_median", "examples_per_second", "achieved_gflops",
                "matmul_peak_gflops", "eval_all_clients_seconds", "host_peak_rss_bytes"):  # fmt: skip
        assert result[key] > 0, key
    assert result["examples_per_round"] == 10 * 32  # 10 clients of 40 examples, one full batch each
    assert "s/round" in capsys.readouterr().out


def test_bench_profile_writes_a_trace_and_says_a_cpu_has_no_device_kernels(tmp_path, capsys):
    trace = tmp_path / "trace"
    args = [
        "bench",
        "w2",
        "--rounds",
        "2",
        "--baseline",
        "none",
        "--profile",
        str(trace),
        "--json",
        str(tmp_path / "r"),
    ]
    assert main([*args, *(x for pair in TINY_W2 for x in ("--set", pair))]) == 0
    profile = json.loads((tmp_path / "r").read_text())["profile"]
    assert profile["device_events"] == 0 and profile["trace_dir"] == str(trace)
    assert list(trace.rglob("perfetto_trace.json.gz"))
    assert "profile: no device events in the trace (on a CPU" in capsys.readouterr().out


def test_bench_refuses_the_torch_baseline_for_other_algorithms_and_models(capsys, tmp_path):
    assert main(["bench", "w2", "--set", "algorithm=fedprox", "--baseline", "torch", *("--set", TINY_W2[0])]) == 2
    assert "--baseline: torch runs fedavg only" in capsys.readouterr().err
    net = tmp_path / "net.py"
    net.write_text("import flax.linen as nn\nclass Net(nn.Module):\n    @nn.compact\n    def __call__(self, x):\n"
                   "        return nn.Dense(10)(x.reshape(x.shape[0], -1))\n")  # fmt: skip
    assert main(["bench", "w2", "--set", f"model={net}:Net", "--baseline", "torch"]) == 2  # before any timing
    assert f"not model '{net}:Net'; use --baseline none" in capsys.readouterr().err


UNTWINNED = ["weight_decay=0.0001", "clip_norm=1.0", "lr_schedule=cosine", "server_optimizer=adam"]
UNTWINNED += ["client_optimizer=adam"]


@pytest.mark.parametrize("setting", UNTWINNED)
def test_bench_refuses_a_torch_baseline_that_would_do_other_work(setting, capsys):
    """The PyTorch loop is plain SGD (with momentum) at a constant lr and a plain average: with
    any other setting it compared different work and said nothing."""
    assert main(["bench", "w2", "--set", setting, "--baseline", "torch", "--set", TINY_W2[0]]) == 2
    err = capsys.readouterr().err
    assert err.startswith("jaxfed: error: --baseline: the torch loop runs plain SGD") and setting in err


def test_the_torch_loop_runs_jaxfeds_rounds_or_the_baseline_rounds_asked(monkeypatch, capsys):
    """The PyTorch loop (a stand-in recording its rounds, so this runs without torch) runs as many
    rounds as jaxfed did (the warm-up call and the timed ones), or ``--baseline-rounds``; the
    summary compares global accuracies "after the same rounds" only when they are."""
    from jaxfed.cli.bench import torch_loop

    asked = []

    def loop(sim, config, rounds, hidden, initial_params=None):
        asked.append(rounds)
        return {"device": "cpu", "threads": 1, "round_seconds_median": 1.0, "global_acc": 0.5,
                "eval_all_clients_seconds": 1.0}  # fmt: skip

    monkeypatch.setattr(torch_loop, "require_torch", lambda: None)
    monkeypatch.setattr(torch_loop, "fedavg_rounds", loop)
    tiny = [x for pair in TINY_W2 for x in ("--set", pair)]
    assert main(["bench", "w2", "--rounds", "2", *tiny]) == 0
    assert "after the same rounds" in capsys.readouterr().out
    assert main(["bench", "w2", "--rounds", "2", "--baseline-rounds", "1", *tiny]) == 0
    assert "torch 0.5000 after 1" in capsys.readouterr().out
    assert main(["bench", "w2", "--rounds", "10", *tiny, "--set", "rounds_per_call=5"]) == 0
    # --rounds 2 at rounds_per_call 1: a warm-up call of 1 round, then at least MIN_TIMED_CALLS (5) timed calls;
    # --rounds 10 at rounds_per_call 5: calls of 10 // 5 = 2 rounds, the warm-up one and 5 timed
    assert asked == [6, 1, 12]
    for flags, message in [
        (["--baseline-rounds", "-1"], "--baseline-rounds: -1; allowed: 0 (as many as jaxfed ran) or more"),
        (["--baseline", "none", "--baseline-rounds", "3"], "--baseline-rounds: 3 rounds of no baseline; it needs"),
        (["--rounds", "0"], "jaxfed: error: --rounds: 0; allowed: 1 or more (rounds timed)"),
    ]:
        assert main(["bench", "w2", *flags, *tiny]) == 2
        err = capsys.readouterr().err
        assert message in err and len(err.splitlines()) == 1, err
    assert asked == [6, 1, 12]  # refused before any timing


def test_the_torch_baseline_without_pytorch_is_one_line_before_any_timing(monkeypatch, capsys):
    """It exited 1 with its own prefix; now the CLI's one line and exit 2, as any mistake."""
    import builtins

    real_import = builtins.__import__

    def no_torch(name, *args, **kwargs):
        if name == "torch":
            raise ImportError("No module named 'torch'")
        return real_import(name, *args, **kwargs)

    timed = []
    monkeypatch.setattr(builtins, "__import__", no_torch)
    monkeypatch.setattr("jaxfed.cli.bench.time_rounds", lambda *a: timed.append(a))
    assert main(["bench", "w2", *[x for pair in TINY_W2 for x in ("--set", pair)]]) == 2
    err = capsys.readouterr().err
    assert (
        err
        == (
            "jaxfed: error: --baseline: torch needs PyTorch (pip install -e '.[bench]', or pip install torch); "
            "or pass --baseline none\n"
        )
        and not timed
    )


@pytest.mark.parametrize("name, shape", [("cnn", (28, 28, 1)), ("mlp", (8, 8, 1)), ("resnet8", (32, 32, 3))])
def test_the_torch_twin_from_jaxfed_weights_computes_the_same_outputs(name, shape):
    torch = pytest.importorskip("torch", reason="the PyTorch baseline is a benchmark extra (pip install torch)")
    import jax

    from jaxfed.cli.bench.torch_loop import copy_jax_params, torch_model
    from jaxfed.nn import get_model

    model = get_model(name, shape, 10)
    variables = model.init(jax.random.key(0))
    noise = np.random.default_rng(1)  # every parameter moved off its init (norm scales 1, biases 0)
    variables = jax.tree.map(lambda a: a + np.float32(0.1) * noise.normal(size=a.shape).astype(np.float32), variables)
    twin = torch_model(name, shape, 10)
    copy_jax_params(twin, variables["params"])
    x = np.random.default_rng(0).normal(size=(3, *shape)).astype(np.float32)
    expected = np.asarray(model.apply(variables, x)[0])
    with torch.no_grad():
        got = twin(torch.from_numpy(np.ascontiguousarray(np.moveaxis(x, -1, 1)))).numpy()
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-5)


def test_a_step_counts_the_models_own_multiply_adds():
    """The FedAvg CNN's step, written out: forward 2 x MACs per layer; backward the weight
    gradients (as many) and the input gradients of every layer but the first."""
    from jaxfed.cli.bench.flops import model_step_flops
    from jaxfed.nn import get_model

    conv1, conv2 = 24 * 24 * 32 * 5 * 5 * 1, 8 * 8 * 64 * 5 * 5 * 32  # VALID 5x5 convs on 28x28x1, 12x12x32
    fc1, head = 4 * 4 * 64 * 512, 512 * 10
    forward = 2 * (conv1 + conv2 + fc1 + head)
    for conv in ("xla", "patches"):  # either implementation: the same arithmetic
        model = get_model("cnn", (28, 28, 1), 10, conv=conv)
        assert model_step_flops(model, (28, 28, 1), 4) / 4 == 3 * forward - 2 * conv1, conv


@pytest.mark.parametrize("stride, padding", [(1, "SAME"), (2, "SAME"), (2, "VALID"), (1, ((2, 0), (1, 3)))])
def test_a_convolutions_count_skips_padding_and_dilation_holes(stride, padding):
    """Forward and both gradients of a conv against a brute-force count of the multiply-adds
    whose input element is real (a numpy loop over output positions and kernel taps)."""
    import jax
    import jax.numpy as jnp

    from jaxfed.cli.bench.flops import jaxpr_flops

    x = jnp.ones((2, 9, 7, 3))
    w = jnp.ones((3, 4, 3, 5))
    conv = lambda x, w: jax.lax.conv_general_dilated(  # noqa: E731
        x, w, (stride, stride), padding, dimension_numbers=("NHWC", "HWIO", "NHWC")
    )
    out = conv(x, w)
    pads = (
        jax.lax.padtype_to_pads(x.shape[1:3], w.shape[:2], (stride, stride), padding)
        if isinstance(padding, str)
        else padding
    )
    macs = 0
    for i in range(out.shape[1]):
        for j in range(out.shape[2]):
            for a in range(w.shape[0]):
                for b in range(w.shape[1]):
                    r, c = i * stride + a - pads[0][0], j * stride + b - pads[1][0]
                    macs += 0 <= r < x.shape[1] and 0 <= c < x.shape[2]
    macs *= x.shape[0] * w.shape[2] * w.shape[3]
    assert jaxpr_flops(jax.make_jaxpr(conv)(x, w).jaxpr) == 2 * macs
    grads = jax.make_jaxpr(jax.grad(lambda x, w: conv(x, w).sum(), argnums=(0, 1)))(x, w)
    assert jaxpr_flops(grads.jaxpr) == 3 * 2 * macs  # forward, input gradient, weight gradient: the same MACs


@pytest.mark.parametrize("name", ["resnet8", "cnn4"])
def test_a_same_padded_patches_convolution_counts_as_the_xla_convolution(name):
    """The FLOP count does not depend on the convolution's lowering and leaves out the padding's
    multiply-adds: counted from its matmul, the default patches convolution (the padded input,
    then one dot_general) counted them (resnet8, W4's model, 1.08x the lax.conv count, cnn4 1.21x)."""
    shape = (32, 32, 3)
    counts = {conv: model_step_flops(get_model(name, shape, 10, conv=conv), shape, 2) for conv in ("patches", "xla")}
    assert counts["patches"] == counts["xla"]


@pytest.mark.parametrize("setting", ["matmul_precision=highest", "client_state=host"])
def test_the_timed_evaluation_of_every_client_compiles_nothing(monkeypatch, setting):
    """time_rounds warmed up ``sim._eval`` outside ``sim.precision()`` and past the host-held
    path, so ``eval_all_clients_seconds`` timed a compilation (0.97 s against 0.002 s)."""
    compiles_per_call = []  # one list per evaluate call, the last the timed one
    evaluate = Simulation.evaluate

    def watched(self, state):
        compiles_per_call.append([])
        return evaluate(self, state)

    def record(event, duration, **_):
        if compiles_per_call and "backend_compile" in event:
            compiles_per_call[-1].append(event)

    monkeypatch.setattr(Simulation, "evaluate", watched)
    jax.monitoring.register_event_duration_secs_listener(record)
    try:
        time_rounds(workload_config("w2", [*TINY_W2, setting]), 1)
    finally:
        jax.monitoring.unregister_event_duration_listener(record)
    assert len(compiles_per_call) >= 2 and compiles_per_call[-1] == []


def test_useful_steps_follow_the_clients_each_device_runs():
    """With D devices the engine deals the size-ordered clients round-robin (padded with
    step-less dummies to a multiple of D) and each device runs its own chunks
    (ClientStrategy.run_order), as fastest_chunk models; useful_step_fraction and sequential_steps
    grouped every client as if on one device."""
    config = workload_config("w2", TINY_W2)  # batch 32, drop_last, one epoch
    counts = 32 * np.array([20, 10, 1, 1])  # 20, 10, 1, 1 steps
    sim = SimpleNamespace(data=SimpleNamespace(train_count=counts), sampled_ids=lambda t: np.arange(4), num_devices=2)
    # device 0 runs [20, 1], device 1 [10, 1]: all vmapped, 2 x 20 + 2 x 10 steps run for 32 real (not 4 x 20)
    assert useful_step_fraction(sim, config, range(1), 0) == pytest.approx(32 / 60)
    assert useful_step_fraction(sim, config, range(1), 1) == 1.0
    # one after another: device 0 runs 20 then 1 step one at a time, 20 at once; the busiest device counts
    assert sequential_steps(sim, config, range(1), 1) == 21  # one device's sequence would be 32
    assert sequential_steps(sim, config, range(1), 0) == 20
