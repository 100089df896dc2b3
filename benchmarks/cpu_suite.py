"""The CPU suite: step-time and compile-time ratios, residual bytes, FLOP shares.

Run as ``python -m benchmarks run --suite cpu`` (see ``benchmarks/README.md``).
Absolute CPU times say nothing about accelerators (XLA:CPU emulates half
precision); the suite reports *ratios* between variants that compute the same
thing, and static properties of the programs (bytes saved for the backward
pass, share of matmul FLOPs in half precision), which carry over to GPUs.
"""

from __future__ import annotations

import os
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jmp_lite
from benchmarks import analysis
from benchmarks import common
from benchmarks import workloads as wl

LEARNING_RATE = 1e-3
INITIAL_SCALE = 2.0**15
MAX_CONSECUTIVE_ERRORS = 10
CHECK_STEPS = 3
# bf16 variants compiled --compile-repeats times, interleaved (median; ratios:
# median of the per-round ratios).
COMPILE_REPEATED = ("jmp_lite", "hand", "autocast")
TARGETS = {
    "wrapper_step_ratio": 1.03,
    "autocast_step_ratio": 1.05,
    "autocast_compile_ratio": 1.5,
    "residual_ratio_examples": 0.55,
    "residual_ratio_floor": 0.5,
    "half_flop_share": 1.0,
}
POLICIES = {
    "bf16": jmp_lite.get_policy("p=f32,c=bf16,o=f32"),
    "f16": jmp_lite.get_policy("p=f32,c=f16,o=f32"),
}
# Interleaved groups: variants timed against each other.
GROUPS = {
    "bf16": ("jmp_lite", "hand", "apply_if_finite", "autocast"),
    "f16": ("jmp_lite", "hand"),
}
RATIOS = (
    # (name, group, numerator, denominator)
    ("jmp_lite/hand bf16", "bf16", "jmp_lite", "hand"),
    ("jmp_lite/hand f16", "f16", "jmp_lite", "hand"),
    ("jmp_lite/apply_if_finite bf16", "bf16", "jmp_lite", "apply_if_finite"),
    ("autocast/policy bf16", "bf16", "autocast", "jmp_lite"),
)


# --- step and compile time --------------------------------------------------------


def build_variants(workload: wl.Workload, params, group: str) -> dict[str, tuple[Any, Any]]:
  """``{variant: (step, initial state)}`` for one interleaved group.

  * ``jmp_lite``: ``loss_scaling(adam, DynamicLossScale)`` with the loss cast
    by hand with the policy (the "policy" loss);
  * ``hand``: the same, jmp style (scale, unscale, ``all_finite``,
    ``select_tree``);
  * ``apply_if_finite``: ``optax.apply_if_finite(adam)`` and no loss scaling
    (bf16 only: with float16 compute and no scaling, gradients underflow;
    params and so grads stay float32);
  * ``autocast``: as ``jmp_lite`` with the loss under ``jmp_lite.autocast``.
  """
  policy = POLICIES[group]
  adam = optax.adam(LEARNING_RATE)
  scaled = jmp_lite.loss_scaling(adam, jmp_lite.DynamicLossScale(INITIAL_SCALE))
  policy_loss = wl.loss_fn(workload, "policy", policy)
  variants = {
      "jmp_lite": (common.make_jmp_lite_step(policy_loss, scaled),
                   (params, scaled.init(params))),
      "hand": (common.make_hand_step(policy_loss, adam),
               (params, adam.init(params), jmp_lite.DynamicLossScale(INITIAL_SCALE))),
  }
  if "apply_if_finite" in GROUPS[group]:
    skipping = optax.apply_if_finite(adam, MAX_CONSECUTIVE_ERRORS)
    variants["apply_if_finite"] = (common.make_plain_step(policy_loss, skipping),
                                   (params, skipping.init(params)))
  if "autocast" in GROUPS[group]:
    autocast_loss = wl.loss_fn(workload, "autocast", policy)
    variants["autocast"] = (common.make_jmp_lite_step(autocast_loss, scaled),
                            (params, scaled.init(params)))
  return {name: (step, common.fresh_copy(state)) for name, (step, state) in variants.items()}


def _block_steps(fn, state, batch, target_s: float, quick: bool) -> tuple[Any, int]:
  """Steps per timed block so that a block lasts about ``target_s``."""
  if quick:
    return state, 1
  state, wall, _ = common.time_block(fn, state, batch, 2)
  return state, int(np.clip(round(target_s / (wall / 2)), 1, 64))


def _shape_structs(state: Any) -> Any:
  """``state`` with every array replaced by its shape and dtype (for lowering)."""
  return jax.tree_util.tree_map(
      lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, weak_type=x.weak_type)
      if isinstance(x, jax.Array) else x, state)


def _recompile_interleaved(variants, shapes, batch, rounds: int, compile_info) -> None:
  """Compiles the ``COMPILE_REPEATED`` bf16 variants ``rounds`` more times.

  Rounds interleave the variants (order rotating), like the step timing, so
  that a burst of load from other processes hits one round of every variant
  rather than all compilations of one. Updates ``compile_info`` in place:
  ``total_s_values`` gets one value per round, ``total_s`` etc. the medians.
  """
  names = list(COMPILE_REPEATED)
  for r in range(rounds):
    shift = r % len(names)
    for name in names[shift:] + names[:shift]:
      _, info = common.compile_step(variants[name][0], shapes[name], batch)
      entry = compile_info[f"bf16/{name}"]
      entry["total_s_values"].append(info["total_s"])
      entry.setdefault("lower_s_values", [entry["lower_s"]]).append(info["lower_s"])
      entry.setdefault("compile_s_values", [entry["compile_s"]]).append(info["compile_s"])
  for name in names:
    entry = compile_info[f"bf16/{name}"]
    entry["total_s"] = float(np.median(entry["total_s_values"]))
    if rounds:
      entry["lower_s"] = float(np.median(entry["lower_s_values"]))
      entry["compile_s"] = float(np.median(entry["compile_s_values"]))


def time_workload(workload: wl.Workload, args) -> dict[str, Any]:
  """Compiles, checks and times every variant of one workload."""
  params, batch = wl.setup(workload, args.seed)
  result: dict[str, Any] = {"compile": {}, "check": {}, "step_time_s": {},
                            "cpu_time_s": {}, "block_steps": {}}
  compile_repeats = 1 if args.quick else args.compile_repeats

  f32_step = common.make_plain_step(wl.loss_fn(workload, "f32"), optax.adam(LEARNING_RATE))
  _, result["compile"]["f32"] = common.compile_step(
      f32_step, common.fresh_copy((params, optax.adam(LEARNING_RATE).init(params))), batch)

  for group, names in GROUPS.items():
    variants = build_variants(workload, params, group)
    fns, states = {}, {}
    shapes = {name: _shape_structs(state) for name, (_, state) in variants.items()}
    for name in names:
      step, state = variants[name]
      fns[name], result["compile"][f"{group}/{name}"] = common.compile_step(step, state, batch)
      states[name], losses = common.run_steps(fns[name], state, batch, CHECK_STEPS)
      result["check"][f"{group}/{name}"] = [float(x) for x in losses]
    if group == "bf16":
      _recompile_interleaved(variants, shapes, batch, compile_repeats - 1, result["compile"])
    ref = result["check"][f"{group}/jmp_lite"]
    if not np.allclose(ref, result["check"][f"{group}/hand"], rtol=1e-4, atol=1e-5):
      raise SystemExit(f"{workload.name} {group}: jmp_lite and hand-written steps differ "
                       f"({ref} vs {result['check'][f'{group}/hand']}).")
    states["jmp_lite"], steps = _block_steps(
        fns["jmp_lite"], states["jmp_lite"], batch, args.block_s, args.quick)
    result["block_steps"][group] = steps
    per_step = common.time_interleaved(fns, states, batch, steps, args.repeats, names)
    for name in names:
      result["step_time_s"][f"{group}/{name}"] = common.summarize(per_step["wall"][name])
      result["cpu_time_s"][f"{group}/{name}"] = common.summarize(per_step["cpu"][name])
    result[f"_raw_{group}"] = per_step
    print(f"  [{workload.name}] {group}: " + ", ".join(
        f"{n} {np.median(per_step['wall'][n]) * 1e3:.2f} ms" for n in names), flush=True)

  result["ratios"] = {}
  for name, group, num, den in RATIOS:
    raw = result[f"_raw_{group}"]
    result["ratios"][name] = {
        "wall": common.ratio_summary(raw["wall"][num], raw["wall"][den]),
        "cpu": common.ratio_summary(raw["cpu"][num], raw["cpu"][den]),
    }
  for group in GROUPS:
    del result[f"_raw_{group}"]
  comp = result["compile"]

  def round_ratio(num: str, den: str) -> float:
    """Median over compilation rounds of the per-round ratio."""
    pairs = zip(comp[num]["total_s_values"], comp[den]["total_s_values"])
    return float(np.median([a / b for a, b in pairs]))

  result["compile_ratios"] = {
      "jmp_lite/hand bf16": round_ratio("bf16/jmp_lite", "bf16/hand"),
      "jmp_lite/apply_if_finite bf16":
          comp["bf16/jmp_lite"]["total_s"] / comp["bf16/apply_if_finite"]["total_s"],
      "autocast/policy bf16": round_ratio("bf16/autocast", "bf16/jmp_lite"),
      "jmp_lite bf16/f32": comp["bf16/jmp_lite"]["total_s"] / comp["f32"]["total_s"],
  }
  return result


# --- static figures ---------------------------------------------------------------


def static_figures(loss_of, params, exclude, f32_key: str = "f32") -> dict[str, Any]:
  """Residuals and matmul FLOPs of ``loss_of(key)`` for every key.

  Args:
    loss_of: ``{name: params -> loss}``.
    params: the params to differentiate.
    exclude: arrays the losses close over that do not count as residuals.
    f32_key: the float32 entry the residual ratios are relative to.
  """
  out = {}
  for name, loss in loss_of.items():
    out[name] = {
        "residuals": analysis.residual_bytes(loss, params, exclude),
        "flops": analysis.matmul_flops(jax.value_and_grad(loss), params),
    }
  base = out[f32_key]["residuals"]
  for figures in out.values():
    r = figures["residuals"]
    r["ratio_vs_f32"] = r["bytes"] / base["bytes"]
    r["activation_ratio_vs_f32"] = r["activation_bytes"] / base["activation_bytes"]
  return out


def _half_residuals(loss):
  """``loss`` under ``jax.checkpoint(policy=jmp_lite.save_half_residuals)``."""
  return jax.checkpoint(loss, policy=jmp_lite.save_half_residuals)


def workload_static(workload: wl.Workload, seed: int) -> dict[str, Any]:
  params, batch = wl.setup(workload, seed)
  losses = {"f32": wl.loss_fn(workload, "f32")}
  for dt, policy in POLICIES.items():
    losses[f"policy {dt}"] = wl.loss_fn(workload, "policy", policy)
    losses[f"autocast {dt}"] = wl.loss_fn(workload, "autocast", policy)
    losses[f"policy+remat {dt}"] = _half_residuals(losses[f"policy {dt}"])
  return static_figures(
      {k: (lambda p, f=f: f(p, batch)) for k, f in losses.items()}, params, batch)


def digits_cnn_static(quick: bool) -> dict[str, Any]:
  """``DigitsCNN`` under ``jmp_lite.linen.apply_policy``, training mode."""
  import jmp_lite.linen as jlinen
  from models.flax_models import DigitsCNN

  batch = 4 if quick else 64
  x = jax.random.normal(jax.random.PRNGKey(0), (batch, 8, 8, 1), jnp.float32)
  y = jnp.arange(batch, dtype=jnp.int32) % 10
  out = {}
  for name, spec in (("f32", "p=f32,c=f32,o=f32"), ("bf16", "p=f32,c=bf16,o=f32"),
                     ("f16", "p=f32,c=f16,o=f32")):
    model = jlinen.apply_policy(DigitsCNN(), spec)
    variables = model.init(jax.random.PRNGKey(1), x)
    stats = variables["batch_stats"]

    def loss(p, model=model, stats=stats):
      logits, _ = model.apply({"params": p, "batch_stats": stats}, x, train=True,
                              mutable=["batch_stats"])
      return wl.cross_entropy(logits, y)

    out[name] = static_figures({name: loss}, variables["params"], (x, stats), name)[name]
    if name != "f32":
      out[f"{name}+remat"] = static_figures(
          {name: _half_residuals(loss)}, variables["params"], (x, stats), name)[name]
  return _relative_to_f32(out, f"DigitsCNN (linen), batch {batch} of 8x8x1")


def char_lm_static(quick: bool) -> dict[str, Any]:
  """``CharLM`` under ``jmp_lite.nnx.apply_policy``."""
  from flax import nnx
  import jmp_lite.nnx as jnnx
  from models.flax_models import CharLM

  dims = (dict(d_model=16, num_heads=2, num_layers=1), 8, 2) if quick else (
      dict(d_model=128, num_heads=4, num_layers=2), 128, 16)
  kwargs, seq, batch = dims
  tokens = jax.random.randint(jax.random.PRNGKey(0), (batch, seq + 1), 0, 256, jnp.int32)
  out = {}
  for name, spec in (("f32", "p=f32,c=f32,o=f32"), ("bf16", "p=f32,c=bf16,o=f32"),
                     ("f16", "p=f32,c=f16,o=f32")):
    module = CharLM(256, max_len=seq, rngs=nnx.Rngs(0), **kwargs)
    graphdef, params, rest = nnx.split(jnnx.apply_policy(module, spec), nnx.Param, ...)

    def loss(p, graphdef=graphdef, rest=rest):
      logits = nnx.merge(graphdef, p, rest)(tokens[:, :-1])
      return wl.cross_entropy(logits, tokens[:, 1:])

    out[name] = static_figures({name: loss}, params, (tokens, rest), name)[name]
    if name != "f32":
      out[f"{name}+remat"] = static_figures(
          {name: _half_residuals(loss)}, params, (tokens, rest), name)[name]
  desc = (f"CharLM (nnx) {kwargs['num_layers']} layers x {kwargs['d_model']}, "
          f"{seq} tokens, batch {batch}")
  return _relative_to_f32(out, desc)


def _relative_to_f32(out: dict[str, Any], description: str) -> dict[str, Any]:
  base = out["f32"]["residuals"]
  for figures in out.values():
    r = figures["residuals"]
    r["ratio_vs_f32"] = r["bytes"] / base["bytes"]
    r["activation_ratio_vs_f32"] = r["activation_bytes"] / base["activation_bytes"]
  return {"description": description, "figures": out}


# --- the suite --------------------------------------------------------------------


def run(args) -> dict[str, Any]:
  """Runs the CPU suite; returns the report (not yet written)."""
  load_before = os.getloadavg()
  started = time.perf_counter()
  # --quick (the smoke test) times only the MLP: compilation dominates there.
  chosen = wl.make_workloads("quick")[:1] if args.quick else wl.make_workloads("cpu")
  results = []
  for workload in chosen:
    print(f"[cpu] {workload.name}: {workload.description}", flush=True)
    params, _ = wl.setup(workload, args.seed)
    entry = {"workload": workload.name, "description": workload.description,
             "param_count": wl.param_count(params)}
    entry["static"] = workload_static(workload, args.seed)
    entry.update(time_workload(workload, args))
    results.append(entry)
  print("[cpu] example models (static figures)", flush=True)
  examples = {"DigitsCNN": digits_cnn_static(args.quick),
              "CharLM": char_lm_static(args.quick)}
  return {
      "suite": "cpu",
      "machine": common.machine_info(),
      "load_average": {"before": list(load_before), "after": list(os.getloadavg())},
      "config": {
          "quick": args.quick, "repeats": args.repeats, "block_s": args.block_s,
          "compile_repeats": 1 if args.quick else args.compile_repeats,
          "seed": args.seed, "learning_rate": LEARNING_RATE,
          "initial_loss_scale": INITIAL_SCALE,
          "max_consecutive_errors": MAX_CONSECUTIVE_ERRORS,
          "policies": {k: str(v) for k, v in POLICIES.items()},
          "groups": {k: list(v) for k, v in GROUPS.items()},
          "targets": TARGETS,
      },
      "results": results,
      "example_models": examples,
      "wall_s": time.perf_counter() - started,
  }
