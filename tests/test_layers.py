"""The package's layers import one way: each module imports only layers below its own (or its own
folder), including the imports written inside functions; and the light layers stay light."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "jaxfed"

# the layer of each top-level piece of the package, lowest first
LAYERS = {
    "errors": 0,
    "core": 1,
    "nn": 2,
    "data": 2,
    "options": 3,
    "contract": 3,
    "algorithms": 4,
    "simulation": 5,
    "runs": 6,
    "cli": 7,
}


def _piece(module: str) -> str:
    """``jaxfed.runs.config`` -> ``runs``; ``jaxfed`` itself -> ``""``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def _imports(path: Path) -> list[tuple[int, str]]:
    """``(line, module)`` of every ``jaxfed`` import in ``path``, wherever it is written."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "jaxfed":
            if node.module == "jaxfed":
                found += [(node.lineno, f"jaxfed.{alias.name}") for alias in node.names]
            else:
                found.append((node.lineno, node.module))
        elif isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names if a.name.split(".")[0] == "jaxfed"]
    return found


def _modules():
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        yield path, ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def test_every_piece_of_the_package_has_a_layer():
    pieces = {_piece(module) for _, module in _modules()} - {""}
    assert pieces == set(LAYERS), f"pieces without a layer: {pieces - set(LAYERS)}"


@pytest.mark.parametrize("path,module", [(p, m) for p, m in _modules() if _piece(m)], ids=lambda v: str(v))
def test_a_module_imports_only_layers_below_its_own(path, module):
    own = _piece(module)
    upward = [
        f"{path.name} line {line}: {target}"
        for line, target in _imports(path)
        if _piece(target) != own and LAYERS[_piece(target)] >= LAYERS[own]
    ]
    assert not upward, f"{module} ({own}, layer {LAYERS[own]}) imports at or above its layer: {upward}"


def test_the_layer_check_sees_an_upward_import(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("def f():\n    from jaxfed.runs.config import Config\n")
    assert _imports(bad) == [(2, "jaxfed.runs.config")]
    assert LAYERS[_piece("jaxfed.runs.config")] > LAYERS["algorithms"]


def _loaded_after(statement: str) -> set[str]:
    code = f"import sys; {statement}; print(' '.join(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    return set(out.stdout.split())


def test_core_and_the_contract_are_light():
    loaded = _loaded_after("import jaxfed.core, jaxfed.contract")
    heavy = {m for m in loaded if m.split(".")[0] in ("orbax", "flax", "tensorflow_datasets", "matplotlib")}
    assert not heavy, f"import jaxfed.core loads {sorted(heavy)[:5]}"
    assert not {m for m in loaded if m.startswith(("jaxfed.simulation", "jaxfed.runs.", "jaxfed.algorithms."))} - {
        "jaxfed.runs.config",  # `import jaxfed` gives the public Config and register
        "jaxfed.algorithms.registry",
    }


def test_naming_an_algorithm_loads_its_module_only():
    loaded = _loaded_after("from jaxfed.algorithms import registry; registry.get('feddecomp')")
    algorithms = {m.rsplit(".", 1)[1] for m in loaded if m.startswith("jaxfed.algorithms.")}
    shared = {"registry", "training", "records", "aggregation", "fedopt"}  # what several algorithms build on
    assert "feddecomp" in algorithms and algorithms <= {"feddecomp", *shared}
