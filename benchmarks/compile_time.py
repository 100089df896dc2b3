"""Trace, lowering and compile time of every precision route against a hand-cast step.

The question (issue 27): does a precision route cost more to trace, lower and
compile than the same step written by hand, and does that cost stay linear in
the depth of the model? The program measured is
``jax.jit(jax.value_and_grad(loss))`` of a decoder LM's float32 cross-entropy
(width 64, 4 heads, 32 tokens, vocab 256, batch 8) at 12, 24 and 48 blocks
unrolled, and at 48 blocks under ``jax.lax.scan`` over stacked blocks. Routes,
in three families, each against the hand-cast step of its own family:

* plain JAX (``models/jax_models.py``'s ``apply_lm``): ``hand`` (params and
  inputs cast to bfloat16 by hand, ``policy.cast_to_compute``), ``float32``
  (no cast at all: the control for what XLA does with a float32 program),
  ``with_policy`` and ``autocast`` with ``mixed_bfloat16``, ``with_policy_fp8``
  and ``autocast_fp8`` with ``mixed_fp8``, and ``hand_fp8`` (the hand-cast
  step with the blocks' dense matmuls through ``jmp_lite.fp8.dot_general``:
  the float8 step written by hand, the float8 routes' second baseline), and
  ``plain_fp8`` (the same with a per-tensor e4m3/e5m2 float8 matmul written
  plainly with ``jax.custom_vjp``, ``plain_fp8_matmul`` below, no jmp_lite:
  what jmp_lite's float8 matmul costs beyond the float8 work itself, issue 36;
  ``hand_fp8`` and the float8 routes get ``ratios_plain`` to it); and the int8
  routes (issue 38): ``hand_int8`` (the hand-cast step with the blocks' dense
  matmuls through ``jmp_lite.int8.dot_general``), ``with_policy_int8``,
  ``with_policy_int8_switchback`` and ``autocast_int8``, each against the
  float8 route of the same door (``ratios_int8_fp8``: ``hand_fp8``,
  ``with_policy_fp8``, ``autocast_fp8``; target <= 1.3), and
  ``with_policy_int8`` also against ``with_policy_fp8_rowwise``
  (``ratios_int8_rowwise``: the float8 recipe that quantizes as ``m=int8``
  does, six quantizations per linear where per-tensor float8 makes three);
* linen (a linen twin of ``CharLM``): ``linen_hand`` (params cast to bfloat16
  by hand) and ``linen_policy`` (``jmp_lite.linen.apply_policy``);
* NNX (``models/flax_models.py``'s ``CharLM``): ``nnx_hand`` and
  ``nnx_policy`` (``jmp_lite.nnx.apply_policy``).

Per route and depth: trace + lower (``.lower()``, best of ``--repeats`` after
``jax.clear_caches()``), compile (``.compile()``, once), the number of
functions in the lowered StableHLO, and the optimized HLO's size (characters
and instructions, fused computations included). Ratios are to the family's
hand-cast step measured in the same run. Compile times on a shared machine are
noisy; the HLO sizes are not.

Run from the repository root::

  python -m benchmarks.compile_time                        # 15-40 min on 2 CPU cores
  python -m benchmarks.compile_time --update-results       # ... into benchmarks/results/
  python -m benchmarks.compile_time --quick --out /tmp/ct  # smoke test
"""

from __future__ import annotations

import argparse
import json
import pathlib
import re
import sys
import time
from typing import Any, Callable, Sequence

import jax
from jax import lax
import jax.numpy as jnp
import numpy as np

import jmp_lite
import jmp_lite.int8  # pylint: disable=unused-import
import jmp_lite.linen  # pylint: disable=unused-import
import jmp_lite.nnx  # pylint: disable=unused-import
from benchmarks import common
from benchmarks import runner
from benchmarks import workloads as wl
from models import jax_models as models

NAME = "compile_time"
TITLE = "Trace, lowering and compile time of every precision route (issue 27)"
#: Route -> (family, what it is).
ROUTES = {
    "hand": ("jax", "params and inputs cast to bfloat16 by hand"),
    "float32": ("jax", "no cast at all: float32 params and compute (control)"),
    "with_policy": ("jax", "with_policy(apply_lm, 'mixed_bfloat16')"),
    "autocast": ("jax", "autocast(loss, 'mixed_bfloat16')"),
    "hand_fp8": ("jax", "hand, with the blocks' dense matmuls through "
                 "jmp_lite.fp8.dot_general (mixed_fp8's recipe)"),
    "plain_fp8": ("jax", "hand, with the blocks' dense matmuls through a per-tensor "
                  "e4m3/e5m2 float8 matmul written plainly with jax.custom_vjp "
                  "(plain_fp8_matmul, not jmp_lite)"),
    "with_policy_fp8": ("jax", "with_policy(apply_lm, 'mixed_fp8')"),
    "autocast_fp8": ("jax", "autocast(loss, 'mixed_fp8')"),
    "hand_int8": ("jax", "hand, with the blocks' dense matmuls through "
                  "jmp_lite.int8.dot_general (mixed_int8's recipe)"),
    "with_policy_int8": ("jax", "with_policy(apply_lm, 'mixed_int8')"),
    "with_policy_int8_switchback": ("jax", "with_policy(apply_lm, "
                                    "'p=f32,c=bf16,o=f32,m=int8_switchback')"),
    "autocast_int8": ("jax", "autocast(loss, 'mixed_int8')"),
    "with_policy_fp8_rowwise": ("jax", "with_policy(apply_lm, "
                                "'p=f32,c=bf16,o=f32,m=fp8_rowwise')"),
    "linen_hand": ("linen", "linen LM, params cast to bfloat16 by hand"),
    "linen_policy": ("linen", "jmp_lite.linen.apply_policy(lm, 'mixed_bfloat16')"),
    "nnx_hand": ("nnx", "NNX CharLM, params cast to bfloat16 by hand"),
    "nnx_policy": ("nnx", "jmp_lite.nnx.apply_policy(lm, 'mixed_bfloat16')"),
}
HAND = {"jax": "hand", "linen": "linen_hand", "nnx": "nnx_hand"}
#: The float8 routes' second baseline: the float8 step written by hand.
HAND_FP8 = "hand_fp8"
#: The float8 routes' third baseline: a float8 matmul written plainly, no jmp_lite.
PLAIN_FP8 = "plain_fp8"
#: The routes that put float8 on the matmuls through jmp_lite.
FP8_ROUTES = tuple(r for r in ROUTES if r.endswith("_fp8") and r not in (HAND_FP8, PLAIN_FP8))
#: The int8 step written by hand (issue 38).
HAND_INT8 = "hand_int8"
#: Each int8 route -> (its m= recipe, the float8 route of the same door it is
#: compared with: ``ratios_int8_fp8``, the issue's target <= 1.3).
INT8_ROUTES = {
    HAND_INT8: ("int8", HAND_FP8),
    "with_policy_int8": ("int8", "with_policy_fp8"),
    "with_policy_int8_switchback": ("int8_switchback", "with_policy_fp8"),
    "autocast_int8": ("int8", "autocast_fp8"),
}
#: The float8 recipe that quantizes as ``m=int8`` does: each operand of each
#: of a linear's three products along that product's own contracted axis (six
#: quantizations per linear, where per-tensor float8 makes three and reuses
#: them), so that a comparison separates the recipe's work from the cost of
#: the int8 machinery.
FP8_ROWWISE = "with_policy_fp8_rowwise"
#: An int8 route -> the float8 route with its quantization structure
#: (``ratios_int8_rowwise``).
INT8_STRUCTURE_TWINS = {"with_policy_int8": FP8_ROWWISE}
#: The issue's target for an int8 route against its float8 twin (trace +
#: lower, and compile).
TARGET_INT8_VS_FP8 = 1.3
#: The issue's targets: every route / hand-cast at the deepest depth.
TARGET_UNROLLED = 1.3
TARGET_SCAN = 1.1
SIZES = {
    False: dict(vocab=256, width=64, heads=4, seq_len=32, batch=8,
                depths=(12, 24, 48), scan_depth=48),
    True: dict(vocab=32, width=16, heads=2, seq_len=8, batch=2,
               depths=(1, 2), scan_depth=2),
}
_COMPUTATION = re.compile(r"^(?:ENTRY )?%?[\w.\-]+ .*\{$", re.M)
_INSTRUCTION = re.compile(r"^\s+(?:ROOT )?%?[\w.\-]+ = ", re.M)


# --- the plain float8 matmul ------------------------------------------------------------


def _plain_quantize(x: jax.Array, dtype: Any, fmax: float) -> tuple[jax.Array, jax.Array]:
  """Per-tensor current scaling: ``clip(x * fmax / amax)`` cast to ``dtype``,
  and the dequantization scale ``amax / fmax``."""
  x32 = x.astype(jnp.float32)
  amax = jnp.max(jnp.abs(x32))
  scale = jnp.where(amax > 0, fmax / amax, 1.0)
  return jnp.clip(x32 * scale, -fmax, fmax).astype(dtype), 1.0 / scale


def _plain_dot(a, a_scale, b, b_scale, contract, out_dtype):
  out = lax.dot_general(a, b, (contract, ((), ())), preferred_element_type=jnp.float32)
  return (out * (a_scale * b_scale)).astype(out_dtype)


@jax.custom_vjp
def plain_fp8_matmul(x: jax.Array, w: jax.Array) -> jax.Array:
  """``x @ w`` (``w`` 2-D) in float8 as a user would write it without jmp_lite:
  e4m3 operands, e5m2 gradients, per-tensor current scales (448/amax,
  57344/amax), saturating casts, float32 accumulation, ``x.dtype`` out."""
  return _plain_fwd(x, w)[0]


def _plain_fwd(x, w):
  qx, sx = _plain_quantize(x, jnp.float8_e4m3fn, 448.0)
  qw, sw = _plain_quantize(w, jnp.float8_e4m3fn, 448.0)
  return _plain_dot(qx, sx, qw, sw, ((x.ndim - 1,), (0,)), x.dtype), (qx, sx, qw, sw)


def _plain_bwd(residuals, g):
  qx, sx, qw, sw = residuals
  qg, sg = _plain_quantize(g, jnp.float8_e5m2, 57344.0)
  lead = tuple(range(g.ndim - 1))
  dx = _plain_dot(qg, sg, qw, sw, ((g.ndim - 1,), (1,)), g.dtype)  # dgrad
  dw = _plain_dot(qx, sx, qg, sg, (lead, lead), g.dtype)          # wgrad
  return dx, dw


plain_fp8_matmul.defvjp(_plain_fwd, _plain_bwd)


# --- the models -----------------------------------------------------------------------


def _lm_config(size: dict, layers: int) -> models.LMConfig:
  return models.LMConfig(vocab=size["vocab"], layers=layers, width=size["width"],
                         heads=size["heads"], seq_len=size["seq_len"])


def apply_lm_scanned(params: Any, tokens: jax.Array, cfg: models.LMConfig,
                     matmul: Callable = jnp.matmul) -> jax.Array:
  """``apply_lm`` with the blocks stacked and run by ``jax.lax.scan``."""
  x = params["embed"][tokens] + params["pos"][: tokens.shape[1]]

  def step(x, block):
    return models.apply_block(x, block, cfg.heads, matmul), None

  x, _ = lax.scan(step, x, params["blocks"])
  x = models.layer_norm(x, params["ln_f"])
  return x @ params["embed"].T


def _jax_program(route: str, size: dict, layers: int, scan: bool, seed: int):
  cfg = _lm_config(size, layers)
  workload = wl.transformer(size["batch"], cfg)
  params, batch = wl.setup(workload, seed)
  recipe_name = ("fp8" if route in FP8_ROUTES
                 else "fp8_rowwise" if route == FP8_ROWWISE
                 else INT8_ROUTES[route][0]
                 if route in INT8_ROUTES and route != HAND_INT8 else None)
  policy = wl.policy("bf16", recipe_name)
  matmul = jnp.matmul
  if route == HAND_INT8:
    int8_recipe = wl.policy("bf16", "int8").fp8_recipe

    def matmul(x, w):  # what with_policy's int8 rule binds for a Dense matmul
      return jmp_lite.int8.dot_general(x, w, (((x.ndim - 1,), (0,)), ((), ())),
                                            preferred_element_type=x.dtype,
                                            config=int8_recipe)
  elif route == HAND_FP8:
    recipe = wl.policy("bf16", "fp8").fp8_recipe

    def matmul(x, w):  # what with_policy's float8 rule binds for a Dense matmul
      return jmp_lite.fp8.dot_general(x, w, (((x.ndim - 1,), (0,)), ((), ())),
                                          preferred_element_type=x.dtype, config=recipe)
  elif route == PLAIN_FP8:
    matmul = plain_fp8_matmul

  apply = lambda p, x: (apply_lm_scanned if scan else models.apply_lm)(p, x, cfg, matmul)
  if scan:
    params = dict(params, blocks=jax.tree.map(lambda *b: jnp.stack(b), *params["blocks"]))

  def f32_loss(p, b):
    return wl.cross_entropy(apply(p, b["x"]), b["y"])

  if route == "float32":
    loss = f32_loss
  elif route in ("hand", HAND_FP8, PLAIN_FP8, HAND_INT8):
    def loss(p, b):
      p, x = policy.cast_to_compute((p, b["x"]))
      return wl.cross_entropy(apply(p, x), b["y"])
  elif route.startswith("with_policy"):
    applied = jmp_lite.with_policy(apply, policy)

    def loss(p, b):
      return wl.cross_entropy(applied(p, b["x"]), b["y"])
  else:
    loss = jmp_lite.autocast(f32_loss, policy)
  return loss, (params, batch)


def _linen_lm(size: dict, layers: int):
  import flax.linen as nn  # pylint: disable=g-import-not-at-top
  from models import flax_models  # pylint: disable=g-import-not-at-top

  class LinenBlock(nn.Module):
    @nn.compact
    def __call__(self, x, mask):
      h = nn.MultiHeadDotProductAttention(
          num_heads=size["heads"], attention_fn=flax_models.causal_attention)(
              nn.LayerNorm()(x), mask=mask)
      x = x + h
      h = nn.Dense(4 * size["width"])(nn.LayerNorm()(x))
      return x + nn.Dense(size["width"])(nn.gelu(h))

  class LinenLM(nn.Module):
    """The linen twin of ``CharLM``: the same blocks, embeddings and head."""

    @nn.compact
    def __call__(self, tokens):
      x = nn.Embed(size["vocab"], size["width"])(tokens)
      x = x + nn.Embed(size["seq_len"], size["width"])(jnp.arange(tokens.shape[-1]))
      mask = nn.make_causal_mask(tokens)
      for _ in range(layers):
        x = LinenBlock()(x, mask)
      return nn.Dense(size["vocab"])(nn.LayerNorm()(x))

  return LinenLM()


def _tokens(size: dict, seed: int) -> dict[str, jax.Array]:
  tokens = jax.random.randint(jax.random.PRNGKey(seed), (size["batch"], size["seq_len"] + 1),
                              0, size["vocab"], jnp.int32)
  return {"x": tokens[:, :-1], "y": tokens[:, 1:]}


def _bf16(tree: Any) -> Any:
  return jax.tree.map(lambda x: x.astype(jnp.bfloat16) if jnp.issubdtype(
      x.dtype, jnp.floating) else x, tree)


def _linen_program(route: str, size: dict, layers: int, seed: int):
  model = _linen_lm(size, layers)
  batch = _tokens(size, seed)
  variables = model.init(jax.random.PRNGKey(seed), batch["x"])
  if route == "linen_hand":
    def loss(v, b):
      return wl.cross_entropy(model.apply(_bf16(v), b["x"]), b["y"])
  else:
    policy_model = jmp_lite.linen.apply_policy(model, "mixed_bfloat16")

    def loss(v, b):
      return wl.cross_entropy(policy_model.apply(v, b["x"]), b["y"])
  return loss, (variables, batch)


def _nnx_program(route: str, size: dict, layers: int, seed: int):
  from flax import nnx  # pylint: disable=g-import-not-at-top
  from models import flax_models  # pylint: disable=g-import-not-at-top

  model = flax_models.CharLM(size["vocab"], d_model=size["width"], num_heads=size["heads"],
                             num_layers=layers, max_len=size["seq_len"],
                             rngs=nnx.Rngs(seed))
  batch = _tokens(size, seed)
  if route == "nnx_hand":
    graphdef, state = nnx.split(model)

    def loss(s, b):
      return wl.cross_entropy(nnx.merge(graphdef, _bf16(s))(b["x"]), b["y"])
  else:
    graphdef, state = nnx.split(jmp_lite.nnx.apply_policy(model, "mixed_bfloat16"))

    def loss(s, b):
      return wl.cross_entropy(nnx.merge(graphdef, s)(b["x"]), b["y"])
  return loss, (state, batch)


def program(route: str, size: dict, layers: int, scan: bool, seed: int):
  """``(loss, (params, batch))`` of one route at one depth."""
  family = ROUTES[route][0]
  if family == "jax":
    return _jax_program(route, size, layers, scan, seed)
  if family == "linen":
    return _linen_program(route, size, layers, seed)
  return _nnx_program(route, size, layers, seed)


# --- measuring ------------------------------------------------------------------------


def hlo_size(text: str) -> dict[str, int]:
  """Characters, computations and instructions of an HLO module's text."""
  return {"chars": len(text), "computations": len(_COMPUTATION.findall(text)),
          "instructions": len(_INSTRUCTION.findall(text))}


def measure_one(route: str, size: dict, layers: int, scan: bool, args) -> dict[str, Any]:
  """Trace + lower (best of ``args.repeats``), compile once, program sizes."""
  loss, operands = program(route, size, layers, scan, args.seed)
  step = jax.jit(jax.value_and_grad(loss))
  lower_s = []
  for _ in range(args.repeats):
    jax.clear_caches()
    started = time.perf_counter()
    lowered = step.lower(*operands)
    lower_s.append(time.perf_counter() - started)
  stablehlo = lowered.as_text()
  started = time.perf_counter()
  compiled = lowered.compile()
  compile_s = time.perf_counter() - started
  loss_value = float(compiled(*operands)[0])
  row = {"route": route, "family": ROUTES[route][0], "layers": layers, "scan": scan,
         "trace_lower_s": min(lower_s), "trace_lower_all_s": lower_s,
         "compile_s": compile_s,
         "lowered_functions": len(re.findall(r"func\.func ", stablehlo)),
         "stablehlo_chars": len(stablehlo),
         "optimized_hlo": hlo_size(compiled.as_text()), "loss": loss_value}
  print(f"[{NAME}] {route:16s} {'scan ' if scan else ''}{layers:3d} blocks: trace+lower "
        f"{row['trace_lower_s']:.2f} s, compile {compile_s:.2f} s, "
        f"{row['lowered_functions']} functions, optimized HLO "
        f"{row['optimized_hlo']['instructions']} instructions", flush=True)
  return row


def cases(args) -> list[tuple[int, bool]]:
  size = SIZES[args.quick]
  return [(d, False) for d in args.depths] + (
      [(size["scan_depth"], True)] if args.scan else [])


def _ratios(row: dict[str, Any], base: dict[str, Any] | None) -> dict[str, float] | None:
  if base is None:
    return None
  return {
      "trace_lower": row["trace_lower_s"] / base["trace_lower_s"],
      "compile": row["compile_s"] / base["compile_s"],
      "total": ((row["trace_lower_s"] + row["compile_s"])
                / (base["trace_lower_s"] + base["compile_s"])),
      "hlo_instructions": (row["optimized_hlo"]["instructions"]
                           / base["optimized_hlo"]["instructions"]),
  }


def add_ratios(rows: list[dict[str, Any]]) -> None:
  """Each row's ratios to its family's hand-cast step at the same depth, a
  float8 route's (``ratios_fp8``) to the float8 step written by hand, and
  every jmp_lite float8 row's, ``hand_fp8``'s included (``ratios_plain``), to
  the plain float8 matmul's step (``plain_fp8``), and an int8 route's
  (``ratios_int8_fp8``) to the float8 route of the same door
  (:data:`INT8_ROUTES`) and (``ratios_int8_rowwise``) to the float8 route
  that quantizes as it does (:data:`INT8_STRUCTURE_TWINS`)."""
  hand = {(r["family"], r["layers"], r["scan"]): r for r in rows if r["route"] in HAND.values()}
  hand_fp8 = {(r["layers"], r["scan"]): r for r in rows if r["route"] == HAND_FP8}
  plain = {(r["layers"], r["scan"]): r for r in rows if r["route"] == PLAIN_FP8}
  by_route = {_key(r): r for r in rows}
  for r in rows:
    r["ratios"] = _ratios(r, hand.get((r["family"], r["layers"], r["scan"])))
    if r["route"] in FP8_ROUTES:
      r["ratios_fp8"] = _ratios(r, hand_fp8.get((r["layers"], r["scan"])))
    if r["route"] in FP8_ROUTES + (HAND_FP8,):
      r["ratios_plain"] = _ratios(r, plain.get((r["layers"], r["scan"])))
    if r["route"] in INT8_ROUTES:
      twin = INT8_ROUTES[r["route"]][1]
      r["ratios_int8_fp8"] = _ratios(r, by_route.get((twin, r["layers"], r["scan"])))
    if r["route"] in INT8_STRUCTURE_TWINS:
      twin = INT8_STRUCTURE_TWINS[r["route"]]
      r["ratios_int8_rowwise"] = _ratios(r, by_route.get((twin, r["layers"], r["scan"])))


def measure_all(args) -> dict[str, Any]:
  size = SIZES[args.quick]
  rows = []
  for layers, scan in cases(args):
    for route in args.routes:
      if scan and ROUTES[route][0] != "jax":
        continue  # The flax models unroll their blocks.
      if (route == "float32" and not scan and args.control_max_depth
          and layers > args.control_max_depth):
        continue  # The control's deepest programs take XLA:CPU too long.
      rows.append(measure_one(route, size, layers, scan, args))
  add_ratios(rows)
  by_route = {_key(r): r for r in rows}
  for r in rows:  # an int8 row keeps the figures its ratios were taken to
    if r["route"] in INT8_ROUTES:
      r["baselines"] = {
          b: {k: by_route[b, r["layers"], r["scan"]][k] for k in ("trace_lower_s", "compile_s")}
          | {"hlo_instructions":
             by_route[b, r["layers"], r["scan"]]["optimized_hlo"]["instructions"]}
          for b in (HAND["jax"], INT8_ROUTES[r["route"]][1],
                    INT8_STRUCTURE_TWINS.get(r["route"]))
          if (b, r["layers"], r["scan"]) in by_route}
  return {"results": rows}


def _key(row: dict[str, Any]) -> tuple[str, int, bool]:
  return row["route"], row["layers"], row["scan"]


def merge_previous(report: dict[str, Any], out: pathlib.Path) -> dict[str, Any]:
  """With ``--merge``: this run's rows replace those of the same route, depth
  and scan in ``out/compile_time.json`` (a baseline the run added itself, a
  route not named in ``--routes``, only where the file has no row for it: the
  int8 rows keep their baselines' figures in ``row["baselines"]``), the
  others are kept, each naming the run that measured it (``row["run"]``, an index into ``report["runs"]``:
  command, date, wall time and load average of every run still represented).
  Ratios stay those of each row's own run (a same-process comparison); a
  report of other sizes or repeats is replaced, never mixed in."""
  run = {k: report[k] for k in ("command", "date", "wall_s", "load_average")}
  path = out / f"{NAME}.json"
  old = None
  if path.exists():
    old = json.loads(path.read_text())
    same = all(old.get("config", {}).get(k) == report["config"][k]
               for k in ("quick", "repeats", "size", "seed"))
    if old.get("benchmark") != NAME or not same:
      print(f"[{NAME}] note: {path} is replaced, not merged (another configuration).",
            flush=True)
      old = None
  if old is None:
    return dict(report, runs=[run], results=[dict(r, run=0) for r in report["results"]])
  runs = old.get("runs") or [{k: old[k] for k in run}]
  named = set(report["config"].get("named_routes") or report["config"]["routes"])
  old_keys = {_key(r) for r in old["results"]}
  fresh = [r for r in report["results"] if r["route"] in named or _key(r) not in old_keys]
  new = {_key(r) for r in fresh}
  rows = [dict(r, run=r.get("run", 0)) for r in old["results"] if _key(r) not in new]
  rows += [dict(r, run=len(runs)) for r in fresh]
  runs = runs + [run]
  used = sorted({r["run"] for r in rows})
  rows = [dict(r, run=used.index(r["run"])) for r in rows]
  order = list(ROUTES)
  rows.sort(key=lambda r: (r["scan"], r["layers"], order.index(r["route"])))
  config = dict(old["config"])
  config["routes"] = {r: ROUTES[r][1] for r in order
                      if r in old["config"]["routes"] or r in report["config"]["routes"]}
  config["depths"] = sorted(set(old["config"]["depths"]) | set(report["config"]["depths"]))
  config["scan"] = old["config"]["scan"] or report["config"]["scan"]
  print(f"[{NAME}] merged into {path}.", flush=True)
  return dict(report, config=config, runs=[runs[i] for i in used], results=rows)


# --- the page -------------------------------------------------------------------------


def _per_block(rows: list[dict], route: str, key: Callable[[dict], float]) -> list[str]:
  unrolled = sorted((r for r in rows if r["route"] == route and not r["scan"]),
                    key=lambda r: r["layers"])
  return [f"{key(r) / r['layers'] * 1e3:.0f}" for r in unrolled]


def table(report: dict[str, Any]) -> list[str]:
  rows = report["results"]
  config = report["config"]
  lines = [
      "Program: `jax.jit(jax.value_and_grad(loss))` of a decoder LM "
      f"({config['size']['width']} wide, {config['size']['heads']} heads, "
      f"{config['size']['seq_len']} tokens, vocab {config['size']['vocab']}, batch "
      f"{config['size']['batch']}), float32 cross-entropy. Trace + lower: best of "
      f"{config['repeats']} after `jax.clear_caches()`; compile: once. Ratios: to the "
      "hand-cast step of the same family and depth, measured in the same run. "
      f"Targets at the deepest depth: <= {TARGET_UNROLLED} unrolled, <= {TARGET_SCAN} with "
      "scan.",
      "",
  ]
  runs = report.get("runs", [])
  if len(runs) > 1:
    lines += [f"Merged from {len(runs)} runs (`--merge`); each row's ratios are to the "
              "baselines measured in its own run:", ""]
    for i, run in enumerate(runs):
      measured = sorted({(r["route"], r["scan"]) for r in rows if r["run"] == i},
                        key=lambda k: (k[1], list(ROUTES).index(k[0])))
      depths = sorted({r["layers"] for r in rows if r["run"] == i})
      lines.append(f"* run {i}: `{run['command']}` on {run['date']} ({run['wall_s']:.0f} s, "
                   f"load average {run['load_average']['before'][0]:.2f} / "
                   f"{run['load_average']['after'][0]:.2f}): "
                   + ", ".join(f"{r}{' (scan)' if sc else ''}" for r, sc in measured)
                   + f" at {', '.join(map(str, depths))} blocks")
    lines.append("")
  lines += [
      "| route | blocks | trace+lower s | compile s | lowered functions | optimized HLO "
      "instructions | trace+lower / hand | compile / hand | HLO / hand |",
      "|---|---|---:|---:|---:|---:|---:|---:|---:|",
  ]
  for r in rows:
    ratios = r["ratios"] or {}
    lines.append(
        f"| {r['route']} | {r['layers']}{' (scan)' if r['scan'] else ''} "
        f"| {r['trace_lower_s']:.2f} | {r['compile_s']:.2f} | {r['lowered_functions']} "
        f"| {r['optimized_hlo']['instructions']} "
        + "".join(f"| {runner.fmt(ratios.get(k), '.2f')} "
                  for k in ("trace_lower", "compile", "hlo_instructions")) + "|")
  fp8_rows = [r for r in rows if r.get("ratios_fp8")]
  if fp8_rows:
    lines += ["", f"The float8 routes against the float8 step written by hand ({HAND_FP8}: "
              "the same matmuls through `jmp_lite.fp8.dot_general`), same run:", "",
              "| route | blocks | trace+lower / hand fp8 | compile / hand fp8 | HLO / hand fp8 |",
              "|---|---|---:|---:|---:|"]
    for r in fp8_rows:
      lines.append(f"| {r['route']} | {r['layers']}{' (scan)' if r['scan'] else ''} "
                   + "".join(f"| {runner.fmt(r['ratios_fp8'].get(k), '.2f')} "
                             for k in ("trace_lower", "compile", "hlo_instructions")) + "|")
  plain_rows = [r for r in rows if r.get("ratios_plain")]
  if plain_rows:
    lines += ["", f"jmp_lite's float8 steps against the plain float8 matmul's ({PLAIN_FP8}: "
              "the hand-cast step's dense matmuls through a per-tensor float8 matmul "
              "written plainly with `jax.custom_vjp`, `plain_fp8_matmul`), same run:", "",
              "| route | blocks | trace+lower / plain fp8 | compile / plain fp8 "
              "| trace+lower+compile / plain fp8 | HLO / plain fp8 |",
              "|---|---|---:|---:|---:|---:|"]
    for r in plain_rows:
      lines.append(f"| {r['route']} | {r['layers']}{' (scan)' if r['scan'] else ''} "
                   + "".join(f"| {runner.fmt(r['ratios_plain'].get(k), '.2f')} "
                             for k in ("trace_lower", "compile", "total",
                                       "hlo_instructions")) + "|")
  int8_tables = (
      ("ratios_int8_fp8", lambda route: INT8_ROUTES[route][1],
       "The int8 routes against the float8 route of the same door (issue 38's "
       f"target: <= {TARGET_INT8_VS_FP8} for trace + lower and for compile), same run:"),
      ("ratios_int8_rowwise", INT8_STRUCTURE_TWINS.get,
       "The int8 routes against the float8 route that quantizes as they do "
       "(`m=fp8_rowwise`: each operand of each of a linear's three products along "
       "that product's own contracted axis, six quantizations per linear where "
       "per-tensor float8 makes three), same run:"))
  for ratios, twin, title in int8_tables:
    int8_rows = [r for r in rows if r.get(ratios)]
    if not int8_rows:
      continue
    lines += ["", title, "",
              "| route | float8 twin | blocks | trace+lower / fp8 | compile / fp8 "
              "| HLO / fp8 |",
              "|---|---|---|---:|---:|---:|"]
    for r in int8_rows:
      lines.append(f"| {r['route']} | {twin(r['route'])} "
                   f"| {r['layers']}{' (scan)' if r['scan'] else ''} "
                   + "".join(f"| {runner.fmt(r[ratios].get(k), '.2f')} "
                             for k in ("trace_lower", "compile", "hlo_instructions")) + "|")
  for what, key in (("compile time", lambda r: r["compile_s"]),
                    ("trace + lower", lambda r: r["trace_lower_s"])):
    lines += ["", f"Per block (unrolled depths in order), milliseconds of {what}:", ""]
    for route in dict.fromkeys(r["route"] for r in rows):
      per = _per_block(rows, route, key)
      if per:
        lines.append(f"* {route}: {' / '.join(per)}")
  return lines + [""]


# --- flags and main --------------------------------------------------------------------


def parse(argv: Sequence[str]) -> argparse.Namespace:
  parser = argparse.ArgumentParser(prog=f"python -m benchmarks.{NAME}",
                                   description=TITLE)
  parser.add_argument("--quick", action="store_true",
                      help="tiny sizes (1 and 2 blocks): a smoke test, not a measurement")
  parser.add_argument("--repeats", type=int, default=None,
                      help="trace+lower repeats, the best reported (default 3; 1 with --quick)")
  parser.add_argument("--routes", default=",".join(ROUTES),
                      help=f"comma-separated routes (default all: {','.join(ROUTES)})")
  parser.add_argument("--depths", default=None,
                      help="comma-separated unrolled depths (default 12,24,48; 1,2 with --quick)")
  parser.add_argument("--no-scan", dest="scan", action="store_false",
                      help="leave out the scanned case")
  parser.add_argument("--control-max-depth", type=int, default=None,
                      help="measure the float32 control unrolled only up to this depth "
                           "(default: every depth; at 48 blocks XLA:CPU takes over 15 "
                           "minutes and ~14 GB for it)")
  parser.add_argument("--seed", type=int, default=0, help="PRNG seed (default 0)")
  parser.add_argument("--merge", action="store_true",
                      help="merge into the output folder's compile_time.json: this run's rows "
                           "replace those of the same route, depth and scan, the others are "
                           "kept with the run that measured them")
  common.OUTPUTS.add_args(parser)
  args = parser.parse_args(argv)
  args.routes = runner.split_choices(parser, "--routes", args.routes, tuple(ROUTES))
  args.named_routes = list(args.routes)  # before the baselines are added
  for family, hand in HAND.items():
    if any(ROUTES[r][0] == family for r in args.routes) and hand not in args.routes:
      args.routes.insert(0, hand)  # Ratios need the family's baseline.
  for route, (_, twin) in INT8_ROUTES.items():
    for twin in (twin, INT8_STRUCTURE_TWINS.get(route)):
      if route in args.routes and twin and twin not in args.routes:
        args.routes.insert(args.routes.index(route), twin)  # int8's ratios need it.
  if any(r in FP8_ROUTES for r in args.routes) and HAND_FP8 not in args.routes:
    args.routes.insert(args.routes.index(HAND["jax"]) + 1, HAND_FP8)
  if HAND_FP8 in args.routes and PLAIN_FP8 not in args.routes:
    args.routes.insert(args.routes.index(HAND_FP8) + 1, PLAIN_FP8)
  if args.repeats is None:
    args.repeats = 1 if args.quick else 3
  if args.repeats < 1:
    parser.error(f"--repeats must be >= 1, got {args.repeats}")
  if args.depths is None:
    args.depths = list(SIZES[args.quick]["depths"])
  else:
    try:
      args.depths = [int(d) for d in args.depths.split(",") if d.strip()]
    except ValueError:
      parser.error(f"--depths: expected comma-separated positive integers, got {args.depths!r}")
    if not args.depths or min(args.depths) < 1:
      parser.error(f"--depths: expected comma-separated positive integers, got {args.depths!r}")
  args.out = common.OUTPUTS.folder(args)
  return args


def main(argv: Sequence[str] | None = None) -> int:
  argv = sys.argv[1:] if argv is None else list(argv)
  args = parse(argv)
  size = SIZES[args.quick]
  config = {"quick": args.quick, "repeats": args.repeats, "seed": args.seed,
            "routes": {r: ROUTES[r][1] for r in args.routes}, "depths": args.depths,
            "named_routes": args.named_routes,
            "scan": args.scan, "control_max_depth": args.control_max_depth, "size": {k: v for k, v in size.items() if k not in (
                "depths", "scan_depth")},
            "scan_depth": size["scan_depth"],
            "targets": {"unrolled": TARGET_UNROLLED, "scan": TARGET_SCAN}}
  runner.publish(NAME, f"benchmarks.{NAME}", argv, args.out, config,
                 lambda: measure_all(args),
                 lambda report: "\n".join(runner.header(TITLE, report) + table(report)),
                 finish=(lambda r: merge_previous(r, args.out)) if args.merge else None)
  return 0


if __name__ == "__main__":
  sys.exit(main())
