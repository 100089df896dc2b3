"""Test configuration.

* 8 simulated CPU devices, so pmap/shard_map/NamedSharding tests run anywhere.
  This must happen before jax initialises its backend, hence at import time.
* XLA:CPU compiles with its cheap passes only: the suite compiles thousands of
  small programs and runs each a few times, so compile time dominates. The
  flags change speed, not results (tests assert behaviour, never timing), and
  subprocesses the tests start inherit them.
* Strict dtype promotion for every test: jmp_lite must never rely on implicit
  promotion. Tests that run optax code which is not strict-clean (adam raises
  ``float ** int32`` under strict) mark themselves ``standard_promotion``.
"""

import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    " --xla_llvm_disable_expensive_passes=true --xla_backend_optimization_level=0"
).strip()

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
