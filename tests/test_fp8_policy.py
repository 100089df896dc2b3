"""Float8 in the policy: the grammar and presets, autocast and with_policy,
the default exclusions, the program exported for CUDA, training steps, errors.

The Flax policies (linen, NNX) and delayed scaling's state: test_fp8_flax.py.
"""

import contextlib
import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jmp_lite
from jmp_lite import fp4
from jmp_lite import fp8
from jmp_lite._src import markers
from jmp_lite._src.low_precision import recipes as recipes_lib
from helpers import default_run_keeps

RECIPES = tuple(recipes_lib.FP8_RECIPES)
CURRENT = tuple(r for r in RECIPES if r != "fp8_delayed")
E4, E5 = "float8_e4m3fn", "float8_e5m2"

# ---------------------------------------------------------------------------
# Helpers (test_fp8_flax.py imports them).
# ---------------------------------------------------------------------------


def jaxpr_dots(fn, *args):
  """Operand dtype names of every live ``dot_general`` ``fn`` runs, in order."""
  return [dtypes for op, dtypes in jmp_lite.op_dtypes(fn, *args)
          if op == "dot_general"]


_MX_CHECK = [jax.export.DisabledSafetyCheck.custom_call(
    "__op$block_scaled_dot")]
_TYPE = re.compile(r"x(f8E4M3FN|f8E5M2|f8E8M0FNU|bf16|f16|f32)>")


def cuda_program(fn, *args):
  """The StableHLO text of ``jax.jit(fn)`` exported for CUDA (on this CPU)."""
  exported = jax.export.export(jax.jit(fn), platforms=["cuda"],
                               disabled_checks=_MX_CHECK)(*args)
  return exported.mlir_module()


def cuda_ops(text, op="dot_general"):
  """``[(operand element types, result element type)]`` of each ``op``."""
  out = []
  for line in text.splitlines():
    if f"stablehlo.{op}" in line and "->" in line:
      operands, result = line.rsplit(" : ", 1)[1].split("->")
      out.append((tuple(_TYPE.findall(operands)),
                  _TYPE.findall(result)[0]))
  return out


def assert_no_host_calls(text, allowed=()):
  """No host callback, and no custom call but the allowed ones."""
  assert "callback" not in text
  calls = set(re.findall(r"custom_call @([\w$.]+)", text))
  assert calls <= set(allowed), calls


def fp8_counts(dots):
  """(forward e4m3 x e4m3 dots, backward dots taking an e5m2 gradient)."""
  fwd = sum(d == ("f8E4M3FN", "f8E4M3FN") for d, _ in dots)
  bwd = sum("f8E5M2" in d for d, _ in dots)
  return fwd, bwd


def _data(shape, seed, scale=1.0):
  return jnp.asarray(np.random.default_rng(seed).standard_normal(shape)
                     * scale, jnp.float32)


# A two-layer MLP (the second layer is the output head) and an attention
# score: the exclusions in one function.
PARAMS = {"w1": _data((32, 64), 0, 0.2), "w2": _data((64, 16), 1, 0.2)}
X = _data((16, 32), 2)
Y = jnp.arange(16) % 16


def mlp(params, x):
  h = jax.nn.relu(x @ params["w1"])
  return h @ params["w2"]


def mlp_with_attention(params, x):
  h = jax.nn.relu(x @ params["w1"])                        # (16, 64)
  q = h.reshape(16, 4, 16)
  scores = jnp.einsum("qhd,khd->hqk", q, q)                # batched
  h = jnp.einsum("hqk,khd->qhd", jax.nn.softmax(scores), q).reshape(16, 64)
  return h @ params["w2"]                                  # the head


def loss_fn(params, x, y):
  logits = mlp(params, x).astype(jnp.float32)
  return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


# ---------------------------------------------------------------------------
# The grammar, the presets, the recipe type.
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("recipe", RECIPES)
def test_every_named_recipe_round_trips_and_hashes(recipe):
  policy = jmp_lite.get_policy(f"p=f32,c=bf16,o=f32,m={recipe}")
  assert policy.matmul_precision == recipe
  assert str(policy) == f"p=full,c=bf16,o=full,m={recipe}"
  again = jmp_lite.get_policy(str(policy))
  assert again == policy and hash(again) == hash(policy)
  # The same recipe as a config makes the same policy.
  config = fp8.Fp8Config(**recipes_lib.FP8_RECIPES[recipe])
  assert config.spec() == recipe
  built = jmp_lite.Policy(jnp.float32, jnp.bfloat16, jnp.float32,
                          matmul_precision=config)
  assert built == policy and hash(built) == hash(policy)


def test_mixed_fp8_preset_and_spellings():
  policy = jmp_lite.get_policy("mixed_fp8")
  assert policy == jmp_lite.get_policy(" P=F32, c = BF16 ,o=f32,m = FP8 ")
  assert policy == jmp_lite.get_policy("mixed_bfloat16").with_matmul_precision(
      "fp8")
  assert policy.compute_dtype is jnp.bfloat16
  assert str(policy) == "p=full,c=bf16,o=full,m=fp8"
  assert policy.with_matmul_precision(None) == jmp_lite.get_policy(
      "mixed_bfloat16")


@pytest.mark.parametrize("config", [
    fp8.Fp8Config(granularity="row"),                 # e5m2 gradients
    fp8.Fp8Config(scaling="delayed", margin=1, history_length=32,
                  amax_algorithm="most_recent"),
    fp8.Fp8Config(granularity="blockwise", block_size=64,
                  gradient_format="e4m3", include_batched=True),
    fp8.Fp8Config(granularity="mxfp8", native_mx=False, dim_multiple=32),
    fp8.Fp8Config(include_output_head=True, power_of_two_scales=False),
], ids=lambda c: c.spec())
def test_custom_recipes_round_trip(config):
  policy = jmp_lite.get_policy("mixed_bfloat16").with_matmul_precision(config)
  text = str(policy)
  assert text.startswith("p=full,c=bf16,o=full,m=") and "(" in text
  again = jmp_lite.get_policy(text)
  assert again == policy and hash(again) == hash(policy)
  assert again.matmul_precision == config
  assert jmp_lite.get_policy(text.upper()) == policy


_AXES = ("batch", "data", "fsdp", "Data", "model_1", "dp.x", "i")


def _random_config(rng):
  """A random valid Fp8Config: every field, many values (the generator
  covers every field but compute_dtype: see the test below)."""
  granularity, scaling = [("tensor", "current"), ("row", "current"),
                          ("blockwise", "current"), ("mxfp8", "current"),
                          ("tensor", "delayed")][rng.integers(5)]
  pick = lambda *values: values[rng.integers(len(values))]
  fields = dict(
      granularity=granularity, scaling=scaling,
      forward_format=pick("e4m3", "e5m2", "E4M3"),
      gradient_format=pick("e4m3", "e5m2"),
      power_of_two_scales=granularity == "mxfp8" or pick(True, False),
      include_output_head=pick(True, False),
      include_batched=pick(True, False),
      include_moe_gating=pick(True, False),
      dim_multiple=int(rng.integers(1, 65)),
      native_mx=pick(True, False),
      axis_name=pick(None, _AXES[rng.integers(len(_AXES))],
                     tuple(rng.choice(_AXES, rng.integers(1, 4),
                                      replace=False).tolist())),
      fsdp_axis=pick(None, _AXES[rng.integers(len(_AXES))],
                     tuple(rng.choice(_AXES, rng.integers(1, 3),
                                      replace=False).tolist())))
  if granularity == "blockwise":
    fields["block_size"] = pick(None, 16 * int(rng.integers(1, 17)))
  if scaling == "delayed":
    fields.update(
        history_length=pick(None, int(rng.integers(1, 1025))),
        margin=pick(0, int(rng.integers(0, 65)), float(rng.integers(0, 65))),
        amax_algorithm=pick(None, "max", "most_recent"))
  return fp8.Fp8Config(**fields), fields


def _random_fp4_config(rng):
  """A random valid Fp4Config: every field but ``recipe``'s spelling varied
  (the generator covers every field: see the test below)."""
  pick = lambda *values: values[rng.integers(len(values))]
  recipe = pick("nvfp4", "mxfp4", " NVFP4 ", "MxFp4")
  mx = recipe.strip().lower() == "mxfp4"
  fields = dict(
      recipe=recipe, rht=pick(True, False),
      stochastic_rounding=pick(True, False),
      two_d_weights=pick(None, False) if mx else pick(None, True, False),
      mx_scale_rule=pick(None, "round_up", "floor", "Round-Up") if mx
      else None,
      native=pick(True, False), quantize_forward=pick(True, False),
      include_output_head=pick(True, False),
      include_batched=pick(True, False),
      include_moe_gating=pick(True, False),
      dim_multiple=pick(None, int(rng.integers(1, 65))),
      axis_name=pick(None, _AXES[rng.integers(len(_AXES))],
                     tuple(rng.choice(_AXES, rng.integers(1, 4),
                                      replace=False).tolist())))
  return fp4.Fp4Config(**fields), fields


@pytest.mark.parametrize("family", ["float8", "fp4"])
def test_random_policies_round_trip_exactly(family):
  """``get_policy(str(p)) == p`` (and equal hashes) over many random float8
  and FP4 recipes, every field varied, in every compute dtype a recipe takes;
  the policy's resolved recipe is the config."""
  random_config, config_cls, seed, count, unvaried = {
      "float8": (_random_config, fp8.Fp8Config, 0, 300, {"compute_dtype"}),
      "fp4": (_random_fp4_config, fp4.Fp4Config, 1, 200, set()),
  }[family]
  rng = np.random.default_rng(seed)
  covered = set()
  for _ in range(count):
    config, fields = random_config(rng)
    covered |= set(fields)
    policy = jmp_lite.Policy(
        *[("f32", "bf16", "f16")[i] for i in rng.integers(3, size=3)],
        matmul_precision=config)
    text = str(policy)
    again = jmp_lite.get_policy(text)
    assert again == policy and hash(again) == hash(policy), text
    assert str(again) == text
    assert again.fp8_recipe == config, text
    if family == "fp4" and config.axis_name is None:  # axis names keep case
      assert jmp_lite.get_policy(text.upper()) == policy, text
  assert covered == {f.name for f in dataclasses.fields(config_cls)} - unvaried, (
      f"a new {config_cls.__name__} field: add it to {random_config.__name__}")


@pytest.mark.parametrize("recipe", ["nvfp4", "mxfp4"])
def test_named_fp4_recipes_and_preset(recipe):
  policy = jmp_lite.get_policy(f"p=f32,c=bf16,o=f32,m={recipe}")
  assert policy.matmul_precision == recipe
  assert policy.fp8_recipe == fp4.Fp4Config(recipe)
  assert str(policy) == f"p=full,c=bf16,o=full,m={recipe}"
  # The config equal to the named recipe makes the same policy.
  built = jmp_lite.Policy(jnp.float32, jnp.bfloat16, jnp.float32,
                          matmul_precision=fp4.Fp4Config(recipe.upper()))
  assert built == policy and hash(built) == hash(policy)
  assert built.matmul_precision == recipe
  if recipe == "nvfp4":
    assert jmp_lite.get_policy("mixed_nvfp4") == policy


def test_fp4_recipe_fields_in_the_grammar():
  policy = jmp_lite.get_policy(
      "p=f32,c=bf16,o=f32,m=nvfp4( rht=False ; stochastic_rounding=false)")
  assert policy.fp8_recipe == fp4.Fp4Config(rht=False,
                                            stochastic_rounding=False)
  assert str(policy) == ("p=full,c=bf16,o=full,"
                         "m=nvfp4(rht=false;stochastic_rounding=false)")
  late = jmp_lite.get_policy("mixed_bfloat16").with_matmul_precision(
      "nvfp4(quantize_forward=false)")
  assert late.fp8_recipe == fp4.Fp4Config(quantize_forward=False)
  # Defaults written out read back to the named recipe.
  assert jmp_lite.get_policy(
      "c=bf16,m=mxfp4(mx_scale_rule=round_up;dim_multiple=32)"
  ).matmul_precision == "mxfp4"


@pytest.mark.parametrize("spec, error, words", [
    ("c=bf16,m=nvfp4(rht=false;rht=true)", ValueError,
     ["'rht' is given twice", "FP4 recipe"]),
    ("c=bf16,m=nvfp4(rht=false,stochastic_rounding=false)", ValueError,
     ["separates its fields with ','", "';'"]),
    ("c=bf16,m=nvfp4(disable_rht=true)", ValueError,
     ["Unknown field 'disable_rht'", "rht, stochastic_rounding"]),
    ("c=bf16,m=nvfp4(recipe=mxfp4)", ValueError, ["Unknown field 'recipe'"]),
    ("c=bf16,m=nvfp4(mx_scale_rule=floor)", ValueError,
     ["mx_scale_rule='floor'", "recipe='nvfp4'"]),
    ("c=bf16,m=mxfp4(two_d_weights=true)", ValueError,
     ["two_d_weights=True", "recipe='mxfp4'"]),
    ("c=bf16,m=nvfp4(rht=1)", ValueError,
     ["Invalid policy spec 'c=bf16,m=nvfp4(rht=1)'", "Field 'rht'",
      "takes true or false, got '1'", "rht=true or rht=false"]),
    ("c=bf16,m=nvfp4(dim_multiple=0)", ValueError, ["dim_multiple"]),
    ("p=f32,c=f64,o=f32,m=nvfp4", ValueError,
     ["'nvfp4' is an FP4 recipe", "float64", "mixed_nvfp4"]),
    ("p=f32,c=float4_e2m1fn,o=f32", ValueError,
     ["FP4 (float4_e2m1fn) holds no params", "m=nvfp4"]),
    ("p=e2m1", ValueError, ["FP4", "mixed_nvfp4"]),
])
def test_fp4_policy_errors_teach(spec, error, words):
  with pytest.raises(error) as info:
    jmp_lite.get_policy(spec)
  for word in words:
    assert word in str(info.value), (word, str(info.value))


@pytest.mark.parametrize("field", ["param_dtype", "compute_dtype",
                                   "output_dtype"])
def test_fp4_dtypes_are_no_policy_dtypes(field):
  dtypes = dict(param_dtype=jnp.float32, compute_dtype=jnp.bfloat16,
                output_dtype=jnp.float32)
  dtypes[field] = jnp.float4_e2m1fn
  with pytest.raises(ValueError,
                     match=r"FP4 \(float4_e2m1fn\) holds no params.*mixed_nvfp4"):
    jmp_lite.Policy(**dtypes)


def test_in_float32_refuses_fp4_recipes():
  for value in ("nvfp4", "MXFP4(rht=false)", fp4.Fp4Config()):
    with pytest.raises(ValueError, match="is an FP4 recipe"):
      jmp_lite.in_float32(lambda x: x, matmul_precision=value)


@pytest.mark.parametrize("value", [1 / 3, 0.1, 2.0**-149, 1e300, 12345.678])
def test_float_fields_render_exactly(value):
  """A float in a recipe is written with repr (str printed 6 digits:
  1/3 came back as 0.333333), so it reads back to the same float."""
  config_lib = __import__("jmp_lite._src.low_precision.recipes", fromlist=["_"])
  text = config_lib._render(value)  # pylint: disable=protected-access
  assert config_lib._parse_value("margin", text) == value  # pylint: disable=protected-access


def test_axis_names_keep_their_case_and_tuples_round_trip():
  policy = jmp_lite.get_policy(
      " C=BF16 , M = FP8_Delayed( Margin=2 ; AXIS_NAME=(Data|fsdp) ) ")
  config = policy.matmul_precision
  assert config.axis_name == ("Data", "fsdp") and config.margin == 2
  assert str(policy) == ("p=full,c=bf16,o=bf16,"
                         "m=fp8_delayed(margin=2;axis_name=(Data|fsdp))")
  assert jmp_lite.get_policy(str(policy)) == policy
  single = jmp_lite.get_policy("c=bf16,m=fp8(axis_name=batch)")
  assert single.matmul_precision.axis_name == "batch"
  assert single.matmul_precision == fp8.Fp8Config(axis_name="batch")
  # A whole-float margin is the int margin.
  assert fp8.Fp8Config(scaling="delayed", margin=3.0) == fp8.Fp8Config(
      scaling="delayed", margin=3)
  assert fp8.Fp8Config(scaling="delayed", margin=3.0).margin.__class__ is int


@pytest.mark.parametrize("axis", ["a b", "a,b", "x;y", "none", "1x", ("ok", "")])
def test_axis_names_the_grammar_cannot_write_are_refused_in_a_policy(axis):
  config = fp8.Fp8Config(axis_name=axis)  # fine for fp8.dot_general
  with pytest.raises(ValueError, match="cannot be written in the policy "
                     "grammar.*axis_name=\\(data\\|fsdp\\)"):
    jmp_lite.get_policy("mixed_bfloat16").with_matmul_precision(config)


@pytest.mark.parametrize("margin,error,pattern", [
    (-1, ValueError, "margin=-1 is not a whole number from 0 to 64.*clips"),
    (0.5, ValueError, "margin=0.5 .*fractional"),
    (1e9, ValueError, "margin=1000000000.0 .*0 to 64"),
    (65, ValueError, "margin=65 .*0 to 64"),
    (200, ValueError, "margin=200 .*NaN outputs"),
    (float("nan"), ValueError, "margin=nan"),
    (True, TypeError, "margin must be a whole number.*bool"),
    ("1", TypeError, "margin must be a whole number.*str"),
])
def test_bad_margins_name_the_value_the_range_and_why(margin, error, pattern):
  with pytest.raises(error, match=pattern):
    fp8.Fp8Config(scaling="delayed", margin=margin)


def test_delayed_defaults_and_matmul_context():
  config = fp8.Fp8Config(scaling="delayed")
  assert (config.history_length, config.margin, config.amax_algorithm) == (
      16, 0.0, "max")
  # A float8 recipe sets no float32 matmul precision (and, inside a tf32
  # region, leaves it in force).
  for recipe in RECIPES:
    context = jmp_lite.get_policy(f"c=f32,m={recipe}").matmul_context()
    assert isinstance(context, contextlib.nullcontext)
  f = jmp_lite.with_policy(lambda x, w: (x @ w).sum(), "p=f32,c=f32,o=f32,m=fp8")
  eqns = jax.make_jaxpr(f)(jnp.ones((2, 8)), jnp.ones((8, 2))).eqns
  dots = [e for e in eqns if e.primitive.name == "dot_general"]
  assert dots and all(e.params["precision"] is None for e in dots)


@pytest.mark.parametrize("spec,error,pattern", [
    ("m=fp9", ValueError, "Unknown matmul precision 'fp9'.*fp8, fp8_rowwise"),
    ("m=fp8(foo=1)", ValueError, "Unknown field 'foo'.*Fields: "),
    ("m=fp8_rowwise(margin)", ValueError, "Malformed entry 'margin'"),
    ("m=fp8_rowwise(margin=1", ValueError,
     "'fp8_rowwise\\(margin=1' does not close its parenthesis"),
    ("c=bf16,m=fp8_delayed(margin=1))", ValueError, "a '\\)' with no '\\('"),
    ("m=fp8(margin=1)", ValueError, "margin=1.*scaling='current'"),
    # A field twice, or fields separated by ',': named, with the fix.
    ("m=fp8_delayed(margin=1;margin=2)", ValueError,
     "Field 'margin' is given twice.*margin=1, then margin=2.*once"),
    ("m=fp8_delayed(margin=1,history_length=32)", ValueError,
     "'fp8_delayed\\(margin=1,history_length=32\\)' separates its fields "
     "with ','.*separated by ';'.*"
     "'fp8_delayed\\(margin=1;history_length=32\\)'"),
    ("c=bf16,m=fp8_delayed(margin=1, history_length=32),o=f32", ValueError,
     "separated by ';'"),
    # Margins: whole numbers from 0 to 64, with the reason.
    ("m=fp8_delayed(margin=-1)", ValueError,
     "margin=-1 is not a whole number from 0 to 64.*clips"),
    ("m=fp8_delayed(margin=0.5)", ValueError, "margin=0.5 .*fractional"),
    ("m=fp8_delayed(margin=1e9)", ValueError, "margin=1000000000.0 .*0 to 64"),
    ("m=fp8_delayed(margin=200)", ValueError, "margin=200 .*NaN"),
    ("m=fp8_delayed(margin=inf)", ValueError, "margin=inf .*0 to 64"),
    ("m=fp8_delayed(history_length=0)", ValueError, "history_length.*got 0"),
    ("m=fp8_delayed(amax_algorithm=mean)", ValueError, "'mean'.*'max'"),
    ("m=fp8_blockwise(block_size=100)", ValueError,
     "block_size=100 is not a positive multiple of 16"),
    ("m=fp8_blockwise(block_size=8)", ValueError, "block_size=8"),
    ("m=fp8(granularity=row;scaling=delayed)", ValueError,
     "granularity='tensor'"),
    ("m=fp8(dim_multiple=0)", ValueError, "dim_multiple.*got 0"),
    ("m=fp8(include_batched=yes)", ValueError,
     "'m=fp8\\(include_batched=yes\\)'.*Field 'include_batched' .*takes true "
     "or false, got 'yes'"),
    ("c=f64,m=fp8", ValueError, "computes in float64"),
    ("c=fp8", ValueError, "Unknown dtype 'fp8'.*matmul recipe.*mixed_fp8"),
    ("c=float8_e4m3fn", ValueError, "float8_e4m3fn.*matmul recipe"),
    ("fp8", ValueError, "Unknown dtype or preset 'fp8'.*mixed_fp8"),
    ("p=f32,c=bf16=m", ValueError, "not a single key=value pair"),
])
def test_bad_specs_name_the_value(spec, error, pattern):
  with pytest.raises(error, match=pattern):
    jmp_lite.get_policy(spec)


@pytest.mark.parametrize("recipe, field, value, takes", [
    ("nvfp4", "rht", "maybe", "true or false"),
    ("nvfp4", "stochastic_rounding", "1", "true or false"),
    ("nvfp4", "two_d_weights", "yes", "true, false or none"),
    ("mxfp4", "mx_scale_rule", "1", "one of round_up, floor or none"),
    ("nvfp4", "dim_multiple", "x", "a whole number or none"),
    ("nvfp4", "quantize_forward", "none", "true or false"),
    ("fp8", "power_of_two_scales", "0", "true or false"),
    ("fp8", "native_mx", "none", "true or false"),
    ("fp8", "granularity", "3", "one of tensor, row, blockwise, mxfp8"),
    ("fp8", "forward_format", "true", "one of e4m3, e5m2"),
    ("fp8", "scaling", "false", "one of current, delayed"),
    ("fp8_delayed", "amax_algorithm", "2", "one of max, most_recent or none"),
    ("fp8_delayed", "history_length", "1.5", "a whole number or none"),
    ("fp8_delayed", "margin", "abc", "a whole number"),
    ("fp8_blockwise", "block_size", "true", "a whole number or none"),
    ("fp8", "dim_multiple", "sixteen", "a whole number"),
])
def test_a_recipe_field_of_the_wrong_type_is_a_value_error(recipe, field,
                                                           value, takes):
  """Every field type of Fp8Config and Fp4Config (bool, int, str choice):
  a ValueError that quotes the field, the value as written, what it takes
  and the policy text, like every other malformed spec (rht=maybe was the
  config's TypeError, without the policy)."""
  spec = f"p=f32,c=bf16,o=f32,m={recipe}({field}={value})"
  with pytest.raises(ValueError) as info:
    jmp_lite.get_policy(spec)
  message = str(info.value)
  for words in (f"Invalid policy spec {spec!r}", f"Field {field!r} in the",
                f"recipe '{recipe}({field}={value})' takes {takes}, got "
                f"{value!r}: write ", "Fields: "):
    assert words in message, (words, message)


def test_recipe_fields_of_the_right_type_still_read_back():
  for spec in ("c=bf16,m=nvfp4(two_d_weights=none;dim_multiple=none)",
               "c=bf16,m=fp8_delayed(margin=1.0;amax_algorithm=none)",
               "c=bf16,m=fp8(axis_name=(data|fsdp))"):
    policy = jmp_lite.get_policy(spec)
    assert jmp_lite.get_policy(str(policy)) == policy
  assert jmp_lite.get_policy(
      "c=bf16,m=fp8_delayed(margin=1.0)").fp8_recipe.margin == 1


def test_float8_dtypes_and_bad_recipes_are_refused():
  for field in range(3):
    dtypes = [jnp.float32] * 3
    dtypes[field] = jnp.float8_e4m3fn
    with pytest.raises(ValueError, match="float8_e4m3fn.*matmul recipe"):
      jmp_lite.Policy(*dtypes)
  with pytest.raises(ValueError, match="float8_e5m2.*mixed_fp8"):
    jmp_lite.get_policy("bf16").with_param_dtype(jnp.float8_e5m2)
  with pytest.raises(ValueError, match="compute_dtype=bfloat16.*Leave it None"):
    jmp_lite.get_policy("mixed_bfloat16").with_matmul_precision(
        fp8.Fp8Config(compute_dtype=jnp.bfloat16))
  with pytest.raises(TypeError, match="matmul_precision.*Fp8Config.*int: 8"):
    jmp_lite.Policy(jnp.float32, jnp.float32, jnp.float32, matmul_precision=8)


# ---------------------------------------------------------------------------
# autocast and with_policy: which dots run in float8.
# ---------------------------------------------------------------------------


def test_autocast_puts_float8_in_every_dot_but_the_head():
  f = jmp_lite.autocast(mlp, "mixed_fp8")
  assert jaxpr_dots(f, PARAMS, X) == [(E4, E4), ("bfloat16", "bfloat16")]
  assert f(PARAMS, X).dtype == jnp.float32          # the interface is kept
  grad = jax.grad(lambda p: jmp_lite.autocast(loss_fn, "mixed_fp8")(p, X, Y))
  dots = set(jaxpr_dots(grad, PARAMS))
  # Forward e4m3 products, backward products of an e5m2 gradient, the head
  # (forward and backward) in bfloat16; nothing else.
  assert dots == {(E4, E4), (E5, E4), ("bfloat16",) * 2}


def test_with_policy_changes_only_the_dots():
  plain = jmp_lite.with_policy(mlp_with_attention, "mixed_bfloat16")
  f = jmp_lite.with_policy(mlp_with_attention, "mixed_fp8")
  assert jaxpr_dots(f, PARAMS, X) == [(E4, E4)] + [("bfloat16",) * 2] * 3
  assert [d for d in jaxpr_dots(plain, PARAMS, X)] == [("bfloat16",) * 2] * 4
  softmax = lambda g: [d for op, d in jmp_lite.op_dtypes(g, PARAMS, X)
                       if op == "exp"]
  assert softmax(f) == softmax(plain) == [("bfloat16",)]  # as traced
  out = f(PARAMS, X)
  assert out.dtype == jnp.float32
  ref = plain(PARAMS, X)
  assert float(jnp.linalg.norm(out - ref)) <= 0.1 * float(jnp.linalg.norm(ref))


@pytest.mark.parametrize("route", ["autocast", "with_policy"])
def test_opting_back_in(route):
  wrap = jmp_lite.autocast if route == "autocast" else jmp_lite.with_policy
  recipe = lambda **kw: jmp_lite.get_policy("mixed_bfloat16").with_matmul_precision(
      fp8.Fp8Config(**kw))
  assert jaxpr_dots(wrap(mlp_with_attention, recipe(include_output_head=True,
                                                    include_batched=True)),
                    PARAMS, X) == [(E4, E4)] * 4
  # A head of 10 classes is no multiple of 16: dim_multiple=1 admits it.
  w2 = PARAMS["w2"][:, :10]
  params = {**PARAMS, "w2": w2}
  assert jaxpr_dots(wrap(mlp, recipe(include_output_head=True)),
                    params, X)[-1] == ("bfloat16",) * 2
  assert jaxpr_dots(wrap(mlp, recipe(include_output_head=True,
                                     dim_multiple=1)),
                    params, X)[-1] == (E4, E4)
  # The rows (M: a batch of 12) are not constrained, only K and N are.
  assert jaxpr_dots(wrap(mlp, recipe()), PARAMS, X[:12])[0] == (E4, E4)


def test_what_stays_out_of_float8():
  def model(params, x, tokens):
    emb = jnp.take(params["embed"], tokens, axis=0)              # a gather
    img = jax.lax.conv_general_dilated(                          # a conv
        x[None, :, :, None], params["kernel"], (1, 1), "SAME",
        dimension_numbers=("NHWC", "HWIO", "NHWC"))[0, :, :, 0]
    ints = jnp.ones((16, 16), jnp.int32) @ jnp.ones((16, 16), jnp.int32)
    h = (emb + img) @ params["w1"] + ints.sum().astype(jnp.float32)
    norm = jmp_lite.in_float32(lambda h: h @ params["w_norm"])(h)  # an island
    return norm @ params["w2"]
  params = {"embed": _data((64, 32), 3), "kernel": _data((3, 3, 1, 1), 4),
            "w1": PARAMS["w1"], "w_norm": _data((64, 64), 5),
            "w2": PARAMS["w2"]}
  tokens = jnp.arange(16) % 64
  f = jmp_lite.autocast(model, "mixed_fp8")
  ops = jmp_lite.op_dtypes(f, params, X, tokens)
  conv = [d for op, d in ops if op == "conv_general_dilated"]
  assert conv == [("bfloat16", "bfloat16")]
  dots = [d for op, d in ops if op == "dot_general"]
  # the int matmul as written (op_dtypes lists a matmul's integer operands),
  # w1 in float8, the island in f32, the head bf16.
  assert dots == [("int32",) * 2, (E4, E4), ("float32",) * 2,
                  ("bfloat16",) * 2]


def test_user_dot_rule_wins_over_the_recipe():
  dot = jax.lax.dot_general_p
  f = jmp_lite.autocast(mlp, "mixed_fp8", op_rules={dot: "f32"})
  assert jaxpr_dots(f, PARAMS, X) == [("float32",) * 2] * 2


def test_delayed_recipes_need_state():
  for wrap in (jmp_lite.autocast, jmp_lite.with_policy):
    with pytest.raises(ValueError,
                       match="'fp8_delayed' uses delayed scaling.*linen"):
      wrap(mlp, "p=f32,c=bf16,o=f32,m=fp8_delayed")


def test_policy_holds_its_recipe_resolved_once():
  """Policy.fp8_recipe: derived from matmul_precision (not compared, hashed
  or printed apart from it), carried through copies and pickling."""
  import pickle  # pylint: disable=import-outside-toplevel
  policy = jmp_lite.get_policy("mixed_fp8")
  assert policy.matmul_precision == "fp8" and repr(policy) == (
      "Policy('p=full,c=bf16,o=full,m=fp8')")
  assert policy.with_output_dtype("bf16").fp8_recipe is policy.fp8_recipe
  assert policy.with_matmul_precision(None).fp8_recipe is None
  again = pickle.loads(pickle.dumps(policy))
  assert again == policy and again.fp8_recipe == fp8.Fp8Config()
  with pytest.raises(dataclasses.FrozenInstanceError):
    policy.fp8_recipe = None  # pytype: disable=attribute-error


def test_no_recipe_is_parsed_from_text_while_tracing(monkeypatch):
  """Recipes travel as objects: a policy resolves its recipe once, markers
  carry a registry key, and tracing a 4-matmul model under autocast,
  with_policy and a marked region parses no recipe text."""
  custom = "p=f32,c=bf16,o=f32,m=fp8_rowwise(dim_multiple=8)"
  policy = jmp_lite.get_policy(custom)
  assert policy.fp8_recipe == fp8.Fp8Config(
      granularity="row", gradient_format="e4m3", dim_multiple=8)
  assert jmp_lite.get_policy("mixed_fp8").fp8_recipe == fp8.Fp8Config()
  assert jmp_lite.get_policy("tf32").fp8_recipe is None
  blockwise = jmp_lite.get_policy("c=bf16,m=fp8_blockwise(block_size=32)")
  marker = markers.fp8_marker(blockwise.fp8_recipe)
  assert re.fullmatch(r"jmp_lite\.fp8\[\d+\]", marker), marker
  assert markers.marked_recipe(f"a/{marker}/b", None) is blockwise.fp8_recipe
  calls = []
  real = recipes_lib.from_spec
  monkeypatch.setattr(recipes_lib, "from_spec",
                      lambda text: calls.append(text) or real(text))

  def model(params, x):
    h = x @ params["w1"]
    with jax.named_scope(marker):
      h = jax.nn.relu(h[:, :32] @ params["sq"])
      h = h @ params["sq"]
    return h @ params["w2"][:32]

  params = {**PARAMS, "sq": _data((32, 32), 6)}
  for f in (jmp_lite.autocast(model, policy),
            jmp_lite.with_policy(model, policy)):
    dots = jaxpr_dots(jax.grad(lambda p, f=f: f(p, X).sum()), params)
    assert (E4, E4) in dots
  assert calls == []
  # The same spelling resolves to an equal recipe (text is read once, by
  # get_policy; the parse is cached).
  assert jmp_lite.get_policy(custom).fp8_recipe == policy.fp8_recipe


def test_markers_scope_recipes_and_reach_bodies():
  """The innermost marker wins; a marker around jit/scan reaches its body."""
  rowwise = jmp_lite.get_policy("c=bf16,m=fp8_rowwise")

  def region(policy, fn):
    def wrapped(*args):
      with jax.named_scope(markers.fp8_marker(
          None if policy is None else policy.fp8_recipe)):
        return fn(*args)
    return wrapped

  def f(params, x):
    h = region(None, lambda x: x @ params["w1"])(x)            # no float8
    body = lambda c, _: (jax.nn.relu(c @ params["sq"]), None)
    h2, _ = region(rowwise, lambda h: jax.lax.scan(body, h, length=2))(
        h[:, :32])
    h3 = region(rowwise, jax.jit(lambda h: h @ params["sq"]))(h2)
    return h3 @ params["w2"][:32]
  params = {**PARAMS, "sq": _data((32, 32), 6)}
  g = jmp_lite.autocast(f, "mixed_fp8")
  assert jaxpr_dots(g, params, X) == [("bfloat16",) * 2, (E4, E4), (E4, E4),
                                      ("bfloat16",) * 2]
  text = cuda_program(jax.grad(lambda p: g(p, X).sum()), params)
  # rowwise: e4m3 gradients; the scan body and the jit body, forward and
  # backward, all in float8.
  f8 = [d for d, _ in cuda_ops(text) if d == ("f8E4M3FN", "f8E4M3FN")]
  assert len(f8) == 2 + 2 * 2


# ---------------------------------------------------------------------------
# The program a GPU runs.
# ---------------------------------------------------------------------------


def _train_step(route, policy):
  opt = jmp_lite.loss_scaling(optax.adam(1e-2), jmp_lite.NoOpLossScale())
  if route == "autocast":
    loss = jmp_lite.autocast(loss_fn, policy)
  else:
    apply = jmp_lite.with_policy(mlp_with_attention, policy)
    loss = lambda p, x, y: optax.softmax_cross_entropy_with_integer_labels(
        apply(p, x), y).mean()

  def step(params, state, x, y):
    value, grads = jmp_lite.scaled_value_and_grad(loss, state)(params, x, y)
    updates, state = opt.update(grads, state, params)
    return optax.apply_updates(params, updates), state, value
  return opt, step


@pytest.mark.standard_promotion
@pytest.mark.parametrize("route", ["autocast", "with_policy"])
def test_exported_cuda_step(route):
  opt, step = _train_step(route, "mixed_fp8")
  text = cuda_program(step, PARAMS, opt.init(PARAMS), X, Y)
  dots = cuda_ops(text)
  f8 = [(d, r) for d, r in dots if any(t.startswith("f8") for t in d)]
  # w1: forward e4m3 x e4m3 and the e5m2 weight gradient; every float8 dot
  # accumulates in float32 and takes two float8 operands.
  assert fp8_counts(dots) == (1, 1)
  assert all(r == "f32" and all(t.startswith("f8") for t in d) for d, r in f8)
  rest = [d for d, _ in dots if (d, _) not in f8]
  # The head forward and backward (3 products), with_policy's two attention
  # products forward and backward (6 more).
  half = {"autocast": 3, "with_policy": 9}[route]
  assert rest == [("bf16", "bf16")] * half
  assert_no_host_calls(text)


@pytest.mark.standard_promotion
def test_exported_cuda_recipes():
  for recipe, fwd, grad in (("fp8_rowwise", "f8E4M3FN", "f8E4M3FN"),
                            ("fp8_blockwise", "f8E4M3FN", "f8E4M3FN")):
    opt, step = _train_step("autocast", f"p=f32,c=bf16,o=f32,m={recipe}")
    text = cuda_program(step, PARAMS, opt.init(PARAMS), X, Y)
    f8 = [(d, r) for d, r in cuda_ops(text) if d[0].startswith("f8")]
    assert sorted(f8) == [((grad, fwd), "f32"), ((fwd, fwd), "f32")]
    assert_no_host_calls(text)
  opt, step = _train_step("autocast", "p=f32,c=bf16,o=f32,m=mxfp8")
  text = cuda_program(step, PARAMS, opt.init(PARAMS), X, Y)
  calls = cuda_ops(text, "custom_call")
  # MX: jax.nn.scaled_matmul's block-scaled GEMM, E8M0 scales, f32 out.
  assert len(calls) == 2
  assert all(d.count("f8E8M0FNU") == 2 and d.count("f8E4M3FN") >= 1
             and r == "f32" for d, r in calls)
  assert_no_host_calls(text, allowed={"__op$block_scaled_dot"})


# ---------------------------------------------------------------------------
# Training.
# ---------------------------------------------------------------------------

#: How far a float8 run may end from the bfloat16 run of the same steps (the
#: final loss, relative). e4m3 keeps 3 mantissa bits (relative rounding error
#: up to 2**-4 per operand); over a few steps of a small MLP the losses stay
#: within a few percent.
LOSS_RTOL = 0.05


@pytest.mark.standard_promotion
@pytest.mark.parametrize("route", default_run_keeps(["autocast", "with_policy"]))
@pytest.mark.parametrize("jit", default_run_keeps([True, False]),
                         ids=["jit", "eager"])
def test_training_is_finite_and_close_to_bf16(route, jit):
  def run(policy):
    opt, step = _train_step(route, policy)
    traces = []

    def counted(*args):
      traces.append(1)
      return step(*args)
    fn = jax.jit(counted) if jit else counted
    params, state = PARAMS, opt.init(PARAMS)
    losses = []
    for _ in range(4 if jit else 2):  # eager: every op dispatched alone
      params, state, loss = fn(params, state, X, Y)
      losses.append(float(loss))
    return losses, params, len(traces)

  bf16, _, _ = run("mixed_bfloat16")
  f8, params, traces = run("mixed_fp8")
  assert all(np.isfinite(f8)) and all(np.all(np.isfinite(p)) for p in jax.tree.leaves(params))
  assert f8[-1] < f8[0]
  assert abs(f8[-1] - bf16[-1]) <= LOSS_RTOL * bf16[-1], (f8, bf16)
  if jit:
    assert traces == 1  # no recompilation on the second step


#: How far float8 gradients may be from float32's (relative norm). One e4m3
#: matmul is within 4% of float32 here (unit roundoff 2**-4 per operand); the
#: first layer's weight gradient passes through a ReLU mask and the softmax,
#: which amplify it: bfloat16's is 6% off, every float8 recipe's 14-15%.
GRAD_RTOL = 0.2


@pytest.mark.parametrize("recipe", default_run_keeps(CURRENT))
def test_every_current_recipe_gives_gradients_close_to_f32(recipe):
  policy = f"p=f32,c=bf16,o=f32,m={recipe}"
  grad = jax.jit(jax.value_and_grad(jmp_lite.autocast(loss_fn, policy)))
  (l8, g8), (l32, g32) = grad(PARAMS, X, Y), jax.value_and_grad(loss_fn)(
      PARAMS, X, Y)
  assert abs(float(l8) - float(l32)) <= 0.02 * float(l32)
  for a, b in zip(jax.tree.leaves(g8), jax.tree.leaves(g32)):
    assert np.all(np.isfinite(a))
    assert float(jnp.linalg.norm(a - b)) <= GRAD_RTOL * float(
        jnp.linalg.norm(b))


# ---------------------------------------------------------------------------
# Bad inputs.
# ---------------------------------------------------------------------------


def test_fp8_matmul_bad_operands_name_the_value():
  dn = (((1,), (0,)), ((), ()))
  with pytest.raises(TypeError, match="lhs must be a floating array.*int32"):
    fp8.dot_general(jnp.ones((2, 16), jnp.int32), jnp.ones((16, 2)), dn)
  with pytest.raises(TypeError, match="rhs is already float8.*float8_e4m3fn"):
    fp8.dot_general(jnp.ones((2, 16)),
                        jnp.ones((16, 2), jnp.float8_e4m3fn), dn)
  with pytest.raises(TypeError, match="Missing or malformed scales"):
    fp8.dot_general(jnp.ones((2, 16)), jnp.ones((16, 2)), dn,
                        config=fp8.Fp8Config(scaling="delayed"))
  # Delayed scaling with a current-scaled gradient (what the policies use).
  config = fp8.Fp8Config(scaling="delayed")
  scales = fp8.DelayedScales(jnp.float32(2.0**-6), jnp.float32(2.0**-6))

  def loss(x, w, s):
    return fp8.dot_general(x, w, dn, config=config, scales=s).sum()
  grads = jax.grad(loss, argnums=(0, 1, 2))(jnp.ones((2, 16)),
                                           jnp.ones((16, 2)), scales)
  assert grads[2].grad is None and float(grads[2].lhs) == 1.0
  assert float(grads[0][0, 0]) == 2.0


def test_dataclass_replace_keeps_the_config_valid():
  config = fp8.Fp8Config(granularity="row")
  assert dataclasses.replace(config, gradient_format="e4m3").spec() == (
      "fp8_rowwise")
  with pytest.raises(ValueError, match="block_size=64.*only applies"):
    dataclasses.replace(config, block_size=64)
