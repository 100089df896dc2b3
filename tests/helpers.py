"""Helpers shared by the tests (a plain module: ``from helpers import ...``).

* Jaxpr inspection: :func:`all_eqns`, :func:`operand_dtypes`,
  :func:`full_precision_windows`, :func:`assert_all_f32`.
* Trees: :func:`assert_bit_identical` (chex for structure, dtypes and
  shapes; bytes for the values).
* Documentation: :func:`assert_documented_with_examples`.
* Training: :func:`pull_to_zero` (params at 1.0 pulled to 0 by an optimizer
  under loss scaling).
* Running the examples end to end: :data:`ROOT`, :func:`example_env`,
  :func:`run_example`, :func:`is_finite_number`, :func:`assert_exited_cleanly`,
  :func:`assert_is_png`, :func:`assert_finite_figures`.
"""

import contextlib
import inspect
import math
import os
import pathlib
import re
import subprocess
import sys

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jmp_lite
from jmp_lite._src import compat

ROOT = pathlib.Path(__file__).resolve().parents[1]
F32 = np.dtype(jnp.float32)

# ---------------------------------------------------------------------------
# Trees.
# ---------------------------------------------------------------------------


def assert_bit_identical(a, b):
  """The same structure, dtypes and shapes (chex), and the same bytes: stricter
  than equality, which takes -0.0 for 0.0 and any NaN for any other."""
  chex.assert_trees_all_equal_structs(a, b)
  chex.assert_trees_all_equal_dtypes(a, b)
  chex.assert_trees_all_equal_shapes(a, b)
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    assert np.asarray(x).tobytes() == np.asarray(y).tobytes(), (x, y)


# ---------------------------------------------------------------------------
# Jaxpr inspection.
# ---------------------------------------------------------------------------


def all_eqns(jaxpr):
  """Every equation of a jaxpr, recursing into jit, remat, scan, cond..."""
  return compat.walk_eqns(jaxpr)


def lowered_functions(fn, *args):
  """The names of the functions in ``jax.jit(fn)``'s lowered StableHLO
  (``main`` and every function it calls)."""
  text = jax.jit(fn).lower(*args).as_text()
  return re.findall(r"func\.func (?:private |public )?@([\w.$-]+)", text)


def operand_dtypes(jaxpr, primitives):
  """``[(primitive, (dtype of each array operand))]`` for the given primitives."""
  return [
      (e.primitive.name, tuple(np.dtype(v.aval.dtype) for v in e.invars))
      for e in all_eqns(jaxpr)
      if e.primitive.name in primitives
  ]


def full_precision_windows(jaxpr, half):
  """The runs of top-level equations between a cast half -> f32 and the next
  cast f32 -> half: where a norm layer runs under ``FullPrecision``."""
  windows, current = [], None
  for eqn in jaxpr.jaxpr.eqns:
    if eqn.primitive.name == "convert_element_type":
      src, dst = np.dtype(eqn.invars[0].aval.dtype), np.dtype(eqn.params["new_dtype"])
      if (src, dst) == (half, F32):
        current = []
        continue
      if (src, dst) == (F32, half) and current is not None:
        windows.append(current)
        current = None
        continue
    if current is not None:
      current.append(eqn)
  return windows


def assert_all_f32(window):
  """Every floating operand of every equation in ``window`` is float32."""
  dtypes = {
      np.dtype(v.aval.dtype)
      for eqn in window
      for v in eqn.invars
      if jnp.issubdtype(v.aval.dtype, jnp.floating)
  }
  assert dtypes == {F32}, [
      (e.primitive.name, [str(v.aval) for v in e.invars]) for e in window
  ]
  names = [e.primitive.name for e in window]
  assert "reduce_sum" in names and "mul" in names and "rsqrt" in names, names


# ---------------------------------------------------------------------------
# Documentation.
# ---------------------------------------------------------------------------


def assert_documented_with_examples(module, name):
  """``module.name`` has a docstring with an example (``>>>``), and so does
  each public method of a class; ``DEFAULT_MODULE_RULES`` has a ``#:`` comment."""
  obj = getattr(module, name)
  if name == "DEFAULT_MODULE_RULES":
    source = inspect.getsource(inspect.getmodule(module.ModuleRules))
    assert re.search(r"^#:.*\n(#:.*\n)*DEFAULT_MODULE_RULES = ", source, re.MULTILINE)
    return
  doc = inspect.getdoc(obj) or ""
  assert "Example" in doc and ">>>" in doc, name
  if inspect.isclass(obj):
    for attr, value in vars(obj).items():
      if not attr.startswith("_") and inspect.isfunction(value):
        assert inspect.getdoc(value), f"{name}.{attr}"


# ---------------------------------------------------------------------------
# Running the examples.
# ---------------------------------------------------------------------------


def example_env():
  """The environment an example runs in as a subprocess.

  The repository root goes on ``PYTHONPATH`` (so an uninstalled checkout
  works), and the examples get one device, not the 8 simulated ones conftest
  asks for.
  """
  env = dict(os.environ)
  env["PYTHONPATH"] = os.pathsep.join(
      p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
  env["XLA_FLAGS"] = " ".join(
      flag for flag in env.get("XLA_FLAGS", "").split()
      if not flag.startswith("--xla_force_host_platform_device_count"))
  return env


def run_example(script, *args):
  """Runs the example ``script`` (its path under ``examples/``) with ``args``
  as a user would, ``python -m examples.<name>`` from the repository root;
  never raises."""
  module = f"examples.{pathlib.Path(script).stem}"
  return subprocess.run(
      [sys.executable, "-m", module, *map(str, args)],
      capture_output=True, text=True, env=example_env(), cwd=ROOT, timeout=300,
      check=False)


def is_finite_number(x):
  """Whether ``x`` is an int or float (not a bool) and finite."""
  is_number = isinstance(x, (int, float)) and not isinstance(x, bool)
  return is_number and math.isfinite(x)


def assert_exited_cleanly(proc):
  """The example's process exited with 0 (else: the end of its stderr)."""
  assert proc.returncode == 0, proc.stderr[-3000:]


def assert_is_png(path):
  """``path`` holds a PNG image of some size."""
  png = path.read_bytes()
  assert png.startswith(b"\x89PNG\r\n\x1a\n") and len(png) > 10_000


def assert_finite_figures(runs, numbers, steps):
  """Each run's ``numbers`` are finite and its per-step histories (loss, loss
  scale) have ``steps`` entries."""
  for name, run in runs.items():
    for key in numbers:
      assert is_finite_number(run[key]), (name, key, run[key])
    assert len(run["loss_history"]) == steps, name
    assert len(run["loss_scale_history"]) == steps, name


def orbax_round_trip(tree, path, target=None):
  """``tree`` saved with orbax's ``StandardCheckpointer`` at ``path`` and
  restored into ``target`` (an abstract tree: the documented
  ``jax.eval_shape(opt.init, params)`` for an optimizer state; by default
  ``tree``'s own structure). orbax is in the ``test`` extra: never skipped."""
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
  if target is None:
    target = jax.eval_shape(lambda: tree)
  with ocp.StandardCheckpointer() as checkpointer:
    checkpointer.save(path, tree)
    checkpointer.wait_until_finished()
    return checkpointer.restore(path, target)


# ---------------------------------------------------------------------------
# jax_debug_nans / jax_debug_infs.
# ---------------------------------------------------------------------------


@contextlib.contextmanager
def debug_nans_and_infs(enabled=True):
  """``jax_debug_nans`` and ``jax_debug_infs`` set to ``enabled`` inside the
  block (restored after). With them on, an eager op or a jitted program whose
  output holds NaN/inf raises ``FloatingPointError``: a finite run must pass
  with them on (no state jmp_lite creates holds NaN or inf); a step that gets
  a NaN/inf on purpose runs inside ``debug_nans_and_infs(False)``."""
  with jax.debug_nans(enabled), jax.debug_infs(enabled):
    yield


def faulty(value=True):
  """``debug_nans_and_infs(False)`` where ``value`` (a step given a NaN/inf
  on purpose), a no-op context elsewhere."""
  return debug_nans_and_infs(False) if value else contextlib.nullcontext()


def _quadratic_loss(params):
  return 0.5 * jnp.sum(params["w"].astype(jnp.float32) ** 2)


@jax.jit
def _scaled_quadratic_grads(params, loss_scale):
  return jax.grad(lambda p: loss_scale.scale(_quadratic_loss(p)))(params)


def pull_to_zero(inner, loss_scale, dtype, *, n, steps, jit):
  """``steps`` steps of ``jmp_lite.loss_scaling(inner, loss_scale)`` on ``n``
  params at 1.0 in ``dtype`` and the loss ``0.5 * sum(w**2)``: the update
  eager or (``jit``) the whole step jitted. The loss's gradients are one
  jitted program either way: an eager variant is about the optimizer's eager
  update, not jax.grad's. Returns ``(params, state)``."""
  opt = jmp_lite.loss_scaling(inner, loss_scale)
  params = {"w": jnp.ones(n, dtype)}
  state = opt.init(params)

  def step(params, state):
    grads = _scaled_quadratic_grads(params, jmp_lite.get_loss_scale(state))
    updates, state = opt.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  step = maybe_jit(step, jit)
  for _ in range(steps):
    params, state = step(params, state)
  return params, state


#: A test's eager and jitted variants: ``@JIT`` passes ``jit`` (False, True).
JIT = pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])


def default_run_keeps(values, keep=0, *, unpack=False):
  """A parametrize grid whose case ``values[keep]`` runs in the README's
  selection and whose other cases are marked ``grid``: the README's command
  leaves them out (pyproject.toml's ``-m 'not slow and not grid'``), every
  nox session that runs the behavioural tests runs them (``-m 'not slow'``:
  newest-3.13, floor, and the upgrade-flag run of newest-3.12). ``unpack``
  for several argnames (each value a tuple). The ids do not change."""
  values = list(values)
  out = []
  for i, v in enumerate(values):
    if i == keep:
      out.append(v)
    elif isinstance(v, type(pytest.param(None))):  # already a pytest.param
      out.append(pytest.param(*v.values, marks=(*v.marks, pytest.mark.grid),
                              id=v.id))
    elif unpack:
      out.append(pytest.param(*v, marks=pytest.mark.grid))
    else:
      out.append(pytest.param(v, marks=pytest.mark.grid))
  return out


def maybe_jit(fn, jit, **jit_kwargs):
  """``jax.jit(fn, **jit_kwargs)`` for the jitted variant, ``fn`` itself for the eager one."""
  return jax.jit(fn, **jit_kwargs) if jit else fn
