"""The README and the pages of docs/: blocks run, links resolve, sizes hold.

Every ```python block of the README and of each page in docs/ runs. Blocks
run in order, in one namespace per file, as a reader would paste them, in a
scratch directory (some write figures), with JAX's standard dtype promotion
(a user's default; optax's adam needs it). A block that needs names from an
earlier block of the same file may use them; nothing else is defined.
```text, ```bash and ```diff blocks are not Python and are not run.

The API reference (docs/api/) is generated from the docstrings by mkdocs.yml;
CI builds it with warnings as errors, and tests/test_public_api.py checks
that it lists every public name.
"""

import contextlib
import io
import json
import pathlib
import re

import pytest

from helpers import ROOT

DOCS = ROOT / "docs"
README = ROOT / "README.md"
FILES = [README] + sorted(DOCS.glob("*.md"))
API_PAGES = sorted((DOCS / "api").glob("*.md"))  # no code: ::: directives

#: Pages of docs/ that hold prose, tables and figures but no code to run.
PROSE_PAGES = {"index.md", "benchmarks.md", "design.md", "contributing.md"}

#: The README is a front door (DESIGN.md): at most this many bytes.
README_MAX_BYTES = 10_000

#: What some files' blocks print or write, checked after they ran.
PRINTS = {
    "docs/training_loops.md": ["True 3", "False", "True"],
    "docs/diagnostics.md": ["True"],
}
WRITES = {"docs/diagnostics.md": ["grads.png"]}


def python_blocks(path: pathlib.Path) -> list[str]:
  return re.findall(r"^```python\n(.*?)^```", path.read_text(),
                    re.DOTALL | re.MULTILINE)


def _name(path: pathlib.Path) -> str:
  return str(path.relative_to(ROOT))


def test_every_guide_has_python_blocks():
  guides = [p for p in FILES
            if p.parent == DOCS and p.name not in PROSE_PAGES]
  assert len(guides) >= 7, guides
  for path in [README] + guides:
    assert python_blocks(path), _name(path)
  for name in PROSE_PAGES:  # the exemptions name pages that exist
    assert (DOCS / name).is_file(), name


def test_every_api_page_is_generated_from_docstrings():
  assert API_PAGES
  for path in API_PAGES:
    assert re.search(r"^::: jmp_lite", path.read_text(), re.MULTILINE), _name(path)
    assert not python_blocks(path), f"{_name(path)}: examples belong in docstrings"


def test_readme_is_a_front_door():
  size = len(README.read_bytes())
  assert size <= README_MAX_BYTES, (
      f"README.md is {size} bytes, more than {README_MAX_BYTES}: move the "
      "long explanation into the page of docs/ where it belongs and link it")


def _readme_test_command() -> str:
  commands = [line.split("#")[0].strip()
              for line in README.read_text().splitlines()
              if "python -m pytest" in line and "pip install" in line]
  assert len(commands) == 1, commands
  return commands[0]


def test_ci_runs_the_readmes_test_command_first():
  ci = (ROOT / ".ci" / "run").read_text().splitlines()
  commands = [line for line in ci
              if line.strip() and not line.startswith("#")
              and not line.startswith(("set ", "cd "))]
  assert commands[0] == _readme_test_command(), commands[0]


def test_ci_builds_the_api_reference_with_warnings_as_errors():
  ci = (ROOT / ".ci" / "run").read_text()
  assert re.search(r"^python -m mkdocs build --strict --site-dir ", ci,
                   re.MULTILINE), ci
  assert (ROOT / "mkdocs.yml").is_file()


# ---------------------------------------------------------------------------
# Links.
# ---------------------------------------------------------------------------

_LINK = re.compile(r"\]\(([^)\s]+)\)")


def _links(path: pathlib.Path) -> list[str]:
  text = re.sub(r"^```.*?^```", "", path.read_text(), flags=re.DOTALL | re.MULTILINE)
  text = re.sub(r"`[^`\n]*`", "", text)  # inline code is not a link
  return [m for m in _LINK.findall(text)
          if not re.match(r"[a-z][a-z0-9+.-]*:", m)]  # http:, mailto:, ...


def _github_anchor(heading: str) -> str:
  """The anchor GitHub gives a markdown heading."""
  text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
  return text.replace(" ", "-")


def _anchors(path: pathlib.Path) -> set[str]:
  text = re.sub(r"^```.*?^```", "", path.read_text(), flags=re.DOTALL | re.MULTILINE)
  headings = {_github_anchor(h) for h in re.findall(r"^#+ (.+)$", text, re.MULTILINE)}
  return headings | set(re.findall(r'<a id="([^"]+)"', text))


def test_github_anchor():
  assert _github_anchor("What may wrap `loss_scaling`") == "what-may-wrap-loss_scaling"
  assert _github_anchor("Float8") == "float8"


@pytest.mark.parametrize("path", FILES + API_PAGES, ids=_name)
def test_every_relative_link_resolves(path):
  broken = []
  for link in _links(path):
    target, _, anchor = link.partition("#")
    file = (path.parent / target).resolve() if target else path
    if not file.exists():
      broken.append(link)
    elif (anchor and file.suffix == ".md" and file.parent.is_relative_to(DOCS)
          and anchor not in _anchors(file)):
      broken.append(link)  # mkdocs checks anchors too, but not the README's
  assert not broken, f"{_name(path)}: links to nothing: {broken}"


# ---------------------------------------------------------------------------
# Blocks.
# ---------------------------------------------------------------------------


# Running the guides end to end is the slow stage's (pytest -m slow).
@pytest.mark.slow
@pytest.mark.standard_promotion
@pytest.mark.parametrize("path", FILES, ids=_name)
def test_every_python_block_runs(path, tmp_path, monkeypatch):
  monkeypatch.chdir(tmp_path)
  namespace = {"__name__": "__docs__"}
  out = io.StringIO()
  for i, block in enumerate(python_blocks(path)):
    try:
      with contextlib.redirect_stdout(out):
        exec(compile(block, f"{path.name} block {i}", "exec"), namespace)  # pylint: disable=exec-used
    except Exception as e:  # pragma: no cover - the message names the block
      raise AssertionError(f"block {i} of {path.name} failed:\n{block}") from e
  printed = [line for line in out.getvalue().splitlines() if line.strip()]
  for expected in PRINTS.get(_name(path), []):
    assert expected in printed, (expected, printed)
  for name in WRITES.get(_name(path), []):
    assert (tmp_path / name).stat().st_size > 0, name


def test_autocast_guide_quotes_the_committed_compile_time_run():
  """docs/autocast.md's compile-time figures are the committed run's."""
  report = json.loads(
      (ROOT / "benchmarks" / "results" / "compile_time.json").read_text())
  guide = (ROOT / "docs" / "autocast.md").read_text()
  guide = " ".join(guide.split())  # Figures may sit across a line break.
  rows = {(r["route"], r["layers"], r["scan"]): r for r in report["results"]}
  for route, layers in (("autocast", 12), ("autocast", 24), ("autocast", 48),
                        ("hand", 48), ("float32", 24)):
    assert f"{rows[route, layers, False]['optimized_hlo']['instructions']:,}" in guide
  for route, key, layers in (("autocast", "compile", 48),
                             ("autocast_fp8", "compile", 48),
                             ("hand_fp8", "trace_lower", 48),
                             ("hand_fp8", "compile", 48)):
    assert f"{rows[route, layers, False]['ratios'][key]:.1f}x" in guide, (route, key)
  assert f"{rows['autocast_fp8', 48, False]['ratios_fp8']['compile']:.1f}x" in guide
  assert f"{rows['autocast', 48, True]['ratios']['compile']:.2f}x" in guide
  for route, layers, scan, key in (("with_policy_fp8", 48, False, "trace_lower"),
                                   ("with_policy_fp8", 48, False, "compile"),
                                   ("with_policy_fp8", 48, True, "compile"),
                                   ("autocast_fp8", 48, False, "hlo_instructions")):
    assert f"{rows[route, layers, scan]['ratios_fp8'][key]:.2f}x" in guide, (route, key)
  assert all(rows["with_policy_fp8", layers, scan]["ratios_fp8"]["hlo_instructions"] == 1.0
             for layers, scan in ((12, False), (24, False), (48, False), (48, True)))
  # Against the plain float8 step (issue 36): the program at every depth, the
  # totals at 12, 24 and 48 blocks, within the 1.3x target.
  assert f"{rows['hand_fp8', 48, False]['ratios']['hlo_instructions']:.2f}x" in guide
  for route in ("hand_fp8", "plain_fp8"):
    assert f"{rows[route, 48, False]['optimized_hlo']['instructions']:,}" in guide
  for route in ("hand_fp8", "with_policy_fp8"):
    plain = [rows[route, layers, False]["ratios_plain"] for layers in (12, 24, 48)]
    assert all(f"{p['hlo_instructions']:.2f}x" == "1.10x" for p in plain)
    totals = [f"{p['total']:.2f}x" for p in plain]
    assert f"{totals[0]}, {totals[1]} and {totals[2]}" in guide, (route, totals)
    assert all(p["total"] <= 1.3 for p in plain)


def test_precision_guide_quotes_the_committed_update_rounding_run():
  """docs/precision.md's compiled peaks are the committed run's, and the
  low-memory methods' peaks are no higher than the master copy's there."""
  report = json.loads(
      (ROOT / "benchmarks" / "results" / "update_rounding.json").read_text())
  guide = " ".join((ROOT / "docs" / "precision.md").read_text().split())
  peaks = {r["workload"]: {k: v["peak"] / 2**20 for k, v in r["memory"].items()}
           for r in report["results"]}
  for workload, names in (("mlp", ("copy", "stochastic_rounding", "kahan")),
                          ("transformer", ("copy", "kahan"))):
    for name in names:
      assert f"{peaks[workload][name]:.1f}" in guide, (workload, name)
    assert peaks[workload]["kahan"] <= peaks[workload]["copy"]
  assert peaks["mlp"]["stochastic_rounding"] <= peaks["mlp"]["copy"]
