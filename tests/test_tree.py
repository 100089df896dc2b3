"""Tests for ``all_finite`` and ``select_tree`` (``jmp_lite._src.tree``)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jmp_lite

from helpers import JIT
from helpers import maybe_jit

FLOAT_DTYPES = (jnp.float16, jnp.bfloat16, jnp.float32)

# Leaves that cannot be jit arguments; tests close over them instead.
STATICS = {"object": object(), "none": None, "string": "relu", "py_int": 7}


def finite_arrays():
  """A tree of finite arrays: every float dtype, numpy and jax, ints and bools."""
  return {
      "f16": jnp.linspace(-2, 2, 5, dtype=jnp.float16),
      "bf16": jnp.ones((2, 3), jnp.bfloat16),
      "f32": jnp.full((4,), -1e30, jnp.float32),
      "np_f32": np.ones((2,), np.float32),
      "ints": jnp.arange(3, dtype=jnp.int32),
      "np_ints": np.array([2**15 - 1], np.int16),
      "bools": jnp.array([True, False]),
      "nested": [{"w": jnp.zeros((2, 2), jnp.float32)}, (jnp.float16(1.0),)],
  }


def all_finite_with_statics(arrays, jit):
  return maybe_jit(lambda a: jmp_lite.all_finite({**a, **STATICS}), jit)(arrays)


def assert_scalar_bool(x, expected):
  assert isinstance(x, jax.Array)
  assert x.shape == ()
  assert x.dtype == np.bool_
  assert bool(x) is expected


# ---------------------------------------------------------------------------
# all_finite.
# ---------------------------------------------------------------------------


@JIT
def test_all_finite_true_for_finite_mixed_tree(jit):
  assert_scalar_bool(all_finite_with_statics(finite_arrays(), jit), True)


def with_bad_value(dtype, bad, numpy=False):
  """A (3,) array of ``dtype`` holding ``bad`` among finite values."""
  value = np.ones((3,), dtype)
  value[1] = bad
  return value if numpy else jnp.asarray(value)


@JIT
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_all_finite_false_for_any_non_finite_leaf(dtype, bad, jit):
  arrays = {**finite_arrays(), "extra": with_bad_value(dtype, bad)}
  assert_scalar_bool(all_finite_with_statics(arrays, jit), False)


@JIT
@pytest.mark.parametrize("dtype,bad", [(jnp.float16, np.nan), (jnp.bfloat16, -np.inf)])
def test_all_finite_false_for_non_finite_numpy_or_nested_leaf(dtype, bad, jit):
  arrays = {**finite_arrays(), "extra": with_bad_value(dtype, bad, numpy=True)}
  assert_scalar_bool(all_finite_with_statics(arrays, jit), False)
  arrays = finite_arrays()
  arrays["nested"][0]["bad"] = with_bad_value(dtype, bad)
  assert_scalar_bool(all_finite_with_statics(arrays, jit), False)


@JIT
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_all_finite_non_finite_scalar_leaf(dtype, jit):
  fn = maybe_jit(jmp_lite.all_finite, jit)
  assert_scalar_bool(fn({"x": jnp.array(np.nan, dtype)}), False)
  assert_scalar_bool(fn(jnp.array(1.0, dtype)), True)


@JIT
@pytest.mark.parametrize("empty", [{}, [], (), None, {"a": [], "b": {}}])
def test_all_finite_empty_tree_is_finite(empty, jit):
  fn = maybe_jit(jmp_lite.all_finite, jit)
  assert_scalar_bool(fn(empty), True)


def test_all_finite_tree_without_float_leaves_is_finite():
  tree = {"i": jnp.arange(3), "b": np.array([True]), **STATICS}
  assert_scalar_bool(jmp_lite.all_finite(tree), True)


@JIT
@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16])
def test_all_finite_half_max_is_finite_and_overflow_is_not(dtype, jit):
  fn = maybe_jit(jmp_lite.all_finite, jit)
  biggest = jnp.array(jnp.finfo(dtype).max, dtype)
  assert_scalar_bool(fn({"max": biggest, "min": -biggest}), True)
  overflow = biggest * jnp.array(2, dtype)
  assert not np.isfinite(np.asarray(overflow, np.float32))
  assert_scalar_bool(fn({"max": biggest, "overflow": overflow}), False)


# ---------------------------------------------------------------------------
# select_tree.
# ---------------------------------------------------------------------------


def branch(offset):
  """A tree of arrays of several dtypes whose values depend on ``offset``."""
  return {
      "f32": jnp.full((2, 3), offset, jnp.float32),
      "f16": jnp.full((2,), offset, jnp.float16),
      "bf16": jnp.full((), offset, jnp.bfloat16),
      "ints": jnp.full((3,), offset, jnp.int32),
      "bools": jnp.full((2,), offset > 0, jnp.bool_),
      "nested": [(jnp.full((1,), offset, jnp.float32),)],
  }


def assert_trees_equal(x, y):
  x_leaves, x_def = jax.tree_util.tree_flatten(x)
  y_leaves, y_def = jax.tree_util.tree_flatten(y)
  assert x_def == y_def
  for a, b in zip(x_leaves, y_leaves):
    assert a.dtype == b.dtype
    np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


@JIT
@pytest.mark.parametrize("pred", [True, False])
def test_select_tree_picks_a_branch(pred, jit):
  a, b = branch(1), branch(-1)
  # Equal (not necessarily identical) non-array leaves on both sides.
  statics_a = {"object": STATICS["object"], "none": None, "string": "relu", "n": 3}
  statics_b = {"object": STATICS["object"], "none": None,
               "string": "".join(["re", "lu"]), "n": 3}

  def select(pred, a, b):
    out = jmp_lite.select_tree(pred, {**a, **statics_a}, {**b, **statics_b})
    for key, value in statics_a.items():
      assert out[key] is value
    return {k: out[k] for k in a}

  out = maybe_jit(select, jit)(jnp.array(pred), a, b)
  assert_trees_equal(out, a if pred else b)


def test_select_tree_under_jit_with_traced_predicate():
  @jax.jit
  def step(x, a, b):
    return jmp_lite.select_tree(jmp_lite.all_finite(x), a, b)

  a, b = branch(2), branch(-3)
  assert_trees_equal(step(jnp.ones(2), a, b), a)
  assert_trees_equal(step(jnp.array([1.0, np.inf]), a, b), b)


@pytest.mark.parametrize("pred", [True, False, np.bool_(True), np.bool_(False)])
def test_select_tree_accepts_python_and_numpy_bools(pred):
  a, b = branch(1), branch(0)
  assert_trees_equal(jmp_lite.select_tree(pred, a, b), a if pred else b)


def test_select_tree_accepts_numpy_leaves():
  a = {"w": np.ones((2,), np.float32), "i": np.arange(2)}
  b = {"w": np.zeros((2,), np.float32), "i": np.arange(2) + 5}
  out = jmp_lite.select_tree(jnp.array(False), a, b)
  np.testing.assert_array_equal(out["w"], b["w"])
  np.testing.assert_array_equal(out["i"], b["i"])


def test_select_tree_differing_python_numbers_are_selected():
  out = jmp_lite.select_tree(jnp.array(False), {"n": 1}, {"n": 2})
  assert int(out["n"]) == 2


@pytest.mark.parametrize(
    "pred", [jnp.array([True, False]), np.array([True]), jnp.ones((1, 1), bool)]
)
def test_select_tree_non_scalar_predicate_is_a_value_error(pred):
  with pytest.raises(ValueError, match="scalar"):
    jmp_lite.select_tree(pred, branch(1), branch(0))


@pytest.mark.parametrize(
    "pred",
    [jnp.float32(1.0), jnp.array(1, jnp.int32), np.float32(0.0), 1, 1.0, "yes", None],
)
def test_select_tree_non_bool_predicate_is_a_type_error(pred):
  with pytest.raises(TypeError, match="bool"):
    jmp_lite.select_tree(pred, branch(1), branch(0))


def test_select_tree_non_bool_traced_predicate_is_a_type_error():
  fn = jax.jit(lambda p, a, b: jmp_lite.select_tree(p, a, b))
  with pytest.raises(TypeError, match="float32"):
    fn(jnp.float32(1.0), branch(1), branch(0))


@pytest.mark.parametrize(
    "a,b",
    [
        ({"a": jnp.ones(2)}, {"b": jnp.ones(2)}),
        ([jnp.ones(2)], [jnp.ones(2), jnp.ones(2)]),
        ({"a": jnp.ones(2)}, [jnp.ones(2)]),
        ({"a": None}, {"a": jnp.ones(2)}),
    ],
)
def test_select_tree_mismatched_structures_are_a_value_error(a, b):
  # JAX's own pytree error (its wording differs between jax versions).
  with pytest.raises(ValueError):
    jmp_lite.select_tree(jnp.array(True), a, b)


def test_select_tree_mismatched_shapes_are_named_by_jax():
  a = {"layer": {"kernel": jnp.ones((2, 3)), "bias": jnp.ones(3)}}
  b = {"layer": {"kernel": jnp.ones((3, 2)), "bias": jnp.ones(3)}}
  with pytest.raises(TypeError, match=r"same shapes.*\(3, 2\).*\(2, 3\)"):
    jmp_lite.select_tree(jnp.array(True), a, b)


def test_select_tree_mismatched_dtypes_are_named_by_jax():
  a = {"layer": [jnp.ones(3, jnp.float32)]}
  b = {"layer": [jnp.ones(3, jnp.float16)]}
  with pytest.raises(TypeError, match=r"same dtypes.*float16, float32"):
    jmp_lite.select_tree(jnp.array(True), a, b)


@pytest.mark.parametrize(
    "x,y",
    [
        (object(), object()),
        ("relu", "gelu"),
        (jnp.ones(2), "relu"),
        ("relu", jnp.ones(2)),
    ],
)
def test_select_tree_differing_non_arrays_are_a_type_error(x, y):
  with pytest.raises(TypeError, match=r"\['act'\]"):
    jmp_lite.select_tree(jnp.array(True), {"act": x}, {"act": y})
