"""Should the default Flax rules recompute the float32 norm regions in the backward pass?

With jmp_lite's default Flax rules, normalisation layers run in float32
(``FullPrecision``: half input cast to float32, float32 statistics, scale and
bias, output cast back to the compute dtype). ``jax.grad`` then saves their
float32 intermediates for the backward pass, so the saved activations stay
far above half of float32's (0.76x for DigitsCNN, 0.67x for CharLM, in
``results/cpu.md``). This script measures, for the Flax example models
(``models/flax_models.py``: ``DigitsCNN``, linen, with BatchNorm; ``CharLM``,
NNX, with LayerNorm), under ``p=f32,c=bf16,o=f32`` and ``p=f32,c=f16,o=f32``:

* ``policy``: ``apply_policy`` with the default rules;
* ``remat norms`` (the candidate default): the same, with every module the
  default rules keep in float32 recomputed in the backward pass from its
  half-precision input: its whole boundary (the cast of the input to float32,
  the norm, the cast of the output back) runs under
  ``jax.checkpoint(policy=jmp_lite.save_half_residuals)``;
* ``remat loss``: the whole loss under
  ``jax.checkpoint(loss, policy=jmp_lite.save_half_residuals)`` (the
  documented opt-in);

(a) the residual bytes (``benchmarks.analysis.residual_bytes``, the measure of
``results/cpu.md``; float32 policy = 1.0) and (b) the step time of a full
jitted train step (forward, backward, ``loss_scaling(adam)``, BatchNorm
statistics carried in the state), the variants interleaved
(``benchmarks/runner.py``); ratio = median of the per-block ratios against
``policy``. Before timing, the gradients of the three variants are compared:
recomputation may change their rounding, never by more than mixed precision
itself changes them (the distance of ``policy`` to float32), or the script
stops.

**How "remat norms" is built** (what the default rules would do):

* linen: a method interceptor, entered around ``PolicyModel.apply`` so that
  it runs before jmp_lite's boundary interceptor, replaces the call of every
  module of a ``FullPrecision`` class of ``jmp_lite.linen.DEFAULT_MODULE_RULES`` by
  ``nn.checkpoint(lambda m, *a: m(*a), policy=save_half_residuals)(module,
  ...)``, Flax's lifted remat (which carries ``batch_stats`` updates out
  correctly). The inner call goes through jmp_lite's boundary, so the cast to
  float32 happens inside the remat: its saved input is the half-precision
  tensor. (``nn.remat(nn.BatchNorm)`` in the model would not do: jmp_lite's
  boundary would cast to float32 *outside* the lifted remat, whose float32
  input would then be saved.)
* NNX: every norm module of the model is replaced, in its attribute slot, by
  a small module holding it whose ``__call__`` is
  ``nnx.remat(lambda norm, x: norm(x), policy=save_half_residuals)(self.norm,
  x)``; jmp_lite's boundary is installed in the ``norm`` slot, so again the
  casts run inside the remat.

Run from the repository root::

  python -m benchmarks.residual_recompute                    # a few minutes on 2 cores
  python -m benchmarks.residual_recompute --update-results   # ... into benchmarks/results/
  python -m benchmarks.residual_recompute --quick --out /tmp/rr   # smoke test
"""

from __future__ import annotations

import sys
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jmp_lite
from benchmarks import analysis
from benchmarks import common
from benchmarks import runner
from benchmarks import workloads as wl

COMPUTES = ("bf16", "f16")
VARIANTS = ("policy", "remat norms", "remat loss")
RATIOS = {"ratio_to_policy": {name: (name, "policy") for name in VARIANTS[1:]}}
# The recommendation's thresholds (from the issue): the candidate becomes the
# default if it costs at most this much step time ...
MAX_STEP_TIME_RATIO = 1.03
# ... and saves at least this share of the policy's residual bytes.
MIN_RESIDUAL_SAVING = 0.25


def _remat(fn: Callable[..., Any]) -> Callable[..., Any]:
  return jax.checkpoint(fn, policy=jmp_lite.save_half_residuals)


def _full_precision_classes(rules: Any, full_precision: type) -> tuple[type, ...]:
  """The module classes ``rules`` keep in float32 (``FullPrecision`` entries)."""
  return tuple(c for match, override in rules
               if isinstance(override, full_precision) and isinstance(match, tuple)
               for c in match)


# --- DigitsCNN (linen) ----------------------------------------------------------------


def _linen_remat_interceptor(classes: tuple[type, ...]):
  """A linen interceptor recomputing every module of ``classes`` in the backward.

  Entered outside ``PolicyModel.apply``, it runs before jmp_lite's boundary
  interceptor: it calls the module again through Flax's lifted
  ``nn.checkpoint``, and that inner call (let through here) reaches jmp_lite's
  boundary, whose casts are therefore inside the remat.
  """
  import flax.linen as nn  # pylint: disable=import-outside-toplevel

  inside: set[tuple[str, ...]] = set()

  def intercept(next_fun, args, kwargs, context):
    module, path = context.module, tuple(context.module.path)
    if (context.method_name != "__call__" or not isinstance(module, classes)
        or path in inside):
      return next_fun(*args, **kwargs)

    def run(m, *a, **k):
      inside.add(path)
      try:
        return m(*a, **k)
      finally:
        inside.discard(path)

    return nn.checkpoint(run, policy=jmp_lite.save_half_residuals)(
        module, *args, **kwargs)

  return intercept


def digits_cnn(compute: str, quick: bool, seed: int) -> dict[str, Any]:
  """Losses, params, state and batch of DigitsCNN under each variant."""
  import flax.linen as nn  # pylint: disable=import-outside-toplevel
  import jmp_lite.linen as jlinen  # pylint: disable=import-outside-toplevel
  from models.flax_models import DigitsCNN  # pylint: disable=import-outside-toplevel

  batch_size = 4 if quick else 64
  key_x, key_init = jax.random.split(jax.random.PRNGKey(seed))
  batch = {"x": jax.random.normal(key_x, (batch_size, 8, 8, 1), jnp.float32),
           "y": jnp.arange(batch_size, dtype=jnp.int32) % 10}
  classes = _full_precision_classes(jlinen.DEFAULT_MODULE_RULES, jlinen.FullPrecision)
  models = {"f32": jlinen.apply_policy(DigitsCNN(), "p=f32,c=f32,o=f32"),
            "policy": jlinen.apply_policy(DigitsCNN(), f"p=f32,c={compute},o=f32")}
  variables = models["policy"].init(key_init, batch["x"])

  def make_loss(model, remat_norms: bool):
    def loss_fn(params, stats, batch):
      def run():
        return model.apply({"params": params, "batch_stats": stats}, batch["x"],
                           train=True, mutable=["batch_stats"])
      if remat_norms:
        with nn.intercept_methods(_linen_remat_interceptor(classes)):
          logits, updates = run()
      else:
        logits, updates = run()
      return wl.cross_entropy(logits, batch["y"]), updates["batch_stats"]
    return loss_fn

  losses = {
      "f32": make_loss(models["f32"], False),
      "policy": make_loss(models["policy"], False),
      "remat norms": make_loss(models["policy"], True),
  }
  losses["remat loss"] = _remat(losses["policy"])
  return {"description": f"DigitsCNN (linen), batch {batch_size} of 8x8x1",
          "losses": losses,
          "params": {name: variables["params"] for name in losses},
          "exclude": {name: () for name in losses},
          "stats": variables["batch_stats"], "batch": batch,
          "rematted": sorted(c.__name__ for c in classes)}


# --- CharLM (NNX) ------------------------------------------------------------------


def _nnx_remat_norms(module: Any, classes: tuple[type, ...]) -> Any:
  """Replaces every module of ``classes`` inside ``module`` by a remat wrapper."""
  from flax import nnx  # pylint: disable=import-outside-toplevel

  class RematNorm(nnx.Module):
    """Calls the held module under nnx.remat(policy=save_half_residuals)."""

    def __init__(self, norm):
      self.norm = norm

    def __call__(self, x):
      return nnx.remat(lambda norm, x: norm(x),
                       policy=jmp_lite.save_half_residuals)(self.norm, x)

  for _, parent in list(nnx.iter_modules(module)):
    for name, child in list(vars(parent).items()):
      if isinstance(child, classes):
        setattr(parent, name, RematNorm(child))
  return module


def char_lm(compute: str, quick: bool, seed: int) -> dict[str, Any]:
  """Losses, params, state and batch of CharLM under each variant."""
  from flax import nnx  # pylint: disable=import-outside-toplevel
  import jmp_lite.nnx as jnnx  # pylint: disable=import-outside-toplevel
  from models.flax_models import CharLM  # pylint: disable=import-outside-toplevel

  kwargs, seq, batch_size = (dict(d_model=16, num_heads=2, num_layers=1), 8, 2) if quick \
      else (dict(d_model=128, num_heads=4, num_layers=2), 128, 16)
  tokens = jax.random.randint(jax.random.PRNGKey(seed), (batch_size, seq + 1), 0, 256,
                              jnp.int32)
  classes = _full_precision_classes(jnnx.DEFAULT_MODULE_RULES, jnnx.FullPrecision)

  def make_loss(spec: str, remat_norms: bool):
    module = CharLM(256, max_len=seq, rngs=nnx.Rngs(seed), **kwargs)
    if remat_norms:
      _nnx_remat_norms(module, classes)
    graphdef, params, rest = nnx.split(jnnx.apply_policy(module, spec), nnx.Param, ...)

    def loss_fn(p, stats, batch):
      logits = nnx.merge(graphdef, p, rest)(batch["tokens"][:, :-1])
      return wl.cross_entropy(logits, batch["tokens"][:, 1:]), stats

    return loss_fn, params, rest

  policy = f"p=f32,c={compute},o=f32"
  losses, params, rest = {}, {}, {}
  for name, spec, remat_norms in (("f32", "p=f32,c=f32,o=f32", False),
                                  ("policy", policy, False),
                                  ("remat norms", policy, True)):
    losses[name], params[name], rest[name] = make_loss(spec, remat_norms)
  losses["remat loss"] = _remat(losses["policy"])
  params["remat loss"], rest["remat loss"] = params["policy"], rest["policy"]
  desc = (f"CharLM (nnx) {kwargs['num_layers']} layers x {kwargs['d_model']}, "
          f"{seq} tokens, batch {batch_size}")
  # The same seed gives every variant the same param values; the remat
  # wrapper nests each norm's params one level down ("norm").
  return {"description": desc, "losses": losses, "params": params,
          "exclude": rest, "stats": {}, "batch": {"tokens": tokens},
          "rematted": sorted(c.__name__ for c in classes)}


MODELS = {"DigitsCNN": digits_cnn, "CharLM": char_lm}


# --- measurements -------------------------------------------------------------------


def residuals(model: dict[str, Any]) -> dict[str, Any]:
  out = {}
  for name, loss in model["losses"].items():
    fn = lambda p, loss=loss: loss(p, model["stats"], model["batch"])[0]  # noqa: E731
    out[name] = analysis.residual_bytes(
        fn, model["params"][name],
        (model["batch"], model["stats"], model["exclude"][name]))
  base = out["f32"]
  for r in out.values():
    r["ratio_vs_f32"] = r["bytes"] / base["bytes"]
    r["activation_ratio_vs_f32"] = r["activation_bytes"] / base["activation_bytes"]
  for r in out.values():
    r["ratio_vs_policy"] = r["bytes"] / out["policy"]["bytes"]
  return out


def make_check(model: dict[str, Any]):
  """The criterion: relative L2 distances between the variants' gradients
  (all leaves), ``<variant> vs policy`` for the two remat variants next to
  ``policy vs f32``, the difference mixed precision itself makes.
  Recomputation may change the rounding (XLA fuses the recomputed float32 ops
  differently), never by more than that. Then two warm-up steps."""

  def check(fns, states, batch):
    grads = {}
    for name in ("f32",) + VARIANTS:
      fn = lambda p, loss=model["losses"][name]: loss(p, model["stats"], batch)[0]  # noqa: E731
      leaves = jax.tree.leaves(jax.jit(jax.grad(fn))(model["params"][name]))
      grads[name] = np.concatenate([np.ravel(np.asarray(x, np.float64)) for x in leaves])
    dist = lambda a, b: float(np.linalg.norm(grads[a] - grads[b]) / np.linalg.norm(grads[b]))  # noqa: E731
    distances = {f"{name} vs policy": dist(name, "policy") for name in VARIANTS[1:]}
    distances["policy vs f32"] = dist("policy", "f32")
    states, _ = runner.run_all(fns, states, batch, 2)
    return states, {"distances": distances, "same": all(
        distances[f"{name} vs policy"] <= distances["policy vs f32"] for name in VARIANTS[1:])}

  return check


def make_step(loss_fn, opt) -> common.Step:
  """A full train step; state ``(params, opt_state, batch_stats)``."""

  def step(state, batch):
    params, opt_state, stats = state
    (loss, new_stats), grads = jmp_lite.scaled_value_and_grad(
        loss_fn, opt_state, has_aux=True)(params, stats, batch)
    updates, opt_state = opt.update(grads, opt_state, params)
    return (optax.apply_updates(params, updates), opt_state, new_stats), loss

  return step


def measure(model_compute: tuple[str, str], args) -> dict[str, Any]:
  name, compute = model_compute
  model = MODELS[name](compute, args.quick, args.seed)
  res = residuals(model)
  print(f"[{name} {compute}] residual MB: "
        + ", ".join(f"{k} {v['bytes'] / 2**20:.2f} ({v['ratio_vs_f32']:.3f}x f32)"
                    for k, v in res.items()), flush=True)
  scale = (jmp_lite.DynamicLossScale(common.INITIAL_SCALE) if compute == "f16"
           else jmp_lite.NoOpLossScale())
  opt = jmp_lite.loss_scaling(optax.adam(common.LEARNING_RATE), scale)
  states = {v: common.fresh_copy((model["params"][v], opt.init(model["params"][v]),
                                  model["stats"])) for v in VARIANTS}
  timing = runner.measure(
      f"{name}-{compute}", {v: make_step(model["losses"][v], opt) for v in VARIANTS},
      states, model["batch"], runner.Timing.from_args(args),
      check=make_check(model), ratios=RATIOS)
  return {"workload": f"{name}-{compute}", "model": name, "compute": compute,
          "policy": str(wl.policy(compute)), "description": model["description"],
          "rematted_classes": model["rematted"], "residuals": res, **timing}


def recommendation(results: list[dict[str, Any]], args=None) -> dict[str, Any]:
  """Applies the thresholds to the candidate, per model and compute dtype."""
  del args
  rows = []
  for r in results:
    saving = 1.0 - r["residuals"]["remat norms"]["ratio_vs_policy"]
    ratio = r["ratio_to_policy"]["remat norms"]["median"]
    rows.append({"model": r["model"], "compute": r["compute"],
                 "residual_saving": saving, "step_time_ratio": ratio,
                 "meets": bool(saving >= MIN_RESIDUAL_SAVING
                               and ratio <= MAX_STEP_TIME_RATIO)})
  return {"recommendation": {"thresholds": {"max_step_time_ratio": MAX_STEP_TIME_RATIO,
                         "min_residual_saving": MIN_RESIDUAL_SAVING},
          "rows": rows, "all_meet": all(row["meets"] for row in rows)}}


def _saving(report: dict[str, Any], model: str) -> str:
  """The candidate's residual saving for ``model`` (first compute dtype)."""
  for row in report["recommendation"]["rows"]:
    if row["model"] == model:
      return f"{row['residual_saving']:.0%}"
  return "(not measured)"


def table(report: dict[str, Any]) -> list[str]:
  mb = lambda b: f"{b / 2**20:.2f}"  # noqa: E731
  lines = [
      "Variants, all with `jmp_lite.linen`/`jmp_lite.nnx.apply_policy` and the "
      "default rules (norm layers `FullPrecision`): **policy** as is; **remat "
      "norms** (the candidate default): every norm module's boundary (cast to "
      "float32, norm, cast back) under `jax.checkpoint(policy="
      "save_half_residuals)` (linen: Flax's lifted `nn.checkpoint` through an "
      "interceptor that runs before jmp_lite's; NNX: `nnx.remat` around the "
      "slot holding the norm; see the script's docstring); **remat loss**: "
      "the whole loss under `jax.checkpoint(loss, policy=save_half_residuals)`.",
      "",
      "## Residual bytes (saved for the backward pass)",
      "",
      "`benchmarks.analysis.residual_bytes` (as in `cpu.md`): arrays the VJP "
      "keeps, excluding the params, the batch and the batch statistics; "
      "activations = all minus the half-precision param copies.",
      "",
      "| model | policy | f32 MB | policy MB | remat norms MB | remat loss MB "
      "| policy / f32 | remat norms / f32 | remat loss / f32 "
      "| activations: policy / remat norms / remat loss (x f32) "
      "| remat norms / policy |",
      "|---|---|---:|---:|---:|---:|---:|---:|---:|---|---:|",
  ]
  for r in report["results"]:
    res = r["residuals"]
    lines.append(
        f"| {r['description']} | `{r['policy']}` | {mb(res['f32']['bytes'])} "
        f"| {mb(res['policy']['bytes'])} | {mb(res['remat norms']['bytes'])} "
        f"| {mb(res['remat loss']['bytes'])} | {res['policy']['ratio_vs_f32']:.3f} "
        f"| {res['remat norms']['ratio_vs_f32']:.3f} "
        f"| {res['remat loss']['ratio_vs_f32']:.3f} "
        f"| {res['policy']['activation_ratio_vs_f32']:.3f} / "
        f"{res['remat norms']['activation_ratio_vs_f32']:.3f} / "
        f"{res['remat loss']['activation_ratio_vs_f32']:.3f} "
        f"| {res['remat norms']['ratio_vs_policy']:.3f} |")
  lines += [
      "",
      "## Step time (full jitted train step)",
      "",
      f"Forward, backward, `loss_scaling(adam({common.LEARNING_RATE:g}))` "
      f"(`DynamicLossScale({common.INITIAL_SCALE:g})` for f16, `NoOpLossScale` for "
      "bf16), batch statistics carried in the state; state donated, compiled "
      "ahead of time. " + runner.method(report["config"], "to `policy`"),
      "",
      "| model | policy | policy ms | remat norms ms | remat loss ms "
      "| remat norms / policy | remat loss / policy | CPU-time ratios (norms, loss) "
      "| grad rel. L2 distance: norms vs policy, loss vs policy, policy vs f32 |",
      "|---|---|---:|---:|---:|---:|---:|---|---|",
  ]
  for r in report["results"]:
    t, g = r["step_time_s"], r["check"]["distances"]
    ratios, cpu = r["ratio_to_policy"], r["cpu_ratio_to_policy"]
    lines.append(
        f"| {r['description']} | `{r['policy']}` "
        + "".join(f"| {t[v]['median'] * 1e3:.2f} " for v in VARIANTS)
        + "".join(f"| {runner.ratio_cell(ratios[v])} " for v in VARIANTS[1:])
        + f"| {cpu['remat norms']['median']:.3f}, {cpu['remat loss']['median']:.3f} "
        f"| {g['remat norms vs policy']:.1e}, {g['remat loss vs policy']:.1e}, "
        f"{g['policy vs f32']:.1e} |")
  rec = report["recommendation"]
  lines += [
      "",
      "## Against the thresholds",
      "",
      f"Candidate default if it saves >= {MIN_RESIDUAL_SAVING:.0%} of the "
      f"policy's residual bytes at a step-time ratio <= {MAX_STEP_TIME_RATIO}:",
      "",
      "| model | compute | residual saving | step-time ratio | meets both |",
      "|---|---|---:|---:|:---:|",
  ]
  for row in rec["rows"]:
    lines.append(f"| {row['model']} | {row['compute']} | {row['residual_saving']:.1%} "
                 f"| {row['step_time_ratio']:.3f} | {runner.yes_no(row['meets'])} |")
  lines += [
      "",
      "What the norm regions can and cannot save. DigitsCNN's float32 "
      "residuals are almost all BatchNorm's, so recomputing them removes "
      f"{_saving(report, 'DigitsCNN')} of the policy's residual bytes. In "
      "CharLM most float32 residuals are "
      "not in a norm module: the attention softmax of `causal_attention` "
      "(float32, `(batch, heads, T, T)`) and the float32 logits of the loss "
      "stay. Also, CharLM's residual stream is float32 under the policy: "
      "`nnx.Embed` fixes its `dtype` to its embedding's (float32) when it is "
      "built, so the embeddings, the residual additions and the inputs of "
      "every LayerNorm stay float32, and a recomputed norm region starts from "
      "(and saves) a float32 input.",
      "",
      "CPU caveat: XLA:CPU has no native float16/bfloat16 arithmetic (it "
      "converts to float32), which makes the matmuls relatively slow and the "
      "recomputed element-wise work relatively cheap. On a GPU, where matmuls "
      "run on tensor cores, the same recomputation can be a larger share of "
      "the step; not measured (no GPU). Full figures: "
      "`residual_recompute.json`.",
      "",
  ]
  return lines


def _add_flags(parser) -> None:
  parser.add_argument("--models", default=",".join(MODELS),
                      help=f"comma-separated subset of {','.join(MODELS)} (default all)")


STUDY = runner.Study(
    name="residual_recompute",
    title="Recomputing the float32 norm regions: residual bytes and step time",
    description="Residual bytes and step time of recomputing jmp_lite's float32 "
                "norm regions for the Flax example models.",
    workloads=lambda args: [(m, c) for m in args.models for c in args.computes],
    measure=measure, table=table, repeats=(21, 3), block_s=0.2, computes=COMPUTES,
    add_flags=_add_flags,
    finish_flags=lambda parser, args: setattr(
        args, "models", runner.split_choices(parser, "--models", args.models, MODELS)),
    config=lambda args: {"models": args.models, "variants": list(VARIANTS)},
    summary=recommendation)


def main(argv: list[str] | None = None) -> int:
  return runner.main(STUDY, argv)


if __name__ == "__main__":
  sys.exit(main())
