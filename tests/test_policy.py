"""Tests for the policy grammar, ``Policy`` and casting (``jmp_lite._src.policy``)."""

import dataclasses
import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jmp_lite
from jmp_lite._src import compat
from jmp_lite._src import policy as policy_lib

from helpers import JIT
from helpers import maybe_jit

F16 = np.dtype(jnp.float16)
BF16 = np.dtype(jnp.bfloat16)
F32 = np.dtype(jnp.float32)
F64 = np.dtype(jnp.float64)

# Every dtype name of the grammar and the dtype it means ("half" is float16 on
# CPU/GPU and bfloat16 on TPU, so it is resolved through half_dtype()).
DTYPE_ALIASES = (
    ("full", F32),
    ("f32", F32),
    ("float32", F32),
    ("half", None),
    ("f16", F16),
    ("float16", F16),
    ("bf16", BF16),
    ("bfloat16", BF16),
    ("f64", F64),
    ("float64", F64),
)

PARAM_KEYS = ("p", "params")
COMPUTE_KEYS = ("c", "compute")
OUTPUT_KEYS = ("o", "output")

POLICY_DTYPES = (F32, F16, BF16, F64)

# The first name of each dtype: what str(policy) prints (jmp's convention).
SHORT_NAMES = {F32: "full", F16: "f16", BF16: "bf16", F64: "f64"}


def resolve(dtype):
  """The dtype an alias means, resolving "half" for the current backend."""
  return jmp_lite.half_dtype() if dtype is None else dtype


def assert_policy(policy, param, compute, output):
  assert isinstance(policy, jmp_lite.Policy)
  assert (policy.param_dtype, policy.compute_dtype, policy.output_dtype) == (
      param,
      compute,
      output,
  )


def all_eqns(jaxpr):
  """The equations of a (closed) jaxpr, those of nested jaxprs included."""
  return list(compat.walk_eqns(jaxpr))


def primitive_names(jaxpr):
  """Names of the primitives of a jaxpr, nested jaxprs included."""
  return [eqn.primitive.name for eqn in all_eqns(jaxpr)]


def find_eqns(jaxpr, name):
  """The equations of a jaxpr (nested ones included) named ``name``."""
  return [eqn for eqn in all_eqns(jaxpr) if eqn.primitive.name == name]


# ---------------------------------------------------------------------------
# Grammar.
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("name,dtype", DTYPE_ALIASES)
def test_bare_dtype_sets_all_three(name, dtype):
  dtype = resolve(dtype)
  assert_policy(jmp_lite.get_policy(name), dtype, dtype, dtype)


@pytest.mark.parametrize("name,dtype", DTYPE_ALIASES)
def test_compute_alias_defaults_params_to_f32_and_output_to_compute(name, dtype):
  dtype = resolve(dtype)
  for key in COMPUTE_KEYS:
    assert_policy(jmp_lite.get_policy(f"{key}={name}"), F32, dtype, dtype)


@pytest.mark.parametrize("name,dtype", DTYPE_ALIASES)
def test_param_alias_cascades_to_compute_and_output(name, dtype):
  dtype = resolve(dtype)
  for key in PARAM_KEYS:
    assert_policy(jmp_lite.get_policy(f"{key}={name}"), dtype, dtype, dtype)


@pytest.mark.parametrize("name,dtype", DTYPE_ALIASES)
def test_output_alias_alone_keeps_f32_params_and_compute(name, dtype):
  dtype = resolve(dtype)
  for key in OUTPUT_KEYS:
    assert_policy(jmp_lite.get_policy(f"{key}={name}"), F32, F32, dtype)


@pytest.mark.parametrize(
    "p_key,c_key,o_key", list(itertools.product(PARAM_KEYS, COMPUTE_KEYS, OUTPUT_KEYS))
)
def test_every_key_alias_sets_its_field(p_key, c_key, o_key):
  spec = f"{p_key}=f16,{c_key}=bf16,{o_key}=f64"
  assert_policy(jmp_lite.get_policy(spec), F16, BF16, F64)
  # The order of the pairs does not matter.
  reordered = f"{o_key}=f64,{p_key}=f16,{c_key}=bf16"
  assert jmp_lite.get_policy(reordered) == jmp_lite.get_policy(spec)


@pytest.mark.parametrize(
    "spec,expected",
    [
        ("c=f16", (F32, F16, F16)),
        ("p=f16", (F16, F16, F16)),
        ("c=bf16,o=full", (F32, BF16, F32)),
        ("p=bf16,o=f32", (BF16, BF16, F32)),
        ("p=f64,c=f16", (F64, F16, F16)),
        ("o=f16", (F32, F32, F16)),
        ("params=float32,compute=bfloat16,output=float32", (F32, BF16, F32)),
    ],
)
def test_defaults_cascade(spec, expected):
  assert_policy(jmp_lite.get_policy(spec), *expected)


@pytest.mark.parametrize(
    "preset,expected",
    [
        ("mixed_float16", (F32, F16, F32)),
        ("mixed_bfloat16", (F32, BF16, F32)),
        ("mixed_half", (F32, None, F32)),
    ],
)
def test_presets(preset, expected):
  expected = tuple(resolve(d) for d in expected)
  assert_policy(jmp_lite.get_policy(preset), *expected)
  assert_policy(jmp_lite.get_policy(f"  {preset.upper()} "), *expected)
  assert jmp_lite.get_policy(policy_lib.PRESETS[preset]) == jmp_lite.get_policy(preset)


@pytest.mark.parametrize(
    "spec,expected",
    [
        (" P = F32 , C=BF16 ", (F32, BF16, BF16)),
        ("\tParams=Float32,\nCompute = F16 ,Output= FULL\n", (F32, F16, F32)),
        ("  BF16  ", (BF16, BF16, BF16)),
        ("Half", (None, None, None)),
    ],
)
def test_whitespace_and_case_are_ignored(spec, expected):
  expected = tuple(resolve(d) for d in expected)
  assert_policy(jmp_lite.get_policy(spec), *expected)


def test_str_uses_jmp_first_names():
  assert str(jmp_lite.get_policy("c=f16")) == "p=full,c=f16,o=f16"
  assert str(jmp_lite.get_policy("mixed_bfloat16")) == "p=full,c=bf16,o=full"
  assert str(jmp_lite.Policy(F64, F32, F16)) == "p=f64,c=full,o=f16"


@pytest.mark.parametrize(
    "param,compute,output", list(itertools.product(POLICY_DTYPES, repeat=3))
)
def test_str_round_trips_through_get_policy(param, compute, output):
  policy = jmp_lite.Policy(param, compute, output)
  text = str(policy)
  expected = (
      f"p={SHORT_NAMES[param]},c={SHORT_NAMES[compute]},o={SHORT_NAMES[output]}"
  )
  assert text == expected
  assert jmp_lite.get_policy(text) == policy


def test_get_policy_returns_a_policy_unchanged():
  policy = jmp_lite.Policy(F32, F16, F32)
  assert jmp_lite.get_policy(policy) is policy


# ---------------------------------------------------------------------------
# Policy objects: canonical dtypes, equality, hashing, immutability.
# ---------------------------------------------------------------------------

F16_SPELLINGS = (jnp.float16, np.float16, "f16", "float16", " F16 ", np.dtype("float16"))


@pytest.mark.parametrize("spelling", F16_SPELLINGS)
def test_dtype_spellings_are_canonicalised(spelling):
  policy = jmp_lite.Policy(jnp.float32, spelling, np.float32)
  # jmp's objects: JAX's scalar types, one per dtype.
  assert policy.compute_dtype is jnp.float16
  assert policy.param_dtype is policy.output_dtype is jnp.float32
  assert policy.compute_dtype == F16
  assert policy == jmp_lite.get_policy("p=f32,c=f16,o=f32")


def test_equal_policies_hash_equal_and_key_dicts():
  policies = [jmp_lite.Policy("f32", s, "full") for s in F16_SPELLINGS]
  assert len({hash(p) for p in policies}) == 1
  table = {policies[0]: "mixed"}
  for policy in policies:
    assert table[policy] == "mixed"
  other = jmp_lite.Policy("f32", "bf16", "f32")
  assert other != policies[0]
  assert other not in table


def test_equal_policies_are_one_static_jit_argument():
  traces = []

  @functools.partial(jax.jit, static_argnums=1)
  def apply(x, policy):
    traces.append(policy)
    return policy.cast_to_output(policy.cast_to_compute(x) * 2)

  x = jnp.ones(3, jnp.float32)
  outputs = [
      apply(x, jmp_lite.Policy(jnp.float32, spelling, jnp.float16))
      for spelling in F16_SPELLINGS
  ]
  assert len(traces) == 1
  for out in outputs:
    assert out.dtype == F16
  apply(x, jmp_lite.Policy(jnp.float32, jnp.bfloat16, jnp.float16))
  assert len(traces) == 2


@pytest.mark.parametrize("new", [jnp.bfloat16, "bf16", np.dtype("bfloat16")])
def test_with_methods_replace_one_dtype(new):
  policy = jmp_lite.Policy(F32, F16, F64)
  assert_policy(policy.with_param_dtype(new), BF16, F16, F64)
  assert_policy(policy.with_compute_dtype(new), F32, BF16, F64)
  assert_policy(policy.with_output_dtype(new), F32, F16, BF16)
  assert_policy(policy, F32, F16, F64)  # the original is unchanged


def test_with_methods_validate_the_dtype():
  policy = jmp_lite.Policy(F32, F16, F32)
  with pytest.raises(ValueError, match="int32"):
    policy.with_compute_dtype(jnp.int32)
  with pytest.raises(ValueError, match="f8"):
    policy.with_output_dtype("f8")


@pytest.mark.parametrize("field", ["param_dtype", "compute_dtype", "output_dtype"])
def test_policy_is_frozen(field):
  policy = jmp_lite.Policy(F32, F16, F32)
  with pytest.raises(dataclasses.FrozenInstanceError):
    setattr(policy, field, BF16)
  assert_policy(policy, F32, F16, F32)


# ---------------------------------------------------------------------------
# Bad specs and bad dtypes.
# ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "spec,token",
    [
        ("", "empty"),
        ("   ", "empty"),
        ("x=f32", "'x'"),
        ("p=f32,weights=f16", "'weights'"),
        ("c=f8", "'f8'"),
        ("f8", "'f8'"),
        ("p=f32,params=f16", "'params'"),
        ("o=f16,output=f16", "'output'"),
        ("c=c=f16", "'c=c=f16'"),
        ("c=", "'c'"),
        ("c=f16=f32", "'c=f16=f32'"),
        ("p=f32,", "empty entry"),
        (",c=f16", "empty entry"),
        ("p=f32,,c=f16", "empty entry"),
        ("=f16", "''"),
    ],
)
def test_bad_spec_names_the_token_and_the_choices(spec, token):
  with pytest.raises(ValueError) as info:
    jmp_lite.get_policy(spec)
  message = str(info.value)
  assert repr(spec) in message
  assert token in message
  for choice in ("p/params", "c/compute", "o/output", "bf16", "float16", "half"):
    assert choice in message


@pytest.mark.parametrize("spec", ["compute_float16", "c=f8", "P=F32,C=FP8"])
def test_unknown_dtype_message_matches_jmp(spec):
  with pytest.raises(ValueError, match="Unknown dtype"):
    jmp_lite.get_policy(spec)


@pytest.mark.parametrize("position", range(3))
@pytest.mark.parametrize("bad", [jnp.int32, np.int8, np.bool_, np.complex64])
def test_non_floating_policy_dtype_is_a_value_error(position, bad):
  dtypes = [jnp.float32] * 3
  dtypes[position] = bad
  with pytest.raises(ValueError, match=np.dtype(bad).name):
    jmp_lite.Policy(*dtypes)


def test_non_dtype_policy_argument_is_a_type_error():
  with pytest.raises(TypeError, match="object"):
    jmp_lite.Policy(jnp.float32, object(), jnp.float32)


@pytest.mark.parametrize("spec", [3, None, 1.5, jnp.float16, ["c=f16"]])
def test_non_string_spec_is_a_type_error(spec):
  with pytest.raises(TypeError, match="get_policy"):
    jmp_lite.get_policy(spec)


# ---------------------------------------------------------------------------
# Casting.
# ---------------------------------------------------------------------------

CAST_TARGETS = (F16, BF16, F32)


def mixed_tree():
  """Floating numpy/jax leaves of four dtypes and every kind of pass-through leaf."""
  return {
      "np_f16": np.full((2,), 1.5, np.float16),
      "np_bf16": np.full((2,), 1.5, jnp.bfloat16),
      "np_f32": np.full((3,), 1.5, np.float32),
      "np_f64": np.full((2, 2), 1.5, np.float64),
      "np_scalar": np.float32(1.5),
      "jnp_f16": jnp.full((2,), 1.5, jnp.float16),
      "jnp_bf16": jnp.full((2,), 1.5, jnp.bfloat16),
      "jnp_f32": jnp.full((3,), 1.5, jnp.float32),
      "jnp_int": jnp.arange(3, dtype=jnp.int32),
      "np_int": np.arange(3, dtype=np.int16),
      "jnp_bool": jnp.array([True, False]),
      "np_bool": np.array([True]),
      "py_int": 3,
      "py_float": 1.5,
      "py_bool": True,
      "none": None,
      "string": "relu",
      "object": object(),
      "nested": [(np.float64(2.0), "tanh"), {"k": jnp.zeros((1,), jnp.float32)}],
  }


def is_float_array(x):
  return isinstance(x, (jax.Array, np.ndarray, np.generic)) and jnp.issubdtype(
      x.dtype, jnp.floating
  )


def assert_cast(before, after, dtype):
  """Floating arrays cast (keeping numpy/jax kind), everything else is identical."""
  leaves_before, treedef = jax.tree_util.tree_flatten(before, is_leaf=lambda x: x is None)
  leaves_after, treedef_after = jax.tree_util.tree_flatten(
      after, is_leaf=lambda x: x is None
  )
  assert treedef == treedef_after
  for x, y in zip(leaves_before, leaves_after):
    if not is_float_array(x):
      assert y is x
    elif x.dtype == dtype:
      assert y is x
    else:
      assert y.dtype == dtype
      assert np.shape(y) == np.shape(x)
      if isinstance(x, jax.Array):
        assert isinstance(y, jax.Array)
      else:
        assert isinstance(y, (np.ndarray, np.generic))
        assert not isinstance(y, jax.Array)
        assert isinstance(y, np.ndarray) == isinstance(x, np.ndarray)
      np.testing.assert_array_equal(np.asarray(y, np.float32), np.asarray(x, np.float32))


@pytest.mark.parametrize("dtype", CAST_TARGETS)
@pytest.mark.parametrize("method", ["cast_to_param", "cast_to_compute", "cast_to_output"])
def test_policy_casts_mixed_tree_eagerly(method, dtype):
  policy = jmp_lite.Policy(dtype, dtype, dtype)
  tree = mixed_tree()
  assert_cast(tree, getattr(policy, method)(tree), dtype)


def test_each_cast_uses_its_own_dtype():
  policy = jmp_lite.Policy(F16, BF16, F32)
  x = {"w": np.ones(2, np.float64), "b": jnp.ones(2, jnp.float32)}
  assert {v.dtype for v in policy.cast_to_param(x).values()} == {F16}
  assert {v.dtype for v in policy.cast_to_compute(x).values()} == {BF16}
  assert {v.dtype for v in policy.cast_to_output(x).values()} == {F32}


def test_numpy_leaves_cast_to_float64_stay_numpy_float64():
  policy = jmp_lite.get_policy("f64")
  tree = {"h": np.ones(2, np.float16), "f": np.ones(2, np.float32), "i": np.arange(2)}
  out = policy.cast_to_compute(tree)
  assert type(out["h"]) is np.ndarray and out["h"].dtype == F64
  assert type(out["f"]) is np.ndarray and out["f"].dtype == F64
  assert out["i"] is tree["i"]


@pytest.mark.parametrize("dtype", CAST_TARGETS)
def test_policy_casts_under_jit(dtype):
  policy = jmp_lite.Policy(dtype, dtype, dtype)
  tree = mixed_tree()
  arrays = {k: v for k, v in tree.items() if isinstance(v, (jax.Array, np.ndarray))}
  statics = {
      k: tree[k] for k in ("py_int", "py_float", "py_bool", "none", "string", "object")
  }

  @jax.jit
  def cast(arrays):
    out = policy.cast_to_compute({**arrays, **statics})
    # Non-array leaves are Python values at trace time and must pass through.
    for key, value in statics.items():
      assert out[key] is value
    assert out["jnp_int"] is arrays["jnp_int"]
    assert out["np_bool"] is arrays["np_bool"]
    return {k: out[k] for k in arrays}

  out = cast(arrays)
  for key, x in arrays.items():
    expected = dtype if jnp.issubdtype(x.dtype, jnp.floating) else x.dtype
    assert out[key].dtype == expected
    np.testing.assert_array_equal(
        np.asarray(out[key], np.float32), np.asarray(x, np.float32)
    )


@pytest.mark.parametrize("dtype", CAST_TARGETS)
def test_cast_to_own_dtype_adds_no_op(dtype):
  policy = jmp_lite.Policy(dtype, dtype, dtype)
  x = {"w": jnp.ones((2, 3), dtype), "i": jnp.arange(2)}
  jaxpr = jax.make_jaxpr(policy.cast_to_compute)(x)
  assert "convert_element_type" not in primitive_names(jaxpr)
  other = F32 if dtype != F32 else F16
  jaxpr = jax.make_jaxpr(policy.with_compute_dtype(other).cast_to_compute)(x)
  assert primitive_names(jaxpr).count("convert_element_type") == 1


@JIT
def test_cast_to_full_and_half(jit):
  assert jmp_lite.half_dtype() == F16  # tests run on CPU
  tree = {
      "h": jnp.ones((2,), jnp.float16),
      "b": jnp.ones((2,), jnp.bfloat16),
      "f": jnp.ones((2,), jnp.float32),
      "n": np.ones((2,), np.float64),
      "i": jnp.arange(2, dtype=jnp.int16),
  }
  to_full = maybe_jit(jmp_lite.cast_to_full, jit)
  to_half = maybe_jit(jmp_lite.cast_to_half, jit)
  full, half = to_full(tree), to_half(tree)
  assert {k: v.dtype for k, v in full.items()} == {
      "h": F32, "b": F32, "f": F32, "n": F32, "i": np.dtype(np.int16)
  }
  assert {k: v.dtype for k, v in half.items()} == {
      "h": F16, "b": F16, "f": F16, "n": F16, "i": np.dtype(np.int16)
  }
  if not jit:
    assert full["f"] is tree["f"] and full["i"] is tree["i"]
    assert half["h"] is tree["h"] and half["i"] is tree["i"]
    assert isinstance(full["n"], np.ndarray) and not isinstance(full["n"], jax.Array)


def test_cast_to_full_and_half_pass_objects_through():
  tree = mixed_tree()
  assert_cast(tree, jmp_lite.cast_to_full(tree), F32)
  assert_cast(tree, jmp_lite.cast_to_half(tree), jmp_lite.half_dtype())


# ---------------------------------------------------------------------------
# with_policy.
# ---------------------------------------------------------------------------


def linear(params, x):
  """A tiny model: ``x @ w + b``."""
  return x @ params["w"] + params["b"]


def make_params():
  return {"w": jnp.full((3, 2), 0.5, jnp.float32), "b": jnp.zeros((2,), jnp.float32)}


@pytest.mark.parametrize("compute", [F16, BF16])
def test_with_policy_dot_general_sees_compute_dtype(compute):
  policy = jmp_lite.Policy(F32, compute, F32)
  apply = jmp_lite.with_policy(linear, policy)
  jaxpr = jax.make_jaxpr(apply)(make_params(), jnp.ones((4, 3), jnp.float32))
  dots = find_eqns(jaxpr, "dot_general")
  assert len(dots) == 1
  assert [v.aval.dtype for v in dots[0].invars] == [compute, compute]
  assert [v.aval.dtype for v in jaxpr.jaxpr.outvars] == [F32]


@JIT
@pytest.mark.parametrize("spec,compute,output", [
    ("p=f32,c=f16,o=f32", F16, F32),
    ("c=bf16", BF16, BF16),
    ("mixed_float16", F16, F32),
])
def test_with_policy_casts_args_kwargs_and_outputs(spec, compute, output, jit):
  seen = {}

  def fn(params, x, *, scale, labels):
    seen.update(w=params["w"].dtype, x=x.dtype, scale=scale.dtype, labels=labels.dtype)
    y = linear(params, x) * scale
    return {"y": y, "labels": labels, "mean": jnp.mean(y)}

  apply = jmp_lite.with_policy(fn, spec)
  if jit:
    apply = jax.jit(apply)
  labels = jnp.array([0, 1, 1, 0], jnp.int32)
  out = apply(
      make_params(), np.ones((4, 3), np.float32), scale=jnp.float32(2.0), labels=labels
  )
  assert seen == {"w": compute, "x": compute, "scale": compute, "labels": np.int32}
  assert out["y"].dtype == output
  assert out["mean"].dtype == output
  assert out["labels"].dtype == np.int32
  np.testing.assert_array_equal(out["labels"], labels)
  np.testing.assert_allclose(np.asarray(out["y"], np.float32), np.full((4, 2), 3.0))


def test_with_policy_passes_int_and_object_inputs_through_identically():
  labels = np.array([1, 0], np.int32)
  config = object()
  received = {}

  def fn(x, labels, config, name):
    received.update(labels=labels, config=config, name=name)
    return x

  name = "".join(["lay", "er"])
  out = jmp_lite.with_policy(fn, "c=f16,o=f32")(np.ones(2, np.float32), labels, config, name)
  assert received["labels"] is labels
  assert received["config"] is config
  assert received["name"] is name
  assert out.dtype == F32


@pytest.mark.parametrize("compute", ["f16", "bf16"])
def test_gradient_through_with_policy_comes_back_in_param_dtype(compute):
  policy = jmp_lite.get_policy(f"p=f32,c={compute},o=f32")

  def loss_fn(params, x, labels):
    logits = linear(params, x)
    picked = jnp.take_along_axis(logits, labels[:, None], axis=1)
    return -jnp.mean(picked)

  apply = jmp_lite.with_policy(loss_fn, policy)
  params = make_params()
  x = jnp.ones((4, 3), jnp.float32)
  labels = jnp.array([0, 1, 1, 0], jnp.int32)
  loss, grads = jax.jit(jax.value_and_grad(apply))(params, x, labels)
  assert loss.dtype == F32
  assert jax.tree_util.tree_map(lambda g: g.dtype, grads) == {"w": F32, "b": F32}
  np.testing.assert_allclose(grads["b"], [-0.5, -0.5])
  np.testing.assert_allclose(grads["w"], np.full((3, 2), -0.5))


def test_with_policy_accepts_policy_or_spec():
  x = jnp.ones((4, 3), jnp.float32)
  from_spec = jmp_lite.with_policy(linear, "p=f32,c=bf16,o=f16")
  from_policy = jmp_lite.with_policy(linear, jmp_lite.Policy(F32, BF16, F16))
  assert from_spec(make_params(), x).dtype == F16
  assert from_policy(make_params(), x).dtype == F16


def test_with_policy_validates_its_arguments():
  with pytest.raises(TypeError, match="callable"):
    jmp_lite.with_policy(3, "f16")
  with pytest.raises(ValueError, match="'f8'"):
    jmp_lite.with_policy(linear, "c=f8")


def test_with_policy_keeps_name_and_doc():
  wrapped = jmp_lite.with_policy(linear, "mixed_float16")
  assert wrapped.__name__ == "linear"
  assert wrapped.__doc__ == linear.__doc__
  assert wrapped.__wrapped__ is linear
