"""The test matrix: ``nox`` (or ``nox -s floor``, ``nox -s newest``...).

Sessions (each installs jmp_lite with its ``test`` extra in a fresh venv and
runs the whole suite, as the README's test command does):

* ``newest-3.12``, ``newest-3.13``: the newest jax, jaxlib, flax and optax the
  pins in ``pyproject.toml`` allow (jax >= 0.11 needs Python >= 3.12).
* ``floor``: Python 3.11 with every pinned package at the lower bound of its
  pin, read from ``pyproject.toml``: the oldest versions we claim to support.

The default environment (Python 3.11 with the newest jax it has) is the
README's own test command, which ``.ci/run`` runs before this matrix.

A session whose interpreter is missing fails (it is never skipped). Python
versions installed with pyenv are found even when they are not on ``PATH``.
"""

from __future__ import annotations

import glob
import os
import pathlib
import shutil
import subprocess
import tomllib

import nox
from packaging.requirements import Requirement

nox.options.error_on_missing_interpreters = True
nox.options.download_python = "never"
nox.options.default_venv_backend = "venv"
nox.options.sessions = ["newest", "floor"]

ROOT = pathlib.Path(__file__).resolve().parent
# The packages whose supported range the pins state and the matrix tests.
RANGED = ("jax", "jaxlib", "flax", "optax")
PYTEST = ("python", "-m", "pytest", "-q")


def _add_pyenv_versions_to_path() -> None:
  """Appends pyenv's interpreters to PATH (after its shims, which only run
  the versions selected globally)."""
  if not shutil.which("pyenv"):
    return
  root = subprocess.run(["pyenv", "root"], capture_output=True, text=True,
                        check=False).stdout.strip()
  extra = sorted(glob.glob(os.path.join(root, "versions", "*", "bin")))
  os.environ["PATH"] = os.pathsep.join([os.environ.get("PATH", ""), *extra])


_add_pyenv_versions_to_path()


def floor_pins() -> list[str]:
  """``name==lower bound`` for each ranged package pinned in pyproject.toml."""
  project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
  specs = list(project["dependencies"])
  for extra in project["optional-dependencies"].values():
    specs.extend(extra)
  pins = {}
  for spec in map(Requirement, specs):
    if spec.name in RANGED:
      floors = [s.version for s in spec.specifier if s.operator == ">="]
      if not floors:
        raise ValueError(f"pyproject.toml pins {spec} without a lower bound")
      pins[spec.name] = f"{spec.name}=={floors[0]}"
  return sorted(pins.values())


def _versions(session: nox.Session) -> None:
  session.run("python", "-c", "import sys, jax, jaxlib, flax, optax; "
              "print('Python', sys.version.split()[0], '| jax', jax.__version__, "
              "'| jaxlib', jaxlib.__version__, '| flax', flax.__version__, "
              "'| optax', optax.__version__)")


@nox.session(python=["3.12", "3.13"])
def newest(session: nox.Session) -> None:
  """The whole suite on the newest releases the pins allow."""
  session.install("--upgrade", "-e", ".[test]")
  _versions(session)
  session.run(*PYTEST, *session.posargs)


@nox.session(python="3.11")
def floor(session: nox.Session) -> None:
  """The whole suite with jax, jaxlib, flax and optax at their lower pins."""
  constraints = pathlib.Path(session.create_tmp()) / "floor.txt"
  constraints.write_text("\n".join(floor_pins()) + "\n")
  session.install("-e", ".[test]", "-c", str(constraints))
  _versions(session)
  session.run(*PYTEST, *session.posargs)
