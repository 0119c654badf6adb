"""A researcher's own inputs from the command line (issue 34): a Flax module of one's own
(``model=module:Class`` or ``model=path/to/file.py:Class``), a partition of one's own
(``partition=file``, and what ``federate`` refuses) and options named by Python keywords."""

from __future__ import annotations

import dataclasses
import json
import re
import textwrap
from pathlib import Path

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_faults import _one_line_error

from jaxfed.algorithms import registry
from jaxfed.cli import main
from jaxfed.data import PARTITIONERS, DataError, federate, partition, save_partition
from jaxfed.data.federated import index_table
from jaxfed.errors import ConfigError
from jaxfed.nn import get_model
from jaxfed.options import TrainingOptions, at_least, option
from jaxfed.runs.build import build, build_data, build_model
from jaxfed.runs.config import Config
from jaxfed.runs.driver import resume_point
from jaxfed.runs.fingerprint import check_same_simulation
from jaxfed.runs.plots import run_labels
from jaxfed.runs.sweep import member_name, run_grid, sweep_configs

NET = """
import flax.linen as nn


class Net(nn.Module):
    num_classes: int
    width: int = 12

    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Dense(self.width)(x.reshape(x.shape[0], -1)))
        return nn.Dense(self.num_classes)(x)


class Fixed(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(3)(x.reshape(x.shape[0], -1))


class Needs(nn.Module):
    features: int

    def __call__(self, x):
        return x


def helper():
    return None
"""
SMALL = {"num_clients": 3, "participation": 1.0, "rounds": 1, "eval_every": 1, "checkpoint_every": 1}


def _write(path, text=NET):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text))
    return path


def _reference_params(num_classes=10, width=12, shape=(8, 8, 1)):
    """The parameters Net's definition gives for key 0, written out here (not loaded from the spec)."""

    class Net(nn.Module):
        num_classes: int
        width: int = 12

        @nn.compact
        def __call__(self, x):
            x = nn.relu(nn.Dense(self.width)(x.reshape(x.shape[0], -1)))
            return nn.Dense(self.num_classes)(x)

    return Net(num_classes, width).init(jax.random.key(0), jnp.zeros((1, *shape)))


# ----- a model of one's own ------------------------------------------------------------------------


def test_a_model_file_runs_is_recorded_named_and_found_again_on_resume(digits, tmp_path, monkeypatch, capsys):
    _write(tmp_path / "work" / "nets" / "net.py")
    monkeypatch.chdir(tmp_path / "work")
    out = tmp_path / "run"
    settings = [f"{key}={value}" for key, value in SMALL.items()]
    assert main(["run", "--quiet", "--out", str(out), "--set", "model=nets/net.py:Net", *settings]) == 0
    spec = f"{tmp_path / 'work' / 'nets' / 'net.py'}:Net"  # recorded absolute: found from anywhere
    assert "fedavg on digits (net.py:Net, 3 clients, 1 round)" in capsys.readouterr().out  # short, as in plots
    config = json.loads((out / "config.json").read_text())
    assert config["model"] == spec and json.loads((out / "summary.json").read_text())["model"] == spec
    assert run_labels([config]) == ["fedavg model=net.py:Net"]
    assert run_labels([config, {**config, "model": ""}]) == ["fedavg model=net.py:Net", "fedavg model=default"]

    monkeypatch.chdir(tmp_path)  # the relative path names nothing here; the recorded one does
    resumed, _ = resume_point(out)
    model = build_model(resumed, build_data(resumed, load=lambda config: digits))
    assert model.name == spec
    chex.assert_trees_all_equal(model.init(jax.random.key(0)), _reference_params())  # Net(num_classes=10)


def test_only_user_code_is_fingerprinted(tmp_path):
    """A built-in on a built-in model records no file; a plugin's algorithm records its file; a
    function of one's own inside a partial or a record (the aggregation) counts too, and two files
    of one name stay apart."""
    import functools
    import importlib.util
    import sys
    from types import SimpleNamespace

    from jaxfed.algorithms.registry import import_plugin
    from jaxfed.contract import Aggregation
    from jaxfed.runs.fingerprint import code_files

    sim = build(Config(num_clients=3).validate()).simulation
    assert code_files(sim) == {}
    plugin = Path(__file__).parents[1] / "examples" / "scaffold.py"
    import_plugin(str(plugin))
    scaffold = build(Config(algorithm="scaffold", plugins=(str(plugin),), num_clients=3).validate()).simulation
    assert set(code_files(scaffold)) == {str(plugin.resolve())}

    def load(path):
        _write(path, "def apply(server_state, total, info):\n    return server_state\n")
        spec = importlib.util.spec_from_file_location(f"jaxfed_test_code_{path.parent.name}", path)
        module = sys.modules[spec.name] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module

    one, two = load(tmp_path / "a" / "helpers.py"), load(tmp_path / "b" / "helpers.py")
    aggregation = Aggregation(sim.algorithm.aggregation.contribute, one.apply)
    algorithm = sim.algorithm._replace(aggregation=aggregation, eval_params=functools.partial(two.apply, info=None))
    found = code_files(SimpleNamespace(model=sim.model, algorithm=algorithm))
    assert set(found) == {str((tmp_path / d / "helpers.py").resolve()) for d in "ab"}


def test_a_resume_warns_when_the_model_file_changed_since_the_checkpoint(tmp_path, capsys):
    """The fingerprint holds the file's digest: an edited model file resumes with a warning naming it."""
    net = _write(tmp_path / "nets" / "edited_net.py")
    out = tmp_path / "run"
    settings = [f"{key}={value}" for key, value in SMALL.items()]
    assert main(["run", "--quiet", "--out", str(out), "--set", f"model={net}:Net", *settings]) == 0
    fingerprint = resume_point(out)[1].record["fingerprint"]
    assert list(fingerprint["code"]) == [str(net.resolve())]
    warnings = []
    check_same_simulation(fingerprint, fingerprint, out, warnings.append)
    assert warnings == []  # the same file: no warning
    capsys.readouterr()
    net.write_text(net.read_text() + "\n# a comment\n")
    assert main(["run", "--quiet", "--out", str(out), "--resume", "--set", "rounds=2"]) == 0
    err = capsys.readouterr().err
    assert f"warning: {net.resolve()} changed since" in err and "resuming with the code as it is now" in err


def test_a_sweep_resumed_after_its_model_file_changed_warns_once(tmp_path, capsys):
    """Its members run one program's code: one warning naming the file and the sweep, not one per member."""
    net = _write(tmp_path / "edited_sweep_net.py")
    out = tmp_path / "sweep"
    settings = [f"{key}={value}" for key, value in SMALL.items()]
    args = ["sweep", "--quiet", "--seeds", "0,1", "--out", str(out), "--set", f"model={net}:Net", *settings]
    assert main(args) == 0
    net.write_text(net.read_text() + "\n# a comment\n")
    capsys.readouterr()
    assert main([*args, "rounds=2", "--resume"]) == 0
    warnings = [line for line in capsys.readouterr().err.splitlines() if "changed since" in line]
    assert warnings == [
        f"warning: {net.resolve()} changed since {out} was written; resuming with the code as it is now "
        "(the rounds before ran the code as it was)"
    ]


def test_a_model_module_on_sys_path_builds_with_num_classes_and_trains(tmp_path, monkeypatch):
    _write(tmp_path / "lib" / "jaxfed_test_usernets.py")
    monkeypatch.syspath_prepend(str(tmp_path / "lib"))
    config = Config(**{**SMALL, "model": "jaxfed_test_usernets:Net"})
    sim = build(config).simulation
    assert sim.model.name == "jaxfed_test_usernets:Net" and config.to_dict()["model"] == "jaxfed_test_usernets:Net"
    assert (type(sim.model.module).__module__, sim.model.module.num_classes) == ("jaxfed_test_usernets", 10)
    start = sim.init()
    state, metrics = sim.run_rounds(start, 1)
    assert np.isfinite(float(np.asarray(metrics["train_loss"])[0]))
    with pytest.raises(AssertionError):  # the server moved
        chex.assert_trees_all_close(state.server, start.server)


def test_a_module_in_the_working_directory_is_found(tmp_path, monkeypatch):
    _write(tmp_path / "jaxfed_test_cwdnets.py")
    monkeypatch.chdir(tmp_path)
    model = get_model("jaxfed_test_cwdnets:Fixed", (8, 8, 1), 3)  # no num_classes field: Fixed()
    assert model.name == "jaxfed_test_cwdnets:Fixed" and model.module.__class__.__name__ == "Fixed"


@pytest.mark.parametrize(
    "spec,expected",
    [
        ("net.py:Nett", r"net.py has no 'Nett' \(did you mean 'Net'\?\); its flax Modules: Fixed, Needs, Net$"),
        ("net.py:helper", r"'helper' in .*net.py is a function, not a flax.linen.Module subclass$"),
        ("net.py:Needs", r"model: Needs\(\) failed: TypeError: .*'features'$"),
        ("net.py:Fixed", r"model: 'net.py:Fixed' returns \(1, 3\) for a batch of 1; expected \(1, 10\)"),
        ("nope.py:Net", r"model: no file '.*nope.py'$"),
        ("jaxfed_no_such_module:Net", r"model: no module 'jaxfed_no_such_module' on sys.path or in the working"),
        ("broken.py:Net", r"model: importing .*broken.py failed: ZeroDivisionError: division by zero \(.*line 3\)$"),
        ("a/b:Net", r"model: 'a/b' is neither a .py file nor a module name; write module:Class or"),
        ("net.py:", r"model: '.*net.py:' is not module:Class or path/to/file.py:Class$"),
        ("os:path", r"model: 'path' in module 'os' is a module, not a flax.linen.Module subclass$"),
        ("net.py", r"model: '.*net.py' names a file, not its class; write .*net.py:ClassName$"),
    ],
)
def test_a_bad_model_spec_is_one_line(spec, expected, tmp_path, monkeypatch, capsys):
    _write(tmp_path / "net.py")
    _write(tmp_path / "broken.py", "import math\n\nx = 1 / 0\n")
    monkeypatch.chdir(tmp_path)
    assert main(["run", "--quiet", "--out", str(tmp_path / "o"), "--set", f"model={spec}"]) == 2
    assert re.search(expected, _one_line_error(capsys))


@pytest.mark.parametrize("model", ["mlp", "cnn", "net.py:Net"])
def test_norm_batch_on_a_model_without_normalization_layers_is_refused(model, tmp_path, monkeypatch, capsys):
    """It ran the model as it is (the digits MLP has no normalization layer): a run the user
    thought had BatchNorm."""
    _write(tmp_path / "net.py")
    monkeypatch.chdir(tmp_path)
    assert main(["run", "--quiet", "--out", str(tmp_path / "o"), "--set", f"model={model}", "norm=batch"]) == 2
    assert _one_line_error(capsys).endswith(
        "norm: batch applies to the built-in models with normalization layers (resnet8, resnet10, resnet18, vgg8), "
        f"not '{model}'"
    )


# ----- a partition of one's own --------------------------------------------------------------------


def _uneven_parts(digits, sizes=(5, 40, 300), seed=0):
    """Client parts of the given training sizes; client 1 gets no test example."""
    rng = np.random.default_rng(seed)
    train = np.split(rng.permutation(len(digits.y_train))[: sum(sizes)], np.cumsum(sizes)[:-1])
    test = [np.sort(rng.choice(len(digits.y_test), 30, replace=False)), np.zeros(0, np.int64), np.arange(7)]
    return train, test


def test_a_partition_file_gives_exactly_its_clients(digits, tmp_path):
    train, test = _uneven_parts(digits)
    path = save_partition(tmp_path / "parts.npz", train, test)
    data = build_data(Config(partition="file", partition_file=str(path), num_clients=3)).data
    for table, counts, parts in ((data.train_idx, data.train_count, train), (data.test_idx, data.test_count, test)):
        assert np.asarray(counts).tolist() == [len(p) for p in parts]
        for k, part in enumerate(parts):
            np.testing.assert_array_equal(np.asarray(table)[k, : len(part)], part)


def _save(path, train, test, **extra):
    np.savez(
        path, **{f"train_{k}": p for k, p in enumerate(train)}, **{f"test_{k}": p for k, p in enumerate(test)}, **extra
    )
    return path


@pytest.mark.parametrize(
    "case,expected",
    [
        ("fewer test parts", "3 training parts and 2 test parts; give one of each per client"),
        ("other client count", "holds 3 clients, the config 4; set num_clients=3"),
        ("float indices", r"client 1's training indices \(train_1\) have dtype float64; expected integers"),
        ("out of range", r"client 2's test indices \(test_2\) run 0..355; the test split has 355 examples"),
        ("empty training part", r"client 0's training indices \(train_0\) are empty; every client needs training"),
        ("a gap", "lacks test_1; expected train_0..train_{K-1} and test_0..test_{K-1}"),
        ("another array", "holds an array named 'x_train'; expected only train_0"),
        ("object arrays", r"holds object arrays \(pickles\), which are never loaded"),
        ("not an npz", "not an .npz file; write one with jaxfed.data.save_partition"),
        ("missing", r"cannot be read \(No such file or directory\)"),
    ],
)
def test_a_bad_partition_file_is_one_line(case, expected, digits, tmp_path):
    train, test = _uneven_parts(digits)
    path = tmp_path / "parts.npz"
    if case == "fewer test parts":
        _save(path, train, test[:2])
    elif case == "float indices":
        save_partition(path, [train[0], train[1].astype(float), train[2]], test)
    elif case == "out of range":
        save_partition(path, train, [*test[:2], np.arange(356)])
    elif case == "empty training part":
        save_partition(path, [[], *train[1:]], test)
    elif case == "a gap":
        np.savez(path, train_0=train[0], train_1=train[1], test_0=test[0], test_2=test[2])
    elif case in ("another array", "object arrays"):
        extra = {"x_train": digits.x_train[:2]} if case == "another array" else {}
        _save(path, train, [np.array([t], dtype=object) for t in test] if extra == {} else test, **extra)
    elif case == "not an npz":
        path.write_text("0 1 2\n")
    elif case != "missing":
        save_partition(path, train, test)
    clients = 4 if case == "other client count" else 3
    with pytest.raises(DataError, match=f"^partition_file: {path}: {expected}"):
        build_data(Config(partition="file", partition_file=str(path), num_clients=clients))


@pytest.mark.parametrize(
    "settings, expected",
    [
        ({}, []),
        ({"partition": "iid", "alpha": 0.5, "min_examples": 10}, []),  # defaults are not settings
        ({"client_train_size": 60}, ["client_train_size=60 does not apply to partition=dirichlet (only to "
                                     "client_dirichlet and resample): ignored"]),
        ({"partition": "iid", "alpha": 0.1, "classes_per_client": 3}, [
            "alpha=0.1 does not apply to partition=iid (only to dirichlet and client_dirichlet): ignored",
            "classes_per_client=3 does not apply to partition=iid (only to pathological): ignored",
        ]),
        ({"partition": "resample", "client_train_size": 8, "min_examples": 2}, [
            "min_examples=2 does not apply to partition=resample (only to dirichlet): ignored"]),
        ({"partition": "client_dirichlet", "alpha": 0.1, "client_test_size": 20}, []),
        ({"partition": "iid", "min_examples": 5, "train_reduction": 0.9}, []),  # the reduction's floor
        ({"dataset": "synthetic_linear", "alpha": 0.1}, []),  # generated partitioned: no partition key applies
    ],
)  # fmt: skip
def test_partition_settings_the_partition_ignores_are_named(settings, expected):
    assert Config(**settings).ignored_partition_keys() == expected


def test_a_run_warns_of_a_partition_setting_it_ignores(tmp_path):
    from jaxfed.runs.driver import run

    lines = []
    config = Config(rounds=1, num_clients=4, checkpoint_every=0, client_train_size=60)
    run(config, tmp_path / "run", log=lines.append)
    assert "warning: client_train_size=60 does not apply to partition=dirichlet" in " ".join(lines)


def test_a_sweep_warns_of_a_partition_setting_its_members_ignore_once_before_it_runs(tmp_path):
    from jaxfed.runs.sweep import member_name, run_grid, sweep_configs

    configs = sweep_configs(Config(client_train_size=60, rounds=1), seeds=[0, 1])
    taken = tmp_path / "sweep" / member_name(configs[1], ["seed"])  # a member's directory holds a run:
    taken.mkdir(parents=True)  # the sweep is refused there, after its warnings and before it runs
    (taken / "metrics.jsonl").write_text('{"round": 1}\n')
    lines = []
    with pytest.raises(ConfigError, match="already holds a run"):
        run_grid(configs, tmp_path / "sweep", ["seed"], progress=False, log=lines.append)
    assert lines == [
        "warning: client_train_size=60 does not apply to partition=dirichlet (only to client_dirichlet and "
        "resample): ignored"
    ]


def test_partition_file_keys_go_together(tmp_path):
    with pytest.raises(ConfigError, match=r"^partition_file: partition=file needs partition_file=PATH"):
        Config(partition="file").validate()
    with pytest.raises(ConfigError, match="^partition_file: applies to partition=file only, not partition=iid$"):
        Config(partition="iid", partition_file="parts.npz").validate()
    with pytest.raises(ConfigError, match="^partition: synthetic_linear comes partitioned"):
        Config(dataset="synthetic_linear", partition="file", partition_file="p.npz").validate()
    assert Config(partition="file", partition_file="p.npz").partition_file == str(Path.cwd() / "p.npz")


def test_federate_refuses_each_bad_part_in_one_line(digits):
    train, test = _uneven_parts(digits)
    cases = {
        "3 training parts and 2 test parts": (train, test[:2]),
        "client 1's training indices have dtype float64; expected integers": (
            [train[0], train[1] + 0.0, train[2]],
            test,
        ),
        "client 2's test indices run 0..355; the test split has 355": (train, [*test[:2], np.arange(356)]),
        "client 0's training indices are empty; every client needs training examples (federate(..., "
        "allow_empty_train=True)": ([np.zeros(0, np.int64), *train[1:]], test),
        "client 0's training indices have shape (5, 1); expected one list": ([train[0][:, None], *train[1:]], test),
        "no training parts": ([], []),
    }
    for expected, (train_parts, test_parts) in cases.items():
        with pytest.raises(DataError, match="^dataset 'digits': " + expected.replace("(", r"\(").replace(")", r"\)")):
            federate(digits, train_parts, test_parts)


def test_an_empty_training_part_allowed_explicitly_is_a_client_of_weight_zero(digits):
    """The engine weights each upload by the client's training count (test_engine checks the
    sample-weighted mean), so a client federated with none has weight 0."""
    train, test = _uneven_parts(digits)
    data = federate(digits, [*train, []], [*test, test[0]], allow_empty_train=True)
    assert np.asarray(data.train_count).tolist() == [5, 40, 300, 0]
    assert np.asarray(data.test_count).tolist() == [30, 0, 7, 30]


@pytest.mark.parametrize("name", PARTITIONERS)
def test_every_partitioner_still_federates_clients_without_test_examples(name, digits):
    """Many clients on digits leave some without a test example (dirichlet with min_examples=0
    too): federate takes them as they are (the tables are the parts), as before it checked parts."""
    clients = {"dirichlet": 20, "pathological": 400, "label_groups": 400}.get(name, 100)
    options = {"alpha": 0.1, "min_examples": 0, "client_train_size": 10, "client_test_size": 3, "num_groups": 4}
    train, test = partition(name, digits.y_train, digits.y_test, clients, np.random.default_rng(2), **options)
    data = federate(digits, train, test)
    for table, counts, parts in ((data.train_idx, data.train_count, train), (data.test_idx, data.test_count, test)):
        expected_table, expected_counts = index_table(parts)
        np.testing.assert_array_equal(np.asarray(table), expected_table)
        np.testing.assert_array_equal(np.asarray(counts), expected_counts)
    if name in ("iid", "dirichlet", "pathological", "label_groups"):
        assert min(len(p) for p in test) == 0  # the case that crashed federate


# ----- options named by Python keywords ------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class KeywordOptions(TrainingOptions):
    lambda_: float = option(0.1, "a penalty weight")
    global_: bool = option(False, "a switch")
    in_: int = option(2, "a count")


@dataclasses.dataclass(frozen=True)
class CheckedKeywordOptions(KeywordOptions):
    in_: int = option(2, "a count", check=at_least(1))


@pytest.fixture
def keyword_algorithm():
    name = "keyword_options_test"
    registry.register(name, KeywordOptions, lambda model, options, config: None, replace=True)
    yield name
    registry._REGISTRY.pop(name, None)


def test_options_named_by_keywords_are_written_without_the_underscore(keyword_algorithm, capsys):
    config = Config(algorithm=keyword_algorithm).with_overrides(["lambda=0.5", "global=true", "in=7"]).validate()
    assert (config.options.lambda_, config.options.global_, config.options.in_) == (0.5, True, 7)
    values = config.to_dict()
    assert {k: values["options"][k] for k in ("lambda", "global", "in")} == {"lambda": 0.5, "global": True, "in": 7}
    assert Config.from_dict(json.loads(json.dumps(values))) == config
    assert Config.of({"algorithm": keyword_algorithm, "lambda": "0.5", "global": True, "in": 7}) == config
    assert KeywordOptions(lambda_=0.5).with_values({"lambda": 0.25}).lambda_ == 0.25
    with pytest.raises(ConfigError, match=r"^in: must be >= 1, got 0$"):  # messages name the key
        CheckedKeywordOptions(in_=0).validate()
    assert main(["list", keyword_algorithm]) == 0
    listed = capsys.readouterr().out
    assert "  lambda = 0.1\n" in listed and "  global = False\n" in listed and "  in = 2\n" in listed


def test_fedaras_lambda_round_trips_through_the_command_line_and_config_json(tmp_path):
    config = Config(algorithm="fedara").with_overrides(["lambda=0.25"]).validate()
    assert config.options.lambda_ == 0.25 and config.to_dict()["options"]["lambda"] == 0.25
    assert Config.from_dict(config.to_dict()).options.lambda_ == 0.25


def test_two_fields_with_one_key_are_refused_at_registration():
    @dataclasses.dataclass(frozen=True)
    class Twice(TrainingOptions):
        mu: float = option(0.0, "one")
        mu_: float = option(0.0, "the other")

    with pytest.raises(ValueError, match=r"option field\(s\) mu, mu_ are all the key 'mu'; rename"):
        registry.register("twice_test", Twice, lambda model, options, config: None)
    assert "twice_test" not in registry.names()


def test_sweep_members_over_model_files_get_one_directory_level_each(tmp_path):
    files = [_write(tmp_path / sub / "nets.py") for sub in ("a", "b")]
    configs = sweep_configs(Config(**SMALL), grid={"model": [f"{files[0]}:Net", f"{files[0]}:Fixed"]})
    names = [member_name(c, ["model"]) for c in configs]
    assert names == ["seed0_lr0.05_modelnets.py:Net", "seed0_lr0.05_modelnets.py:Fixed"]
    same_name = sweep_configs(Config(**SMALL), grid={"model": [f"{f}:Net" for f in files]})
    with pytest.raises(ConfigError, match="share the run directory seed0_lr0.05_modelnets.py:Net"):
        run_grid(same_name, tmp_path / "sweep", ["model"])
