"""Bytes on the wire per training step: the collectives of the compiled
programs on 8 simulated CPU devices (or the GPUs of a machine: the GPU
suite's collectives row), plain against jmp_lite's low-precision
collectives (issue 39).

No time is measured: the figures are read from the programs XLA:CPU
compiles (``jax.jit(...).lower(...).compile().as_text()``), each collective
with its element type and size. Three settings:

* **data-parallel gradient reduction** of an MLP LM-sized stack of dense
  layers under ``jax.shard_map``: ``jax.lax.pmean`` of the float32
  gradients (plain) against ``jmp_lite.pmean_value_and_grad`` with each
  ``wire_format`` (``float32``, ``bfloat16``, ``e4m3``);
* **MoE dispatch**: the tokens' all-to-all to the experts' devices,
  ``jax.lax.all_to_all`` of bfloat16 tokens (plain; and moved as its
  ``uint16`` bits, bfloat16's own width) against
  ``jmp_lite.fp8.all_to_all`` per recipe (values and scales); and the
  gradient of a loss of it (``jax.grad``: the cotangent's all-to-all);
* **FSDP** (weights sharded over the 8 devices, ``jax.jit``): the weight
  all-gathers of a two-layer step in bfloat16 against the float8 policy
  ``m=fp8`` as XLA partitions it by itself (it gathers the quantized weight;
  XLA:CPU widens a float8 all-gather to float16, which the table shows) and
  with ``Fp8Config.fsdp_axis`` (issue 39 item 1: the quantized shard's
  values gathered as ``uint8``, 1 byte per element; the output head stays
  in bfloat16 by default, so the last row puts it in float8 too). The
  remaining wide collectives of those rows are not weight gathers: the
  float32 weight gradients' all-reduces (XLA:CPU does not turn them into
  reduce-scatters) and, with the bfloat16 head, the activations;
* **FSDP under shard_map** (the weight arrives as each device's shard and
  the step gathers it): ``jax.lax.all_gather`` of the bfloat16 shard before
  a bfloat16 matmul (plain) against ``fp8.dot_general`` and
  ``int8.dot_general`` with ``fsdp_axis`` (the quantized shard's bits
  gathered inside the matmul, its gradient reduce-scattered in float32).

Per collective: the payload (the bytes of its operand, for an all-gather its
result) and an estimate of what each device sends: ``(n-1)/n`` of the
payload for an all-gather, all-to-all or reduce-scatter, ``2 (n-1)/n`` for
an all-reduce (a ring). Run from the repository root::

  python -m benchmarks.collective_bytes                   # ~1 min
  python -m benchmarks.collective_bytes --update-results  # into benchmarks/results/
  python -m benchmarks.collective_bytes --quick --out /tmp/cb
  python -m benchmarks.collective_bytes --devices 4 --out /tmp/cb  # e.g. 4 GPUs

On a machine with GPUs the programs are XLA:GPU's (``--devices``: how many,
2, 4 or 8; the GPU suite runs this with its machine's GPUs).
"""

from __future__ import annotations

import os

DEVICES = 8
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
  # Before jax initialises its backend.
  os.environ["XLA_FLAGS"] = (
      os.environ.get("XLA_FLAGS", "")
      + f" --xla_force_host_platform_device_count={DEVICES}").strip()

import argparse  # noqa: E402
import re  # noqa: E402
import sys  # noqa: E402
from typing import Any, Sequence  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import Mesh  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks import common  # noqa: E402
from benchmarks import runner  # noqa: E402
import jmp_lite  # noqa: E402
from jmp_lite import fp8  # noqa: E402
from jmp_lite._src.low_precision import recipes  # noqa: E402

NAME = "collective_bytes"
TITLE = ("Bytes on the wire per step: plain collectives against jmp_lite's "
         "low-precision ones (8 CPU devices, issue 39)")
SIZES = {
    False: {"layers": 4, "width": 1024, "batch": 64, "tokens": 4096,
            "model": 1024},
    True: {"layers": 2, "width": 64, "batch": 16, "tokens": 256, "model": 128},
}
#: pmean_value_and_grad's wire formats.
WIRE_FORMATS = ("float32", "bfloat16", "e4m3")
#: Bytes per element of the HLO element types that occur.
_WIDTH = {"f64": 8, "s64": 8, "u64": 8, "f32": 4, "s32": 4, "u32": 4,
          "bf16": 2, "f16": 2, "s16": 2, "u16": 2, "s8": 1, "u8": 1,
          "f8e4m3fn": 1, "f8e5m2": 1, "f8e8m0fnu": 1, "pred": 1}
_COLLECTIVE = re.compile(
    r"= (\(.*?\)|[a-z0-9]+\[[0-9,]*\]\S*) "
    r"(all-reduce|all-gather|all-to-all|reduce-scatter)\(")
_ARRAY = re.compile(r"([a-z0-9]+)\[([0-9,]*)\]")


def collectives(hlo: str, n: int = DEVICES) -> list[dict[str, Any]]:
  """Every collective of a compiled HLO text: op, element types, payload
  bytes and the bytes each device sends (see the module docstring)."""
  out = []
  for m in _COLLECTIVE.finditer(hlo):
    arrays = _ARRAY.findall(m.group(1))
    payload = sum(_WIDTH[t] * int(np.prod([int(d) for d in s.split(",") if d]))
                  for t, s in arrays)
    factor = 2 * (n - 1) / n if m.group(2) == "all-reduce" else (n - 1) / n
    out.append({"op": m.group(2),
                "types": sorted({t for t, _ in arrays}),
                "payload_bytes": payload,
                "sent_bytes": payload * factor})
  return out


def _compiled(fn, *args) -> str:
  return jax.jit(fn).lower(*args).compile().as_text()


#: The devices the programs run on (``--devices``; set by :func:`main`).
_DEVICES = [DEVICES]


def _mesh() -> Mesh:
  return Mesh(np.array(jax.devices()[:_DEVICES[0]]), ("d",))


def gradient_programs(size) -> dict[str, str]:
  """Data-parallel steps under shard_map: plain pmean and each wire format."""
  width, layers = size["width"], size["layers"]
  keys = jax.random.split(jax.random.key(0), layers)
  params = [jax.random.normal(k, (width, width), jnp.float32) / width**0.5
            for k in keys]
  batch = jnp.ones((size["batch"], width), jnp.float32)

  def loss(ws, x):
    for w in ws:
      x = jnp.tanh(x @ w)
    return jnp.mean(x**2)

  def plain(ws, x):
    value, grads = jax.value_and_grad(loss)(
        [jax.lax.pcast(w, "d", to="varying") for w in ws], x)
    return jax.lax.pmean(value, "d"), jax.lax.pmean(grads, "d")

  programs = {"plain (lax.pmean, float32)": plain}
  for wire in WIRE_FORMATS:
    programs[f"pmean_value_and_grad({wire})"] = (
        jmp_lite.pmean_value_and_grad(jax.value_and_grad(loss), "d",
                                      wire_format=wire))
  return {name: _compiled(jax.shard_map(fn, mesh=_mesh(),
                                        in_specs=(P(), P("d")),
                                        out_specs=P()), params, batch)
          for name, fn in programs.items()}


def dispatch_programs(size, gradient: bool) -> dict[str, str]:
  """An MoE dispatch, its forward (``gradient=False``) or the gradient of
  a loss of it: plain bf16 all_to_all and fp8.all_to_all per recipe."""
  tokens = jnp.ones((size["tokens"], size["model"]), jnp.bfloat16)
  weights = jnp.arange(size["model"], dtype=jnp.float32)
  plain = lambda t: jax.lax.all_to_all(t, "d", 0, 0, tiled=True)
  moves = {"plain (lax.all_to_all, bfloat16)": plain}
  if not gradient:   # (integer bits have no gradient)
    # The same at bfloat16's own width (XLA:CPU widens the plain one).
    moves["plain, bfloat16 moved as its bits (u16)"] = (
        lambda t: jmp_lite._src.parallel.moved_as_bits(t, plain))  # pylint: disable=protected-access
  for recipe in ("fp8_blockwise", "mxfp8", "fp8_rowwise"):
    config = recipes.from_spec(recipe)
    moves[f"fp8.all_to_all({recipe})"] = (
        lambda t, c=config: fp8.all_to_all(t, "d", 0, 0, tiled=True,
                                               config=c))
  out = {}
  for name, move in moves.items():
    mapped = jax.shard_map(move, mesh=_mesh(), in_specs=P("d"),
                           out_specs=P("d"))
    step = (jax.grad(lambda t, m=mapped: jnp.sum(
        m(t).astype(jnp.float32) * weights)) if gradient else mapped)
    out[name] = _compiled(step, tokens)
  return out


def fsdp_programs(size) -> dict[str, str]:
  """FSDP under jax.jit: weights and batch sharded over the devices."""
  width = size["width"]
  sharded = NamedSharding(_mesh(), P("d", None))
  params = jax.device_put({"w1": jnp.ones((width, width)),
                           "w2": jnp.ones((width, width))}, sharded)
  batch = jax.device_put(jnp.ones((size["batch"], width)), sharded)

  def loss(p, x):
    return jnp.mean((jnp.tanh(x @ p["w1"]) @ p["w2"]) ** 2)

  out = {}
  for name, policy in (
      ("bfloat16 (mixed_bfloat16)", "mixed_bfloat16"),
      ("float8 (m=fp8, XLA's partitioning)", "p=f32,c=bf16,o=f32,m=fp8"),
      ("float8 (m=fp8(fsdp_axis=d))", "p=f32,c=bf16,o=f32,m=fp8(fsdp_axis=d)"),
      ("float8, head too (m=fp8(fsdp_axis=d;include_output_head=true))",
       "p=f32,c=bf16,o=f32,m=fp8(fsdp_axis=d;include_output_head=true)")):
    with jax.set_mesh(_mesh()):   # fsdp_axis reads the mesh set here
      out[name] = _compiled(jax.grad(jmp_lite.with_policy(loss, policy)),
                            params, batch)
  return out


def shard_map_fsdp_programs(size) -> dict[str, str]:
  """FSDP under shard_map: each device's shard of a weight, gathered by
  hand in bfloat16 (plain) or by the float8/int8 matmul (fsdp_axis)."""
  width = size["width"]
  w = jnp.ones((width, width), jnp.float32)
  batch = jnp.ones((size["batch"], width), jnp.float32)
  dn = (((1,), (0,)), ((), ()))

  def plain(w, x):
    whole = jax.lax.all_gather(w.astype(jnp.bfloat16), "d", tiled=True)
    return jnp.mean(jax.lax.dot_general(x.astype(jnp.bfloat16), whole, dn,
                                        preferred_element_type=jnp.float32)
                    ** 2)

  def quantized(dot, config):
    return lambda w, x: jnp.mean(
        dot(x.astype(jnp.bfloat16), w.astype(jnp.bfloat16), dn,
            preferred_element_type=jnp.float32, config=config) ** 2)

  from jmp_lite import int8  # pylint: disable=import-outside-toplevel
  losses = {
      "bfloat16 (lax.all_gather, then the matmul)": plain,
      "float8 (fp8.dot_general, fsdp_axis=d)": quantized(
          fp8.dot_general, fp8.Fp8Config(fsdp_axis="d")),
      "int8 (int8.dot_general, fsdp_axis=d)": quantized(
          int8.dot_general, int8.Int8Config(fsdp_axis="d")),
  }
  out = {}
  for name, loss in losses.items():
    step = jax.shard_map(jax.grad(loss), mesh=_mesh(),
                         in_specs=(P("d", None), P("d")),
                         out_specs=P("d", None))
    with jax.set_mesh(_mesh()):
      out[name] = _compiled(step, w, batch)
  return out


def measure_all(args) -> dict[str, Any]:
  size = SIZES[args.quick]
  n = _DEVICES[0]
  rows = []
  for setting, programs in (("gradient reduction", gradient_programs(size)),
                            ("MoE dispatch", dispatch_programs(size, False)),
                            ("MoE dispatch, gradient",
                             dispatch_programs(size, True)),
                            ("FSDP", fsdp_programs(size)),
                            ("FSDP under shard_map",
                             shard_map_fsdp_programs(size))):
    for name, hlo in programs.items():
      found = collectives(hlo, n)
      rows.append({"setting": setting, "program": name, "collectives": found,
                   "payload_bytes": sum(c["payload_bytes"] for c in found),
                   "sent_bytes": sum(c["sent_bytes"] for c in found)})
  for setting in {r["setting"] for r in rows}:
    group = [r for r in rows if r["setting"] == setting]
    base = group[0]["sent_bytes"]
    for r in group:
      r["sent_ratio"] = r["sent_bytes"] / base if base else None
  return {"results": rows, "devices": n,
          "platform": jax.devices()[0].platform}


def _kinds(found: list[dict[str, Any]]) -> str:
  counts: dict[tuple[str, str], int] = {}
  for c in found:
    key = (c["op"], "+".join(c["types"]))
    counts[key] = counts.get(key, 0) + 1
  return ", ".join(f"{n} {op} {types}" for (op, types), n in sorted(counts.items()))


def table(report: dict[str, Any]) -> list[str]:
  size = report["config"]["size"]
  n = report.get("devices", DEVICES)
  platform = {"cpu": "CPU", "gpu": "GPU", "cuda": "GPU"}.get(
      report.get("platform", "cpu"), report.get("platform", "cpu"))
  lines = [
      f"Gradient reduction: {size['layers']} dense layers {size['width']} x "
      f"{size['width']} (float32 params), batch {size['batch']} over "
      f"{n} devices under `jax.shard_map`. MoE dispatch: "
      f"{size['tokens']} bfloat16 tokens of {size['model']} features, tiled "
      f"all-to-all over {n} devices (the forward, and the gradient of a "
      "loss of it: the cotangent's all-to-all). FSDP: two "
      f"{size['width']} x {size['width']} weights sharded over {n} "
      "devices, `jax.jit` of the gradient; the same under `jax.shard_map` "
      "(each device's shard gathered in the step). Bytes per step from the "
      f"compiled {platform} programs; sent: an estimate per device (all-reduce as a ring). "
      "The first row of each setting is the baseline of its ratio.",
      "",
      "| setting | program | collectives (op, element types) | payload bytes | "
      "sent bytes per device | sent / baseline |",
      "|---|---|---|---:|---:|---:|",
  ]
  for r in report["results"]:
    lines.append(
        f"| {r['setting']} | {r['program']} | {_kinds(r['collectives'])} | "
        f"{r['payload_bytes']:,} | {r['sent_bytes']:,.0f} | "
        f"{runner.fmt(r['sent_ratio'], '.3f')} |")
  lines += [
      "",
      "Element types: the low-precision payloads travel as their bits "
      "(`u16` for bfloat16, `u8` for float8, E8M0 and int8), which no "
      "compiler widens"
      + ("; XLA:CPU widens a bfloat16 all-to-all or all-gather to float32 "
         "and a float8 one to float16 (the plain rows, and the FSDP float8 "
         "row's `f16` all-gathers of the quantized weights). A GPU's compiled "
         "program was not read here (no GPU was available)."
         if platform == "CPU" else
         f"; the plain rows show what XLA:{platform} does with bfloat16 and "
         "float8 collectives."),
      "",
  ]
  return lines


def parse(argv: Sequence[str]) -> argparse.Namespace:
  parser = argparse.ArgumentParser(prog=f"python -m benchmarks.{NAME}",
                                   description=TITLE)
  parser.add_argument("--quick", action="store_true",
                      help="tiny sizes: a smoke test, not a measurement")
  parser.add_argument("--devices", type=int, default=DEVICES,
                      choices=(2, 4, 8),
                      help=f"how many devices (default {DEVICES}): the "
                      "simulated CPU devices, or a machine's GPUs")
  common.OUTPUTS.add_args(parser)
  args = parser.parse_args(argv)
  args.out = common.OUTPUTS.folder(args)
  return args


def main(argv: Sequence[str] | None = None) -> int:
  argv = sys.argv[1:] if argv is None else list(argv)
  args = parse(argv)
  if jax.device_count() < args.devices:
    raise SystemExit(
        f"needs {args.devices} devices, found {jax.device_count()} "
        f"({jax.devices()[0].platform}): pass --devices with at most that "
        f"many (XLA_FLAGS: {os.environ.get('XLA_FLAGS')!r}).")
  _DEVICES[0] = args.devices
  config = {"quick": args.quick, "size": SIZES[args.quick],
            "devices": args.devices}
  runner.publish(NAME, f"benchmarks.{NAME}", argv, args.out, config,
                 lambda: measure_all(args),
                 lambda report: "\n".join(runner.header(TITLE, report)
                                          + table(report)))
  return 0


if __name__ == "__main__":
  sys.exit(main())
