"""Test configuration.

* 8 simulated CPU devices, so pmap/shard_map/NamedSharding tests run anywhere.
  This must happen before jax initialises its backend, hence at import time.
* XLA:CPU compiles with its cheap passes only: the suite compiles thousands of
  small programs and runs each a few times, so compile time dominates. Tests
  assert behaviour (within stated tolerances), never timing; subprocesses the
  tests start inherit the flags. Each test process also keeps a persistent
  compilation cache in a temporary folder of its own (removed at the end), so
  an identical program built again by another test (a fresh ``jax.jit`` of the
  same step, the same model in another file) is compiled once per process.
* The collected modules and tests are frozen out of Python's cyclic garbage
  collector, which collects less often: scanning them again and again cost
  about 5% of the suite's time.
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
           "--xla_backend_optimization_level=0",
           # One LLVM module per program: splitting it for parallel codegen
           # costs more CPU than it saves on small programs.
           "--xla_cpu_parallel_codegen_split_count=1"]
  # XLA:CPU's fusion emitters compile slowly (the suite takes 30% less CPU
  # time without them); jaxlib 0.11 removed the flag, and XLA aborts on an
  # unknown flag, so it is set only where it exists.
  jaxlib = tuple(int(p) for p in metadata.version("jaxlib").split(".")[:2])
  if jaxlib < (0, 11):
    flags.append("--xla_cpu_use_fusion_emitters=false")
  return " ".join(flags).strip()


os.environ["XLA_FLAGS"] = _xla_flags()

import gc  # noqa: E402
import shutil  # noqa: E402
import tempfile  # noqa: E402

import jax  # noqa: E402
import pytest  # noqa: E402

import helpers  # noqa: E402

# Set before any test module compiles (jax reads it at its first compile). One
# folder per process: two xdist workers never write to the same file.
_COMPILATION_CACHE = tempfile.mkdtemp(prefix="jmp_lite_tests_xla_cache_")
jax.config.update("jax_compilation_cache_dir", _COMPILATION_CACHE)
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


def pytest_collection_finish(session):
  del session
  gc.collect()
  gc.freeze()
  gc.set_threshold(50_000, 20, 20)


def pytest_unconfigure(config):
  del config
  shutil.rmtree(_COMPILATION_CACHE, ignore_errors=True)


@pytest.fixture
def debug_nans_and_infs():
  """``jax_debug_nans`` and ``jax_debug_infs`` on for the test, restored
  after (``helpers.debug_nans_and_infs``): with ``jax.disable_jit`` every
  intermediate is checked."""
  with helpers.debug_nans_and_infs(True):
    yield


@pytest.fixture(autouse=True)
def _dtype_promotion(request):
  mode = (
      "standard"
      if request.node.get_closest_marker("standard_promotion")
      else "strict"
  )
  with jax.numpy_dtype_promotion(mode):
    yield
