"""Matmul precision in the policy (TF32, DotAlgorithmPresets) and float32 islands.

Checked on the lowered HLO (``jax.jit(f).lower(...).as_text()``): the policy's
precision reaches every ``dot_general``/``convolution`` it covers, under
``with_policy``, the linen and NNX policies (per-module rules too) and
``autocast``; ``in_float32`` regions run in float32 inside half-precision code.
"""

import re
import warnings

import flax.linen as nn
from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jmp_lite
from jmp_lite import fp8
import jmp_lite.linen as jlinen
import jmp_lite.nnx as jnnx
from jmp_lite._src import policy as policy_lib

F32 = np.dtype(jnp.float32)
F16 = np.dtype(jnp.float16)
BF16 = np.dtype(jnp.bfloat16)


def _dots(fn, *args):
  """The dot_general / convolution lines of fn's lowered StableHLO."""
  text = jax.jit(fn).lower(*args).as_text()
  return [line for line in text.splitlines()
          if "dot_general" in line or "convolution" in line]


def _precision(line):
  """'HIGH', 'HIGHEST', 'DEFAULT', or the algorithm's lhs precision type."""
  algorithm = re.search(r"lhs_precision_type = (\w+)", line)
  if algorithm:
    return f"algorithm:{algorithm.group(1)}"
  found = re.search(r"precision = \[(\w+), \w+\]", line)
  return found.group(1) if found else "DEFAULT"


# -- the grammar ---------------------------------------------------------------


@pytest.mark.parametrize("spec,expected", [
    ("tf32", "p=full,c=full,o=full,m=tf32"),
    ("p=f32,c=f32,o=f32,m=tf32", "p=full,c=full,o=full,m=tf32"),
    ("c=f32, MATMUL = TensorFloat32", "p=full,c=full,o=full,m=tf32"),
    ("c=f32,m=highest", "p=full,c=full,o=full,m=f32"),
    ("c=f32,m=bf16_bf16_f32_x3", "p=full,c=full,o=full,m=bf16_bf16_f32_x3"),
    ("c=f16,m=F16_F16_F32", "p=full,c=f16,o=f16,m=f16_f16_f32"),
    ("c=bf16,o=f32,m=bf16_bf16_f32", "p=full,c=bf16,o=full,m=bf16_bf16_f32"),
    ("c=f32,m=default", "p=full,c=full,o=full"),
])
def test_matmul_precision_round_trips(spec, expected):
  policy = jmp_lite.get_policy(spec)
  assert str(policy) == expected
  assert jmp_lite.get_policy(str(policy)) == policy
  assert hash(jmp_lite.get_policy(str(policy))) == hash(policy)


def test_jmp_strings_are_unchanged_without_a_matmul_precision():
  policy = jmp_lite.get_policy("params=f32,compute=f16")
  assert str(policy) == "p=full,c=f16,o=f16"
  assert policy.matmul_precision is None
  assert policy == jmp_lite.Policy(jnp.float32, jnp.float16, jnp.float16)


def test_policy_constructor_and_copies():
  preset = jax.lax.DotAlgorithmPreset.BF16_BF16_F32_X3
  policy = jmp_lite.Policy("f32", "f32", "f32", matmul_precision=preset)
  assert policy.matmul_precision == "bf16_bf16_f32_x3"
  assert policy.with_matmul_precision("tf32").matmul_precision == "tf32"
  assert policy.with_matmul_precision(None).matmul_precision is None
  assert policy.with_output_dtype("f16").matmul_precision == "bf16_bf16_f32_x3"


@pytest.mark.parametrize("make,error,words", [
    (lambda: jmp_lite.get_policy("c=f16,m=tf32"), ValueError,
     ["'tf32'", "float16", "float32 compute"]),
    (lambda: jmp_lite.get_policy("mixed_bfloat16").with_matmul_precision("tf32"),
     ValueError, ["'tf32'", "bfloat16"]),
    (lambda: jmp_lite.get_policy("c=f32,m=tf33"), ValueError,
     ["tf33", "tf32", "bf16_bf16_f32_x3"]),
    (lambda: jmp_lite.get_policy("c=bf16,m=f16_f16_f32"), ValueError,
     ["F16_F16_F32", "float16 inputs", "bfloat16"]),
    (lambda: jmp_lite.get_policy("c=f32,m=any_f8_any_f8_f32"), ValueError,
     ["float8"]),
    (lambda: jmp_lite.get_policy("c=f32,m=tf32,matmul=f32"), ValueError,
     ["'matmul'", "'m'"]),
    (lambda: jmp_lite.get_policy("c=f32,m="), ValueError, ["'m'", "no value"]),
    (lambda: jmp_lite.Policy("f32", "f32", "f32", matmul_precision=3),
     TypeError, ["matmul_precision", "3"]),
    (lambda: jmp_lite.in_float32(lambda x: x, matmul_precision="tf16"),
     ValueError, ["tf16"]),
    (lambda: jmp_lite.in_float32(3), TypeError, ["callable", "int"]),
])
def test_bad_matmul_precisions_are_named(make, error, words):
  with pytest.raises(error) as info:
    make()
  for word in words:
    assert word in str(info.value), (word, str(info.value))


# -- with_policy -----------------------------------------------------------------


def _mlp(params, x):
  h = jax.nn.relu(x @ params["w1"])
  return h @ params["w2"]


PARAMS = {"w1": jnp.ones((8, 16)), "w2": jnp.ones((16, 4))}
X = jnp.ones((2, 8))


@pytest.mark.parametrize("spec,want", [
    ("tf32", "HIGH"),
    ("c=f32,m=f32", "HIGHEST"),
    ("c=f32,m=bf16_bf16_f32_x3", "algorithm:bf16"),
    ("mixed_float16", "DEFAULT"),
])
def test_with_policy_applies_the_precision_to_every_matmul(spec, want):
  dots = _dots(jmp_lite.with_policy(_mlp, spec), PARAMS, X)
  assert len(dots) == 2
  assert [_precision(d) for d in dots] == [want, want], dots


def _cuda_dots(fn, *args):
  """The dot_general / convolution lines of fn's program exported for GPU."""
  text = jax.export.export(jax.jit(fn), platforms=["cuda"])(*args).mlir_module()
  return [line for line in text.splitlines()
          if ("stablehlo.dot_general" in line
              or "stablehlo.convolution" in line)]


def _conv_net(params, x):
  h = jax.lax.conv_general_dilated(x, params["k"], (1, 1), "SAME",
                                   dimension_numbers=("NHWC", "HWIO", "NHWC"))
  return h.reshape(h.shape[0], -1) @ params["w"]


CONV_PARAMS = {"k": jnp.ones((3, 3, 2, 4)), "w": jnp.ones((4 * 4 * 4, 3))}
CONV_X = jnp.ones((2, 4, 4, 2))


@pytest.mark.parametrize("spec,matmul,conv", [
    ("tf32", "HIGH", "HIGH"),
    ("c=f32,m=f32", "HIGHEST", "HIGHEST"),
    # One bfloat16 pass is the preset: JAX's "bfloat16" setting is DEFAULT.
    ("c=f32,m=bf16", "algorithm:bf16", "DEFAULT"),
    ("c=f32,m=bf16_bf16_f32_x3", "algorithm:bf16", "DEFAULT"),
    ("c=f32,m=tf32_tf32_f32", "algorithm:tf32", "DEFAULT"),
])
def test_what_each_precision_puts_in_the_gpu_program(spec, matmul, conv):
  """The table of docs/precision.md, on the program exported for GPU: named
  precisions reach convolutions; algorithm presets only matmuls."""
  dots = _cuda_dots(jmp_lite.with_policy(_conv_net, spec), CONV_PARAMS, CONV_X)
  convs = [d for d in dots if "convolution" in d]
  mms = [d for d in dots if "dot_general" in d]
  assert len(convs) == 1 and len(mms) == 1, dots
  assert _precision(mms[0]) == matmul, mms
  conv_precision = re.search(r"precision (\w+)>", convs[0])
  assert (conv_precision.group(1) if conv_precision else "DEFAULT") == conv


def test_bf16_matmul_precision_on_cpu_computes_in_float32():
  """What docs/precision.md says of XLA:CPU: it accepts the preset on float32
  operands but does not round them to bfloat16 (the GPU program above carries
  the one-pass algorithm)."""
  a = jnp.full((2, 8), 1.0 + 2.0**-12, F32)
  b = jnp.eye(8, 4, dtype=F32)
  one_pass = jax.jit(jmp_lite.with_policy(lambda a, b: a @ b,
                                          "c=f32,m=bf16"))(a, b)
  np.testing.assert_array_equal(one_pass, np.full((2, 4), 1.0 + 2.0**-12, F32))


def test_presets_for_half_inputs_reach_the_jaxpr():
  # XLA:CPU cannot lower F16_F16_F32 (GPUs can): check the traced dots.
  f = jmp_lite.with_policy(_mlp, "c=f16,m=f16_f16_f32")
  jaxpr = jax.make_jaxpr(f)(PARAMS, X)
  dots = [e for e in jaxpr.jaxpr.eqns if e.primitive is jax.lax.dot_general_p]
  want = jax.lax.DotAlgorithmPreset.F16_F16_F32
  assert len(dots) == 2 and all(e.params["precision"] == want for e in dots)


def test_the_precision_is_scoped_to_the_wrapped_function():
  inner = jmp_lite.with_policy(lambda p, x: x @ p["w1"], "tf32")

  def fn(params, x):
    return inner(params, x) @ params["w2"]   # outside the policy

  assert [_precision(d) for d in _dots(fn, PARAMS, X)] == ["HIGH", "DEFAULT"]


def test_tf32_policy_keeps_float32_values():
  out = jax.jit(jmp_lite.with_policy(_mlp, "tf32"))(PARAMS, X)
  assert out.dtype == F32
  np.testing.assert_allclose(out, _mlp(PARAMS, X), rtol=1e-6)


# -- Flax ------------------------------------------------------------------------


class _LinenNet(nn.Module):

  @nn.compact
  def __call__(self, x):
    h = nn.Dense(16, name="body")(x)
    h = nn.LayerNorm(name="norm")(h)
    return nn.Dense(4, name="head")(h)


def test_linen_policy_precision_and_per_module_rules():
  rules = jlinen.ModuleRules(("head", "p=f32,c=f32,o=f32,m=bf16_bf16_f32_x3"))
  model = jlinen.apply_policy(_LinenNet(), "tf32", rules)
  variables = model.init(jax.random.key(0), X)
  dots = _dots(lambda v, x: model.apply(v, x), variables, X)
  assert [_precision(d) for d in dots] == ["HIGH", "algorithm:bf16"], dots


@pytest.mark.standard_promotion  # Flax's LayerNorm on bfloat16 inputs
def test_full_precision_modules_run_full_float32_matmuls():
  rules = jlinen.ModuleRules((nn.Dense, jlinen.FullPrecision()))
  model = jlinen.apply_policy(_LinenNet(), "mixed_bfloat16", rules)
  variables = model.init(jax.random.key(0), X)
  dots = _dots(lambda v, x: model.apply(v, x), variables, X)
  assert [_precision(d) for d in dots] == ["HIGHEST", "HIGHEST"], dots
  policies = model.module_policies(variables, X)
  assert str(policies["head"]) == "p=full,c=full,o=bf16,m=f32"


class _NnxNet(nnx.Module):

  def __init__(self, rngs):
    self.body = nnx.Linear(8, 16, rngs=rngs)
    self.head = nnx.Linear(16, 4, rngs=rngs)

  def __call__(self, x):
    return self.head(jax.nn.relu(self.body(x)))


def test_nnx_policy_precision_and_per_module_rules():
  rules = jnnx.ModuleRules(("head", "p=f32,c=f32,o=f32,m=f32"))
  model = jnnx.apply_policy(_NnxNet(nnx.Rngs(0)), "tf32", rules)
  graphdef, state = nnx.split(model)

  def run(state, x):
    return nnx.merge(graphdef, state)(x)

  dots = _dots(run, state, X)
  assert [_precision(d) for d in dots] == ["HIGH", "HIGHEST"], dots


# -- float32 islands -----------------------------------------------------------------


def _dot_operand_dtypes(fn, *args):
  return [d for op, d in jmp_lite.op_dtypes(fn, *args) if op == "dot_general"]


def test_in_float32_inside_with_policy():
  logits = jmp_lite.in_float32(lambda h, w: h @ w)

  def model(params, x):
    h = jax.nn.relu(x @ params["w1"])          # compute dtype
    return logits(h, params["w2"])             # float32 island

  f = jmp_lite.with_policy(model, "p=f32,c=f16,o=f16")
  assert _dot_operand_dtypes(f, PARAMS, X) == [("float16", "float16"),
                                               ("float32", "float32")]
  assert [_precision(d) for d in _dots(f, PARAMS, X)] == ["DEFAULT", "HIGHEST"]
  # The island's float32 output is cast by the policy at the boundary.
  assert f(PARAMS, X).dtype == F16


def test_in_float32_inside_autocast_and_its_gradients():
  logits = jmp_lite.in_float32(lambda h, w: h @ w, matmul_precision="tf32")

  def loss(params, x):
    return jnp.sum(logits(jax.nn.relu(x @ params["w1"]), params["w2"]))

  f = jmp_lite.autocast(loss, jnp.bfloat16)
  assert _dot_operand_dtypes(f, PARAMS, X) == [("bfloat16", "bfloat16"),
                                               ("float32", "float32")]
  grads = jax.jit(jax.grad(f))(PARAMS, X)
  assert {g.dtype for g in jax.tree.leaves(grads)} == {F32}
  assert all(np.isfinite(g).all() for g in jax.tree.leaves(grads))


def test_in_float32_inside_a_linen_module():

  class Head(nn.Module):

    @nn.compact
    def __call__(self, x):
      kernel = self.param("kernel", nn.initializers.ones, (x.shape[-1], 3))
      return jmp_lite.in_float32(lambda a, k: a @ k)(x, kernel)

  class Net(nn.Module):

    @nn.compact
    def __call__(self, x):
      return Head()(nn.Dense(8)(x))

  model = jlinen.apply_policy(Net(), "p=f32,c=bf16,o=bf16")
  variables = model.init(jax.random.key(0), X)
  dtypes = _dot_operand_dtypes(lambda v, x: model.apply(v, x), variables, X)
  assert dtypes == [("bfloat16", "bfloat16"), ("float32", "float32")]


@pytest.mark.parametrize("precision,error,words", [
    ("fp8", ValueError, ["'fp8' is a float8 recipe", "defeat the island",
                         "'mixed_fp8'"]),
    ("MXFP8", ValueError, ["float8 recipe"]),
    ("fp8_delayed(margin=1)", ValueError, ["float8 recipe"]),
    (fp8.Fp8Config(granularity="row"), ValueError,
     ["'fp8_rowwise(gradient_format=e5m2)' is a float8 recipe"]),
    (None, ValueError, ["None leaves", "JAX's default precision",
                        "TF32 on NVIDIA"]),
    ("default", ValueError, ["JAX's default precision"]),
    (jax.lax.DotAlgorithmPreset.DEFAULT, ValueError, ["default precision"]),
    ("f16_f16_f32", ValueError, ["not a precision for float32 matmuls",
                                 "float16 inputs"]),
    ("any_f8_any_f8_f32", ValueError, ["float8 inputs"]),
    (3, TypeError, ["matmul_precision must be a name", "int: 3"]),
])
def test_in_float32_refuses_precisions_that_defeat_the_island(
    precision, error, words):
  with pytest.raises(error) as info:
    jmp_lite.in_float32(lambda h, w: h @ w, matmul_precision=precision)
  for word in words + ["jmp_lite.in_float32", "'tf32'"]:
    assert word in str(info.value), (word, str(info.value))


def _cuda_dot_kinds(fn, *args):
  """``(precision, operand types)`` of each dot of fn's CUDA program."""
  return [(_precision(d), tuple(re.findall(r"x(f8E4M3FN|f8E5M2|bf16|f32)>",
                                           d.rsplit(" : ", 1)[1])[:2]))
          for d in _cuda_dots(fn, *args) if "dot_general" in d]


@pytest.mark.parametrize("wrap", [
    lambda f: f,
    lambda f: jmp_lite.with_policy(f, "mixed_fp8"),
    lambda f: jmp_lite.autocast(f, "mixed_fp8"),
    lambda f: jmp_lite.with_policy(f, "tf32"),
    lambda f: jmp_lite.autocast(f, "bf16"),
], ids=["plain", "with_policy-fp8", "autocast-fp8", "with_policy-tf32",
        "autocast-bf16"])
def test_island_dots_run_highest_in_the_gpu_program(wrap):
  """Under every route, the island's forward dot and both backward dots take
  float32 operands at HIGHEST in the program exported for CUDA; the others
  follow the policy."""
  island = jmp_lite.in_float32(lambda h, w: h @ w)
  params = {"w1": jnp.ones((32, 32)), "w2": jnp.ones((32, 32)),
            "w3": jnp.ones((32, 16))}

  def loss(params, x):
    h = island(x @ params["w1"], params["w2"])
    return jnp.sum((h.astype(x.dtype) @ params["w3"]).astype(jnp.float32))

  x = jnp.ones((16, 32))
  for fn, islands in ((wrap(loss), 1), (jax.grad(wrap(loss)), 3)):
    kinds = _cuda_dot_kinds(fn, params, x)
    highest = [ops for precision, ops in kinds if precision == "HIGHEST"]
    assert highest == [("f32", "f32")] * islands, kinds
    assert len(kinds) > islands, kinds


def test_in_float32_keeps_float64_and_non_floats():
  seen = {}

  def fn(a, n, flag):
    seen.update(a=a.dtype, n=n.dtype)
    return a * 2, n, flag

  with jax.numpy_dtype_promotion("standard"):
    out = jmp_lite.in_float32(fn)(jnp.ones(2, jnp.float16), jnp.arange(2), "x")
  assert seen == {"a": F32, "n": np.dtype(jnp.int32)}
  assert out[0].dtype == F32 and out[2] == "x"


# -- m= through a cast alone (jmp-API clients: Levanter, Haiku) ------------------


@pytest.fixture
def fresh_warnings(monkeypatch):
  """A fresh record of the policies already warned about."""
  monkeypatch.setattr(policy_lib, "_WARNED_UNAPPLIED", set())


def _caught(fn):
  """The UserWarnings ``fn()`` emits (every one: no filter deduplicates)."""
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    fn()
  return [w for w in caught if issubclass(w.category, UserWarning)]


@pytest.mark.usefixtures("fresh_warnings")
def test_casting_with_a_matmul_precision_warns_once_per_policy():
  policy = jmp_lite.get_policy("p=f32,c=bf16,m=fp8")
  x = {"w": jnp.ones((2, 2)), "n": jnp.arange(2)}
  with pytest.warns(UserWarning) as record:
    out = policy.cast_to_compute(x)
  assert out["w"].dtype == BF16 and out["n"].dtype == np.int32
  message = str(record[0].message)
  for words in ("m=fp8 has no effect through Policy.cast_to_compute",
                "'p=full,c=bf16,o=bf16,m=fp8'", "in float8",
                "jmp_lite.with_policy(loss_fn, policy)",
                "jmp_lite.autocast(loss_fn, policy)", "jmp_lite.linen",
                "jmp_lite.nnx", "Levanter, Haiku, Equinox"):
    assert words in message, (words, message)
  assert len(record) == 1
  # Once per policy value: not per call, method, trace, or spelling.
  same = jmp_lite.Policy("f32", "bf16", "bf16",
                         matmul_precision=fp8.Fp8Config())
  assert not _caught(lambda: (
      policy.cast_to_compute(x), policy.cast_to_param(x),
      policy.cast_to_output(x), same.cast_to_compute(x),
      jax.jit(policy.cast_to_compute)(x),
      jax.jit(lambda t: policy.cast_to_output(t))(x)))
  # Another policy with a matmul precision warns once on its own.
  tf32 = jmp_lite.get_policy("tf32")
  caught = _caught(lambda: (tf32.cast_to_param(x), tf32.cast_to_output(x)))
  assert len(caught) == 1
  assert "m=tf32 has no effect through Policy.cast_to_param" in str(
      caught[0].message)
  assert "at the tf32 precision" in str(caught[0].message)
  # The filter docs/precision.md gives silences it.
  bf16_tf32 = jmp_lite.get_policy("c=f32,m=bf16_bf16_f32_x3")
  with warnings.catch_warnings():
    warnings.filterwarnings("ignore", message="jmp_lite: m=")
    assert not _caught(lambda: None)
    with warnings.catch_warnings(record=True) as caught:
      warnings.filterwarnings("ignore", message="jmp_lite: m=")
      bf16_tf32.cast_to_compute(x)
    assert not caught


@pytest.mark.usefixtures("fresh_warnings")
def test_plain_policies_and_the_library_routes_never_warn():
  x = jnp.ones((16, 16))
  params = {"w": jnp.ones((16, 16))}

  def loss(params, x):
    return jnp.sum(x @ params["w"])

  class Net(nn.Module):

    @nn.compact
    def __call__(self, x):
      return nn.Dense(16)(x)

  def routes(spec):
    policy = jmp_lite.get_policy(spec)
    jax.grad(jmp_lite.with_policy(loss, policy))(params, x)
    jax.grad(jmp_lite.autocast(loss, policy))(params, x)
    model = jlinen.apply_policy(Net(), policy)
    variables = model.init(jax.random.key(0), x)
    model.apply(variables, x)
    jnnx.apply_policy(nnx.Linear(16, 16, rngs=nnx.Rngs(0)), policy)(x)

  for spec in ("mixed_float16", "bf16", "mixed_fp8", "tf32",
               "c=f32,m=bf16_bf16_f32_x3"):
    assert not _caught(lambda: routes(spec)), spec
  for spec in ("mixed_bfloat16", "f16", "p=f32,c=f16,o=f32"):
    policy = jmp_lite.get_policy(spec)
    assert not _caught(lambda: (policy.cast_to_param(x),
                                policy.cast_to_compute(x),
                                policy.cast_to_output(x))), spec
