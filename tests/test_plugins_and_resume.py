"""Plugins and the sweep resume as research code uses them: two plugin files of one name, a plugin
fixed after failing midway, a sweep resumed with another command, a builder that returns nothing, a
plugin module in the working directory, a plugin without an algorithm named, an algorithm
registered from Python recorded as its plugin (each test failed before its fix)."""

import importlib
import json
import sys

import pytest
from conftest import make_federation

from jaxfed.algorithms import registry
from jaxfed.errors import ConfigError
from jaxfed.runs.build import build_algorithm
from jaxfed.runs.config import Config
from jaxfed.runs.driver import recorded_config
from jaxfed.runs.rundir import LoopSettings
from jaxfed.simulation import Simulation


@pytest.fixture
def own_registry(monkeypatch):
    """The registry restored after the test: what the test registers leaves with it."""
    monkeypatch.setattr(registry, "_REGISTRY", dict(registry._REGISTRY))


PLUGIN = """import jaxfed
from jaxfed.algorithms.fedavg import FedAvgOptions, fedavg
jaxfed.register({name!r}, FedAvgOptions, lambda model, options, config: fedavg(model, options))
{tail}
"""


def test_two_plugin_files_with_one_file_name_both_register(tmp_path):
    # a/plug.py and b/plug.py: the second used to be skipped silently (its module name,
    # jaxfed_plugin_plug, was taken), so `--plugin a/plug.py --plugin b/plug.py` lost b's algorithms
    for folder, name in (("a", "audit_same_stem_a"), ("b", "audit_same_stem_b")):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "plug.py").write_text(PLUGIN.format(name=name, tail=""))
        registry.import_plugin(str(tmp_path / folder / "plug.py"))
    assert "audit_same_stem_a" in registry.names()
    assert "audit_same_stem_b" in registry.names()


def test_a_plugin_fixed_after_failing_midway_imports_again(tmp_path):
    # a plugin that registered, then raised: its registration stayed, so importing the fixed
    # file again (a notebook, a retried jaxfed.run) failed with "exists already" instead of working
    plugin = tmp_path / "midway.py"
    plugin.write_text(PLUGIN.format(name="audit_midway", tail="raise RuntimeError('typo')"))
    with pytest.raises(ConfigError, match="typo"):
        registry.import_plugin(str(plugin))
    assert "audit_midway" not in registry.names()
    plugin.write_text(PLUGIN.format(name="audit_midway", tail=""))
    registry.import_plugin(str(plugin))
    assert "audit_midway" in registry.names()


def test_a_builder_that_returns_no_algorithm_is_named_with_its_file(own_registry, tmp_path, mlp):
    # a registered builder that returned None used to fail later with an AttributeError traceback
    plugin = tmp_path / "nodc.py"
    plugin.write_text(
        "import jaxfed\nfrom jaxfed.options import TrainingOptions\n\n\n"
        "@jaxfed.register('audit_nodc', TrainingOptions)\ndef build(model, options, config):\n    pass\n"
    )
    registry.import_plugin(str(plugin))
    config = Config(algorithm="audit_nodc")
    with pytest.raises(ConfigError) as caught:
        build_algorithm(config, mlp)
    assert str(caught.value) == (
        f"algorithm 'audit_nodc': its builder build ({plugin} line 5) returned None, not a "
        "jaxfed.algorithms.FederatedAlgorithm (return the record the builder makes)"
    )


def test_a_plugin_module_is_found_in_the_working_directory_as_a_model_module_is(own_registry, tmp_path, monkeypatch):
    # `jaxfed run myditto --plugin myditto` in the plugin's folder said No module named 'myditto'
    (tmp_path / "audit_cwd_plugin.py").write_text(PLUGIN.format(name="audit_cwd", tail=""))
    monkeypatch.chdir(tmp_path)
    path_before = list(sys.path)
    registry.import_plugin("audit_cwd_plugin")
    assert "audit_cwd" in registry.names() and sys.path == path_before
    with pytest.raises(ConfigError, match=r"^plugins: no module 'audit_no_such_plugin' on sys.path or in the working"):
        registry.import_plugin("audit_no_such_plugin")


def test_an_unknown_algorithm_says_a_plugin_needs_plugin():
    with pytest.raises(ConfigError) as caught:
        registry.get("myditto")
    message = str(caught.value)
    assert message.startswith("algorithm: unknown 'myditto' (did you mean 'ditto'?); an algorithm of your own needs")
    assert "--plugin FILE_OR_MODULE (also on --resume" in message.split("; allowed:")[0]


def _cli_config(arguments: list[str], base=None) -> Config:
    from jaxfed.cli.commands import _parser, config_from_args

    return config_from_args(_parser().parse_args(arguments), base)


def test_a_plugin_given_without_an_algorithm_is_refused_naming_its_algorithms(own_registry, tmp_path):
    # `jaxfed run --plugin myditto.py` used to run fedavg, the default algorithm, silently
    plugin = tmp_path / "unnamed.py"
    plugin.write_text(PLUGIN.format(name="audit_unnamed", tail=""))
    for command in ("run", "sweep"):
        with pytest.raises(ConfigError) as caught:
            _cli_config([command, "--plugin", str(plugin)])
        assert str(caught.value) == (
            f"algorithm: not given; {plugin} registers audit_unnamed: jaxfed {command} audit_unnamed --plugin {plugin}"
        )
    assert _cli_config(["run", "audit_unnamed", "--plugin", str(plugin)]).algorithm == "audit_unnamed"
    config_file = tmp_path / "c.conf"
    config_file.write_text("algorithm = audit_unnamed\n")
    assert _cli_config(["run", "--config", str(config_file), "--plugin", str(plugin)]).algorithm == "audit_unnamed"
    assert _cli_config(["run", "--plugin", str(plugin), "--set", "algorithm=fedavg"]).algorithm == "fedavg"
    _cli_config(["sweep", "--plugin", str(plugin), "--grid", "algorithm=audit_unnamed,fedavg"])  # the grid names it
    resumed = Config(algorithm="audit_unnamed", plugins=(str(plugin),))  # --resume: the saved config's algorithm
    assert _cli_config(["run", "--plugin", str(plugin)], base=resumed).algorithm == "audit_unnamed"


def test_an_algorithm_registered_from_python_is_recorded_as_its_plugin(
    own_registry, tmp_path, monkeypatch, digits, mlp
):
    # a run started from Python after `import myplugin` recorded plugins: [], so --resume could not find it
    plugin = tmp_path / "audit_from_python.py"
    plugin.write_text(PLUGIN.format(name="audit_from_python", tail=""))
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.import_module("audit_from_python")
    config = Config(algorithm="audit_from_python")
    recorded = config.recorded()
    assert recorded["plugins"] == [str(plugin.resolve())] and config.to_dict()["plugins"] == []
    assert Config.from_dict(recorded).algorithm == "audit_from_python"  # the file is not imported twice
    assert Config(algorithm="audit_from_python", plugins=(str(plugin),)).recorded()["plugins"] == [str(plugin)]
    assert Config().recorded()["plugins"] == []
    algorithm = registry.get("audit_from_python").build(mlp, Config(algorithm="audit_from_python").options, None)
    sim = Simulation(algorithm._replace(name="audit_from_python"), mlp, make_federation(digits, num_clients=4))
    assert recorded_config(sim, LoopSettings(rounds=1))["plugins"] == [str(plugin.resolve())]


def test_the_module_calling_register_is_recorded_a_packages_by_its_dotted_name(own_registry, tmp_path, monkeypatch):
    """The plugin recorded was the builder's module: functools.py for a functools.partial builder,
    the helper's file for a builder defined elsewhere; and a package's module, recorded by its
    file, failed its relative imports on --resume."""
    package = tmp_path / "auditpkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "helpers.py").write_text(
        "from jaxfed.algorithms.fedavg import fedavg\n\ndef build(model, options, config, extra=0):\n"
        "    return fedavg(model, options)\n"
    )
    (package / "algos.py").write_text(
        "import functools\nimport jaxfed\nfrom jaxfed.algorithms.fedavg import FedAvgOptions\n"
        "from .helpers import build\n"
        "jaxfed.register('audit_in_package', FedAvgOptions, functools.partial(build, extra=2))\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.import_module("auditpkg.algos")
    assert registry.get("audit_in_package").module == "auditpkg.algos"
    assert Config(algorithm="audit_in_package").recorded()["plugins"] == ["auditpkg.algos"]
    assert registry.registered_by("auditpkg") == registry.registered_by("auditpkg.algos") == ["audit_in_package"]
    registry.import_plugin("auditpkg.algos")  # what --resume does: imported already, not again


def test_a_python_sweep_resumed_where_none_of_its_members_are_is_refused(tmp_path, digits_federation, mlp):
    """`run_simulation_sweep(..., resume=True)` naming none of the members in its directory
    started a new sweep beside them (the CLI refused it already); a new sweep beside another one
    runs, and each member's config.json tells the two apart."""
    from jaxfed.algorithms.fedavg import fedavg
    from jaxfed.runs.sweep import Sweep, run_simulation_sweep
    from jaxfed.simulation import Simulation

    out = tmp_path / "sweep"
    for lr in (0.05, 0.2):
        sim = Simulation(fedavg(mlp, lr=lr), mlp, digits_federation, participation=0.5)
        run_simulation_sweep(
            Sweep.of_simulation(sim, seeds=[int(lr == 0.2)]), out, 1, progress=False, log=lambda m: None
        )
    configs = [json.loads((out / name / "config.json").read_text()) for name in ("seed0", "seed1")]
    assert [c["options"]["lr"] for c in configs] == [0.05, 0.2]  # the fixed lr of each: two variants
    sweep = Sweep.of_simulation(sim, seeds=[3])
    with pytest.raises(ConfigError, match="none of this sweep's members .*resume with the sweep that wrote them"):
        run_simulation_sweep(sweep, out, 1, resume=True, progress=False)
    assert sorted(p.name for p in out.iterdir()) == ["seed0", "seed1"]
    (out / "seed0").rename(tmp_path / "a_run")  # a run directory (docs: recipes.md's runs/mine, then sweeps.md's)
    with pytest.raises(ConfigError, match="is a run directory .* choose another --out for a sweep"):
        run_simulation_sweep(sweep, tmp_path / "a_run", 1, progress=False)
    assert sorted(p.name for p in (tmp_path / "a_run").iterdir()) == sorted(
        p.name for p in (out / "seed1").iterdir()
    )  # nothing written into it
