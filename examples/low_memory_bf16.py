"""bfloat16 params without a float32 master copy: bytes per parameter, training.

``jmp_lite.master_weights`` makes bfloat16 params train like float32 ones in
one of three ways (``method=``): a float32 master copy (``"copy"``), stochastic
rounding of each write (``"stochastic_rounding"``, no per-parameter state) or
a 2-byte Kahan compensation (``"kahan"``). This script measures what each
costs in memory and whether it trains.

**(a) Bytes per parameter** of params + optimizer state, from the real
optimizer states (``jax.eval_shape`` of ``opt.init``: the sum of the leaves'
bytes over the parameter count), for every recipe, with Adam's moments in
float32, bfloat16, 8-bit, 4-bit and e4m3 (``with_state_dtype``), on the
digits MLP and on a GPT-2 small shape (124M parameters, nothing trained).
:func:`bytes_table` prints the tables quoted in ``docs/precision.md``, and a
test recomputes them.

**(b) Training**, the same initial params and batches for every recipe:

* the digits MLP (``models.flax_models.DigitsMLP``, Adam with cosine decay to
  0, as in ``examples/master_weights.py``), several seeds: test accuracy,
  final train loss, and the "learning-rate decay stall": the fraction of
  params that did not change at all over the last 10% of the steps (99.3% for
  plain bfloat16 params with seed 0);
* the tiny language model (``models.jax_models``'s decoder, 2 layers, 64 wide,
  byte-level, on the Python standard library's source), several seeds: final
  train loss and held-out loss and next-byte accuracy.

Recipes: ``f32`` (float32 params and compute), ``bf16`` (bfloat16 params and
compute, Adam's moments follow the params), ``bf16_copy``, ``bf16_sr``,
``bf16_kahan`` (bfloat16 params and compute, Adam wrapped in
``master_weights`` with each method: float32 moments), and with low-bit
moments: ``sr_8bit``, ``sr_4bit``, ``sr_e4m3``, ``sr_4bit_rank1``
(bfloat16 params,
``master_weights(with_state_dtype(adam, mu=..., nu=...),
method="stochastic_rounding")``).

**(d) Low-bit states against f32**: each low-bit recipe's gap to f32, per
seed and on the mean, against the examples' parity bars (digits test
accuracy within 1 point, LM held-out loss at most 2% above), misses reported
as misses.

**(e) The zero-point problem**: the digits MLP with Adam whose second moment
is stored in a naive affine int8 code (``min + k (max - min) / 255`` per
block: small ``v`` decode to the block's minimum, ~0, and
``m / (sqrt(v) + eps)`` explodes) diverges; jmp_lite's zero-free 8-bit and
4-bit codes train like float32 ``v``.

Run it with::

  pip install -e ".[examples]"
  python -m examples.low_memory_bf16            # about 10 minutes on 2 cores
  python -m examples.low_memory_bf16 --quick    # a smoke test

It prints the tables and writes ``low_memory_bf16.md`` and
``low_memory_bf16.json`` to ``--out`` (a scratch folder; ``--update-results``
writes ``examples/results/``).
"""

from __future__ import annotations

import argparse
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax

from examples import common
from models import flax_models
from models import jax_models
import jmp_lite

F32 = np.dtype(jnp.float32)
BF16 = np.dtype(jnp.bfloat16)

#: The training recipes: name -> (label, param dtype, method or None, Adam's
#: moment formats ``(mu, nu)`` for ``with_state_dtype`` or None: float32).
RECIPES = {
    "f32": ("f32", F32, None, None),
    "bf16": ("bf16 alone", BF16, None, None),
    "bf16_copy": ("bf16 + master copy", BF16, "copy", None),
    "bf16_sr": ("bf16 + stochastic rounding", BF16, "stochastic_rounding",
                None),
    "bf16_kahan": ("bf16 + Kahan", BF16, "kahan", None),
    "sr_8bit": ("bf16 + SR + 8-bit states", BF16, "stochastic_rounding",
                ("8bit", "8bit")),
    "sr_4bit": ("bf16 + SR + 4-bit states", BF16, "stochastic_rounding",
                ("4bit", "4bit")),
    "sr_e4m3": ("bf16 + SR + e4m3 states", BF16, "stochastic_rounding",
                ("e4m3", "e4m3")),
    "sr_4bit_rank1": ("bf16 + SR + 4-bit states, rank-1 `v`", BF16,
                      "stochastic_rounding", ("4bit", "4bit_rank1")),
}
#: The recipes with low-bit optimizer states, judged against f32 by the
#: examples' parity bars.
LOW_BIT = ("sr_8bit", "sr_4bit", "sr_e4m3", "sr_4bit_rank1")
#: The parity bars: held-out loss of the language model within this relative
#: gap of f32's, and test accuracy of the digits MLP within
#: ``common.ACCURACY_TOLERANCE`` points.
LM_LOSS_TOLERANCE = 0.02

#: The tiny language model.
LM_CONFIG = jax_models.LMConfig(vocab=256, layers=2, width=64, heads=4,
                                seq_len=32)


def make_optimizer(method, learning_rate, moments=None, seed=0):
  """Adam for a recipe: plain (``method=None``) or in ``master_weights``;
  ``moments``: a dtype to store Adam's moments in, or a ``(mu, nu)`` pair of
  formats (``with_state_dtype``, inside ``master_weights``); ``seed``:
  stochastic rounding's."""
  inner = optax.adam(learning_rate)
  if isinstance(moments, tuple):
    inner = jmp_lite.with_state_dtype(inner, mu=moments[0], nu=moments[1])
  elif moments is not None:
    inner = jmp_lite.with_state_dtype(inner, moments)
  if method is None:
    return inner
  if method == "stochastic_rounding":
    return jmp_lite.master_weights(inner, method=method, seed=seed)
  return jmp_lite.master_weights(inner, method=method)


# -- (a) bytes per parameter ---------------------------------------------------

#: The rows of the bytes table: (label, param dtype, method or None, what the
#: optimizer keeps besides Adam's moments).
BYTES_ROWS = (
    ("f32 Adam", F32, None, "-"),
    ("f32 params + bf16 compute (`p=f32,c=bf16`)", F32, None, "-"),
    ("bf16 params alone", BF16, None, "-"),
    ("bf16 + `master_weights` (copy)", BF16, "copy",
     "float32 master copy"),
    ("bf16 + stochastic rounding", BF16, "stochastic_rounding",
     "one PRNG key"),
    ("bf16 + Kahan", BF16, "kahan", "int16 compensation"),
)


def _nbytes(tree) -> int:
  return sum(int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize
             for x in jax.tree.leaves(tree))


#: Adam's moments in the bytes table's columns: a dtype for both, or one
#: low-bit format name for both (``with_state_dtype(mu=..., nu=...)``).
BYTES_MOMENTS = ((F32, "f32"), (BF16, "bf16"), ("8bit", "8-bit"),
                 ("4bit", "4-bit"), ("e4m3", "e4m3"))

#: GPT-2 small (Radford et al. 2019; 124M parameters, the output head tied to
#: the token embedding): its parameter shapes, for sizing only.
GPT2_SMALL = dict(vocab=50257, context=1024, width=768, layers=12)


def digits_mlp_shapes():
  """The digits MLP's parameter shapes (float32 ``ShapeDtypeStruct``s)."""
  return jax.eval_shape(
      lambda: flax_models.DigitsMLP().init(
          jax.random.key(0), jnp.zeros((1, 64), F32))["params"])


def gpt2_small_shapes():
  """GPT-2 small's parameter shapes (Hugging Face's ``Conv1D`` layout:
  kernels ``(in, out)``), 124,439,808 parameters; nothing is allocated."""
  v, c, d, layers = (GPT2_SMALL[k] for k in ("vocab", "context", "width",
                                             "layers"))
  s = lambda *shape: jax.ShapeDtypeStruct(shape, F32)
  block = {"ln_1": {"scale": s(d), "bias": s(d)},
           "attn": {"c_attn": {"kernel": s(d, 3 * d), "bias": s(3 * d)},
                    "c_proj": {"kernel": s(d, d), "bias": s(d)}},
           "ln_2": {"scale": s(d), "bias": s(d)},
           "mlp": {"c_fc": {"kernel": s(d, 4 * d), "bias": s(4 * d)},
                   "c_proj": {"kernel": s(4 * d, d), "bias": s(d)}}}
  return {"wte": s(v, d), "wpe": s(c, d),
          "h": {str(i): block for i in range(layers)},
          "ln_f": {"scale": s(d), "bias": s(d)}}


#: The models the bytes table is computed for: name -> (description, shapes).
BYTES_MODELS = {
    "digits_mlp": ("the digits MLP", digits_mlp_shapes),
    "gpt2_small": ("a GPT-2 small shape", gpt2_small_shapes),
}


def bytes_per_parameter(param_dtype, method, moments,
                        model="digits_mlp") -> float:
  """(params + optimizer state bytes) / parameter count of ``model`` (a key
  of :data:`BYTES_MODELS`), from ``jax.eval_shape`` of the optimizer's init
  (nothing is allocated).

  ``moments``: the dtype of Adam's moments, or a low-bit format name
  (``"8bit"``, ``"4bit"``, ``"e4m3"``) for both. For bf16 params alone,
  bfloat16 moments are plain Adam's own (they follow the params) and float32
  ones need ``with_state_dtype``; for f32 params it is the other way round;
  inside ``master_weights`` the moments are float32 unless
  ``with_state_dtype`` stores them otherwise.
  """
  shapes = BYTES_MODELS[model][1]()
  params = jax.tree.map(
      lambda s: jax.ShapeDtypeStruct(s.shape, param_dtype), shapes)
  if isinstance(moments, str):
    states = (moments, moments)
  else:
    default = param_dtype if method is None else F32
    states = None if np.dtype(moments) == default else moments
  opt = make_optimizer(method, 1e-3, states)
  state = jax.eval_shape(opt.init, params)
  count = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params))
  return (_nbytes(params) + _nbytes(state)) / count


def bytes_table(model="digits_mlp") -> str:
  """The bytes-per-parameter table of ``model`` (``"digits_mlp"`` or
  ``"gpt2_small"``), as GitHub markdown: a row per recipe, a column per
  format of Adam's moments."""
  heads = " | ".join(f"{label} moments" for _, label in BYTES_MOMENTS)
  lines = [
      f"| recipe | params | kept besides the moments | {heads} |",
      "|---|---|---|" + "--:|" * len(BYTES_MOMENTS),
  ]
  for label, dtype, method, extra in BYTES_ROWS:
    cells = " | ".join(f"{bytes_per_parameter(dtype, method, m, model):.2f}"
                       for m, _ in BYTES_MOMENTS)
    lines.append(f"| {label} | {dtype.name} | {extra} | {cells} |")
  return "\n".join(lines)


# -- (b) training --------------------------------------------------------------


def _late_snapshot_loop(step, params, opt_state, batches, late):
  """Runs ``step`` over ``batches``; returns the final params and state, the
  params before step ``late`` and the losses."""
  snapshot, losses = params, []
  for i, batch in enumerate(batches):
    if i == late:
      snapshot = params
    params, opt_state, loss = step(params, opt_state, *batch)
    losses.append(loss)
  return params, opt_state, snapshot, [float(x) for x in jax.device_get(losses)]


def _unchanged_fraction(params, snapshot) -> float:
  same = sum(int(jnp.sum(a == b)) for a, b in zip(
      jax.tree.leaves(params), jax.tree.leaves(snapshot)))
  return same / sum(x.size for x in jax.tree.leaves(params))


def train_digits(recipe, seed, data, args) -> dict:
  """The digits MLP in one recipe from ``seed``."""
  _, dtype, method, states = RECIPES[recipe]
  spec = "p=f32,c=f32,o=f32" if dtype == F32 else "p=bf16,c=bf16,o=f32"
  policy = jmp_lite.get_policy(spec)
  apply_fn = jmp_lite.with_policy(flax_models.DigitsMLP().apply, policy)
  opt = make_optimizer(method, optax.cosine_decay_schedule(
      args.lr, args.steps), states, seed=seed)

  def loss_fn(params, x, y):
    return common.cross_entropy(apply_fn({"params": params}, x), y)

  @jax.jit
  def step(params, opt_state, x, y):
    loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
    updates, opt_state = opt.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  init = flax_models.DigitsMLP().init(jax.random.key(seed),
                                      data["x_train"][:1])["params"]
  params = policy.cast_to_param(init)
  idx = common.batch_indices(len(data["x_train"]), args.batch_size,
                             args.steps, seed)
  batches = ((data["x_train"][i], data["y_train"][i]) for i in idx)
  late = args.steps - max(1, args.steps // 10)
  params, _, snapshot, losses = _late_snapshot_loop(
      step, params, opt.init(params), batches, late)
  evaluate = common.make_eval_fn(apply_fn)
  test_acc, test_ce = evaluate(params, data["x_test"], data["y_test"])
  _, train_ce = evaluate(params, data["x_train"], data["y_train"])
  _, late_ce = evaluate(snapshot, data["x_train"], data["y_train"])
  return dict(test_accuracy=100 * float(test_acc), test_loss=float(test_ce),
              final_train_loss=float(train_ce),
              late_train_loss_drop=float(late_ce) - float(train_ce),
              unchanged_late_fraction=_unchanged_fraction(params, snapshot),
              loss_history=losses)


def lm_data(args):
  """Byte tokens of the standard library's source: train and held-out."""
  tokens = flax_models.encode(flax_models.load_stdlib_text(args.lm_chars))
  split = int(0.9 * len(tokens))
  return tokens[:split], tokens[split:]


def _windows(tokens, starts, length):
  return np.stack([tokens[s:s + length] for s in starts])


def train_lm(recipe, seed, train_tokens, eval_tokens, args) -> dict:
  """The tiny language model in one recipe from ``seed``."""
  _, dtype, method, states = RECIPES[recipe]
  cfg = LM_CONFIG
  schedule = optax.warmup_cosine_decay_schedule(
      0.0, args.lm_lr, max(1, args.lm_steps // 10), args.lm_steps)
  opt = make_optimizer(method, schedule, states, seed=seed)

  def loss_and_acc(params, tokens):
    logits = jax_models.apply_lm(params, tokens[:, :-1], cfg).astype(F32)
    labels = tokens[:, 1:]
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
    return jnp.mean(loss), jnp.mean(jnp.argmax(logits, -1) == labels)

  @jax.jit
  def step(params, opt_state, tokens):
    loss, grads = jax.value_and_grad(
        lambda p: loss_and_acc(p, tokens)[0])(params)
    updates, opt_state = opt.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  params = jax.tree.map(lambda x: x.astype(dtype),
                        jax_models.init_lm(jax.random.key(seed), cfg))
  rng = np.random.default_rng(seed)
  length = cfg.seq_len + 1
  batches = ((_windows(train_tokens, rng.integers(
      0, len(train_tokens) - length, args.lm_batch_size), length),)
             for _ in range(args.lm_steps))
  late = args.lm_steps - max(1, args.lm_steps // 10)
  params, _, snapshot, losses = _late_snapshot_loop(
      step, params, opt.init(params), batches, late)
  starts = np.arange(0, len(eval_tokens) - length, length)[:args.lm_eval]
  eval_loss, eval_acc = jax.jit(loss_and_acc)(
      params, _windows(eval_tokens, starts, length))
  tail = max(1, args.lm_steps // 10)
  return dict(final_train_loss=float(np.mean(losses[-tail:])),
              eval_loss=float(eval_loss), eval_accuracy=100 * float(eval_acc),
              unchanged_late_fraction=_unchanged_fraction(params, snapshot),
              loss_history=losses)


# -- (d) the zero-point problem ------------------------------------------------


def affine_int8(v, block=256):
  """A naive 8-bit store of a non-negative moment, as float32 values: per
  block of ``block`` along the last axis, the affine int8 code
  ``min + k * (max - min) / 255`` (``k = 0..255``, nearest). Its lowest code
  is the block's minimum, zero or nearly: every ``v`` below half a step
  decodes to it, and Adam's ``m / (sqrt(v) + eps)`` explodes there (lpmm's
  "zero-point problem"; unsloth-zoo#962's int8 ``v``)."""
  *lead, n = v.shape
  pad = -n % block
  b = jnp.pad(v, [(0, 0)] * len(lead) + [(0, pad)], mode="edge")
  b = b.reshape(*lead, -1, block)
  lo, hi = b.min(-1, keepdims=True), b.max(-1, keepdims=True)
  step = jnp.where(hi > lo, (hi - lo) / 255, jnp.float32(1.0))
  k = jnp.clip(jnp.round((b - lo) / step), 0, 255)
  return (lo + k * step).reshape(*lead, -1)[..., :n]


def adam_with_naive_nu(learning_rate, min_size=4096):
  """``optax.adam`` whose second moments (leaves of at least ``min_size``
  elements) are stored by :func:`affine_int8`: the update runs Adam on the
  stored ``nu`` and stores the new one the same way."""
  adam = optax.adam(learning_rate)

  def store(state):
    nu = jax.tree.map(lambda v: affine_int8(v) if v.size >= min_size else v,
                      state[0].nu)
    return (state[0]._replace(nu=nu),) + tuple(state[1:])

  def update(updates, state, params=None):
    updates, state = adam.update(updates, state, params)
    return updates, store(state)

  return optax.GradientTransformation(adam.init, update)


#: The runs of the zero-point demonstration: name -> (label, optimizer).
ZERO_POINT_RUNS = {
    "f32": ("f32 Adam", lambda lr: optax.adam(lr)),
    "affine_int8": ("`v` in naive affine int8 (zero reachable)",
                    adam_with_naive_nu),
    "zero_free_8bit": ("`v` in jmp_lite's 8-bit code (`nu=\"8bit\"`)",
                       lambda lr: jmp_lite.with_state_dtype(
                           optax.adam(lr), nu="8bit")),
    "zero_free_4bit": ("`v` in jmp_lite's 4-bit code (`nu=\"4bit\"`)",
                       lambda lr: jmp_lite.with_state_dtype(
                           optax.adam(lr), nu="4bit")),
    "zero_free_4bit_rank1": (
        "`v` in jmp_lite's 4-bit code, rank-1 (`nu=\"4bit_rank1\"`)",
        lambda lr: jmp_lite.with_state_dtype(optax.adam(lr),
                                             nu="4bit_rank1")),
}


def zero_point(data, args) -> dict:
  """The digits MLP in float32 with Adam (constant learning rate
  ``args.zp_lr``) for ``args.zp_steps`` steps, Adam's ``v`` stored each way
  of :data:`ZERO_POINT_RUNS`; everything else (``m``, params) float32."""
  out = {}
  for name, (_, make) in ZERO_POINT_RUNS.items():
    opt = make(args.zp_lr)
    model = flax_models.DigitsMLP()

    def loss_fn(params, x, y):
      return common.cross_entropy(model.apply({"params": params}, x), y)

    @jax.jit
    def step(params, opt_state, x, y, opt=opt, loss_fn=loss_fn):
      loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
      updates, opt_state = opt.update(grads, opt_state, params)
      return optax.apply_updates(params, updates), opt_state, loss

    params = model.init(jax.random.key(0), data["x_train"][:1])["params"]
    opt_state = opt.init(params)
    losses = []
    for i in common.batch_indices(len(data["x_train"]), args.batch_size,
                                  args.zp_steps, 0):
      params, opt_state, loss = step(params, opt_state, data["x_train"][i],
                                     data["y_train"][i])
      losses.append(loss)
    losses = [float(x) for x in jax.device_get(losses)]
    biggest = max(float(jnp.max(jnp.abs(x))) for x in jax.tree.leaves(params))
    finite = [x for x in losses if np.isfinite(x)]
    out[name] = dict(loss_history=losses, final_loss=losses[-1],
                     max_loss=max(finite) if finite else float("nan"),
                     first_nan_step=next((k for k, x in enumerate(losses)
                                          if not np.isfinite(x)), None),
                     max_abs_param=biggest)
    print(f"zero point {name:>15}: final loss {losses[-1]:.4g}, max loss "
          f"{out[name]['max_loss']:.4g}, max |param| {biggest:.4g}",
          flush=True)
  return out


def format_zero_point(zp, args) -> str:
  marks = sorted({0, 1, 2, 5, 10, 20, 50, args.zp_steps - 1} & set(
      range(args.zp_steps)))
  lines = [
      "| `v` stored as | " + " | ".join(f"loss, step {k}" for k in marks)
      + " | first NaN step | largest \\|param\\| at the end |",
      "|---|" + "--:|" * (len(marks) + 2),
  ]
  for name, r in zp.items():
    cells = " | ".join(f"{r['loss_history'][k]:.4g}" for k in marks)
    nan = "-" if r["first_nan_step"] is None else str(r["first_nan_step"])
    lines.append(f"| {ZERO_POINT_RUNS[name][0]} | {cells} | {nan} "
                 f"| {r['max_abs_param']:.4g} |")
  return "\n".join(lines) + (
      f"\n\nDigits MLP in float32, Adam {args.zp_lr:g} (constant), batch "
      f"{args.batch_size}, seed 0, {args.zp_steps} steps; only the storage of "
      "Adam's second moment (leaves of at least 4096 elements; the first "
      "moment and the params stay float32) differs. The naive code maps each "
      "block of 256 to `min + k (max - min) / 255`: a `v` below half a step "
      "above the block's minimum decodes to it (zero, or nearly), and "
      "`m / (sqrt(v) + eps)` with eps = 1e-8 turns into a step of up to "
      "1e8 x the learning rate. jmp_lite's codes for non-negative moments "
      "have no reachable zero: the smallest code is a fixed fraction of the "
      "block's absmax.")


def parity(digits_runs, lm_runs) -> dict:
  """Each low-bit recipe against f32 by the examples' bars, per seed and on
  the mean: digits test accuracy within ``common.ACCURACY_TOLERANCE``
  points, LM held-out loss within :data:`LM_LOSS_TOLERANCE` (relative)."""
  out = {}
  for name in LOW_BIT:
    acc = [r["test_accuracy"] - f["test_accuracy"]
           for r, f in zip(digits_runs[name], digits_runs["f32"])]
    gap = [r["eval_loss"] / f["eval_loss"] - 1
           for r, f in zip(lm_runs[name], lm_runs["f32"])]
    out[name] = dict(
        digits_accuracy_gap=acc, digits_mean_gap=float(np.mean(acc)),
        digits_pass=bool(abs(np.mean(acc)) <= common.ACCURACY_TOLERANCE),
        lm_loss_gap=gap, lm_mean_gap=float(np.mean(gap)),
        lm_pass=bool(np.mean(gap) <= LM_LOSS_TOLERANCE))
  return out


def format_parity(par) -> str:
  word = lambda ok: "PASS" if ok else "MISS"
  lines = [
      "| recipe | digits: test acc. - f32's, per seed (points) | mean | bar "
      "| LM: held-out loss / f32's - 1, per seed (%) | mean | bar |",
      "|---|---|--:|:-:|---|--:|:-:|",
  ]
  for name, p in par.items():
    acc = ", ".join(f"{x:+.2f}" for x in p["digits_accuracy_gap"])
    gap = ", ".join(f"{100 * x:+.2f}" for x in p["lm_loss_gap"])
    lines.append(
        f"| {RECIPES[name][0]} | {acc} | {p['digits_mean_gap']:+.2f} "
        f"| {word(p['digits_pass'])} | {gap} | {100 * p['lm_mean_gap']:+.2f} "
        f"| {word(p['lm_pass'])} |")
  return "\n".join(lines) + (
      f"\n\nBars: the digits MLP's mean test accuracy within "
      f"{common.ACCURACY_TOLERANCE:g} point of f32's, the language model's "
      f"mean held-out loss at most {100 * LM_LOSS_TOLERANCE:g}% above f32's "
      "(a lower loss passes). Each low-bit recipe is bf16 params, "
      "`master_weights(with_state_dtype(optax.adam(lr), mu=fmt, nu=fmt), "
      "method=\"stochastic_rounding\")` (rank-1: `mu=\"4bit\", "
      "nu=\"4bit_rank1\"`), the same seeds, initial params and batches as "
      "f32.")


# -- report --------------------------------------------------------------------


def _stats(runs, key):
  values = np.array([r[key] for r in runs])
  return float(values.mean()), float(values.std())


def summarize(runs: dict, keys) -> dict:
  """Mean and standard deviation over seeds, per recipe and figure."""
  return {name: {k: _stats(rs, k) for k in keys} for name, rs in runs.items()}


def format_digits(summary, args) -> str:
  lines = [
      "| recipe | test acc. (%) | test loss | final train loss | train loss "
      "drop over the last 10% of steps (10⁻⁵) | params unchanged in the last "
      "10% of steps (%) |",
      "|---|--:|--:|--:|--:|--:|",
  ]
  for name, s in summary.items():
    acc, tl, ftl, drop, fr = (s[k] for k in (
        "test_accuracy", "test_loss", "final_train_loss",
        "late_train_loss_drop", "unchanged_late_fraction"))
    lines.append(
        f"| {RECIPES[name][0]} | {acc[0]:.2f} ± {acc[1]:.2f} "
        f"| {tl[0]:.4f} ± {tl[1]:.4f} | {ftl[0]:.4f} ± {ftl[1]:.4f} "
        f"| {drop[0] * 1e5:.2f} ± {drop[1] * 1e5:.2f} "
        f"| {100 * fr[0]:.1f} ± {100 * fr[1]:.1f} |")
  return "\n".join(lines) + (
      f"\n\nDigits MLP, Adam {args.lr:g} with cosine decay to 0 over "
      f"{args.steps} steps, batch {args.batch_size}; mean ± standard "
      f"deviation over seeds {', '.join(map(str, args.seeds))} (the seed "
      "sets the initial params, the batch order and stochastic rounding's "
      "bits).")


def format_lm(summary, args) -> str:
  lines = [
      "| recipe | final train loss | held-out loss | held-out next-byte "
      "acc. (%) | params unchanged in the last 10% of steps (%) |",
      "|---|--:|--:|--:|--:|",
  ]
  for name, s in summary.items():
    ftl, el, ea, fr = (s[k] for k in ("final_train_loss", "eval_loss",
                                      "eval_accuracy",
                                      "unchanged_late_fraction"))
    lines.append(
        f"| {RECIPES[name][0]} | {ftl[0]:.4f} ± {ftl[1]:.4f} "
        f"| {el[0]:.4f} ± {el[1]:.4f} | {ea[0]:.2f} ± {ea[1]:.2f} "
        f"| {100 * fr[0]:.1f} ± {100 * fr[1]:.1f} |")
  return "\n".join(lines) + (
      f"\n\nTiny language model ({LM_CONFIG.describe()}), byte-level on the "
      f"first {args.lm_chars} characters of the Python standard library's "
      f"source (90% train, 10% held out), Adam {args.lm_lr:g} with "
      f"{max(1, args.lm_steps // 10)} warm-up steps and cosine decay over "
      f"{args.lm_steps} steps, batch {args.lm_batch_size}; final train loss: "
      f"mean of the last 10% of the steps; held out: {args.lm_eval} windows; "
      f"mean ± standard deviation over seeds {', '.join(map(str, args.lm_seeds))}.")


def describe(digits, lm) -> str:
  """What the figures say, against what the literature leads one to expect."""
  d = {n: {k: v[0] for k, v in s.items()} for n, s in digits.items()}
  sd = {n: {k: v[1] for k, v in s.items()} for n, s in digits.items()}
  m = {n: {k: v[0] for k, v in s.items()} for n, s in lm.items()}
  frozen = {n: 100 * d[n]["unchanged_late_fraction"] for n in d}
  loss = {n: d[n]["final_train_loss"] for n in d}
  # "Trains like f32": the final train loss within 10% of f32's (plain bf16
  # is several times f32's once the learning rate has decayed).
  close = {n: abs(loss[n] - loss["f32"]) <= 0.1 * loss["f32"] for n in d}
  word = lambda n: "like f32" if close[n] else "NOT like f32"
  lm_close = lambda n: m[n]["eval_loss"] <= 1.01 * m["f32"]["eval_loss"]
  lm_word = lambda n: ("at most 1% above f32" if lm_close(n)
                       else "more than 1% above f32")
  drop = {n: d[n]["late_train_loss_drop"] for n in d}
  return (
      "**Expected** from the literature: plain bf16 params stall once the "
      "learning rate decays (an update below half a bf16 spacing rounds "
      "away: torchao's README, 'if weight update is smaller than 1e-3 of the "
      "weight magnitude, there will be no change'); the master copy trains "
      "like f32; stochastic rounding is unbiased, so it trains like f32 on "
      "average but with more noise (each write adds a random error of up to "
      "one spacing); Kahan compensation carries each write's rounding error "
      "into the next and should be close to the master copy (jmp_lite's "
      "int16 compensation holds the master copy's float32 values exactly, so "
      "it follows the master copy up to float32 fusion differences).\n\n"
      "**Measured** on the digits MLP (final train loss, mean over seeds): "
      f"f32 {loss['f32']:.4f}; bf16 alone {loss['bf16']:.4f}, with "
      f"{frozen['bf16']:.1f}% of its params frozen over the last 10% of the "
      f"steps; master copy {loss['bf16_copy']:.4f} ({word('bf16_copy')}); "
      f"Kahan {loss['bf16_kahan']:.4f} ({word('bf16_kahan')}); stochastic "
      f"rounding {loss['bf16_sr']:.4f} ({word('bf16_sr')}). Seed-to-seed "
      f"standard deviation of the test loss: f32 "
      f"{sd['f32']['test_loss']:.4f}, master copy "
      f"{sd['bf16_copy']['test_loss']:.4f}, Kahan "
      f"{sd['bf16_kahan']['test_loss']:.4f}, stochastic rounding "
      f"{sd['bf16_sr']['test_loss']:.4f}. Over the last 10% of the steps "
      "the train loss (over the whole train set, from the params at 90% of "
      f"the steps to the final ones) still fell by {drop['f32'] * 1e5:.2f}e-5 "
      f"in f32, {drop['bf16_copy'] * 1e5:.2f}e-5 with the master copy, "
      f"{drop['bf16_kahan'] * 1e5:.2f}e-5 with Kahan and "
      f"{drop['bf16_sr'] * 1e5:.2f}e-5 with stochastic rounding, but by "
      f"{drop['bf16'] * 1e5:.2f}e-5 for bf16 alone (within the seeds' noise "
      "of zero): every recipe but plain bf16 keeps learning as the learning "
      "rate decays. Params unchanged over the last 10% "
      f"of the steps: master copy {frozen['bf16_copy']:.1f}%, Kahan "
      f"{frozen['bf16_kahan']:.1f}% (their bf16 params change only when the "
      "float32 value they track crosses a rounding boundary), stochastic "
      f"rounding {frozen['bf16_sr']:.1f}% (a write moves a param with "
      "probability proportional to the update). On the language model the "
      f"held-out losses are: f32 {m['f32']['eval_loss']:.4f}; bf16 alone "
      f"{m['bf16']['eval_loss']:.4f} ({lm_word('bf16')}); master copy "
      f"{m['bf16_copy']['eval_loss']:.4f} ({lm_word('bf16_copy')}); Kahan "
      f"{m['bf16_kahan']['eval_loss']:.4f} ({lm_word('bf16_kahan')}); "
      f"stochastic rounding {m['bf16_sr']['eval_loss']:.4f} "
      f"({lm_word('bf16_sr')}). The seed-to-seed spread of the language "
      "model (up to 0.02) is larger than the differences between the "
      "recipes other than bf16 alone; in particular Kahan and the master "
      "copy, which hold the same float32 values in exact arithmetic, can part "
      "ways: their bf16 params round ties differently (up, against to "
      "even), XLA may fuse their float32 arithmetic differently, and "
      "training amplifies one-ulp differences.")


def parse_args(argv=None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(
      description="bf16 params with a master copy, stochastic rounding or "
      "Kahan compensation: bytes per parameter and training.",
      formatter_class=argparse.ArgumentDefaultsHelpFormatter)
  parser.add_argument("--steps", type=int, default=1000,
                      help="digits MLP: training steps")
  parser.add_argument("--batch-size", type=int, default=128)
  parser.add_argument("--lr", type=float, default=1e-3,
                      help="digits MLP: peak Adam learning rate")
  parser.add_argument("--seeds", default="0,1,2",
                      help="digits MLP: comma-separated seeds")
  parser.add_argument("--lm-steps", type=int, default=400)
  parser.add_argument("--lm-batch-size", type=int, default=16)
  parser.add_argument("--lm-lr", type=float, default=3e-3)
  parser.add_argument("--lm-seeds", default="0,1")
  parser.add_argument("--lm-chars", type=int, default=400_000,
                      help="characters of text for the language model")
  parser.add_argument("--lm-eval", type=int, default=256,
                      help="held-out windows for the language model")
  parser.add_argument("--zp-steps", type=int, default=100,
                      help="zero-point demonstration: training steps")
  parser.add_argument("--zp-lr", type=float, default=1e-3,
                      help="zero-point demonstration: Adam learning rate")
  parser.add_argument("--quick", action="store_true",
                      help="tiny sizes, one seed: a smoke test")
  common.add_output_args(parser)
  args = parser.parse_args(argv)
  if args.quick:
    args.steps, args.lm_steps, args.seeds, args.lm_seeds = 30, 20, "0", "0"
    args.lm_chars, args.lm_eval, args.zp_steps = 20_000, 16, 10
  for name in ("seeds", "lm_seeds"):
    try:
      setattr(args, name, [int(s) for s in getattr(args, name).split(",")])
    except ValueError:
      parser.error(f"--{name.replace('_', '-')} must be comma-separated ints")
  common.check_at_least_one(parser, args, (
      "steps", "batch_size", "lm_steps", "lm_batch_size", "lm_eval",
      "zp_steps"))
  common.check_positive_finite(parser, args, ("lr", "lm_lr", "zp_lr"))
  args.out = common.output_dir(args)
  return args


def main(argv=None) -> int:
  args = parse_args(argv)
  table = bytes_table()
  gpt2_table = bytes_table("gpt2_small")
  print("(a) bytes per parameter\n" + table + "\n\n" + gpt2_table + "\n",
        flush=True)

  data = flax_models.load_flat_digits()
  digits_runs = {name: [] for name in RECIPES}
  for seed in args.seeds:
    for name in RECIPES:
      r = train_digits(name, seed, data, args)
      digits_runs[name].append(r)
      print(f"digits seed {seed} {RECIPES[name][0]:>28}: test acc "
            f"{r['test_accuracy']:.2f}%, train loss "
            f"{r['final_train_loss']:.4f}, unchanged late "
            f"{100 * r['unchanged_late_fraction']:.1f}%", flush=True)
  train_tokens, eval_tokens = lm_data(args)
  lm_runs = {name: [] for name in RECIPES}
  for seed in args.lm_seeds:
    for name in RECIPES:
      r = train_lm(name, seed, train_tokens, eval_tokens, args)
      lm_runs[name].append(r)
      print(f"LM seed {seed} {RECIPES[name][0]:>28}: train loss "
            f"{r['final_train_loss']:.4f}, held-out loss "
            f"{r['eval_loss']:.4f}", flush=True)

  digits = summarize(digits_runs, ("test_accuracy", "test_loss",
                                   "final_train_loss", "late_train_loss_drop",
                                   "unchanged_late_fraction"))
  lm = summarize(lm_runs, ("final_train_loss", "eval_loss", "eval_accuracy",
                           "unchanged_late_fraction"))
  par = parity(digits_runs, lm_runs)
  zp = zero_point(data, args)
  report = ["## (a) Bytes per parameter", table,
            "Params + optimizer state (Adam) over the parameter count, "
            "summed from the leaves of `jax.eval_shape(opt.init, params)` "
            "on the digits MLP (the scalars -- Adam's count, the PRNG key -- "
            "add under 0.001). The compute dtype does not change them: "
            "`p=f32,c=bf16` stores what f32 Adam stores. Low-bit moments: "
            "`with_state_dtype(adam, mu=fmt, nu=fmt)` (inside "
            "`master_weights`), block scales included; leaves under 4096 "
            "elements (the MLP's head and biases) stay float32.",
            "The same table for a GPT-2 small shape (124,439,808 parameters, "
            "head tied to the token embedding; from `jax.eval_shape`, "
            "nothing trained):", gpt2_table,
            "## (b) Digits MLP", format_digits(digits, args),
            "## (c) Tiny language model", format_lm(lm, args),
            describe(digits, lm),
            "## (d) Low-bit optimizer states against f32",
            format_parity(par),
            "## (e) The zero-point problem", format_zero_point(zp, args)]
  text = "\n\n".join(report)
  print("\n" + text)
  stem = os.path.join(args.out, "low_memory_bf16")
  config = {k: getattr(args, k) for k in (
      "steps", "batch_size", "lr", "lm_steps", "lm_batch_size", "lm_lr",
      "lm_chars", "lm_eval", "zp_steps", "zp_lr")}
  config["seeds"] = ",".join(map(str, args.seeds))
  config["lm_seeds"] = ",".join(map(str, args.lm_seeds))
  with open(stem + ".md", "w") as f:
    f.write("# bf16 params without a float32 master copy: results\n\n")
    f.write(text + "\n\n")
    f.write(f"Command: `{common.command_line('low_memory_bf16', config)}` "
            f"(jax {jax.__version__}, optax {optax.__version__}, "
            f"{jax.default_backend()} backend).\n")
  common.write_json(stem + ".json", dict(
      config=config, quick=args.quick, jax_version=jax.__version__,
      optax_version=optax.__version__, backend=jax.default_backend(),
      bytes_table=table, gpt2_bytes_table=gpt2_table, digits=digits, lm=lm,
      parity=par, zero_point=zp,
      digits_runs=digits_runs, lm_runs=lm_runs))
  print(f"\nWrote {stem}.md and {stem}.json")
  return 0


if __name__ == "__main__":
  sys.exit(main())
