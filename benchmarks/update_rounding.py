"""Step time and peak memory of bf16 params with each ``master_weights`` method.

The question: what do stochastic rounding and Kahan compensation
(``jmp_lite.master_weights(adam, method="stochastic_rounding" | "kahan")``)
cost per step against the float32 master copy (``method="copy"``, the
default), and how much memory does one training step take with each? The
variants train the same model from the same bf16 params with Adam, compute in
bf16 (``p=f32,c=bf16`` casts; the bf16 params are already bf16), and no loss
scaling:

* ``copy``, ``stochastic_rounding``, ``kahan``: bf16 params,
  ``master_weights(optax.adam(lr), method=...)``;
* ``bf16``: bf16 params, plain Adam (moments bf16): the stall-prone recipe,
  for reference;
* ``f32``: float32 params, plain Adam: the usual mixed-precision recipe;
* ``sr_8bit``, ``sr_4bit``, ``sr_e4m3``: bf16 params, stochastic rounding and
  Adam's moments stored in 8-bit, 4-bit or e4m3 blocks
  (``with_state_dtype(adam, mu=..., nu=...)`` inside ``master_weights``):
  about 4, 3 and 4 bytes per parameter.

Step times are given over the master copy's and over float32 Adam's.

Peak memory is XLA's own figure for the compiled step
(``compiled.memory_analysis()``): arguments + outputs - aliased (the donated
state) + temporaries, in bytes, with the arguments (params + optimizer state +
batch) also given alone. Before timing, the check runs every variant from the
same params and requires finite losses and both low-memory methods' losses
to follow the master copy's within tolerance; it also reports how far Kahan's
float32 values (params + compensation) end from the master copy's, without
gating on it: the forward pass computes in bf16, so one param that differs
(Kahan rounds ties up, the copy to even) or one fusion that differs between
the two compiled programs flips bf16 roundings of activations and gradients,
and Adam carries those into many float32 values within a few steps. That the
two are the same float32 arithmetic for the same gradients is tested exactly
in ``tests/test_low_memory_updates.py``. Method: ``benchmarks/runner.py``.

Run from the repository root::

  python -m benchmarks.update_rounding                       # ~4-6 min on 2 CPU cores
  python -m benchmarks.update_rounding --update-results      # ... into benchmarks/results/
  python -m benchmarks.update_rounding --quick --out /tmp/ur # smoke test
"""

from __future__ import annotations

import sys
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jmp_lite
from benchmarks import common
from benchmarks import runner
from benchmarks import workloads as wl

CHECK_STEPS = 8
#: Kahan's float32 values against the master copy's: the share of entries
#: outside this tolerance is reported, not gated (see the module docstring).
MASTER_RTOL = 1e-3
MASTER_ATOL = 1e-5
#: The losses of the low-memory methods against the master copy's over the
#: check's steps (stochastic rounding adds noise of up to one bf16 spacing).
LOSS_RTOL = 0.05
MODELS = ("mlp", "transformer")
#: The variants, in timing order.
VARIANTS = {
    "copy": "bf16 params, master_weights(adam) (float32 master copy)",
    "stochastic_rounding": "bf16 params, master_weights(adam, "
                           "method='stochastic_rounding')",
    "kahan": "bf16 params, master_weights(adam, method='kahan')",
    "bf16": "bf16 params, plain adam (bf16 moments)",
    "f32": "float32 params, plain adam",
    "sr_8bit": "bf16 params, master_weights(with_state_dtype(adam, mu='8bit', "
               "nu='8bit'), method='stochastic_rounding')",
    "sr_4bit": "bf16 params, master_weights(with_state_dtype(adam, mu='4bit', "
               "nu='4bit'), method='stochastic_rounding')",
    "sr_e4m3": "bf16 params, master_weights(with_state_dtype(adam, mu='e4m3', "
               "nu='e4m3'), method='stochastic_rounding')",
}
METHODS = ("copy", "stochastic_rounding", "kahan")
#: Low-bit optimizer states (issue 28): variant -> the moments' format.
STATE_FORMATS = {"sr_8bit": "8bit", "sr_4bit": "4bit", "sr_e4m3": "e4m3"}
RATIOS = {"over_copy": {name: (name, "copy") for name in VARIANTS
                        if name != "copy"},
          "over_f32": {name: (name, "f32") for name in VARIANTS
                       if name != "f32"}}


def workloads(args) -> list[wl.Workload]:
  return wl.make_workloads("quick" if args.quick else "cpu", args.models)


def _optimizer(name: str) -> optax.GradientTransformation:
  adam = optax.adam(common.LEARNING_RATE)
  if name in STATE_FORMATS:
    fmt = STATE_FORMATS[name]
    return jmp_lite.master_weights(
        jmp_lite.with_state_dtype(adam, mu=fmt, nu=fmt),
        method="stochastic_rounding")
  return jmp_lite.master_weights(adam, method=name) if name in METHODS else adam


def _init_state(name: str, params32) -> tuple[Any, Any]:
  dtype = jnp.float32 if name == "f32" else jnp.bfloat16
  params = jax.tree.map(lambda x: x.astype(dtype), params32)
  return common.fresh_copy((params, _optimizer(name).init(params)))


def _master(state) -> Any:
  params, opt_state = state
  try:
    return jmp_lite.get_master_params(opt_state, params)
  except ValueError:  # plain Adam: the params are all there is
    return params


def check(fns, states, batch) -> tuple[dict, dict[str, Any]]:
  """Every variant CHECK_STEPS steps from the same params: finite losses and
  the low-memory methods' losses within LOSS_RTOL of the master copy's; how
  far Kahan's float32 values end from the master copy's (reported only)."""
  states, losses = runner.run_all(fns, states, batch, CHECK_STEPS)
  finite = {name: bool(np.all(np.isfinite(v))) for name, v in losses.items()}
  copy = np.asarray(losses["copy"])
  loss_close = {name: bool(np.allclose(losses[name], copy, rtol=LOSS_RTOL))
                for name in ("stochastic_rounding", "kahan", *STATE_FORMATS)
                if name in losses}
  master_copy, master_kahan = _master(states["copy"]), _master(states["kahan"])
  verdict = {
      "steps": CHECK_STEPS, "finite": finite, "loss_rtol": LOSS_RTOL,
      "loss_close_to_copy": loss_close,
      "final_losses": {name: v[-1] for name, v in losses.items()},
      "master_rtol": MASTER_RTOL, "master_atol": MASTER_ATOL,
      "kahan_max_abs_master_diff": runner.max_abs_diff(master_kahan,
                                                       master_copy),
  }
  outside = [np.sum(~np.isclose(np.asarray(k, np.float64),
                                np.asarray(c, np.float64),
                                rtol=MASTER_RTOL, atol=MASTER_ATOL))
             for k, c in zip(jax.tree.leaves(master_kahan),
                             jax.tree.leaves(master_copy))]
  size = sum(np.size(c) for c in jax.tree.leaves(master_copy))
  verdict["kahan_share_outside"] = float(sum(outside) / size)
  # The low-bit states train differently (4-bit moments are coarse), by
  # design: they must stay finite; their losses are reported, not gated.
  verdict["same"] = bool(all(finite.values()) and all(
      close for name, close in loss_close.items()
      if name not in STATE_FORMATS))
  return states, verdict


def _memory(compiled) -> dict[str, int] | None:
  try:
    stats = compiled.memory_analysis()
    sizes = {key: int(getattr(stats, f"{key}_size_in_bytes"))
             for key in ("argument", "output", "alias", "temp")}
  except (AttributeError, NotImplementedError, RuntimeError):
    return None
  sizes["peak"] = (sizes["argument"] + sizes["output"] - sizes["alias"]
                   + sizes["temp"])
  return sizes


def measure(workload: wl.Workload, args) -> dict[str, Any]:
  params32, batch = wl.setup(workload, args.seed)
  loss_fn = wl.loss_fn(workload, "policy", wl.policy("bf16"))
  steps = {name: common.make_plain_step(loss_fn, _optimizer(name))
           for name in VARIANTS}
  states = {name: _init_state(name, params32) for name in VARIANTS}
  # Counted before the steps donate (delete) these buffers.
  state_bytes = {name: sum(int(x.nbytes) for x in jax.tree.leaves(state))
                 for name, state in states.items()}
  result = runner.measure(
      workload.name, steps, states, batch, runner.Timing.from_args(args),
      check=check, ratios=RATIOS,
      inspect=lambda fns: {"memory": {n: _memory(f) for n, f in fns.items()}})
  return {"workload": workload.name, "description": workload.description,
          "param_count": common.param_count(params32),
          "params_and_state_bytes": state_bytes, **result}


def _mib(x: float) -> str:
  return f"{x / 2**20:.2f}"


def table(report: dict[str, Any]) -> list[str]:
  lines = [
      "Variants: " + "; ".join(f"`{k}`: {v}" for k, v in VARIANTS.items())
      + f". Adam({common.LEARNING_RATE:g}), compute in bf16, no loss scaling, "
      "`jax.jit` with the state donated, compiled ahead of time.",
      "",
      runner.method(report["config"], "of each variant over `copy`"),
      "",
      "| workload | params | variant | ms/step | / copy (IQR) | CPU-time / copy "
      "| / f32 Adam (IQR) | params + state (MiB) | B/param | XLA peak (MiB) "
      "| XLA temp (MiB) |",
      "|---|--:|---|--:|--:|--:|--:|--:|--:|--:|--:|",
  ]
  for r in report["results"]:
    n = r["param_count"]
    for name in VARIANTS:
      t = r["step_time_s"][name]["median"]
      if name == "copy":
        ratio = cpu = "1"
      else:
        ratio = runner.ratio_cell(r["over_copy"][name])
        cpu = f"{r['cpu_over_copy'][name]['median']:.3f}"
      over_f32 = ("1" if name == "f32"
                  else runner.ratio_cell(r["over_f32"][name]))
      mem = r["memory"][name]
      peak = _mib(mem["peak"]) if mem else "–"
      temp = _mib(mem["temp"]) if mem else "–"
      size = r["params_and_state_bytes"][name]
      lines.append(
          f"| {r['workload']}: {r['description']} | {n} | `{name}` "
          f"| {t * 1e3:.3f} | {ratio} | {cpu} | {over_f32} | {_mib(size)} "
          f"| {size / n:.2f} | {peak} | {temp} |")
  return lines + [
      "",
      "params + state: bytes of the step's state (params and optimizer "
      "state); B/param: the same over the parameter count. XLA peak: "
      "arguments + outputs - aliased (donated) + temporaries, from "
      "`compiled.memory_analysis()`; it includes the batch. Before timing, "
      f"the variants ran {CHECK_STEPS} steps from the same params: finite "
      f"losses, and the losses of both low-memory methods within "
      f"{LOSS_RTOL:g} (relative) of the master copy's; the low-bit state "
      "variants must be finite, their losses after those steps are reported "
      "(final losses: " + _final_losses(report) + "). Kahan's float32 "
      "values (params + compensation) are the master copy's for the same "
      "gradients (tested exactly); here the bf16 forward pass of two "
      "compiled programs differs, so they drift apart: `update_rounding.json`"
      " gives the largest difference and the share of entries outside "
      f"rtol {MASTER_RTOL:g} / atol {MASTER_ATOL:g} after the check's steps.",
      "",
  ]


def _final_losses(report: dict[str, Any]) -> str:
  return "; ".join(
      r["workload"] + ": " + ", ".join(
          f"`{name}` {r['check']['final_losses'][name]:.4f}"
          for name in ("copy", *STATE_FORMATS)
          if name in r["check"]["final_losses"])
      for r in report["results"])


def _add_flags(parser) -> None:
  parser.add_argument("--models", default=",".join(MODELS),
                      help=f"comma-separated subset of {','.join(MODELS)} "
                      "(default all)")


def _finish_flags(parser, args) -> None:
  args.models = runner.split_choices(parser, "--models", args.models, MODELS)


STUDY = runner.Study(
    name="update_rounding",
    title="bf16 params: master copy, stochastic rounding, Kahan, low-bit "
          "Adam states: step time and memory",
    description="Step time and peak memory of bf16 params trained with "
                "master_weights' methods (copy, stochastic_rounding, kahan), "
                "stochastic rounding with 8-bit/4-bit/e4m3 Adam states, plain "
                "bf16 and float32.",
    workloads=workloads, measure=measure, table=table,
    repeats=(41, 3), steps=(4, 2), computes=(),
    add_flags=_add_flags, finish_flags=_finish_flags,
    config=lambda args: {"models": args.models, "check_steps": CHECK_STEPS,
                         "variants": VARIANTS})


def main(argv: list[str] | None = None) -> int:
  return runner.main(STUDY, argv)


if __name__ == "__main__":
  sys.exit(main())
