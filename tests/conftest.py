"""Test configuration.

* 8 simulated CPU devices, so pmap/shard_map/NamedSharding tests run anywhere.
  This must happen before jax initialises its backend, hence at import time.
* XLA:CPU compiles with its cheap passes only: the suite compiles thousands of
  small programs and runs each a few times, so compile time dominates. Tests
  assert behaviour (within stated tolerances), never timing; subprocesses the
  tests start inherit the flags.
* Strict dtype promotion for every test: jmp_lite must never rely on implicit
  promotion. Tests that run optax code which is not strict-clean (adam raises
  ``float ** int32`` under strict) mark themselves ``standard_promotion``.
"""

import os

from importlib import metadata


def _xla_flags() -> str:
  flags = [os.environ.get("XLA_FLAGS", ""),
           "--xla_force_host_platform_device_count=8",
           "--xla_llvm_disable_expensive_passes=true",
           "--xla_backend_optimization_level=0"]
  # XLA:CPU's fusion emitters compile slowly (the suite takes 30% less CPU
  # time without them); jaxlib 0.11 removed the flag, and XLA aborts on an
  # unknown flag, so it is set only where it exists.
  jaxlib = tuple(int(p) for p in metadata.version("jaxlib").split(".")[:2])
  if jaxlib < (0, 11):
    flags.append("--xla_cpu_use_fusion_emitters=false")
  return " ".join(flags).strip()


os.environ["XLA_FLAGS"] = _xla_flags()

import jax  # noqa: E402
import pytest  # noqa: E402


@pytest.fixture(autouse=True)
def _dtype_promotion(request):
  mode = (
      "standard"
      if request.node.get_closest_marker("standard_promotion")
      else "strict"
  )
  with jax.numpy_dtype_promotion(mode):
    yield
