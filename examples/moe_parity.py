"""Mixture-of-Experts parity: a tiny MoE LM in f32, bf16, float8 and NVFP4.

A decoder-only byte-level language model written in plain JAX the way JAX
trainers write MoE layers (MaxText's ``RoutedMoE``, Levanter's Mixtral): each
block is pre-LayerNorm causal self-attention followed by a Mixture-of-Experts
MLP of 8 SwiGLU experts with top-2 routing:

1. router logits (a float32 island, ``jmp_lite.in_float32``, as Switch
   Transformer and MaxText keep the router in float32) -> ``jax.lax.top_k``;
   the two gates are the softmax of the two chosen logits (Mixtral);
2. the token copies are sorted by expert (``argsort``), the group sizes
   counted (``bincount``);
3. ``jax.lax.ragged_dot(x_sorted, w_experts, group_sizes)`` runs each
   expert's up, gate and down projections on its own rows;
4. the rows are unsorted and the two copies of each token summed, weighted by
   their gates;
5. the Switch Transformer load-balancing loss (weight 0.01) keeps the experts
   in use.

It is trained on the Python standard library's source bytes (the data and
size class of ``fp4_parity.py``'s tiny LM), from the same initial parameters
on the same batches, with the same hyperparameters, five times per seed; only
the precision changes:

* ``f32``: the loss function as written (the reference of bf16);
* ``bf16``: ``jmp_lite.autocast(loss_fn, "p=f32,c=bf16,o=f32")``, the
  reference of the low-precision recipes, as in the dense examples;
* ``fp8_rowwise``, ``mxfp8``, ``nvfp4``: the same policy with ``m=`` set
  (float8 with one scale per row; 1x32 float8 blocks with E8M0 scales; NVIDIA's
  FP4 recipe).

**Evidence.** For every run the script reads, with ``jmp_lite.op_dtypes``,
the operand dtypes of every ``ragged_dot_general`` (the expert matmuls) and
``dot_general`` of the loss (forward) and of its gradient (forward and
backward), the fallback reason of each matmul a recipe left out, and the
block-scaled products (``scaled_matmul_wrapper``) with float8/FP4 operands.
A run whose expert matmuls did not run in its recipe is reported as such
(``experts in recipe: no``) and gets no verdict; ``--update-results`` refuses
to write such results.

**The bars** are the dense examples' own, unchanged: bf16 within 2% (relative
validation loss) of f32 (``examples/parity.py``'s ``--loss-tolerance``); the
float8 recipes within 0.25% of bf16 for every seed (``fp8_parity.py``'s
``LOSS_TOLERANCE``, DeepSeek-V3's bar); NVFP4 at most 1.5% above bf16 for
every seed (``fp4_parity.py``'s ``GAP``, the NVFP4 paper's bar).

Run it with::

  python -m examples.moe_parity                       # 2.5-4 min on 2 CPU cores
  python -m examples.moe_parity --quick --out /tmp/moe   # the smoke run (tests)

It writes ``moe_parity.md`` and ``moe_parity.json`` to ``--out`` (a scratch
folder; ``--update-results`` writes ``examples/results/``) and exits with
status 1 if a run misses its bar or its experts fell out of its recipe (not
with --quick). On CPU float8 and FP4 are emulated: step times are the
emulation's cost, not a speed figure.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import functools
import math
import sys
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from examples import common
from examples import fp4_parity
from examples import fp8_parity
from models import flax_models
import jmp_lite

NAME = "moe_parity"
#: (name, label, policy spec or None for the function as written, reference).
RUNS = (
    ("f32", "f32", None, None),
    ("bf16", "bf16", "p=f32,c=bf16,o=f32", "f32"),
    ("fp8_rowwise", "float8 rowwise", "p=f32,c=bf16,o=f32,m=fp8_rowwise",
     "bf16"),
    ("mxfp8", "MXFP8 (1x32 blocks, E8M0)", "p=f32,c=bf16,o=f32,m=mxfp8",
     "bf16"),
    ("nvfp4", "NVFP4", "p=f32,c=bf16,o=f32,m=nvfp4", "bf16"),
)
#: examples/parity.py's --loss-tolerance default: the LM's validation loss
#: within 2% (relative, either way) of f32's (a test checks the two agree).
BF16_LOSS_TOLERANCE = 2.0
#: Per run: (tolerance in percent, one-sided, where the bar comes from).
BARS = {
    "bf16": (BF16_LOSS_TOLERANCE, False, "examples/parity.py (LM: "
             "|relative validation-loss difference to f32| <= 2%)"),
    "fp8_rowwise": (fp8_parity.LOSS_TOLERANCE, False, "examples/fp8_parity.py "
                    "LOSS_TOLERANCE (DeepSeek-V3, arXiv:2412.19437: relative "
                    "loss error to BF16 below 0.25%)"),
    "mxfp8": (fp8_parity.LOSS_TOLERANCE, False, "examples/fp8_parity.py "
              "LOSS_TOLERANCE (DeepSeek-V3, arXiv:2412.19437)"),
    "nvfp4": (fp4_parity.GAP, True, "examples/fp4_parity.py GAP (NVFP4 "
              "paper: final validation loss within 1.5% of BF16's)"),
}
#: Switch Transformer's load-balancing loss weight (alpha = 1e-2).
AUX_WEIGHT = 0.01
#: Peak learning rate. At fp4_parity's 3e-3 this MoE's runs part ways (bf16
#: ended 1.6% and 2.0% from f32 on two seeds); at 1e-3 bf16 tracks f32
#: (within 0.3%) and reaches a lower loss in the same 300 steps.
LR = 1e-3
TAIL = 50  # Final train loss: the mean of the last TAIL steps.
WARMUP_STEPS = 5  # Left out of the median step time (compilation).
LOW_BIT = ("float8", "float4")  # dtype-name prefixes of quantized operands
#: The block-scaled product of MXFP8/NVFP4 (an exact float32 emulation on CPU).
SCALED_PRODUCT = "scaled_matmul_wrapper"
MATMULS = ("dot_general", "ragged_dot_general", SCALED_PRODUCT)
#: The full and the --quick settings. Full: fp4_parity's tiny-LM size class
#: (width 64, 300 steps of 8 windows of 32 bytes); two blocks of attention + 8
#: experts.
FULL = dict(steps=300, seeds=(0, 1), d_model=64, heads=4, blocks=2,
            experts=8, top_k=2, d_ff=128, seq_len=32, batch=8,
            max_chars=400_000, val_windows=512,
            runs=tuple(name for name, *_ in RUNS))
QUICK = dict(steps=30, seeds=(0,), d_model=32, heads=2, blocks=1, experts=8,
             top_k=2, d_ff=64, seq_len=16, batch=8, max_chars=20_000,
             val_windows=16, runs=tuple(name for name, *_ in RUNS))


# -- the model: plain JAX, float32 -----------------------------------------------


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Sizes of the MoE language model.

  Attributes:
    vocab: vocabulary (bytes).
    d_model: features per token.
    heads: attention heads.
    blocks: attention + MoE blocks.
    experts: experts per MoE layer.
    top_k: experts each token is routed to.
    d_ff: hidden features of each expert.
    seq_len: tokens per window.
  """

  vocab: int
  d_model: int
  heads: int
  blocks: int
  experts: int
  top_k: int
  d_ff: int
  seq_len: int


def init_params(key: jax.Array, cfg: ModelConfig) -> dict[str, Any]:
  """Float32 parameters, normal(0.02) weights; experts stacked on axis 0."""
  keys = iter(jax.random.split(key, 8 * cfg.blocks + 3))
  d, e, f = cfg.d_model, cfg.experts, cfg.d_ff

  def normal(shape):
    return jax.random.normal(next(keys), shape, jnp.float32) * 0.02

  def norm():
    return {"scale": jnp.ones((d,)), "bias": jnp.zeros((d,))}

  return {
      "embed": normal((cfg.vocab, d)),
      "pos": normal((cfg.seq_len, d)),
      "blocks": [{
          "ln1": norm(), "qkv": normal((d, 3 * d)), "out": normal((d, d)),
          "ln2": norm(), "router": normal((d, e)),
          "wi_0": normal((e, d, f)),   # gate projection (SwiGLU)
          "wi_1": normal((e, d, f)),   # up projection
          "wo": normal((e, f, d)),     # down projection
      } for _ in range(cfg.blocks)],
      "ln_f": norm(),
      "head": normal((d, cfg.vocab)),
  }


def layer_norm(p: dict[str, jax.Array], x: jax.Array) -> jax.Array:
  mean = jnp.mean(x, axis=-1, keepdims=True)
  var = jnp.mean(jnp.square(x - mean), axis=-1, keepdims=True)
  return (x - mean) * jax.lax.rsqrt(var + 1e-5) * p["scale"] + p["bias"]


def attention(p: dict[str, jax.Array], x: jax.Array, heads: int) -> jax.Array:
  """Causal multi-head self-attention."""
  b, t, d = x.shape
  qkv = (x @ p["qkv"]).reshape(b, t, 3 * heads, d // heads)
  q, k, v = jnp.split(qkv, 3, axis=2)
  scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(d // heads)
  scores = jnp.where(jnp.tril(jnp.ones((t, t), bool)), scores, -1e9)
  weights = jax.nn.softmax(scores, axis=-1)
  out = jnp.einsum("bhqk,bkhd->bqhd", weights, v).reshape(b, t, d)
  return out @ p["out"]


@jmp_lite.in_float32
def router_logits(x: jax.Array, w: jax.Array) -> jax.Array:
  """The router's matmul, in float32 whatever the policy (Switch Transformer's
  selective precision; MaxText's float32 gate)."""
  return x @ w


def moe(p: dict[str, jax.Array], x: jax.Array, cfg: ModelConfig):
  """The MoE MLP: top-k routing, sort by expert, three ragged_dots, unsort,
  gate-weighted combine.

  Returns:
    ``(output, load-balancing loss, group sizes)``.
  """
  b, t, d = x.shape
  tokens = x.reshape(b * t, d)
  logits = router_logits(tokens, p["router"])                 # (T, E)
  probs = jax.nn.softmax(logits, axis=-1)
  top_logits, experts = jax.lax.top_k(logits, cfg.top_k)     # (T, k)
  gates = jax.nn.softmax(top_logits, axis=-1)
  flat = experts.reshape(-1)                                  # (T * k,)
  order = jnp.argsort(flat, stable=True)                      # sort by expert
  x_sorted = tokens[order // cfg.top_k]
  group_sizes = jnp.bincount(flat, length=cfg.experts).astype(jnp.int32)
  gate = jax.lax.ragged_dot(x_sorted, p["wi_0"], group_sizes)
  up = jax.lax.ragged_dot(x_sorted, p["wi_1"], group_sizes)
  y_sorted = jax.lax.ragged_dot(jax.nn.silu(gate) * up, p["wo"], group_sizes)
  y = y_sorted[jnp.argsort(order)].reshape(b * t, cfg.top_k, d)  # unsort
  out = jnp.sum(y * gates[..., None].astype(y.dtype), axis=1)
  # Switch Transformer: E * sum_e (share of the copies routed to e) x (mean
  # router probability of e); 1 when the load is uniform.
  share = group_sizes.astype(jnp.float32) / flat.shape[0]
  aux = cfg.experts * jnp.sum(share * jnp.mean(probs, axis=0))
  return out.reshape(b, t, d), aux, group_sizes


def model(params: dict[str, Any], tokens: jax.Array, cfg: ModelConfig):
  """``(logits, summed load-balancing loss, group sizes per block)``."""
  x = params["embed"][tokens] + params["pos"][:tokens.shape[1]]
  aux, loads = 0.0, []
  for p in params["blocks"]:
    x = x + attention(p, layer_norm(p["ln1"], x), cfg.heads)
    out, block_aux, sizes = moe(p, layer_norm(p["ln2"], x), cfg)
    x, aux = x + out, aux + block_aux
    loads.append(sizes)
  logits = layer_norm(params["ln_f"], x) @ params["head"]
  return logits, aux, jnp.stack(loads)


def make_loss_fn(cfg: ModelConfig):
  """``loss_fn(params, x, y) -> (loss, (cross-entropy, accuracy, loads))``:
  the training loss is the cross-entropy plus the weighted balancing loss."""

  def loss_fn(params, x, y):
    logits, aux, loads = model(params, x, cfg)
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
    accuracy = jnp.mean(jnp.argmax(logits, axis=-1) == y)
    return ce + AUX_WEIGHT * aux, (ce, accuracy, loads)

  return loss_fn


def model_config(s: dict) -> ModelConfig:
  return ModelConfig(flax_models.BYTE_VOCAB_SIZE, s["d_model"], s["heads"],
                     s["blocks"], s["experts"], s["top_k"], s["d_ff"],
                     s["seq_len"])


# -- the evidence: which dtypes the matmuls saw --------------------------------


def _is_low_bit(dtype: str) -> bool:
  return dtype.startswith(LOW_BIT)


def matmul_evidence(fn, *args, compute_dtype: str = "float32"
                    ) -> dict[str, Any]:
  """What the matmuls of ``fn(*args)`` saw, from ``jmp_lite.op_dtypes``.

  Each ``ragged_dot_general`` (an expert matmul) is classified from its
  operand dtypes, its fallback ``note`` and the operations listed since the
  previous matmul:

  * ``low_bit``: float8/FP4 operands (per-tensor and rowwise float8);
  * ``emulated``: float32 operands that are the recipe's exact emulation, as
    on CPU for MXFP8 (E8M0 block scales) and NVFP4/MXFP4 (JAX has no
    block-scaled grouped GEMM): no fallback note and either an operation
    with a float8/FP4 input since the previous matmul (MXFP8 dequantizes
    float8 values) or a ``compute_dtype`` narrower than float32 (autocast
    gives a grouped matmul it leaves out of the recipe compute-dtype
    operands and a note; only the recipe's emulation hands it float32);
  * ``plain``: anything else (float32 as written, bfloat16, a fallback).

  Args:
    fn: the function to trace (the run's loss, or its gradient).
    *args: its arguments.
    compute_dtype: the run's compute dtype (``"float32"`` as written).

  Returns:
    ``ragged_dot``: ``{"lhs, rhs": count}`` of the ``ragged_dot_general``
    equations; ``experts``: ``{"low_bit"|"emulated"|"plain": count}``;
    ``dot``: ``{"lhs, rhs": count}`` of the ``dot_general`` equations;
    ``fallbacks``: ``{"primitive: reason": count}`` of the matmuls a recipe
    left out (their ``note``); ``scaled_products``: how many block-scaled
    products (``scaled_matmul_wrapper``) take float8/FP4 operands.
  """
  narrow = np.dtype(compute_dtype).itemsize < 4
  ragged, experts, dots, fallbacks = (collections.Counter() for _ in range(4))
  scaled, quantized_since = 0, False
  for op in jmp_lite.op_dtypes(fn, *args):
    name, dtypes = op
    note = getattr(op, "note", None)
    low_bit = any(map(_is_low_bit, dtypes))
    if name in MATMULS:
      if name == "ragged_dot_general":
        ragged[", ".join(dtypes)] += 1
        f32 = set(dtypes) == {"float32"}
        experts["low_bit" if low_bit and not note else
                "emulated" if f32 and not note and (quantized_since or narrow)
                else "plain"] += 1
      elif name == "dot_general":
        dots[", ".join(dtypes)] += 1
      elif low_bit:
        scaled += 1
      if note:
        fallbacks[f"{name}: {note}"] += 1
      quantized_since = False
    elif low_bit:
      quantized_since = True
  return dict(ragged_dot=dict(ragged), experts=dict(experts), dot=dict(dots),
              fallbacks=dict(fallbacks), scaled_products=scaled)


#: What the expert matmuls must be, per run, to count as run in the recipe.
EXPECTED_EXPERTS = {"f32": ("plain",), "bf16": ("plain",),
                    "fp8_rowwise": ("low_bit",),
                    "mxfp8": ("low_bit", "emulated"),
                    "nvfp4": ("low_bit", "emulated")}
EXPECTED_DTYPE = {"f32": "float32", "bf16": "bfloat16"}


def experts_in_recipe(name: str, evidence: dict[str, Any]) -> bool:
  """Whether every expert matmul (``ragged_dot_general``) of the run ran in
  its recipe: float32 operands as written, bfloat16 for bf16, float8 for
  rowwise float8, float8/FP4 or their exact emulation for MXFP8 and NVFP4;
  and no ragged_dot left out of the recipe (a ``note``)."""
  if not evidence["ragged_dot"] or any(
      k.startswith("ragged_dot_general") for k in evidence["fallbacks"]):
    return False
  if not set(evidence["experts"]) <= set(EXPECTED_EXPERTS[name]):
    return False
  dtype = EXPECTED_DTYPE.get(name)
  return dtype is None or all(
      d == dtype for key in evidence["ragged_dot"] for d in key.split(", "))


# -- training ----------------------------------------------------------------------


def policy_of(name: str) -> str | None:
  return next(r[2] for r in RUNS if r[0] == name)


@functools.lru_cache(maxsize=None)
def compiled(name: str, key: tuple):
  """The run's loss function, jitted train step and evaluation (cached: the
  seeds of a run reuse them)."""
  s = dict(key)
  cfg = model_config(s)
  loss_fn = make_loss_fn(cfg)
  policy = policy_of(name)
  run_loss = loss_fn if policy is None else jmp_lite.autocast(loss_fn, policy)
  optimizer = optax.adam(fp4_parity.schedule(s["steps"], s["lr"]))

  @jax.jit
  def step(params, opt_state, x, y):
    (_, (ce, _, loads)), grads = jax.value_and_grad(run_loss, has_aux=True)(
        params, x, y)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, ce, loads

  @jax.jit
  def evaluate(params, x, y):
    _, (ce, accuracy, loads) = run_loss(params, x, y)
    return ce, accuracy, loads

  return cfg, run_loss, optimizer, step, evaluate


def _key(s: dict, lr: float) -> tuple:
  names = ("steps", "d_model", "heads", "blocks", "experts", "top_k", "d_ff",
           "seq_len")
  return tuple(sorted((k, s[k]) for k in names)) + (("lr", lr),)


def train(name: str, s: dict, data, seed: int, lr: float) -> dict:
  """Trains one run; returns its figures and evidence."""
  cfg, run_loss, optimizer, step, evaluate = compiled(name, _key(s, lr))
  train_tokens, val_tokens = data
  params = init_params(jax.random.key(seed), cfg)
  opt_state = optimizer.init(params)
  rng = np.random.default_rng(seed)
  batches = [rng.integers(0, len(train_tokens) - s["seq_len"] - 1,
                          size=s["batch"]) for _ in range(s["steps"])]
  x0, y0 = fp4_parity.lm_windows(train_tokens, batches[0], s["seq_len"])
  grad_fn = jax.grad(lambda p, x, y: run_loss(p, x, y)[0])
  policy = policy_of(name)
  compute = ("float32" if policy is None else
             np.dtype(jmp_lite.get_policy(policy).compute_dtype).name)
  evidence = dict(
      forward=matmul_evidence(run_loss, params, x0, y0, compute_dtype=compute),
      gradient=matmul_evidence(grad_fn, params, x0, y0, compute_dtype=compute))
  in_recipe = all(experts_in_recipe(name, e) for e in evidence.values())

  losses, step_ms = [], []
  train_load = np.zeros((cfg.blocks, cfg.experts))
  for starts in batches:
    x, y = fp4_parity.lm_windows(train_tokens, starts, s["seq_len"])
    t0 = time.perf_counter()
    params, opt_state, ce, loads = step(params, opt_state, x, y)
    losses.append(float(ce))
    step_ms.append(1e3 * (time.perf_counter() - t0))
    train_load += np.asarray(loads)

  count = min(s["val_windows"], (len(val_tokens) - 1) // s["seq_len"])
  starts = np.arange(count) * s["seq_len"]
  chunks = np.array_split(starts, max(1, count // 64))
  val_ce, val_acc, val_load = [], [], np.zeros((cfg.blocks, cfg.experts))
  for c in chunks:  # equal-sized chunks (count is a multiple of 64 or small)
    ce, acc, loads = evaluate(
        params, *fp4_parity.lm_windows(val_tokens, c, s["seq_len"]))
    val_ce.append(float(ce))
    val_acc.append(float(acc))
    val_load += np.asarray(loads)
  share = val_load / val_load.sum(axis=1, keepdims=True)
  return dict(
      label=next(r[1] for r in RUNS if r[0] == name),
      policy=policy_of(name),
      validation_loss=float(np.mean(val_ce)),
      validation_accuracy=100.0 * float(np.mean(val_acc)),
      final_train_loss=float(np.mean(losses[-TAIL:])),
      median_step_ms=float(np.median(step_ms[WARMUP_STEPS:] or step_ms)),
      expert_share=share.tolist(),
      experts_used=[int(n) for n in (share > 0).sum(axis=1)],
      train_expert_share=(train_load / train_load.sum(axis=1, keepdims=True)
                          ).tolist(),
      evidence=evidence,
      experts_in_recipe=in_recipe,
      loss_history=losses)


# -- the report ----------------------------------------------------------------------


def verdicts(results: dict) -> list[dict]:
  """One row per (run, seed) that has a bar: its validation loss, its
  reference's, the relative difference and whether it is within the bar.
  A run whose experts fell out of its recipe gets no verdict
  (``passed=None``)."""
  rows = []
  for name, _, _, reference in RUNS:
    if reference is None:
      continue
    tolerance, one_sided, source = BARS[name]
    for seed, runs in results.items():
      if name not in runs or reference not in runs:
        continue
      value = runs[name]["validation_loss"]
      ref = runs[reference]["validation_loss"]
      error = fp8_parity.relative_error(value, ref)
      within = math.isfinite(error) and (
          error <= tolerance if one_sided else abs(error) <= tolerance)
      measured = (runs[name]["experts_in_recipe"]
                  and runs[reference]["experts_in_recipe"])
      rows.append(dict(run=name, seed=seed, reference=reference,
                       value=value, reference_value=ref, error=error,
                       tolerance=tolerance, one_sided=one_sided,
                       source=source, experts_in_recipe=measured,
                       passed=within if measured else None))
  return rows


def _short(dtypes: str) -> str:
  short = {"float32": "f32", "bfloat16": "bf16", "float8_e4m3fn": "e4m3",
           "float8_e5m2": "e5m2", "float4_e2m1fn": "e2m1",
           "float8_e8m0fnu": "e8m0"}
  return "x".join(short.get(d, d) for d in dtypes.split(", "))


def format_counts(counts: dict[str, int]) -> str:
  return " + ".join(f"{n} {_short(k)}" for k, n in counts.items()) or "none"


def format_report(s: dict, results: dict, rows: list[dict], wall_s: float,
                  lr: float, quick: bool) -> list[str]:
  labels = {name: label for name, label, *_ in RUNS}
  seeds = list(results)
  runs = ["| run | seed | validation loss | validation accuracy (%) "
          "| final train loss | gap to f32 (%) | experts used per block "
          "| largest expert share (%) | median step (ms, CPU) |",
          "|---|--:|--:|--:|--:|--:|--:|--:|--:|"]
  evidence = ["| run | expert ragged_dots, forward (lhs x rhs) "
              "| expert ragged_dots, gradient | of which low-bit / emulated "
              "/ plain | dense block-scaled products (forward / gradient) "
              "| fallbacks (gradient) | experts in recipe |",
              "|---|---|---|--:|--:|---|:-:|"]
  for name, *_ in RUNS:
    for seed, r in results.items():
      if name not in r:
        continue
      f = r[name]
      gap = fp8_parity.relative_error(f["validation_loss"],
                                      r["f32"]["validation_loss"])
      largest = max(max(block) for block in f["expert_share"])
      runs.append(
          f"| {labels[name]} | {seed} | {f['validation_loss']:.4f} "
          f"| {f['validation_accuracy']:.2f} | {f['final_train_loss']:.4f} "
          f"| {gap:+.3f} | {', '.join(map(str, f['experts_used']))} "
          f"| {100 * largest:.1f} | {f['median_step_ms']:.1f} |")
    first = results[seeds[0]].get(name)
    if first is not None:
      ev = first["evidence"]
      fallbacks = "; ".join(f"{n}x {k}" for k, n in
                            ev["gradient"]["fallbacks"].items()) or "none"
      evidence.append(
          f"| {labels[name]} | {format_counts(ev['forward']['ragged_dot'])} "
          f"| {format_counts(ev['gradient']['ragged_dot'])} "
          f"| {' / '.join(str(ev['gradient']['experts'].get(k, 0)) for k in ('low_bit', 'emulated', 'plain'))} "
          f"| {ev['forward']['scaled_products']} / "
          f"{ev['gradient']['scaled_products']} | {fallbacks} "
          f"| {'yes' if first['experts_in_recipe'] else '**no**'} |")
  verdict = ["| run | seed | reference | reference's loss | run's loss "
             "| difference | bar | verdict |",
             "|---|--:|---|--:|--:|--:|--:|:-:|"]
  for row in rows:
    bar = (f"≤ +{row['tolerance']:g} %" if row["one_sided"]
           else f"±{row['tolerance']:g} %")
    shown = ("not measured: experts out of the recipe"
             if row["passed"] is None else
             "PASS" if row["passed"] else "FAIL")
    verdict.append(
        f"| {labels[row['run']]} | {row['seed']} | {row['reference']} "
        f"| {row['reference_value']:.4f} | {row['value']:.4f} "
        f"| {row['error']:+.3f} % | {bar} | {shown} |")
  measured = [r for r in rows if r["passed"] is not None]
  passed = sum(bool(r["passed"]) for r in measured)
  spread = None
  if len(seeds) > 1:
    values = [results[sd]["bf16"]["validation_loss"] for sd in seeds]
    spread = 100.0 * (max(values) - min(values)) / min(values)
  bf16_vs_f32 = ", ".join(f"{r['error']:+.3f}%" for r in rows
                          if r["run"] == "bf16")
  bars = "; ".join(f"{labels[n]}: {src}" for n, (_, _, src) in BARS.items())
  return [
      f"`python -m examples.{NAME}{' --quick' if quick else ''}`: seeds "
      f"{seeds}; {s['steps']} Adam steps (peak lr {lr:g}, warm-up + cosine "
      f"decay) of {s['batch']} windows of {s['seq_len']} bytes of the Python "
      f"standard library's source; d_model {s['d_model']}, {s['blocks']} "
      f"block{'s' if s['blocks'] > 1 else ''} of {s['heads']}-head causal "
      "attention and an MoE MLP of "
      f"{s['experts']} SwiGLU experts (d_ff {s['d_ff']}), top-{s['top_k']} "
      "routing, float32 router, load-balancing loss weight "
      f"{AUX_WEIGHT:g}; validation over {s['val_windows']} windows (the "
      "run's own forward pass). Every run of a seed starts from the same "
      f"parameters and sees the same batches. {wall_s:.0f} s in all on "
      f"{jax.default_backend()} (jax {jax.__version__}).",
      f"**Bars** (the dense examples', unchanged): {bars}. **{passed} of "
      f"{len(measured)} measured rows pass"
      + (f"; {len(rows) - len(measured)} rows not measured (the run's expert "
         "matmuls did not run in its recipe)" if len(measured) < len(rows)
         else "") + ".**"
      + (f" For scale, bf16 itself lands {bf16_vs_f32} from f32 (seed by "
         "seed)" if bf16_vs_f32 else "")
      + (f" and moves by {spread:.3f}% from one seed to the other"
         if spread is not None and bf16_vs_f32 else "")
      + ("." if bf16_vs_f32 else ""),
      "## Parity", "\n".join(verdict),
      "## Every run", "\n".join(runs),
      "## Evidence: what the expert matmuls ran in",
      "Read with `jmp_lite.op_dtypes` from the run's loss (forward) and its "
      "`jax.grad` (forward and backward), seed "
      f"{seeds[0]}: the operand dtypes of each `ragged_dot_general` (the "
      "expert matmuls: 3 per block forward, 3 more per block for the "
      "gradients with respect to the inputs and 3 for the expert weights) "
      "and whether it ran on float8/FP4 operands (low-bit), on the float32 "
      "values of the recipe's exact emulation (emulated: MXFP8 dequantizes "
      "float8 blocks, NVFP4 computes its E2M1 values in float32; JAX has no "
      "block-scaled grouped GEMM, so this holds on GPUs too; autocast gives a "
      "grouped matmul it leaves out of a recipe compute-dtype operands and a "
      "note) or neither (plain); the dense block-scaled products with "
      "float8/FP4 operands (`scaled_matmul_wrapper`); and the fallback reason "
      "of every matmul a recipe left out (`note`). The dense matmuls: "
      + "; ".join(
          f"{labels[n]}: {format_counts(results[seeds[0]][n]['evidence']['gradient']['dot'])}"
          for n, *_ in RUNS if n in results[seeds[0]]) + ".",
      "\n".join(evidence),
  ]


def parse_args(argv=None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--quick", action="store_true",
                      help="a tiny model, a few steps, one seed (a smoke run "
                      "for the tests: its figures mean nothing)")
  parser.add_argument("--seeds", type=int, nargs="+", default=None)
  parser.add_argument("--steps", type=int, default=None,
                      help=f"steps per run (default {FULL['steps']})")
  parser.add_argument("--runs", nargs="+", default=None,
                      choices=[name for name, *_ in RUNS],
                      help="the runs (default: all; f32 and bf16, the "
                      "references, are always trained)")
  parser.add_argument("--lr", type=float, default=LR,
                      help=f"peak learning rate (default {LR:g})")
  common.add_output_args(parser)
  args = parser.parse_args(argv)
  settings = dict(QUICK if args.quick else FULL)
  for key in ("seeds", "steps", "runs"):
    value = getattr(args, key)
    if value is not None:
      settings[key] = tuple(value) if isinstance(value, list) else value
  settings["runs"] = tuple(n for n, *_ in RUNS
                           if n in set(settings["runs"]) | {"f32", "bf16"})
  if settings["steps"] < 1:
    parser.error("--steps must be at least 1")
  if args.quick and args.update_results:
    parser.error("--quick runs are smoke runs: they never replace the "
                 "committed results")
  settings["lr"] = args.lr
  args.settings = settings
  args.out = common.output_dir(args)
  return args


def main(argv=None) -> int:
  args = parse_args(argv)
  s = args.settings
  start = time.perf_counter()
  tokens = flax_models.encode(flax_models.load_stdlib_text(s["max_chars"]))
  split = int(0.9 * len(tokens))
  data = (tokens[:split], tokens[split:])
  results = {}
  for seed in s["seeds"]:
    results[seed] = {}
    for name in s["runs"]:
      t0 = time.perf_counter()
      r = results[seed][name] = train(name, s, data, seed, args.lr)
      print(f"seed {seed} {name:>11}: {time.perf_counter() - t0:5.1f} s, val "
            f"loss {r['validation_loss']:.4f}, acc "
            f"{r['validation_accuracy']:.2f}%, experts in recipe: "
            f"{r['experts_in_recipe']}", flush=True)
      if args.update_results and not r["experts_in_recipe"]:
        print(f"error: the {name} run's expert matmuls did not run in its "
              "recipe (evidence: "
              f"{r['evidence']['gradient']['ragged_dot']}, fallbacks "
              f"{r['evidence']['gradient']['fallbacks']}); --update-results "
              "never commits results that fell back. Rerun with --out, or "
              "with --runs naming the runs that work.", file=sys.stderr)
        return 1
  wall_s = time.perf_counter() - start
  rows = verdicts(results)
  report = format_report(s, results, rows, wall_s, args.lr, args.quick)
  config = dict(
      quick=args.quick, seeds=list(s["seeds"]), steps=s["steps"],
      batch=s["batch"], seq_len=s["seq_len"], d_model=s["d_model"],
      heads=s["heads"], blocks=s["blocks"], experts=s["experts"],
      top_k=s["top_k"], d_ff=s["d_ff"], lr=args.lr, aux_weight=AUX_WEIGHT,
      max_chars=s["max_chars"], val_windows=s["val_windows"],
      optimizer="adam, warm-up + cosine decay",
      bars={n: dict(tolerance_percent=t, one_sided=o, source=src)
            for n, (t, o, src) in BARS.items()},
      wall_s=round(wall_s, 1), jax=jax.__version__,
      backend=jax.default_backend())
  base = args.out / NAME
  common.write_json(base.with_suffix(".json"), dict(
      config=config, verdicts=rows,
      runs={str(seed): r for seed, r in results.items()}))
  with open(base.with_suffix(".md"), "w") as f:
    f.write("# Mixture-of-Experts parity: a tiny MoE LM in f32, bf16, float8 "
            "and NVFP4\n\n")
    f.write("\n\n".join(report) + "\n")
  print("\n".join(report[1:4]))
  print(f"Wrote {base}.{{md,json}} in {wall_s:.0f} s.")
  bad = [r for r in rows if not r["passed"]]
  return 1 if bad and not args.quick else 0


if __name__ == "__main__":
  sys.exit(main())
