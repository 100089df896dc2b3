"""The layers of ``jmp_lite/_src`` (``docs/design.md``): one direction of
dependency, no import circle, lazy imports included.

Every ``import``/``from ... import`` statement of every module under
``jmp_lite/_src`` is read from the source (those inside functions too), each
module is placed in a layer of DESIGN.md's table, and no module may import
one of a higher layer. DESIGN.md allows no exception, so this test lists
none. An import names the module it loads (``from jmp_lite._src.low_precision import
recipes`` loads ``low_precision/recipes.py``; a name imported from a package's
``__init__`` is the package's).
"""

from __future__ import annotations

import ast
import pathlib

import pytest

import jmp_lite

_SRC = pathlib.Path(jmp_lite.__file__).parent / "_src"
_PREFIX = "jmp_lite._src"

#: DESIGN.md's layers, bottom first: a module may import its own layer and
#: those before it.
LAYERS: tuple[str, ...] = (
    "foundations", "trees", "precision recipes", "policy", "loss scale",
    "optimizer side", "low-precision numerics", "autocast", "functional apply",
    "flax", "diagnostics",
)

#: Where each module sits (a package's modules by its name, unless listed).
PLACES: dict[str, str] = {
    "": "foundations",  # jmp_lite/_src/__init__.py, empty
    "dtypes": "foundations",
    "checks": "foundations",
    "compat": "foundations",  # the one module for every jax version branch
    "tree": "trees",
    # The recipe objects, their names and text, and the element formats they
    # name; the markers that carry a recipe object's key in a name stack.
    "low_precision.recipes": "precision recipes",
    "low_precision.formats": "precision recipes",
    "markers": "precision recipes",
    "policy": "policy",
    "loss_scale": "loss scale",
    "loss_scaling": "optimizer side",
    "master_weights": "optimizer side",
    "parallel": "optimizer side",
    "quantized_states": "optimizer side",
    "state_codes": "optimizer side",
    "low_precision": "low-precision numerics",
    "autocast": "autocast",
    "apply": "functional apply",
    # A jax.checkpoint policy a user hands to the function they apply.
    "residuals": "functional apply",
    "flax": "flax",
    "diagnostics": "diagnostics",
}


def _module_name(path: pathlib.Path) -> str:
  parts = path.relative_to(_SRC).with_suffix("").parts
  if parts[-1] == "__init__":
    parts = parts[:-1]
  return ".".join(parts)


def _modules() -> dict[str, pathlib.Path]:
  return {_module_name(p): p for p in sorted(_SRC.rglob("*.py"))}


def _layer(module: str) -> str:
  parts = module.split(".")
  for n in range(len(parts), -1, -1):
    place = PLACES.get(".".join(parts[:n]))
    if place is not None:
      return place
  raise AssertionError(f"no layer for jmp_lite._src.{module}: add it to PLACES")


def _imports(module: str, path: pathlib.Path, known: set[str]) -> set[str]:
  """The ``_src`` modules ``module`` imports, anywhere in its source."""
  package = module if path.name == "__init__.py" else module.rpartition(".")[0]
  found = set()
  for node in ast.walk(ast.parse(path.read_text())):
    if isinstance(node, ast.Import):
      targets = [alias.name for alias in node.names]
    elif isinstance(node, ast.ImportFrom):
      if node.level:
        base = package.split(".") if package else []
        base = base[:len(base) - node.level + 1]
        base = ".".join(filter(None, [_PREFIX, *base, node.module or ""]))
      else:
        base = node.module or ""
      # `from pkg import name`: the submodule pkg.name if there is one.
      targets = [f"{base}.{alias.name}" for alias in node.names] + [base]
      targets = [t for t in targets[:-1]
                 if t.removeprefix(_PREFIX + ".") in known] or [base]
    else:
      continue
    for target in targets:
      if target == _PREFIX or target.startswith(_PREFIX + "."):
        name = target.removeprefix(_PREFIX).lstrip(".")
        while name not in known:
          name = name.rpartition(".")[0]
        if name != module:
          found.add(name)
  return found


def _graph() -> dict[str, set[str]]:
  modules = _modules()
  known = set(modules)
  return {m: _imports(m, p, known) for m, p in modules.items()}


def test_every_module_has_a_layer():
  for module in _modules():
    assert _layer(module) in LAYERS


def test_imports_inside_functions_and_relative_ones_are_read(tmp_path):
  source = tmp_path / "probe.py"
  source.write_text(
      "from jmp_lite._src import tree as tree_lib\n"
      "from jmp_lite._src.low_precision.recipes import Fp8Config\n"
      "def f():\n"
      "  from jmp_lite._src.autocast import float8\n"
      "  import jmp_lite._src.flax.rules\n"
      "  from . import markers\n")
  known = set(_modules())
  assert _imports("probe", source, known) == {
      "tree", "low_precision.recipes", "autocast.float8", "flax.rules", "markers"}


def test_no_module_imports_a_higher_layer():
  graph = _graph()
  upward = sorted(
      f"jmp_lite._src.{m} ({_layer(m)}) imports jmp_lite._src.{t} ({_layer(t)})"
      for m, targets in graph.items() for t in targets
      if LAYERS.index(_layer(t)) > LAYERS.index(_layer(m)))
  assert not upward, "\n".join(upward)


def test_no_import_circle():
  graph = _graph()
  index: dict[str, int] = {}
  low: dict[str, int] = {}
  stack: list[str] = []
  on_stack: set[str] = set()
  circles: list[list[str]] = []

  def visit(v: str) -> None:  # Tarjan's strongly connected components
    index[v] = low[v] = len(index)
    stack.append(v)
    on_stack.add(v)
    for w in sorted(graph[v]):
      if w not in index:
        visit(w)
        low[v] = min(low[v], low[w])
      elif w in on_stack:
        low[v] = min(low[v], index[w])
    if low[v] == index[v]:
      component = []
      while True:
        w = stack.pop()
        on_stack.discard(w)
        component.append(w)
        if w == v:
          break
      if len(component) > 1:
        circles.append(sorted(component))

  for v in sorted(graph):
    if v not in index:
      visit(v)
  assert not circles, circles


@pytest.mark.parametrize("layer", ["precision recipes", "policy"])
def test_recipes_and_policy_import_nothing_of_float8_machinery(layer):
  graph = _graph()
  for module, targets in graph.items():
    if _layer(module) == layer:
      assert not {t for t in targets
                  if _layer(t) in ("autocast", "functional apply", "flax",
                                   "low-precision numerics")}, module
