"""What a run and a report write: the best value past a NaN evaluation, a regression report's best MSE,
the report curve over every seed (each test failed before its fix)."""

import json
import math

from jaxfed.cli.report import collect, per_seed_records
from jaxfed.runs.rundir import task_summary


def _rows(values, kind="mse"):
    return [
        {"round": i + 1, f"personalized_{kind}_mean": v, f"personalized_{kind}_weighted": v,
         f"personalized_{kind}_std": 0.0, f"global_{kind}": v}
        for i, v in enumerate(values)
    ]  # fmt: skip


def test_best_ignores_a_nan_evaluation_whatever_its_position():
    # min()/max() over a list holding NaN depend on where the NaN is: [nan, 1.0] gave nan
    for values in ([math.nan, 1.0, 2.0], [1.0, math.nan, 2.0], [2.0, 1.0, math.nan]):
        best = task_summary(_rows(values))
        assert best["best_personalized_mse"] == 1.0, values
        assert best["best_global_mse"] == 1.0, values
    for values in ([math.nan, 0.9, 0.5], [0.5, 0.9, math.nan]):
        assert task_summary(_rows(values, "acc"))["best_personalized_acc"] == 0.9, values


def test_report_records_of_a_regression_run_carry_its_best_mse(tmp_path):
    run = tmp_path / "v"
    run.mkdir()
    (run / "config.json").write_text(json.dumps({"algorithm": "fedavg", "seed": 0}))
    (run / "metrics.jsonl").write_text(json.dumps({"round": 1, "personalized_mse_mean": 0.5}) + "\n")
    summary = {"task": "regression", "personalized_mse_mean": 0.5, "global_mse": 0.6,
               "best_personalized_mse": 0.4, "bytes_up_total": 1.0, "bytes_total": 2.0}  # fmt: skip
    (run / "summary.json").write_text(json.dumps(summary))
    (record,) = per_seed_records(collect({"v": run}))
    assert record.get("best_personalized_mse") == 0.4


def test_report_curve_is_a_mean_over_every_seed_not_whichever_evaluated_that_round(tmp_path, monkeypatch):
    # eval_every changes no number (NEUTRAL_KEYS), so one variant's seeds may evaluate at different
    # rounds; a round only one seed evaluated was drawn as "the mean over seeds" with a zero band
    from matplotlib.axes import Axes

    from jaxfed.cli.report import plot

    for seed, every in ((0, 5), (1, 2)):
        run = tmp_path / "v" / f"seed{seed}"
        run.mkdir(parents=True)
        (run / "config.json").write_text(json.dumps({"algorithm": "fedavg", "seed": seed, "eval_every": every}))
        rows = [{"round": r, "personalized_acc_mean": r / 10 + seed} for r in range(every, 11, every)]
        (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        (run / "summary.json").write_text(json.dumps({"task": "classification", "personalized_acc_mean": 1.0 + seed}))
    drawn = []
    original = Axes.plot
    monkeypatch.setattr(
        Axes, "plot", lambda self, x, y, *a, **k: drawn.append((list(x), list(y))) or original(self, x, y, *a, **k)
    )
    plot(collect({"v": tmp_path / "v"}), tmp_path / "report.png")
    ((rounds, means),) = drawn
    assert rounds == [10] and means == [1.5]
