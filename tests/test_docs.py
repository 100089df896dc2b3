"""Every ```python block of the README and of each guide in docs/ runs.

Blocks run in order, in one namespace per file, as a reader would paste them,
in a scratch directory (some write figures), with JAX's standard dtype
promotion (a user's default; optax's adam needs it). A block that needs names
from an earlier block of the same file may use them; nothing else is
defined. ```text, ```bash and ```diff blocks are not Python and are not run.
"""

import contextlib
import io
import pathlib
import re

import pytest

from helpers import ROOT

FILES = [ROOT / "README.md"] + sorted((ROOT / "docs").glob("*.md"))

#: What some files' blocks print or write, checked after they ran.
PRINTS = {
    "training_loops.md": ["True 3", "False", "True"],
    "diagnostics.md": ["True"],
}
WRITES = {"diagnostics.md": ["grads.png"]}


def python_blocks(path: pathlib.Path) -> list[str]:
  return re.findall(r"^```python\n(.*?)^```", path.read_text(),
                    re.DOTALL | re.MULTILINE)


def test_every_guide_has_python_blocks():
  for path in FILES:
    assert python_blocks(path), path.name


@pytest.mark.standard_promotion
@pytest.mark.parametrize("path", FILES, ids=lambda p: p.name)
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
  for expected in PRINTS.get(path.name, []):
    assert expected in printed, (expected, printed)
  for name in WRITES.get(path.name, []):
    assert (tmp_path / name).stat().st_size > 0, name
