"""The test matrix: ``nox`` (or ``nox -s floor``, ``nox -s newest``, ``nox -s bench``...).

Sessions (each installs jmp_lite with its ``test`` extra in a fresh venv):

* ``newest-3.12`` and ``newest-3.13``: the newest jax, jaxlib, flax and
  optax the pins in ``pyproject.toml`` allow (jax >= 0.11 needs Python >=
  3.12), sharing the work: 3.13 runs the README's selection (every test but
  the runs of whole programs); 3.12 runs the slow stage (the runs of whole
  programs: examples, benchmarks, the docs' code blocks, docstring examples,
  multi-process jobs), then the README's selection with JAX's upgrade flags
  on, through the environment variables jax reads for them:
  ``JAX_REMAT3=1 JAX_CUSTOM_VJP3=1 JAX_CUSTOM_JVP3=1`` (about to become jax's
  defaults; ``jax_scan3`` stays off until JAX differentiates it, and
  autocast refuses its ``Scan3`` with an error naming it).
* ``floor``: the README's selection on Python 3.11 with every pinned package
  at the lower bound of its pin, read from ``pyproject.toml``: the oldest
  versions we claim to support.
* ``upgrade-flags``: the upgrade-flag run of ``newest-3.12`` alone (not in
  the default list: ``newest-3.12`` runs it); ``plain-3.12``: the README's
  selection on Python 3.12 without the flags (not in the default list:
  ``newest-3.13`` runs that selection on the same releases).
* ``bench``: the GPU suite's tests (``tests/test_gpu_suite.py``) with the
  ``bench`` extra, PyTorch, installed, so that the torch.amp side-by-side runs
  end to end at tiny sizes on the CPU (its tests carry the marker ``torch``,
  which every other selection leaves out). The
  tests need only a CPU build of PyTorch, and PyPI's Linux wheels bundle CUDA
  (about 0.5 GB, plus about 3 GB of CUDA libraries), so the session installs
  ``BENCH_TORCH`` (default ``torch==2.13.0``, the version the session tests)
  first, with PyTorch's CPU wheel index added (``BENCH_TORCH_INDEX``, default
  https://download.pytorch.org/whl/cpu; pip takes the ``+cpu`` build, which
  sorts above PyPI's, from there or from wherever pip's own configuration
  --find-links, a mirror-- offers one; ``BENCH_TORCH_INDEX=`` adds no
  index), then ``.[test,bench]``, which that torch satisfies. E.g.
  ``BENCH_TORCH='torch>=2.4' nox -s bench`` tests the newest torch.

The slow stage runs once in CI, in ``newest-3.12``, on the newest jax; the
default environment (``.ci/run``: this machine's Python 3.11 with the newest
jax it has, the 0.10 line), the floor and Python 3.13 run the README's
selection. ``nox -s newest-3.13 -- -m "slow and not torch"`` runs the slow
stage there by hand (arguments after ``--`` are added to every pytest run of
a session; a later ``-m`` replaces the session's own).

The default environment is the README's own test command, which ``.ci/run``
runs before this matrix. Every session that runs the README's selection here
runs it with ``-m "not slow"``: also the cases of parametrize grids that the
README's command leaves out (marker ``grid``, ``tests/helpers.py``'s
``default_run_keeps``, which keeps one case of each such grid there).

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
nox.options.sessions = ["newest", "floor", "bench"]

ROOT = pathlib.Path(__file__).resolve().parent
# The packages whose supported range the pins state and the matrix tests.
RANGED = ("jax", "jaxlib", "flax", "optax")
PYTEST = ("python", "-m", "pytest", "-q")
#: The slow stage: the runs of whole programs (the PyTorch ones: ``bench``).
SLOW = ("-m", "slow and not torch")
#: The behavioural tests: the README's selection and the grid cases it leaves
#: out (marker ``grid``: tests/helpers.py's ``default_run_keeps``).
BEHAVIOUR = ("-m", "not slow")
#: Every test of tests/test_gpu_suite.py, the PyTorch ones included.
ALL = ("-m", "slow or not slow")
#: jax's upgrade flags (config flags read ``JAX_<NAME>`` environment variables).
UPGRADE_FLAGS = {"JAX_REMAT3": "1", "JAX_CUSTOM_VJP3": "1",
                 "JAX_CUSTOM_JVP3": "1"}
#: The PyTorch the bench session installs, and the index it adds for it.
BENCH_TORCH = os.environ.get("BENCH_TORCH", "torch==2.13.0")
BENCH_TORCH_INDEX = os.environ.get("BENCH_TORCH_INDEX", "https://download.pytorch.org/whl/cpu")


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
  """The newest releases the pins allow: on 3.13 the README's selection; on
  3.12 the slow stage and the README's selection under the upgrade flags."""
  session.install("--upgrade", "-e", ".[test]")
  _versions(session)
  if session.python == "3.12":
    session.run(*PYTEST, *SLOW, *session.posargs)
    _upgrade_flags_run(session)
  else:
    session.run(*PYTEST, *BEHAVIOUR, *session.posargs)


def _upgrade_flags_run(session: nox.Session) -> None:
  session.run("python", "-c", "import jax; print('upgrade flags:', "
              "jax.config.jax_remat3, jax.config.jax_custom_vjp3, "
              "jax.config.jax_custom_jvp3)", env=UPGRADE_FLAGS)
  session.run(*PYTEST, *BEHAVIOUR, *session.posargs, env=UPGRADE_FLAGS)


@nox.session(python="3.12", name="upgrade-flags")
def upgrade_flags(session: nox.Session) -> None:
  """The README's selection on the newest releases with JAX's upgrade flags on
  (``newest-3.12`` runs it too)."""
  session.install("--upgrade", "-e", ".[test]")
  _versions(session)
  _upgrade_flags_run(session)


@nox.session(python="3.12", name="plain-3.12")
def plain_312(session: nox.Session) -> None:
  """The README's selection on the newest releases, Python 3.12."""
  session.install("--upgrade", "-e", ".[test]")
  _versions(session)
  session.run(*PYTEST, *BEHAVIOUR, *session.posargs)


@nox.session(python="3.11")
def floor(session: nox.Session) -> None:
  """The README's selection with jax, jaxlib, flax and optax at their lower
  pins."""
  constraints = pathlib.Path(session.create_tmp()) / "floor.txt"
  constraints.write_text("\n".join(floor_pins()) + "\n")
  session.install("-e", ".[test]", "-c", str(constraints))
  _versions(session)
  session.run(*PYTEST, *BEHAVIOUR, *session.posargs)


@nox.session(python="3.11")
def bench(session: nox.Session) -> None:
  """The GPU suite's tests with PyTorch (a CPU build): the torch.amp side."""
  index = ("--extra-index-url", BENCH_TORCH_INDEX) if BENCH_TORCH_INDEX else ()
  session.install(BENCH_TORCH, *index)
  session.install("-e", ".[test,bench]")
  _versions(session)
  session.run("python", "-c", "import torch; print('torch', torch.__version__, "
              "'| CUDA', torch.version.cuda)")
  session.run(*PYTEST, *ALL, "tests/test_gpu_suite.py", *session.posargs)
