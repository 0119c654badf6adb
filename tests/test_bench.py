"""jaxfed bench: the harness's bookkeeping against numbers written out, and a tiny end-to-end run."""

import json

import numpy as np
import pytest

from jaxfed.cli import main
from jaxfed.cli.bench import examples_per_round, useful_step_fraction, workload_config
from jaxfed.runs.build import build

TINY_W2 = ["num_clients=40", "participation=0.25", "client_train_size=40", "rounds_per_call=1"]


def test_examples_and_useful_steps_follow_the_sampled_clients():
    config = workload_config("w2", [*TINY_W2, "partition=dirichlet", "alpha=0.3", "min_examples=5"])
    sim = build(config).simulation
    counts = np.asarray(sim.data.train_count)
    examples, real, all_together, in_threes = [], 0, 0, 0
    for t in range(3):
        n = counts[sim.sampled_ids(t)]
        examples.append(((n // 32) * 32).sum())  # w2 drops the last partial batch
        steps = np.sort(n // 32)[::-1]
        real += steps.sum()
        all_together += steps.max() * len(steps)
        in_threes += sum(steps[i] * len(steps[i : i + 3]) for i in range(0, len(steps), 3))  # as long as their first
    assert examples_per_round(sim, config, range(3)) == pytest.approx(np.mean(examples))
    assert useful_step_fraction(sim, config, range(3), 0) == pytest.approx(real / all_together)
    assert useful_step_fraction(sim, config, range(3), 3) == pytest.approx(real / in_threes)
    assert useful_step_fraction(sim, config, range(3), 1) == 1.0


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


def test_bench_refuses_the_torch_baseline_for_other_algorithms(capsys):
    assert main(["bench", "w2", "--set", "algorithm=fedprox", "--baseline", "torch", *("--set", TINY_W2[0])]) == 2
    assert "--baseline: torch runs fedavg only" in capsys.readouterr().err


@pytest.mark.parametrize("name, shape", [("cnn", (28, 28, 1)), ("mlp", (8, 8, 1))])
def test_the_torch_twin_from_jaxfed_weights_computes_the_same_outputs(name, shape):
    torch = pytest.importorskip("torch", reason="the PyTorch baseline is a benchmark extra (pip install torch)")
    import jax

    from jaxfed.cli.bench.torch_loop import copy_jax_params, torch_model
    from jaxfed.nn import get_model

    model = get_model(name, shape, 10)
    variables = model.init(jax.random.key(0))
    twin = torch_model(name, shape, 10)
    copy_jax_params(twin, variables["params"])
    x = np.random.default_rng(0).normal(size=(3, *shape)).astype(np.float32)
    expected = np.asarray(model.apply(variables, x)[0])
    with torch.no_grad():
        got = twin(torch.from_numpy(np.ascontiguousarray(np.moveaxis(x, -1, 1)))).numpy()
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-5)
