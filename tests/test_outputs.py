"""What a run and a report write: the best value past a NaN evaluation, a regression report's best MSE,
the report curve over every seed, standard JSON where a value is not finite (each test failed
before its fix)."""

import json
import math

import numpy as np
import pytest

from jaxfed.cli.report import collect, markdown, parse_claim, per_seed_records, write_report
from jaxfed.runs.rundir import RunDirectory, RunRecord, json_text, task_summary


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


def strict_json(text: str):
    """``text`` parsed as RFC 8259 JSON: NaN, Infinity and -Infinity are not JSON."""

    def refuse(constant):
        raise ValueError(f"not standard JSON: {constant}")

    return json.loads(text, parse_constant=refuse)


def test_json_text_writes_a_number_that_is_not_finite_as_null_anywhere():
    value = {"a": math.nan, "b": [1.5, math.inf, {"c": -math.inf}], "d": (2, np.float64("nan")), "e": "NaN"}
    with pytest.raises(ValueError, match="not standard JSON"):
        strict_json(json.dumps(value))  # what Python's json writes by default
    assert strict_json(json_text(value)) == {"a": None, "b": [1.5, None, {"c": None}], "d": [2, None], "e": "NaN"}


def _round_metrics(train_loss: float) -> dict:
    one = np.array([1.0])
    return {"bytes_up": one, "bytes_down": one, "bytes_down_cached": one, "nonfinite_clients": 0 * one,
            "train_loss": np.array([train_loss])}  # fmt: skip


def test_a_diverging_models_loss_is_null_in_the_rows_metrics_jsonl_and_the_summary(tmp_path):
    record = RunRecord({"algorithm": "fedavg"})
    evaluated = {"personalized_acc_mean": 0.1, "personalized_acc_weighted": 0.1, "personalized_acc_std": 0.0,
                 "personalized_loss": math.nan, "global_acc": 0.1, "global_loss": math.inf}  # fmt: skip
    for round_, train_loss in ((1, 2.0), (2, math.inf)):
        record.add_rounds(_round_metrics(train_loss), 0.1)
        record.add_row(round_, evaluated, wall=1.0)
    assert [(r["personalized_loss"], r["global_loss"], r["train_loss"]) for r in record.rows] == [
        (None, None, 2.0),
        (None, None, None),
    ]  # in memory as in the file: what on_evaluation, the checkpoint and metrics.jsonl get
    run = RunDirectory(tmp_path / "run")
    run.start({"algorithm": "fedavg", "lr": math.inf}, record.rows[:1])
    run.append_row(record.rows[1])
    rows = [strict_json(line) for line in run.metrics_path.read_text().splitlines()]
    assert rows == record.rows and strict_json((run.path / "config.json").read_text())["lr"] is None
    summary = task_summary(record.rows)
    assert summary["best_personalized_acc"] == 0.1 and strict_json(json_text(summary)) == summary


def test_a_record_written_before_null_for_nan_resumes_with_null():
    old = {"rows": [{"round": 1, "personalized_acc_mean": math.nan, "personalized_loss": math.nan}]}
    assert RunRecord({}, old).rows == [{"round": 1, "personalized_acc_mean": None, "personalized_loss": None}]
    assert task_summary(_rows([math.nan, math.nan], "acc"))["best_personalized_acc"] is None


def test_a_report_shows_a_null_metric_and_judges_no_claim_on_it(tmp_path):
    for variant, values in (("a", (0.5, None)), ("b", (0.4, 0.3))):
        for seed, value in enumerate(values):
            run = tmp_path / variant / f"seed{seed}"
            run.mkdir(parents=True)
            (run / "config.json").write_text(json.dumps({"algorithm": variant, "seed": seed}))
            (run / "metrics.jsonl").write_text(json.dumps({"round": 1, "personalized_mse_mean": value}) + "\n")
            summary = {"task": "regression", "personalized_mse_mean": value, "bytes_up_total": 1.0, "bytes_total": 2.0}
            (run / "summary.json").write_text(json.dumps(summary))
    variants = collect({"a": tmp_path / "a", "b": tmp_path / "b"})
    table = markdown(variants, [parse_claim("a>b")])
    assert "| a | 2 | n/a |" in table and "0.5000, null" in table
    assert "| a > b | n/a | n/a | not judged: a run's personalized_mse_mean is null (not finite) | n/a |" in table
    write_report({"a": tmp_path / "a", "b": tmp_path / "b"}, tmp_path / "report")
    records = strict_json((tmp_path / "report" / "report.json").read_text())
    assert [r["personalized_mse_mean"] for r in records] == [0.5, None, 0.4, 0.3]
