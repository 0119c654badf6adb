"""Algorithm-owned options: declared checks, parsing, the registry, config sections and scoped keys."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxfed.algorithms import registry
from jaxfed.algorithms.fedavg import fedavg
from jaxfed.algorithms.fedcspack import FedCSPACKOptions
from jaxfed.algorithms.feddecomp import FedDecompOptions
from jaxfed.cli.commands import _parser, config_from_args, main
from jaxfed.errors import ConfigError
from jaxfed.options import TrainingOptions, non_negative, option, positive, resolve
from jaxfed.runs.config import Config, read_config_file, read_config_lines
from jaxfed.simulation import Simulation


def test_every_algorithm_owns_a_documented_options_class_whose_defaults_validate():
    for name in registry.names():
        options = registry.get(name).options
        assert issubclass(options, TrainingOptions) or name == "local"  # every built-in trains locally
        options().validate()
        for key, default, help_, source in options.describe():
            assert help_, f"{name}.{key} has no help"
        assert not set(options.keys()) & set(Config.run_keys()), name


def test_paper_defaults_differ_per_algorithm_and_the_baselines_keep_theirs():
    defaults = {name: registry.get(name).options() for name in ("fedavg", "feddecomp", "fedara", "fedloru")}
    assert (defaults["fedavg"].lr, defaults["fedavg"].local_epochs, defaults["fedavg"].batch_size) == (0.05, 2, 32)
    assert (defaults["feddecomp"].lr, defaults["feddecomp"].batch_size, defaults["feddecomp"].local_epochs) == (
        0.1,
        100,
        5,
    )  # FedDecomp §5.1
    assert (defaults["fedara"].lr, defaults["fedara"].batch_size) == (5e-3, 16)  # FedARA §5
    assert defaults["fedloru"].momentum == 0.9  # FedLoRU App. D
    assert "FedDecomp paper" in dict((k, s) for k, _, _, s in FedDecompOptions.describe())["batch_size"]


def test_values_parse_to_the_field_types_and_checks_name_the_field():
    options = FedCSPACKOptions().with_values({"pack_size": "512", "select": "all_below", "drop_last": "yes"})
    assert (options.pack_size, options.select, options.drop_last) == (512, "all_below", True)
    with pytest.raises(ConfigError, match=r"^pack_size: expected int, got 'big'$"):
        FedCSPACKOptions().with_values({"pack_size": "big"})
    with pytest.raises(ConfigError, match=r"^share_ratio: must be in \(0, 1\], got 1.5$"):
        FedCSPACKOptions(share_ratio=1.5).validate()
    with pytest.raises(ConfigError, match=r"^lr: must be a finite number >= 0, got inf$"):
        FedCSPACKOptions(lr=float("inf")).validate()
    with pytest.raises(ConfigError, match=r"^select: unknown 'best'; allowed: top_k, all_below$"):
        FedCSPACKOptions(select="best").validate()
    with pytest.raises(ConfigError, match=r"^select: unknown 'top-k' \(did you mean 'top_k'\?\); allowed: "):
        FedCSPACKOptions(select="top-k").validate()


def test_config_round_trips_through_its_dict():
    config = Config(algorithm="fedara").with_overrides(["tiers=0.5,0.25", "lambda=5", "rounds=7"])
    again = Config.from_dict(json.loads(json.dumps(config.to_dict())))
    assert again == config and again.options.tiers == (0.5, 0.25)


def test_set_takes_several_pairs_and_algorithm_applies_first_wherever_it_stands():
    args = _parser().parse_args(
        ["run", "--set", "rounds=1", "num_clients=5", "select=all_below", "algorithm=fedcspack"]
    )
    config = config_from_args(args)
    assert (config.rounds, config.num_clients, config.algorithm, config.options.select) == (
        1,
        5,
        "fedcspack",
        "all_below",
    )


def test_an_other_algorithms_key_says_whose_it_is(capsys, tmp_path):
    assert main(["run", "fedavg", "--set", "pack_size=64", "--out", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "jaxfed: error: pack_size: an option of fedcspack, not of fedavg; see `jaxfed list fedavg`"
    assert not (tmp_path / "r").exists()


def test_scoped_keys_and_config_file_sections_apply_only_to_their_algorithm(tmp_path):
    conf = tmp_path / "study.conf"
    conf.write_text(
        "rounds = 4\nlr = 0.02   # every algorithm\n\n[fedcspack]\npack_size = 256\nselect = all_below\n"
        "\n[fedhm]\ntiers = 1.0,0.5\n\n[run]\nnum_clients = 6\n"
    )
    pairs = read_config_file(conf)
    assert pairs == [
        "rounds=4",
        "lr=0.02",
        "fedcspack.pack_size=256",
        "fedcspack.select=all_below",
        "fedhm.tiers=1.0,0.5",
        "num_clients=6",
    ]
    for name in ("fedavg", "fedcspack", "fedhm"):
        config = Config().with_overrides([*pairs, f"algorithm={name}"]).validate()
        assert (config.rounds, config.num_clients, config.options.lr) == (4, 6, 0.02)
        assert getattr(config.options, "pack_size", 256) == 256 and getattr(config.options, "tiers", (1.0, 0.5)) == (
            1.0,
            0.5,
        )
    with pytest.raises(ConfigError, match="algorithm: unknown 'fedcspak'"):
        Config().with_overrides(["fedcspak.pack_size=1"])


def test_list_prints_an_algorithms_options_with_defaults_and_sources(capsys):
    assert main(["list", "feddecomp"]) == 0
    out = capsys.readouterr().out
    assert "  batch_size = 100\n" in out and "FedDecomp paper" in out and "  aggregation = uniform\n" in out
    assert max(len(line) for line in out.splitlines()) <= 100
    assert main(["list"]) == 0
    assert "  rounds = 30\n" in capsys.readouterr().out


def test_a_datasets_defaults_apply_unless_a_value_was_set_whatever_the_order(capsys):
    """FLoRAL's family runs the authors' CIFAR-10 recipe (lr 0.03, batch 64) on cifar10 and their
    MNIST one elsewhere; a value the user set stays, before or after the dataset changes."""
    mnist_recipe, cifar10_recipe = (0.1, 32), (0.03, 64)

    def lr_batch(config):
        return config.options.lr, config.options.batch_size

    assert lr_batch(Config(algorithm="floral")) == mnist_recipe
    assert lr_batch(Config(algorithm="local_adaptor", dataset="cifar10")) == cifar10_recipe
    switched = Config(algorithm="fedavg").with_overrides(["dataset=cifar10", "algorithm=floral"])
    assert lr_batch(switched) == cifar10_recipe
    assert lr_batch(Config(algorithm="floral").with_overrides(["lr=0.1", "dataset=cifar10"])) == (0.1, 64)
    chained = Config(algorithm="floral").with_overrides(["lr=0.2"]).with_overrides(["dataset=cifar10"])
    assert lr_batch(chained) == (0.2, 64)
    assert lr_batch(chained.with_overrides(["dataset=mnist"])) == (0.2, 32)
    assert lr_batch(Config.of({"algorithm": "floral", "dataset": "cifar10", "batch_size": 16})) == (0.03, 16)
    assert Config.from_dict(chained.to_dict()) == chained
    assert lr_batch(Config(algorithm="fedavg", dataset="cifar10")) == lr_batch(Config(algorithm="fedavg"))
    assert main(["list", "floral"]) == 0
    out = capsys.readouterr().out
    assert "(cifar10: 0.03)" in out and "conf/task/cifar10.yaml" in out


@dataclasses.dataclass(frozen=True)
class _Toy(TrainingOptions):
    step: float = option(1.0, "a step", source="nowhere", check=positive)


def test_register_refuses_clashes_and_duplicates():
    with pytest.raises(ValueError, match="exists already"):
        registry.register("fedavg", _Toy, lambda model, options, config: None)

    @dataclasses.dataclass(frozen=True)
    class Clash(TrainingOptions):
        rounds: int = option(3, "shadows the run key")

    with pytest.raises(ValueError, match="rounds shadow run-level config keys"):
        registry.register("clash", Clash, lambda model, options, config: None)
    assert "clash" not in registry.names()


def in_unit_interval(name, value):  # the audit's check: (name, value), not check(value)
    return None if 0 <= value < 1 else "must be in [0, 1)"


def test_a_check_of_another_signature_is_refused_naming_the_option():
    @dataclasses.dataclass(frozen=True)
    class WrongCheck(TrainingOptions):
        server_momentum: float = option(0.9, "server momentum", check=in_unit_interval)

    message = (
        r"^WrongCheck\.server_momentum: its check in_unit_interval\(name, value\) must take the value alone: "
        r"check\(value\) -> str \| None \(None: allowed; else what is wrong"
    )
    with pytest.raises(ConfigError, match=message):
        registry.register("audit_wrong_check", WrongCheck, lambda model, options, config: None)
    assert "audit_wrong_check" not in registry.names()
    with pytest.raises(ConfigError, match=message):  # from Python, unregistered: at its first validation
        resolve(WrongCheck)


def test_a_default_failing_its_own_check_is_said_to_be_the_options_class_default():
    # a plugin's default lam=-0.1 was reported as `lam: must be >= 0, got -0.1`, as if the user set it
    @dataclasses.dataclass(frozen=True)
    class BadDefault(TrainingOptions):
        lam: float = option(-0.1, "a penalty", check=non_negative)

    @dataclasses.dataclass(frozen=True)
    class BadInheritedDefault(_Toy):
        step: float = -1.0

    expected = {
        BadDefault: "BadDefault.lam: the default -0.1 the options class declares fails its own check (must be >= 0)",
        BadInheritedDefault: "BadInheritedDefault.step: the default -1.0 the options class declares fails its own "
        "check (must be > 0)",
    }
    for options, message in expected.items():
        with pytest.raises(ConfigError) as caught:
            registry.register("audit_bad_default", options, lambda model, options, config: None)
        assert str(caught.value) == message + "; declare an allowed default"
        with pytest.raises(ConfigError, match="the options class declares"):
            resolve(options, None, {"lam": 1.0} if options is BadDefault else {"step": 1.0})
    assert "audit_bad_default" not in registry.names()


def test_cosine_schedule_is_the_formula_written_out():
    options = TrainingOptions(lr=0.1, lr_schedule="cosine", lr_min=1e-3, lr_decay_rounds=50)
    for t in (0, 1, 17, 49, 50, 80):
        expected = 1e-3 + (0.1 - 1e-3) * 0.5 * (1 + np.cos(np.pi * min(t, 50) / 50))
        np.testing.assert_allclose(float(options.learning_rate(jnp.int32(t))), expected, rtol=1e-6)
    assert TrainingOptions(lr=0.1).learning_rate(jnp.int32(30)) == 0.1  # constant
    assert registry.get("fedloru").options().lr_schedule == "cosine"  # FedLoRU App. D


def test_the_engine_hands_each_round_its_index_so_schedules_apply(mlp, digits_federation):
    """Two rounds under a cosine schedule = round 0 at constant lr(0), then round 1 at constant lr(1)."""
    scheduled = TrainingOptions(lr=0.2, lr_schedule="cosine", lr_min=0.01, lr_decay_rounds=2)
    rates = [float(scheduled.learning_rate(jnp.int32(t))) for t in (0, 1)]
    assert rates[0] > rates[1] > 0.01

    def sim_with(**options):
        return Simulation(fedavg(mlp, local_epochs=1, **options), mlp, digits_federation, participation=1.0)

    cosine = sim_with(lr=0.2, lr_schedule="cosine", lr_min=0.01, lr_decay_rounds=2)
    start = cosine.init()
    both, _ = cosine.run_rounds(start, 2)
    first, _ = sim_with(lr=rates[0]).run_rounds(start, 1)
    by_hand, _ = sim_with(lr=rates[1]).run_rounds(first, 1)
    chex.assert_trees_all_close(both.server, by_hand.server, rtol=1e-5, atol=1e-6)
    unscheduled, _ = sim_with(lr=rates[0]).run_rounds(start, 2)
    with pytest.raises(AssertionError):
        chex.assert_trees_all_close(both.server, unscheduled.server, rtol=1e-5, atol=1e-6)


def test_clip_norm_bounds_each_local_step(mlp, digits_federation):
    """One full-batch step: the model moves by at most lr * clip_norm, and further without clipping."""
    from jaxfed.contract import RoundInfo
    from jaxfed.data import ClientData

    data = digits_federation.train_data(jnp.array([0]))
    view = ClientData(x=data.x, y=data.y, indices=data.indices[0], count=data.count[0])
    moved = {}
    for clip in (0.0, 0.01):
        alg = fedavg(mlp, lr=0.5, local_epochs=1, batch_size=512, clip_norm=clip)
        server, client = alg.init(jax.random.key(0))
        info = RoundInfo(round=jnp.int32(0), tier=0)
        _, params, metrics = jax.jit(alg.client_update)(
            alg.broadcast(server, info), client, view, jax.random.key(1), info
        )
        assert float(metrics["steps"]) == 1
        diffs = jax.tree.leaves(jax.tree.map(lambda a, b: np.float64(a) - np.float64(b), params, server.params))
        moved[clip] = np.sqrt(sum(np.sum(d**2) for d in diffs))
    assert moved[0.01] <= 0.5 * 0.01 * (1 + 1e-4) < moved[0.0]


def test_a_later_pair_wins_over_a_config_file_section():
    """``--set`` comes after the ``--config`` files, so it overrides their ``[ALGORITHM]`` sections."""
    section_then_set = Config().with_overrides(["algorithm=fedara", "fedara.lambda=2", "lambda=0"])
    set_then_section = Config().with_overrides(["algorithm=fedara", "lambda=0", "fedara.lambda=2"])
    assert section_then_set.options.lambda_ == 0.0 and set_then_section.options.lambda_ == 2.0


def test_jaxfed_list_groups_every_builtin_once_with_its_line(capsys):
    listed = [name for entries in registry.CATALOGUE.values() for name, _ in entries]
    assert sorted(listed) == sorted(registry.BUILTINS) and len(set(listed)) == len(listed)
    assert main(["list"]) == 0
    out = capsys.readouterr().out
    for group, entries in registry.CATALOGUE.items():
        assert f"  {group}:" in out
        for name, line in entries:
            assert f"    {name:<14}{line}" in out


def test_defaults_dict_is_the_default_instances_dict_and_skips_a_field_without_default():
    for name in registry.names():
        options = registry.get(name).options
        assert options.defaults_dict() == options().to_dict(), name

    @dataclasses.dataclass(frozen=True)
    class Required(TrainingOptions):  # research code may declare a field with no default
        width: int = dataclasses.field(default_factory=lambda: 7)
        depth: int = dataclasses.field(kw_only=True)

    defaults = Required.defaults_dict()
    assert "depth" not in defaults and defaults["width"] == 7
    assert defaults["lr"] == TrainingOptions().lr


REPOSITORY = Path(__file__).parents[1]
EXPERIMENT_CONFIGS = sorted(str(p.relative_to(REPOSITORY)) for p in REPOSITORY.glob("experiments/*/*.conf"))


@pytest.mark.parametrize("conf", EXPERIMENT_CONFIGS)
def test_every_experiment_config_file_reads_as_config_keys(conf):
    """Each paper's setting parses: known keys, values of their types, sections of real algorithms
    (the rules that need the data, such as a partition file's path, run when it runs)."""
    path = REPOSITORY / conf
    paper = path.parent.name  # the paper's algorithm, as its run.sh names it
    algorithm = paper if paper in registry.names() else "fedavg"
    Config(algorithm=algorithm).with_overrides(*zip(*read_config_lines(path)))
