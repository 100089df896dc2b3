"""Isolation from JAX internals (``_src/compat.py``).

* Which expected primitives the installed jax lacks (reported, never fatal).
* A jax whose internals moved: ``import jmp_lite`` still works, policies and
  loss scaling still work, and autocast raises a clear error naming the jax
  version.
* Both layouts of a scan's parameters (``num_consts``/``num_carry`` before jax
  0.11, the ``ft_in`` tree from 0.11).
"""

import subprocess
import sys
import warnings

import jax
import jax.numpy as jnp
import pytest

import jmp_lite
from jmp_lite._src import compat
from jmp_lite._src.autocast import interpreter as interpreter_lib
from jmp_lite._src.autocast import default_rules as table_lib

from helpers import example_env

# Primitives autocast cannot be useful without: matmuls, the float32 list's
# core, elementwise arithmetic, and the control flow every model uses.
ESSENTIAL = (
    "dot_general_p", "conv_general_dilated_p", "exp_p", "log_p", "reduce_sum_p",
    "add_p", "mul_p", "convert_element_type_p", "jit_p", "remat_p", "scan_p",
    "while_p", "cond_p", "custom_jvp_call_p", "custom_vjp_call_p",
)


def test_lists_the_expected_primitives_this_jax_lacks():
  missing = compat.missing_primitives(table_lib.EXPECTED_PRIMITIVES)
  if missing:  # Reported, so a new jax's removals show up in the test log.
    warnings.warn(f"jax {jax.__version__} lacks the primitives {missing}; "
                  "autocast leaves them out of its rule table.")
  assert not set(missing) & set(ESSENTIAL), missing
  for name in table_lib.EXPECTED_PRIMITIVES:
    prim = compat.primitive(name)
    assert (prim is None) == (name in missing)
    if prim is not None:
      assert prim in table_lib.DEFAULT_OP_RULES, name


def test_every_registered_higher_order_primitive_is_entered():
  assert set(interpreter_lib.HIGHER_ORDER) == {
      p for p, rule in table_lib.DEFAULT_OP_RULES.items() if rule == "recurse"}
  assert {compat.primitive(n) for n in interpreter_lib.HIGHER_ORDER_HANDLERS
          if compat.primitive(n) is not None} == set(interpreter_lib.HIGHER_ORDER)


def test_a_missing_primitive_name_is_dropped_not_an_error():
  assert compat.primitive("no_such_primitive_p") is None
  assert compat.primitives("exp_p", "no_such_primitive_p") == (jax.lax.exp_p,)


_BROKEN_JAX = """
import sys
sys.modules["jax.extend.linear_util"] = None   # as if jax had moved it
import jax, jax.numpy as jnp, optax
import jmp_lite
policy = jmp_lite.get_policy("mixed_float16")
assert policy.cast_to_compute(jnp.ones(2)).dtype == jnp.float16
opt = jmp_lite.loss_scaling(optax.sgd(0.1), jmp_lite.DynamicLossScale(2.0 ** 4))
state = opt.init({"w": jnp.ones(2)})
updates, state = opt.update({"w": jnp.full(2, 16.0)}, state)
assert abs(float(updates["w"][0]) + 0.1) < 1e-6, updates
try:
  jmp_lite.autocast(lambda x: x @ x, "f16")
except RuntimeError as err:
  print("ERROR:", err)
else:
  print("NO ERROR")
"""


def test_a_jax_without_an_internal_breaks_only_autocast():
  proc = subprocess.run([sys.executable, "-c", _BROKEN_JAX], capture_output=True,
                        text=True, env=example_env(), timeout=120, check=False)
  assert proc.returncode == 0, proc.stderr[-2000:]
  message = proc.stdout.strip()
  assert message.startswith("ERROR: jmp_lite.autocast cannot read the internals "
                            f"of jax {jax.__version__}"), message
  assert "jax.extend.linear_util" in message
  assert compat.SUPPORTED_JAX in message


def test_unsupported_error_names_the_version_and_the_way_out(monkeypatch):
  monkeypatch.setattr(compat, "_jaxprs_in_params", None)
  with pytest.raises(compat.UnsupportedJaxError, match=jax.__version__.replace(".", r"\.")):
    jmp_lite.autocast(lambda x: x, "bf16")
  with pytest.raises(compat.UnsupportedJaxError, match="with_policy"):
    jmp_lite.op_dtypes(lambda x: x, jnp.ones(2))
  # Disabled autocast never needs the internals.
  assert jmp_lite.autocast(lambda x: x + 1, "bf16", enabled=False)(1) == 2


def test_scan_parameters_of_either_layout():
  args = ["c1", "c2", "k", "x"]
  old = {"jaxpr": "body", "num_consts": 2, "num_carry": 1, "length": 3,
         "reverse": False, "unroll": 1, "linear": (False,) * 4}
  assert compat.scan_parts(old, args) == ("body", ["c1", "c2"], ["k"], ["x"])
  assert compat.scan_options(old) == {"length": 3, "reverse": False, "unroll": 1}

  def body(carry, x):
    return carry + x * 2.0, x
  jaxpr = jax.make_jaxpr(lambda c, xs: jax.lax.scan(body, c, xs))(
      jnp.float32(0), jnp.ones(3))
  (eqn,) = [e for e in jaxpr.jaxpr.eqns if e.primitive is jax.lax.scan_p]
  _, consts, carry, xs = compat.scan_parts(eqn.params, ["k", "x"])
  assert (consts, carry, xs) == ([], ["k"], ["x"])


def test_unknown_parameter_layout_is_a_clear_error():
  with pytest.raises(compat.UnsupportedJaxError, match=r"none of the parameters \('num_consts',\)"):
    compat.scan_parts({"jaxpr": None, "length": 1}, [])


def test_the_supported_range_is_the_pins_of_pyproject():
  """compat's version constants (used in error messages) say what
  pyproject.toml pins, so the two cannot drift apart."""
  import pathlib
  import tomllib
  from packaging.requirements import Requirement
  project = tomllib.loads(
      (pathlib.Path(__file__).resolve().parents[1] / "pyproject.toml").read_text()
  )["project"]
  specs = {r.name: r for r in map(Requirement, project["dependencies"])}
  specs.update({r.name: r for r in map(
      Requirement, project["optional-dependencies"]["flax"])})
  assert specs["jax"] == Requirement(compat.JAX_REQUIREMENT)
  floor = next(s.version for s in specs["jax"].specifier if s.operator == ">=")
  top = next(s.version for s in specs["jax"].specifier if s.operator == "<")
  major, minor = top.split(".")[:2]
  assert compat.SUPPORTED_JAX == f"{floor} to {major}.{int(minor) - 1}.x"
  assert next(s.version for s in specs["flax"].specifier
              if s.operator == ">=") == compat.FLAX_FLOOR
