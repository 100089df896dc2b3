"""Smoke tests: the benchmarks run and write well-formed results.

Benchmarks report figures; these tests only check that the scripts run end to
end at tiny sizes (``python -m benchmarks.<study> --quick``, ``python -m
benchmarks run --suite cpu --quick``), that their JSON has the documented
shape, and that the runner every study shares refuses bad flags and stops a
study whose variants do not compute the same thing. They assert nothing about
speed or ratios. The GPU suite's tests are in ``test_gpu_suite.py``;
``accumulation_overhead`` runs in ``test_training_loops.py``.
"""

import collections
import json
import math
import re
import subprocess
import sys

import jax
import pytest

from helpers import example_env
from helpers import ROOT

#: end-to-end benchmark runs: the slow stage (pytest -m slow).
pytestmark = pytest.mark.slow

VARIANTS = ("jmp_lite", "hand", "unguarded", "unchecked")
WRAPPER_RATIOS = ("ratio_a_over_b", "a_over_unguarded", "a_over_unchecked")


def _positive_finite(x):
  return isinstance(x, float) and math.isfinite(x) and x > 0


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
  out = tmp_path_factory.mktemp("wrapper_overhead")
  env = example_env()
  proc = subprocess.run(
      [sys.executable, "-m", "benchmarks.wrapper_overhead", "--quick",
       "--out", str(out)],
      cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
  )
  return proc, out


def test_exits_zero_and_prints_table(quick_run):
  proc, _ = quick_run
  assert proc.returncode == 0, proc.stderr[-4000:]
  assert "| workload | policy |" in proc.stdout


def test_json_has_machine_config_and_results(quick_run):
  _, out = quick_run
  report = json.loads((out / "wrapper_overhead.json").read_text())
  assert report["benchmark"] == "wrapper_overhead"
  assert "--quick" in report["command"]
  for key in ("platform", "cpu_count", "python", "jax", "jaxlib", "optax",
              "device_kind", "backend"):
    assert report["machine"][key] not in (None, ""), key
  assert report["config"]["quick"] is True
  assert report["config"]["target_ratio"] == pytest.approx(1.03)
  names = {r["workload"] for r in report["results"]}
  assert names == {"mlp-f16", "mlp-bf16", "conv-f16", "conv-bf16"}


def test_every_workload_has_positive_finite_figures(quick_run):
  _, out = quick_run
  report = json.loads((out / "wrapper_overhead.json").read_text())
  repeats = report["config"]["repeats"]
  for result in report["results"]:
    assert result["check"]["same"] is True, result["check"]
    for clock in ("step_time_s", "cpu_time_s"):
      for variant in VARIANTS:
        stats = result[clock][variant]
        assert len(stats["values"]) == repeats
        assert all(_positive_finite(v) for v in stats["values"]), stats
        assert stats["q25"] <= stats["median"] <= stats["q75"]
    assert result["check"]["unguarded_same"] is True
    assert result["check"]["unchecked_same"] is True
    for name in WRAPPER_RATIOS:
      for ratio in (name, "cpu_" + name):
        assert _positive_finite(result[ratio]["median"]), result[ratio]
        assert result[ratio]["iqr"] >= 0
        assert len(result[ratio]["values"]) == repeats
    for variant in VARIANTS:
      info = result["compile"][variant]
      assert _positive_finite(info["lower_s"])
      assert _positive_finite(info["compile_s"])
      assert info["entry_kernels"] > 0
    assert isinstance(result["within_target"], bool)


def test_markdown_names_the_command_and_every_workload(quick_run):
  _, out = quick_run
  text = (out / "wrapper_overhead.md").read_text()
  assert "python -m benchmarks.wrapper_overhead --quick" in text
  assert "| (a) / (c) max_consecutive_skips=None | (a) / (d) check_scaling=False |" in text
  for name in ("mlp-f16", "mlp-bf16", "conv-f16", "conv-bf16"):
    assert f"| {name}:" in text


# --- the suite: python -m benchmarks run -------------------------------------


def _run_suite(out, *args):
  env = example_env()
  return subprocess.run(
      [sys.executable, "-m", "benchmarks", "run", *args, "--out", str(out)],
      cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
  )


@pytest.fixture(scope="module")
def cpu_quick(tmp_path_factory):
  out = tmp_path_factory.mktemp("cpu_suite")
  return _run_suite(out, "--suite", "cpu", "--quick"), out


def test_cpu_suite_quick_writes_json_and_markdown(cpu_quick):
  proc, out = cpu_quick
  assert proc.returncode == 0, proc.stderr[-4000:]
  report = json.loads((out / "cpu.json").read_text())
  assert report["benchmark"] == "cpu"
  assert "--quick" in report["command"]
  assert report["config"]["quick"] is True
  for key in ("jax", "jaxlib", "device_kind", "cpu_count", "platform"):
    assert report["machine"][key] not in (None, ""), key
  assert len(report["load_average"]["before"]) == 3
  text = (out / "cpu.md").read_text()
  assert "python -m benchmarks run --suite cpu --quick" in text
  for heading in ("## 1. Step time", "## 2. Residuals", "## 3. Share of matmul",
                  "## 4. Compile time", "## 5. `autocast`"):
    assert heading in text


def test_cpu_suite_timing_figures(cpu_quick):
  _, out = cpu_quick
  report = json.loads((out / "cpu.json").read_text())
  assert report["results"], "no workload ran"
  for result in report["results"]:
    for variant in ("bf16/jmp_lite", "bf16/hand", "bf16/apply_if_finite",
                    "bf16/autocast", "f16/jmp_lite", "f16/hand"):
      stats = result["step_time_s"][variant]
      assert len(stats["values"]) == report["config"]["repeats"]
      assert all(_positive_finite(v) for v in stats["values"])
      assert _positive_finite(result["compile"][variant]["total_s"])
    for name in ("jmp_lite/hand bf16", "jmp_lite/hand f16",
                 "jmp_lite/apply_if_finite bf16", "autocast/policy bf16"):
      assert _positive_finite(result["ratios"][name]["wall"]["median"])
    for name in ("jmp_lite/hand bf16", "jmp_lite/apply_if_finite bf16",
                 "autocast/policy bf16", "jmp_lite bf16/f32"):
      assert _positive_finite(result["compile_ratios"][name])


def test_cpu_suite_static_figures(cpu_quick):
  _, out = cpu_quick
  report = json.loads((out / "cpu.json").read_text())
  for result in report["results"]:
    static = result["static"]
    assert static["f32"]["flops"]["half_share"] == 0.0
    for key in ("policy bf16", "policy f16", "autocast bf16", "autocast f16"):
      flops, res = static[key]["flops"], static[key]["residuals"]
      assert flops["total"] == static["f32"]["flops"]["total"] > 0
      assert 0.0 <= flops["half_share"] <= 1.0
      assert res["bytes"] == res["activation_bytes"] + res["param_copy_bytes"]
      assert _positive_finite(res["ratio_vs_f32"])
  for name in ("DigitsCNN", "CharLM"):
    figures = report["example_models"][name]["figures"]
    assert figures["f32"]["residuals"]["ratio_vs_f32"] == 1.0
    for dt in ("bf16", "f16"):
      assert figures[dt]["flops"]["total"] > 0
      assert _positive_finite(figures[dt]["residuals"]["ratio_vs_f32"])


# --- every study on the one runner ------------------------------------------------


STUDIES = {  # study: (flags that keep its smoke run short, variants it times)
    "diagnostics_overhead": (("--computes", "f16"),
                             ("plain", "stats", "cond_stats", "cond_step")),
    "grad_reduction": (("--computes", "bf16", "--no-control"), ("grouped", "plain")),
    "residual_recompute": (("--models", "DigitsCNN", "--computes", "f16"),
                           ("policy", "remat norms", "remat loss")),
    "update_rounding": (("--models", "mlp"),
                        ("copy", "stochastic_rounding", "kahan", "bf16",
                         "f32", "sr_8bit", "sr_4bit", "sr_e4m3")),
}


@pytest.mark.parametrize("study", sorted(STUDIES))
def test_study_quick_run_checks_then_times(study, tmp_path):
  flags, variants = STUDIES[study]
  env = example_env()
  proc = subprocess.run(
      [sys.executable, "-m", f"benchmarks.{study}", "--quick", *flags, "--out", str(tmp_path)],
      cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stderr[-4000:]
  report = json.loads((tmp_path / f"{study}.json").read_text())
  assert report["benchmark"] == study and report["config"]["quick"] is True
  assert report["machine"]["jax"] and len(report["load_average"]["before"]) == 3
  assert report["results"], "no workload ran"
  for result in report["results"]:
    assert result["check"]["same"] is True, result["check"]
    assert set(result["step_time_s"]) == set(variants) == set(result["compile"])
    for stats in result["step_time_s"].values():
      assert len(stats["values"]) == report["config"]["repeats"]
      assert all(_positive_finite(v) for v in stats["values"])
  text = (tmp_path / f"{study}.md").read_text()
  assert f"`python -m benchmarks.{study} --quick" in text and "--quick`: tiny shapes" in text


@pytest.mark.parametrize("argv, message", [
    (["--repeats", "0"], "--repeats must be >= 1, got 0"),
    (["--steps", "0"], "--steps must be >= 1, got 0"),
    (["--computes", "f16,f8"], "--computes: 'f8' given; choose a comma-separated subset of f16,bf16"),
    (["--models", ""], "--models: nothing given; choose a comma-separated subset of mlp,conv"),
    (["--out", "x", "--update-results"], "not allowed with argument --out"),
])
def test_bad_flags_are_usage_errors(argv, message, capsys):
  from benchmarks import wrapper_overhead  # pylint: disable=import-outside-toplevel
  with pytest.raises(SystemExit) as exit_info:
    wrapper_overhead.main(argv)
  assert exit_info.value.code == 2
  assert message in capsys.readouterr().err


def test_bad_block_length_is_a_usage_error(capsys):
  from benchmarks import residual_recompute  # pylint: disable=import-outside-toplevel
  with pytest.raises(SystemExit):
    residual_recompute.main(["--block-s", "0"])
  assert "--block-s must be a positive number of seconds, got 0.0" in capsys.readouterr().err


def _counting_steps():
  """Two trivial 'steps' whose state counts the steps taken."""
  step = lambda state, batch: (state + 1, float(state))  # noqa: E731
  return {"a": step, "b": step}, {"a": 0, "b": 0}


def test_a_failed_check_stops_the_study_before_timing():
  from benchmarks import runner  # pylint: disable=import-outside-toplevel
  fns, states = _counting_steps()
  differ = lambda fns, states, batch: (states, {"same": False, "why": "test"})  # noqa: E731
  with pytest.raises(SystemExit, match="do not compute the same thing"):
    runner.check_then_time("w", fns, states, None, runner.Timing(repeats=3, steps=2),
                           check=differ, ratios={"r": ("a", "b")})
  assert states == {"a": 0, "b": 0}  # nothing was timed
  untimed = runner.check_then_time("w", fns, states, None, runner.Timing(repeats=3, steps=2),
                                   check=differ, ratios={"r": ("a", "b")}, stop=False)
  assert untimed == {"check": {"same": False, "why": "test"}}


def test_timing_interleaves_blocks_and_reports_per_block_ratios():
  from benchmarks import runner  # pylint: disable=import-outside-toplevel
  fns, states = _counting_steps()
  same = lambda fns, states, batch: (states, {"same": True})  # noqa: E731
  result = runner.check_then_time(
      "w", fns, states, None, runner.Timing(repeats=3, steps=2), check=same,
      ratios={"r": ("a", "b"), "by": {"a": ("a", "b")}})
  assert states == {"a": 6, "b": 6}  # 3 blocks of 2 steps each
  assert result["steps_per_block"] == 2
  wall = result["step_time_s"]
  assert result["r"]["values"] == pytest.approx(
      [x / y for x, y in zip(wall["a"]["values"], wall["b"]["values"])])
  assert result["by"]["a"]["values"] == result["r"]["values"]
  assert len(result["cpu_r"]["values"]) == 3


def test_compile_time_study_runs_and_reports(tmp_path):
  """``benchmarks.compile_time`` at tiny sizes: one unrolled depth and the
  scanned case, one route per family with its hand-cast baseline; only that it
  runs and reports (no figure is checked)."""
  proc = subprocess.run(
      [sys.executable, "-m", "benchmarks.compile_time", "--quick", "--depths", "1",
       "--routes", "autocast,nnx_policy", "--out", str(tmp_path)],
      cwd=ROOT, env=example_env(), capture_output=True, text=True, timeout=600,
  )
  assert proc.returncode == 0, proc.stderr[-4000:]
  assert "| route | blocks |" in proc.stdout
  report = json.loads((tmp_path / "compile_time.json").read_text())
  assert report["benchmark"] == "compile_time"
  seen = {(r["route"], r["layers"], r["scan"]) for r in report["results"]}
  assert seen == {("hand", 1, False), ("autocast", 1, False), ("nnx_hand", 1, False),
                  ("nnx_policy", 1, False), ("hand", 2, True), ("autocast", 2, True)}
  for r in report["results"]:
    assert _positive_finite(r["trace_lower_s"]) and _positive_finite(r["compile_s"])
    assert r["lowered_functions"] >= 1 and r["optimized_hlo"]["instructions"] > 0
    assert math.isfinite(r["loss"])
    assert r["ratios"]["compile"] > 0
  hand = [r for r in report["results"] if r["route"] == "hand"]
  assert all(r["ratios"]["trace_lower"] == 1.0 for r in hand)
  assert (tmp_path / "compile_time.md").read_text().startswith("# Trace, lowering")


@pytest.mark.standard_promotion  # the benchmarks' models mix bfloat16 and float32
def test_compile_time_float8_baseline_is_the_program_with_policy_binds():
  """``hand_fp8`` (the float8 step written by hand) lowers to the same
  operations as ``with_policy`` with ``mixed_fp8``, and asking for a float8
  route brings both baselines."""
  from benchmarks import compile_time  # pylint: disable=g-import-not-at-top
  assert compile_time.parse(["--routes", "autocast_fp8"]).routes == [
      "hand", "hand_fp8", "plain_fp8", "autocast_fp8"]
  assert compile_time.parse(["--routes", "hand_fp8"]).routes == [
      "hand", "hand_fp8", "plain_fp8"]

  def operations(route):
    loss, operands = compile_time.program(route, compile_time.SIZES[True], 1, False, 0)
    text = jax.jit(jax.value_and_grad(loss)).lower(*operands).as_text()
    return collections.Counter(re.findall(r"(?:stablehlo|chlo|func)\.\w+", text))

  hand_fp8 = operations("hand_fp8")
  assert hand_fp8 == operations("with_policy_fp8")
  assert hand_fp8 != operations("hand")  # the float8 matmuls are there


@pytest.mark.standard_promotion  # the benchmarks' models mix bfloat16 and float32
def test_compile_time_plain_float8_baseline():
  """``plain_fp8`` (a per-tensor float8 matmul written plainly with
  ``jax.custom_vjp``, no jmp_lite) puts e4m3 operands on the forward dots and
  an e5m2 gradient on both backward dots, accumulating in float32; jmp_lite's
  float8 rows get their ratios to it."""
  from benchmarks import compile_time  # pylint: disable=g-import-not-at-top
  loss, operands = compile_time.program("plain_fp8", compile_time.SIZES[True], 1, False, 0)
  text = jax.jit(jax.value_and_grad(loss)).lower(*operands).as_text()
  dots = re.findall(r"stablehlo\.dot_general.*?: \((.*?)\) -> tensor<[^>]*x(\w+)>", text)
  fp8 = [(operands_, out) for operands_, out in dots if "f8E" in operands_]
  assert len(fp8) == 3 * 4  # four dense matmuls per block, three products each
  assert all(out == "f32" for _, out in fp8)
  assert sum("f8E5M2" in o for o, _ in fp8) == 2 * 4
  row = lambda route, t: {"route": route, "family": "jax", "layers": 1, "scan": False,
                          "trace_lower_s": t, "compile_s": 2 * t,
                          "optimized_hlo": {"instructions": 10 * t}}
  rows = [row("hand", 1.0), row("hand_fp8", 3.0), row("plain_fp8", 2.0),
          row("with_policy_fp8", 4.0)]
  compile_time.add_ratios(rows)
  assert rows[1]["ratios_plain"] == {"trace_lower": 1.5, "compile": 1.5, "total": 1.5,
                                     "hlo_instructions": 1.5}
  assert rows[3]["ratios_plain"]["total"] == 2.0
  assert "ratios_plain" not in rows[2] and "ratios_plain" not in rows[0]


@pytest.mark.standard_promotion  # the benchmarks' models mix bfloat16 and float32
def test_compile_time_int8_routes():
  """The int8 routes (issue 38): asking for one brings its float8 twin (and
  the twin's baselines); ``hand_int8`` lowers to the operations
  ``with_policy`` binds under ``mixed_int8``, every dense matmul of a block
  as three ``s8 x s8 -> s32`` products (SwitchBack: two, its weight gradient
  in bf16); each int8 row gets its ratios to its float8 twin, reported."""
  from benchmarks import compile_time  # pylint: disable=g-import-not-at-top
  assert compile_time.parse(["--routes", "with_policy_int8"]).routes == [
      "hand", "hand_fp8", "plain_fp8", "with_policy_fp8", "with_policy_fp8_rowwise",
      "with_policy_int8"]
  assert compile_time.parse(["--routes", "hand_int8"]).routes == [
      "hand", "hand_fp8", "plain_fp8", "hand_int8"]

  def lowered(route):
    loss, operands = compile_time.program(route, compile_time.SIZES[True], 1, False, 0)
    return jax.jit(jax.value_and_grad(loss)).lower(*operands).as_text()

  def operations(text):
    return collections.Counter(re.findall(r"(?:stablehlo|chlo|func)\.\w+", text))

  def int8_dots(text):
    dots = re.findall(r"stablehlo\.dot_general.*?: \((.*?)\) -> tensor<[^>]*x(\w+)>", text)
    return [out for operands_, out in dots if operands_.count("xi8>") == 2]

  hand = lowered("hand_int8")
  assert operations(hand) == operations(lowered("with_policy_int8"))
  assert int8_dots(hand) == ["i32"] * (3 * 4)  # four dense matmuls, three products
  assert int8_dots(lowered("with_policy_int8_switchback")) == ["i32"] * (2 * 4)
  row = lambda route, t: {"route": route, "family": "jax", "layers": 1, "scan": False,
                          "trace_lower_s": t, "compile_s": 2 * t, "lowered_functions": 1,
                          "optimized_hlo": {"instructions": 10 * t}}
  rows = [row("hand", 1.0), row("hand_fp8", 2.0), row("with_policy_fp8", 2.0),
          row("hand_int8", 3.0), row("with_policy_int8", 2.2),
          row("with_policy_int8_switchback", 1.0), row("with_policy_fp8_rowwise", 4.4)]
  compile_time.add_ratios(rows)
  # with_policy_int8 against the float8 recipe that quantizes as it does.
  assert rows[4]["ratios_int8_rowwise"]["compile"] == pytest.approx(0.5)
  assert "ratios_int8_rowwise" not in rows[3] and "ratios_int8_rowwise" not in rows[5]
  assert rows[3]["ratios_int8_fp8"]["compile"] == 1.5
  assert rows[4]["ratios_int8_fp8"]["trace_lower"] == pytest.approx(1.1)
  assert rows[5]["ratios_int8_fp8"]["hlo_instructions"] == 0.5
  assert "ratios_int8_fp8" not in rows[1]
  text = "\n".join(compile_time.table({
      "results": rows, "config": {"size": {"width": 16, "heads": 2, "seq_len": 8,
                                           "vocab": 32, "batch": 2}, "repeats": 1}}))
  assert "| hand_int8 | hand_fp8 | 1 | 1.50 | 1.50 | 1.50 |" in text
  assert "| with_policy_int8_switchback | with_policy_fp8 | 1 |" in text
  assert "| with_policy_int8 | with_policy_fp8_rowwise | 1 | 0.50 | 0.50 | 0.50 |" in text
  # The float8 twin with int8's structure runs m=fp8_rowwise.
  assert re.search(r"stablehlo\.dot_general[^\n]*f8E4M3FN",
                   lowered("with_policy_fp8_rowwise"))


def test_compile_time_merge_keeps_rows_it_did_not_measure(tmp_path):
  """``--merge``: a run's rows replace those of the same route, depth and
  scan; the others stay, each naming its run; another configuration is
  replaced, never mixed in."""
  from benchmarks import compile_time  # pylint: disable=g-import-not-at-top

  def report(date, rows, **config):
    config = {"quick": False, "repeats": 3, "seed": 0, "size": {"width": 64}, "scan": False,
              "depths": sorted({layers for _, layers in rows}),
              "routes": {r: "" for r, _ in rows}, **config}
    return {"benchmark": "compile_time", "command": f"run {date}", "date": date,
            "wall_s": 1.0, "load_average": {"before": [0.0], "after": [0.0]},
            "config": config, "results": [{"route": r, "layers": n, "scan": False, "t": date}
                                          for r, n in rows]}

  first = compile_time.merge_previous(
      report("a", [("hand", 12), ("autocast", 12), ("hand", 24)]), tmp_path)
  (tmp_path / "compile_time.json").write_text(json.dumps(first))
  merged = compile_time.merge_previous(
      report("b", [("hand", 12), ("hand_fp8", 12), ("plain_fp8", 12)]), tmp_path)
  got = [(r["route"], r["layers"], r["t"], r["run"]) for r in merged["results"]]
  assert got == [("hand", 12, "b", 1), ("autocast", 12, "a", 0), ("hand_fp8", 12, "b", 1),
                 ("plain_fp8", 12, "b", 1), ("hand", 24, "a", 0)]
  assert [run["date"] for run in merged["runs"]] == ["a", "b"]
  assert merged["config"]["depths"] == [12, 24]
  assert list(merged["config"]["routes"]) == ["hand", "autocast", "hand_fp8", "plain_fp8"]
  page = "\n".join(compile_time.table(dict(merged, config=dict(
      merged["config"], size=dict(width=64, heads=4, seq_len=32, vocab=256, batch=8)),
      results=[dict(r, trace_lower_s=1.0, compile_s=1.0, lowered_functions=1,
                    optimized_hlo={"instructions": 1}, ratios=None)
               for r in merged["results"]])))
  assert "Merged from 2 runs" in page and "* run 1: `run b`" in page
  other = compile_time.merge_previous(report("c", [("hand", 12)], repeats=1), tmp_path)
  assert [r["t"] for r in other["results"]] == ["c"] and len(other["runs"]) == 1
  # The baselines a run added itself (routes not named in --routes) replace
  # nothing: an int8 run leaves the committed float8 rows as they are, and
  # adds a baseline only where the file has none.
  int8 = compile_time.merge_previous(
      report("d", [("hand", 12), ("hand_fp8", 12), ("hand_int8", 12), ("hand_fp8", 48)],
             named_routes=["hand_int8"]), tmp_path)
  got = {(r["route"], r["layers"]): r["t"] for r in int8["results"]}
  assert got[("hand", 12)] == "a" and got[("hand", 24)] == "a"   # kept
  assert got[("hand_int8", 12)] == "d" and got[("hand_fp8", 12)] == "d"   # none before


def test_compile_time_study_refuses_bad_flags(capsys):
  from benchmarks import compile_time  # pylint: disable=g-import-not-at-top
  with pytest.raises(SystemExit):
    compile_time.parse(["--routes", "autocast,bogus"])
  assert "'bogus'" in capsys.readouterr().err
  with pytest.raises(SystemExit):
    compile_time.parse(["--depths", "0"])
  assert "--depths" in capsys.readouterr().err


def test_grouped_matmul_study_runs_and_reports(tmp_path):
  """``benchmarks.grouped_matmul`` at tiny sizes, two recipes: it runs, each
  recipe has its loop baseline and grouped row with ratios, and the XLA:CPU
  row-order figure is there (no figure is checked)."""
  proc = subprocess.run(
      [sys.executable, "-m", "benchmarks.grouped_matmul", "--quick",
       "--recipes", "fp8_rowwise,nvfp4", "--out", str(tmp_path)],
      cwd=ROOT, env=example_env(), capture_output=True, text=True, timeout=600,
  )
  assert proc.returncode == 0, proc.stderr[-4000:]
  report = json.loads((tmp_path / "grouped_matmul.json").read_text())
  seen = [(r["route"], r["recipe"]) for r in report["results"]]
  assert seen == [("bf16", None), ("loop", "fp8_rowwise"),
                  ("grouped", "fp8_rowwise"), ("loop", "nvfp4"),
                  ("grouped", "nvfp4")]
  for r in report["results"]:
    assert _positive_finite(r["trace_lower_s"]) and _positive_finite(r["compile_s"])
    if r["route"] == "grouped":
      assert _positive_finite(r["compile_s_ratio"])
  assert set(report["dot_row_order"]["rows_differing"]) == {"1", "3", "7", "44", "150"}
  assert "| recipe | route |" in (tmp_path / "grouped_matmul.md").read_text()
