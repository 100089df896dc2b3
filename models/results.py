"""Where the examples and the benchmarks write their results, and how.

The one copy of the output plumbing both share (neither imports the other):

* :class:`Outputs`: the ``--out DIR`` / ``--update-results`` flags and the
  folder they choose: a scratch folder under the system temporary folder by
  default (:func:`scratch_dir`), the committed results only when asked, so
  that running a script leaves the clone unchanged.
* :func:`to_json`, :func:`write_json`: readable, strictly valid JSON.
* :func:`machine_info`, :func:`machine_line`: the machine and the library
  versions a figure was measured with.
* :func:`command_line`, :func:`utc_now`: the command and date a page names.

Example:
  >>> import argparse, pathlib
  >>> outputs = Outputs(committed=pathlib.Path("results"), scratch=scratch_dir("demo"))
  >>> parser = argparse.ArgumentParser()
  >>> outputs.add_args(parser)
  >>> str(outputs.folder(parser.parse_args(["--update-results"]), create=False))
  'results'
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import math
import os
import pathlib
import platform
import re
import shlex
import tempfile
from typing import Any, Sequence

#: The folder under the system temporary folder that holds every scratch
#: folder. "jmp-lite", never "jmp_lite": a folder named like the package in
#: the temporary folder would shadow it (as a namespace package) for any
#: script run from there.
SCRATCH_ROOT = "jmp-lite"
#: Significant digits of the floats :func:`to_json` writes.
JSON_DIGITS = 6


def scratch_dir(kind: str) -> pathlib.Path:
  """``<system temporary folder>/jmp-lite/<kind>`` (not created)."""
  return pathlib.Path(tempfile.gettempdir()) / SCRATCH_ROOT / kind


@dataclasses.dataclass(frozen=True)
class Outputs:
  """The committed results folder of a set of scripts and their scratch folder.

  Attributes:
    committed: where ``--update-results`` writes (e.g. ``examples/results``).
    scratch: where results go by default.
  """

  committed: pathlib.Path
  scratch: pathlib.Path

  def add_args(self, parser) -> None:
    """Adds ``--out DIR`` and ``--update-results`` (mutually exclusive)."""
    group = parser.add_mutually_exclusive_group()
    group.add_argument(
        "--out", type=pathlib.Path, default=None,
        help=f"output folder (default: {self.scratch}, a scratch folder)")
    group.add_argument(
        "--update-results", action="store_true",
        help=f"write into {self.committed.parent.name}/{self.committed.name}/, "
        "replacing the committed results")

  def folder(self, args, create: bool = True) -> pathlib.Path:
    """The folder :meth:`add_args`'s flags chose (created unless ``create=False``)."""
    out = self.committed if args.update_results else pathlib.Path(args.out or self.scratch)
    if create:
      out.mkdir(parents=True, exist_ok=True)
    return out


def to_json(data: Any, digits: int = JSON_DIGITS) -> str:
  """Serialises ``data`` as readable, strictly valid JSON.

  Floats keep ``digits`` significant digits, non-finite floats become
  ``null``, and each list of numbers (per-step histories, per-block times) is
  written on one line.
  """

  def clean(x):
    if isinstance(x, dict):
      return {k: clean(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
      return [clean(v) for v in x]
    if isinstance(x, float):
      return float(f"{x:.{digits}g}") if math.isfinite(x) else None
    return x

  text = json.dumps(clean(data), indent=1, allow_nan=False)
  flat_list = r"\[[^\[\]{}\"]*\]"  # A list holding no list, dict or string.
  return re.sub(flat_list, lambda m: " ".join(m.group().split()), text)


def write_json(path: str | os.PathLike, data: Any) -> None:
  """Writes ``data`` to ``path`` as :func:`to_json`, ending in a newline."""
  pathlib.Path(path).write_text(to_json(data) + "\n")


def machine_info() -> dict[str, Any]:
  """The machine, the device JAX uses and the versions of the libraries."""
  import jax  # pylint: disable=import-outside-toplevel
  import jaxlib  # pylint: disable=import-outside-toplevel
  import numpy as np  # pylint: disable=import-outside-toplevel
  import optax  # pylint: disable=import-outside-toplevel
  import jmp_lite  # pylint: disable=import-outside-toplevel

  return {
      "platform": platform.platform(),
      "machine": platform.machine(),
      "processor": platform.processor(),
      "cpu_count": os.cpu_count(),
      "python": platform.python_version(),
      "jax": jax.__version__,
      "jaxlib": jaxlib.__version__,
      "optax": optax.__version__,
      "numpy": np.__version__,
      "jmp_lite": jmp_lite.__version__,
      "backend": jax.default_backend(),
      "device_kind": jax.devices()[0].device_kind,
      "device_count": jax.device_count(),
      "xla_flags": os.environ.get("XLA_FLAGS", ""),
  }


def machine_line(machine: dict[str, Any]) -> str:
  """One markdown sentence naming the machine and the library versions."""
  return (
      f"Machine: {machine['device_kind']} ({machine['backend']} backend, "
      f"{machine['device_count']} device(s)), {machine['cpu_count']} CPU cores, "
      f"{machine['platform']}; Python {machine['python']}, jax {machine['jax']}, "
      f"jaxlib {machine['jaxlib']}, optax {machine['optax']}, "
      f"jmp_lite {machine['jmp_lite']}."
  )


def command_line(module: str, argv: Sequence[str]) -> str:
  """``python -m <module> <argv>``, quoted for a shell."""
  return shlex.join(["python", "-m", module, *map(str, argv)])


def utc_now() -> str:
  """The date and time, to the minute, in UTC."""
  return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
