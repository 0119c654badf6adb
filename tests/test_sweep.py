"""``jaxfed sweep``: members differing in seed and lr, run as one vmapped program, write what
``jaxfed run`` writes for each of them, with the same numbers."""

import json

import jax
import numpy as np
import pytest
from conftest import MODEL_NEEDS, flip_state_byte, make_federation
from conftest import metrics_rows as rows

from jaxfed.algorithms import registry
from jaxfed.cli import main
from jaxfed.errors import ConfigError, NonFiniteUpdateError
from jaxfed.runs.build import build
from jaxfed.runs.checkpoint import RunCheckpoints
from jaxfed.runs.config import Config
from jaxfed.runs.driver import run
from jaxfed.runs.fingerprint import fingerprint
from jaxfed.runs.rundir import RunDirectory
from jaxfed.runs.sweep import (
    Sweep,
    check_sweepable,
    member_name,
    resume_batches,
    run_grid,
    run_sweep,
    shape_groups,
    stack_data,
    sweep_configs,
    traceable_keys,
)

TINY = ["num_clients=12", "participation=0.5", "rounds=2", "eval_every=1", "rounds_per_call=1", "checkpoint_every=2"]


def test_the_grid_and_its_directory_names():
    configs = sweep_configs(Config().with_overrides(TINY), seeds=[0, 1], lrs=[0.05, 0.2])
    assert [(c.seed, c.options.lr) for c in configs] == [(0, 0.05), (0, 0.2), (1, 0.05), (1, 0.2)]
    assert [member_name(c) for c in configs] == ["seed0_lr0.05", "seed0_lr0.2", "seed1_lr0.05", "seed1_lr0.2"]


def test_member_names_tell_distinct_values_apart_and_keep_the_short_form_where_it_is_exact():
    base = Config().with_overrides([*TINY, "algorithm=fedprox"])
    close = sweep_configs(base, lrs=[0.1234567, 0.1234568], grid={"mu": ["0.0000012345671", "0.0000012345672"]})
    assert [member_name(c, ["mu"]) for c in close] == [
        f"seed0_lr{lr}_mu{mu}" for lr in ("0.1234567", "0.1234568") for mu in ("1.2345671e-06", "1.2345672e-06")
    ]
    plain = sweep_configs(base, lrs=[0.05, 1e-05, 0.3], grid={"mu": ["0.01", "100000000"]})
    assert [member_name(c, ["mu"]) for c in plain] == [
        f"seed0_lr{lr}_mu{mu}" for lr in ("0.05", "1e-05", "0.3") for mu in ("0.01", "1e+08")
    ]


@pytest.mark.plots
def test_members_match_their_sequential_runs(tmp_path):
    """One after another in one program (member_chunk=1), fedprox's mu traced as lr is (an option
    a round takes as a number: one program for the grid); vmapped members' numbers are checked
    bit for bit in test_vmapped_members_match_each_member_alone_bit_for_bit."""
    base = Config().with_overrides([*TINY, "member_chunk=1", "algorithm=fedprox"])
    # the second member differs from the first (the compiled template) in lr, mu and seed, so in its partition
    configs = [
        base.with_overrides(["seed=0", "lr=0.05", "mu=0.0"]),
        base.with_overrides(["seed=1", "lr=0.2", "mu=0.5"]),
    ]
    assert traceable_keys(configs) == ["lr", "mu"] and shape_groups(configs, ["lr", "mu"]) == [[0, 1]]
    outs, summaries = run_grid(configs, tmp_path / "sweep", ["mu"], progress=False, log=lambda m: None)
    assert [o.name for o in outs] == ["seed0_lr0.05_mu0", "seed1_lr0.2_mu0.5"]  # mu found traceable: one program
    assert summaries[0]["personalized_acc_mean"] != summaries[1]["personalized_acc_mean"]
    alone = run(configs[1], tmp_path / "alone", progress=False)
    swept, single = rows(outs[1]), rows(tmp_path / "alone")
    assert [r["round"] for r in swept] == [r["round"] for r in single] == [1, 2]
    for a, b in zip(swept, single):
        assert a.keys() == b.keys()
        for key in a:  # lr and mu traced instead of folded into the program: equal to float32 rounding
            np.testing.assert_allclose(a[key], b[key], rtol=1e-5, atol=1e-6, err_msg=key)
    assert summaries[1]["personalized_acc_mean"] == pytest.approx(alone["personalized_acc_mean"], abs=1e-6)
    assert json.loads((outs[1] / "config.json").read_text()) == configs[1].to_dict()
    assert (outs[1] / "accuracy.png").exists() and sorted(p.name for p in (outs[1] / "checkpoints").iterdir()) == ["2"]
    # a member is an ordinary run directory: it continues alone
    more = run(configs[1].with_overrides(["rounds=3"]), outs[1], resume=True, progress=False)
    assert more["rounds"] == 3 and [r["round"] for r in rows(outs[1])] == [1, 2, 3]


def test_stack_data_shares_what_is_equal_and_pads_tables(digits):
    a = make_federation(digits, num_clients=5, seed=0, alpha=0.5)
    b = make_federation(digits, num_clients=5, seed=1, alpha=0.5)
    stacked, axes = stack_data([a, b])
    assert axes.x_train is None and axes.y_test is None and axes.train_idx == 0 and axes.train_count == 0
    width = max(a.train_idx.shape[1], b.train_idx.shape[1])
    assert stacked.train_idx.shape == (2, 5, width)
    for i, d in enumerate((a, b)):
        np.testing.assert_array_equal(stacked.train_idx[i, :, : d.train_idx.shape[1]], d.train_idx)
        np.testing.assert_array_equal(stacked.train_count[i], d.train_count)


def test_a_member_that_diverges_stops_the_sweep_with_its_state_saved(tmp_path):
    configs = sweep_configs(Config().with_overrides([*TINY, "rounds=1"]), lrs=[0.05, 1e30])
    outs = [tmp_path / member_name(c) for c in configs]
    with pytest.raises(NonFiniteUpdateError) as err:
        run_sweep(configs, outs, progress=False)
    assert err.value.round == 1 and str(err.value.checkpoint).startswith(str(outs[1]))
    assert int(jax.device_get(err.value.state.round)) == 0
    # every member's state is kept: the good member after its round, the bad one before it
    assert [sorted(p.name for p in (out / "checkpoints").iterdir()) for out in outs] == [["1"], ["0"]]


def test_one_line_errors(tmp_path, capsys):
    base = Config().with_overrides(TINY)
    with pytest.raises(ConfigError, match="differ only in seed, lr; they differ in \\['rounds'\\]"):
        check_sweepable([base, base.with_overrides(["rounds=3"])], ["lr"])
    with pytest.raises(ConfigError, match="--seeds: values repeat"):
        sweep_configs(base, seeds=[1, 1])
    with pytest.raises(ConfigError, match="lr"):
        sweep_configs(base, lrs=[0.1, -1.0])
    assert main(["sweep", "--seeds", "0,x", "--out", str(tmp_path / "s")]) == 2
    assert "--seeds: expected comma-separated int values, got '0,x'" in capsys.readouterr().err
    assert not (tmp_path / "s").exists()
    (tmp_path / "taken" / "seed0_lr0.05").mkdir(parents=True)
    (tmp_path / "taken" / "seed0_lr0.05" / "metrics.jsonl").write_text('{"round": 1}\n')
    assert main(["sweep", "--lrs", "0.05", "--out", str(tmp_path / "taken"), "--set", "rounds=1"]) == 2
    assert "already holds a run" in capsys.readouterr().err


@pytest.mark.parametrize("algorithm", sorted(registry.names()))
def test_every_algorithm_traces_with_a_traced_learning_rate(algorithm):
    """A sweep builds each algorithm with the member's lr as a tracer: no algorithm may need a
    concrete lr (traced only, not compiled: a Python-level use of lr fails here)."""
    config = Config().with_overrides([*TINY, f"algorithm={algorithm}", *MODEL_NEEDS.get(algorithm, [])])
    sweep = Sweep(sweep_configs(config, lrs=[0.05, 0.1]))
    states = jax.eval_shape(sweep.init)
    _, metrics = jax.eval_shape(sweep.members_run(1), sweep.seeds, sweep.values, states, sweep.data)
    assert metrics["train_loss"].shape == (2, 1)


@pytest.mark.parametrize(
    "grid, expected",
    [
        ("mu", "--grid: expected KEY=V1,V2,..., got 'mu'"),
        ("seed=1,2", "--grid: sweep seed with --seeds"),
        ("mu=0.1,0.1", "--grid mu: values repeat"),
        ("colour=1,2", "colour"),
    ],
)
def test_grid_mistakes_are_one_line(grid, expected, tmp_path, capsys):
    assert main(["sweep", "fedprox", "--grid", grid, "--out", str(tmp_path / "s"), "--set", "rounds=1"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and expected in err


def test_members_still_to_run_go_on_in_one_program_per_shape_group_and_round():
    groups = [[0, 1, 2, 3], [4, 5], [6]]
    points = [2, 0, 2, None, None, None, 0]  # None: finished; 0: never started (or before a checkpoint)
    assert resume_batches(groups, points) == [[0, 2], [1], [6]]


RESUMED = ["num_clients=8", "participation=0.5", "rounds=4", "eval_every=1", "rounds_per_call=1", "checkpoint_every=2"]


def _sweep(out, *more) -> list[str]:
    grid = ["--seeds", "0,1", "--grid", "momentum=0.0,0.5"]  # two shape groups of two members
    return ["sweep", "--quiet", *grid, "--out", str(out), "--set", *RESUMED, *more]


def test_an_interrupted_sweep_goes_on_with_its_command_plus_resume_bit_for_bit(tmp_path, capsys, monkeypatch):
    """momentum picks optax.sgd(momentum=momentum or None), a key used in Python control flow: not
    traceable, so each of its values is a group of its own, one compiled program each."""
    alone, out = tmp_path / "alone", tmp_path / "sweep"
    assert traceable_keys(sweep_configs(Config(), seeds=[0], grid={"momentum": ["0.0", "0.5"]})) == []
    assert main(_sweep(alone)) == 0
    groups = [line for line in capsys.readouterr().err.splitlines() if line.startswith("sweep group")]
    assert groups == [f"sweep group {i}/2: 2 member(s), one compiled program" for i in (1, 2)]
    member = alone / "seed0_lr0.05_momentum0.5"  # the second group's program: the member as its run alone
    run(Config.from_dict(json.loads((member / "config.json").read_text())), tmp_path / "single", progress=False)
    for got, want in zip(rows(member), rows(tmp_path / "single"), strict=True):
        # the evaluation's loss sums two members' clients at once: in another order, to the last bits
        assert got.pop("personalized_loss") == pytest.approx(want.pop("personalized_loss"), rel=1e-6)
        assert got == want
    names = sorted(p.name for p in alone.iterdir())
    calls, run_rounds, save = [0], Sweep.run_rounds, RunCheckpoints.save

    def interrupted(self, states, num_rounds):
        calls[0] += 1
        if calls[0] == 7:  # group 1 done (4 calls), group 2 checkpointed at round 2
            raise KeyboardInterrupt
        return run_rounds(self, states, num_rounds)

    with monkeypatch.context() as patch:
        patch.setattr(Sweep, "run_rounds", interrupted)
        patch.setattr(RunCheckpoints, "save", lambda self, *args: (save(self, *args), self.wait()))  # whole before ^C
        assert main(_sweep(out)) == 130
    done = {
        name: sorted(p.name for p in (out / name / "checkpoints").iterdir()) for name in names if (out / name).exists()
    }
    assert done == {
        f"seed{s}_lr0.05_momentum{m}": rounds for s in (0, 1) for m, rounds in (("0", ["2", "4"]), ("0.5", ["2"]))
    }
    finished = {name: (out / name / "summary.json").read_text() for name in names if name.endswith("momentum0")}
    capsys.readouterr()
    assert main(_sweep(out)) == 2  # the same command: refused, pointing to --resume
    assert "already holds a run; continue the sweep with --resume" in capsys.readouterr().err
    assert main(_sweep(out, "--resume")) == 0
    err = capsys.readouterr().err
    assert err.count("resuming from round 2") == 2 and "sweep group" not in err  # one program
    assert {name: (out / name / "summary.json").read_text() for name in finished} == finished  # skipped
    for name in names:
        assert rows(out / name) == rows(alone / name), name


def test_a_finished_sweep_resumed_is_skipped_or_extended_and_mistakes_are_one_line(tmp_path, capsys):
    out = tmp_path / "sweep"
    args = ["sweep", "--quiet", "--seeds", "0,1", "--out", str(out), "--set", *RESUMED, "rounds=2"]
    assert main(args) == 0
    member = out / "seed0_lr0.05"
    cases = [
        (["sweep", "--resume"], "--resume: needs --out DIR, the sweep's directory to continue"),
        (["sweep", "--resume", "--out", str(tmp_path / "none")], f"--resume: {tmp_path / 'none'} does not exist"),
        ([*args, "participation=0.25", "--resume"], f"differs from {member}'s in participation (0.5 -> 0.25)"),
        ([*args, "rounds=1", "--resume"], "rounds: 1 is fewer than the 2 rounds the checkpoint has done"),
        # a command naming none of the members (as `jaxfed run --out R --resume` may) started a new sweep beside them
        ([*args, "--seeds", "0", "--lrs", "0.1", "--resume"], "none of this sweep's members"),
        (
            ["run", "--quiet", "--resume", "--out", str(out)],
            f"--resume: {out} is a sweep's directory (it holds the run directories seed0_lr0.05, seed1_lr0.05); "
            f"continue the sweep with `jaxfed sweep ... --out {out} --resume` (its command plus --resume), or one "
            f"member with `jaxfed run --out {member} --resume`",
        ),
    ]
    capsys.readouterr()
    before = sorted(p.name for p in out.iterdir())
    for command, expected in cases:
        assert main(command) == 2, command
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and expected in err, err
    assert sorted(p.name for p in out.iterdir()) == before
    _, record = RunDirectory(member).newest_checkpoint_record()
    alone = build(Config.from_dict(json.loads((member / "config.json").read_text()))).simulation
    assert record["fingerprint"] == fingerprint(alone)  # what `jaxfed run --resume` of the member compares
    assert main([*args, "--resume"]) == 0  # every member finished: nothing runs
    assert "seed1_lr0.05: personalized acc" in capsys.readouterr().out
    finished = (member / "summary.json").read_text()
    assert main([*args, "--seeds", "0,1,2", "--resume"]) == 0  # a member never started starts
    assert "resuming" not in capsys.readouterr().err and (member / "summary.json").read_text() == finished
    assert [r["round"] for r in rows(out / "seed2_lr0.05")] == [1, 2]
    assert main([*args, "rounds=3", "--resume"]) == 0  # resumable keys may change: rounds extends every member
    assert capsys.readouterr().err.count("resuming from round 2") == 2
    three = rows(member)
    assert [[r["round"] for r in rows(out / name)] for name in ("seed0_lr0.05", "seed1_lr0.05")] == [[1, 2, 3]] * 2
    flip_state_byte(member / "checkpoints" / "3")  # its record reads, its state does not: found when restoring
    assert main([*args, "rounds=4", "--resume"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert "Traceback" not in "".join(err) and err[-1] == (
        "jaxfed: error: sweep: members at different rounds (seed0_lr0.05 2, seed1_lr0.05 3) cannot run as one "
        "compiled sweep: a member new to the grid starts at round 0 (run new members as a sweep into another out), "
        "or an unreadable checkpoint was set aside (run the same command again to go on from the rounds that read)"
    )
    assert main([*args, "rounds=4", "--resume"]) == 0  # one program from round 2, one from round 3
    assert rows(member)[:3] == three and [r["round"] for r in rows(out / "seed1_lr0.05")] == [1, 2, 3, 4]


def test_vmapped_members_match_each_member_alone_bit_for_bit():
    """Members vmapped, clients one at a time (CPU's default; the members' clients run as one
    client axis, each upload summed into its own member's total): each member's rounds (states,
    metrics) are exactly its simulation's alone. (Client states are scattered outside the
    strategy's client map, as before; the map itself is tested in test_engine.py.)"""
    base = Config().with_overrides([*TINY, "client_chunk=1", "member_chunk=0"])
    configs = sweep_configs(base, seeds=[0, 1], lrs=[0.05, 0.2])[1:3]  # seed 0 lr 0.2, seed 1 lr 0.05
    sweep = Sweep(configs)
    states, metrics = sweep.run_rounds(sweep.init(), 2)
    for m, config in enumerate(configs):
        alone = build(config).simulation
        state, rows_alone = alone.run_rounds(alone.init(), 2)
        for got, want in zip(jax.tree.leaves(sweep.member(states, m)), jax.tree.leaves(state)):
            np.testing.assert_array_equal(got, want)
        assert metrics[m].keys() == rows_alone.keys()
        for key, want in rows_alone.items():
            np.testing.assert_array_equal(metrics[m][key], want, err_msg=key)


def test_a_sweep_of_a_user_built_simulation_runs_each_member_as_it_runs_alone(digits, mlp, tmp_path):
    """Sweep.of_simulation: research code's own simulation (its algorithm built by a function of
    the swept lr, each seed on its own partition) driven into one run directory per member; each
    member (differing from the template simulation in lr, and the second in seed and data too)
    gives the rows of its simulation run alone, and jaxfed report pools the two seeds."""
    from jaxfed.algorithms.fedavg import fedavg
    from jaxfed.cli.report import collect
    from jaxfed.runs.driver import run_simulation
    from jaxfed.runs.rundir import LoopSettings
    from jaxfed.runs.sweep import run_simulation_sweep
    from jaxfed.simulation import Simulation

    datas = {seed: make_federation(digits, num_clients=6, seed=seed, alpha=0.5) for seed in (0, 1)}

    def algorithm(lr):
        return fedavg(mlp, lr=lr, local_epochs=1, batch_size=32)

    def simulation(seed, lr):
        return Simulation(algorithm(lr), mlp, datas[seed], participation=0.5, seed=seed, client_chunk=1)

    sim = simulation(0, 0.01)  # the template: its lr is not the members'
    sweep = Sweep.of_simulation(sim, seeds=[0, 1], values={"lr": [0.2]}, algorithm=algorithm, data=datas)
    settings = LoopSettings(rounds=1, eval_every=1, rounds_per_call=1, checkpoint_every=1)
    outs, summaries = run_simulation_sweep(sweep, tmp_path / "sweep", settings, progress=False, log=lambda m: None)
    assert [o.name for o in outs] == ["seed0_lr0.2", "seed1_lr0.2"] and not sim.strategy.members_as_clients
    for m, seed in enumerate((0, 1)):
        run_simulation(simulation(seed, 0.2), tmp_path / f"alone{seed}", settings, progress=False, log=print)
        swept, single = rows(outs[m]), rows(tmp_path / f"alone{seed}")
        assert [r["round"] for r in swept] == [r["round"] for r in single] == [1]
        assert swept[0].keys() == single[0].keys()
        for key in swept[0]:  # lr traced instead of folded into the program: equal to float32 rounding
            np.testing.assert_allclose(swept[0][key], single[0][key], rtol=1e-5, atol=1e-6, err_msg=key)
    assert summaries[0]["personalized_acc_mean"] != summaries[1]["personalized_acc_mean"]  # the seeds differ
    for m, seed in enumerate((0, 1)):  # each member records the simulation it is, as run_simulation does alone
        config = json.loads((outs[m] / "config.json").read_text())
        assert config == json.loads((tmp_path / f"alone{seed}" / "config.json").read_text())
    assert config["seed"] == 1 and config["options"]["lr"] == 0.2 and config["participation"] == 0.5
    assert [(v.name, v.seeds) for v in collect({"s": tmp_path / "sweep"})] == [("s", [0, 1])]
    swapped = Sweep.of_simulation(sim, [0, 1], {"lr": [0.2]}, algorithm, data={0: datas[1], 1: datas[0]})
    with pytest.raises(ConfigError, match=r"differs from the one that wrote .*seed0_lr0.2 in partition \('#"):
        run_simulation_sweep(swapped, tmp_path / "sweep", settings._replace(rounds=2), resume=True, progress=False)
    assert [p.name for p in (outs[0] / "checkpoints").iterdir()] == ["1"]
    # a member continues alone as the simulation it is (its options hold its swept lr)
    run_simulation(simulation(1, 0.2), outs[1], settings._replace(rounds=2), resume=True, progress=False, log=print)
    assert [r["round"] for r in rows(outs[1])] == [1, 2]


def test_a_sweep_of_a_simulation_says_what_it_needs_in_one_line(digits_federation, mlp):
    from jaxfed.algorithms.fedavg import fedavg
    from jaxfed.simulation import Simulation

    sim = Simulation(fedavg(mlp, lr=0.05), mlp, digits_federation)
    cases = [
        ({"seeds": [0, 0]}, "seeds: values repeat in [0, 0]"),
        ({"seeds": [-1]}, "seeds: expected one or more ints in [0, 2**32), got [-1]"),
        ({"values": {"lr": [0.1]}}, "algorithm: values ['lr'] are swept, so give algorithm="),
        ({"values": {"lr": ["0.1"]}, "algorithm": len}, "values['lr']: expected one or more numbers"),
        ({"values": {"seed": [1]}, "algorithm": len}, "values: 'seed' is not a keyword the algorithm can take"),
        ({"data": {}}, "data: no FederatedData for seed(s) [0]"),
    ]
    for arguments, expected in cases:
        with pytest.raises(ConfigError) as err:
            Sweep.of_simulation(sim, **arguments)
        assert expected in str(err.value) and "\n" not in str(err.value)
    # a swept value the algorithm needs as a Python number: JAX's five-line ConcretizationTypeError before
    for needs_a_number in (
        lambda lr: fedavg(mlp, lr=lr, local_epochs=int(lr) + 1),  # a loop count
        lambda lr: fedavg(mlp, lr=lr if lr > 0.5 else 0.1),  # an if
    ):
        sweep = Sweep.of_simulation(sim, values={"lr": [0.1]}, algorithm=needs_a_number)
        with pytest.raises(ConfigError) as err:
            sweep.init()
        message = str(err.value)
        assert message.startswith("values: the algorithm uses the swept lr as a Python number") and "\n" not in message

    def needs_a_count(lr):  # a bug of the algorithm's own, nothing to do with the sweep: JAX's error, as alone
        algorithm = fedavg(mlp, lr=lr)

        def client_update(message, state, data, rng, info):
            return algorithm.client_update(message, state, data, rng, info) if data.count > 0 else None

        return algorithm._replace(client_update=client_update)

    sweep = Sweep.of_simulation(sim, values={"lr": [0.1]}, algorithm=needs_a_count)
    with pytest.raises(jax.errors.ConcretizationTypeError):
        sweep.run_rounds(sweep.init(), 1)


def test_vmapped_members_vmapping_every_client_run_chunks_of_their_share_instead(digits_federation, mlp):
    """An accelerator's default (every sampled client vmapped at once) under vmapped members: each
    member runs chunks of its share of one member's width (8 sampled, 3 members: chunks of 3), so
    the members' clients side by side are one member's width; a member's numbers stay its own."""
    from jaxfed.algorithms.fedavg import fedavg
    from jaxfed.simulation import ClientStrategy, Simulation

    budget = ClientStrategy(memory_bytes=2**40)  # the chunk chosen to fit: all at once
    sim = Simulation(fedavg(mlp, lr=0.05, local_epochs=1, batch_size=32), mlp, digits_federation, participation=0.8,
                     strategy=budget)  # fmt: skip
    sim.run_rounds(sim.init(), 1)  # a single run fits its chunk to its client sizes; a sweep starts over
    sim.strategy.chunk = 2  # (whatever it fit: 2 here, so that keeping it would show)
    sweep = Sweep.of_simulation(sim, seeds=[0, 1, 2], member_chunk=0)
    assert sim.strategy.sized and sweep.template.strategy.chunk == 3
    given = Simulation(sim.algorithm, mlp, digits_federation, participation=0.8, client_chunk=0)
    assert Sweep.of_simulation(given, seeds=[0, 1], member_chunk=0).template.strategy.chunk == 0  # given: kept
    states, metrics = sweep.run_rounds(sweep.init(), 1)
    alone = sim.variant(jax.random.key(1), sim.algorithm)
    state, want = alone.run_rounds(alone.init(), 1)
    for got, expected in zip(jax.tree.leaves(sweep.member(states, 1)), jax.tree.leaves(state), strict=True):
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(metrics[1]["train_loss"], want["train_loss"], rtol=1e-5)


def test_a_key_that_traces_under_one_value_of_another_swept_key_only_splits_the_grid():
    """server_momentum is never read under server_optimizer=none (it traces there) but is
    ``momentum or None`` under sgd (it does not): tried on the first member only, it was traced
    in every group and the sgd group died with a TracerBoolConversionError; tried in each group,
    the grid runs one program per value."""
    configs = sweep_configs(Config().with_overrides(["num_clients=8", "rounds=1"]),
                            grid={"server_optimizer": ["none", "sgd"], "server_momentum": ["0", "0.9"]})  # fmt: skip
    traced = traceable_keys(configs)
    assert "server_momentum" not in traced
    for group in shape_groups(configs, traced):
        sweep = Sweep([configs[i] for i in group], traced)
        jax.eval_shape(sweep._init, sweep.seeds, sweep.values, None, sweep.data)


def test_a_grid_one_of_whose_groups_cannot_sweep_is_refused_before_any_group_runs(tmp_path, capsys):
    """client_state=host is refused in a sweep: with `--grid client_state=device,host` the device
    group used to run in full before the host group's turn refused it."""
    out = tmp_path / "sweep"
    args = ["sweep", "--quiet", "--out", str(out), "--grid", "client_state=device,host", "--set", *TINY[:3]]
    assert main(args) == 2
    assert "client_state: host is for single runs" in capsys.readouterr().err
    assert not list(out.glob("*/metrics.jsonl"))


def test_members_given_as_dicts_of_run_keys_are_the_configs_they_name(tmp_path):
    """``Sweep`` and ``run_grid`` take dicts of run keys, as ``jaxfed.run`` does (they used to
    fail on ``dict.validate``)."""
    dicts = [{"seed": seed, "rounds": 1, "num_clients": 4, "lr": 0.05} for seed in (0, 1)]
    configs = [Config.of(d) for d in dicts]
    assert Sweep(dicts).members == Sweep(configs).members == [{"seed": 0, "lr": 0.05}, {"seed": 1, "lr": 0.05}]
    outs, summaries = run_grid(dicts, tmp_path / "grid", progress=False, log=lambda line: None)
    assert [json.loads((out / "config.json").read_text())["seed"] for out in outs] == [0, 1]
