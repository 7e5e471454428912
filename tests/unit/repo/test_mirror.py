"""tests/unit mirrors the packages: every module of worker/, engines/ and benchmarks/ has its unit
tests under its mirrored folder, or is named below with where it is tested, or why it has no unit test.

A module worker/a/b.py counts as tested under its mirrored folder when tests/unit/worker/a/ holds
test_b.py (or test_b_<something>.py), or a test file there imports it. A module tested from
another folder names that file in TESTED_ELSEWHERE, which must import it; a module without a unit
test names its reason in NO_UNIT_TEST (a folder, ending in /, covers every module under it). An
entry that is no longer needed (the module is gone or has its mirrored test now) fails too, so
the lists stay short and true.
"""

from __future__ import annotations

import ast
import subprocess
from pathlib import Path

from tests.conftest import ROOT, TESTS

UNIT = TESTS / "unit"
LAYERS = ("unit", "broker", "system")

# module -> the unit test file, elsewhere than its mirrored folder, that imports and tests it
TESTED_ELSEWHERE = {
    "benchmarks/gpu/graph_shapes.py": "tests/unit/worker/backends/test_torch_cuda.py",
    "benchmarks/gpu/prepare_device.py": "tests/unit/engines/test_fp16_onnx.py",
    "benchmarks/host/doubles.py": "tests/unit/worker/intake/test_stage.py",
    "benchmarks/host/pipeline_bench.py": "tests/unit/worker/intake/test_stage.py",
    "engines/build_engine.py": "tests/unit/worker/backends/test_tensorrt.py",
    "engines/onnx_export/encoder.py": "tests/unit/worker/test_families.py",
    "engines/onnx_export/head.py": "tests/unit/engines/test_fp16_onnx.py",
    "engines/onnx_export/mlm.py": "tests/unit/worker/core/test_sparse.py",
    "engines/onnx_export/splade.py": "tests/unit/worker/core/test_sparse.py",
    "worker/backend_choice/torch_choice.py": "tests/unit/worker/backends/test_torch_cuda.py",
    "worker/backends/isolating.py": "tests/unit/worker/test_fault_core.py",
    "worker/backends/onnxruntime.py": "tests/unit/worker/test_embedder_parity.py",
    "worker/backends/static.py": "tests/unit/worker/core/test_static.py",
    "worker/commands/backfill.py": "tests/unit/worker/backfill/test_cluster_calls.py",
    "worker/commands/distill_static.py": "tests/unit/worker/core/test_distill.py",
    "worker/commands/models.py": "tests/unit/worker/core/test_fingerprint.py",
    "worker/commands/settings.py": "tests/unit/repo/test_error_root.py",
    "worker/families/dense.py": "tests/unit/worker/test_families.py",
    "worker/families/parity.py": "tests/unit/worker/test_families.py",
    "worker/families/real.py": "tests/unit/worker/test_families.py",
    "worker/families/rotary.py": "tests/unit/engines/onnx_export/test_rotary_parity.py",
    "worker/families/sparse.py": "tests/unit/worker/core/test_sparse.py",
    "worker/families/static.py": "tests/unit/worker/core/test_static.py",
    "worker/formats/codec_choice.py": "tests/unit/worker/core/test_vectors.py",
    "worker/formats/sparse_codec.py": "tests/unit/worker/core/test_sparse.py",
    "worker/kafka/consumer.py": "tests/unit/worker/test_fault_core.py",
    "worker/names.py": "tests/unit/worker/settings/test_settings.py",
    "worker/operations/redact.py": "tests/unit/worker/kafka/test_client_security.py",
    "worker/output/dead_letter_record.py": "tests/unit/worker/formats/test_messages.py",
    "worker/output/dead_letters.py": "tests/unit/worker/intake/test_stage.py",
    "worker/settings/output_fields.py": "tests/unit/worker/formats/test_messages.py",
}

MEASUREMENT = ("a measurement (minutes, most through the broker) whose result is committed under "
               "benchmarks/results/; tests/unit/benchmarks/test_index.py keeps it indexed")
GPU = "needs a GPU: run on the device (benchmarks/gpu/device_run.sh), its logic on fakes where it has any"

# module or folder/ -> why it has no unit test of its own
NO_UNIT_TEST = {
    "benchmarks/archive/": "finished A/B experiments kept for the record (benchmarks/archive/README.md)",
    "benchmarks/results/": "the scripts that made one committed result, kept beside it",
    "benchmarks/backends_startup.py": MEASUREMENT,
    "benchmarks/backfill_ab.py": MEASUREMENT,
    "benchmarks/bench_ab.py": MEASUREMENT,
    "benchmarks/cache_bench.py": MEASUREMENT,
    "benchmarks/coordinator_outage.py": MEASUREMENT,
    "benchmarks/cpu_floor.py": MEASUREMENT,
    "benchmarks/families_peer.py": MEASUREMENT,
    "benchmarks/families_peer_st.py": MEASUREMENT,
    "benchmarks/gpu/device_bench.py": GPU,
    "benchmarks/gpu/device_check.py": GPU,
    "benchmarks/gpu/paired.py": GPU,
    "benchmarks/gpu/torch_probe.py": GPU,
    "benchmarks/host/delivery_reports.py": MEASUREMENT,
    "benchmarks/host/json_rows.py": MEASUREMENT,
    "benchmarks/host/kafka_cpu.py": MEASUREMENT,
    "benchmarks/host/kafka_relay.py": MEASUREMENT,
    "benchmarks/host/null_worker.py": MEASUREMENT,
    "benchmarks/host/one_run.py": MEASUREMENT,
    "benchmarks/host/static_model.py": MEASUREMENT,
    "benchmarks/int8_kernel.py": MEASUREMENT,
    "benchmarks/int8_study.py": MEASUREMENT,
    "benchmarks/kafka_ab.py": MEASUREMENT,
    "benchmarks/kafka_latency.py": MEASUREMENT,
    "benchmarks/kafka_vs_offline.py": MEASUREMENT,
    "benchmarks/latency_diagnosis.py": MEASUREMENT,
    "benchmarks/latency_rounds.py": "run by tests/system/test_overload_kafka.py against the broker",
    "benchmarks/ort_grid.py": MEASUREMENT,
    "benchmarks/outputs_recall.py": MEASUREMENT,
    "benchmarks/ov_shape_rss.py": MEASUREMENT,
    "benchmarks/sparse.py": MEASUREMENT,
    "benchmarks/stop_storm.py": MEASUREMENT,
    "engines/cuda_context.py": GPU,
    "engines/onnx_export/fusion.py": "run through `export-onnx --fused` in tests/unit/engines/onnx_export/test_export.py",
    "engines/onnx_export/pooling.py": "part of every exported graph: its modes are checked against "
                                      "sentence-transformers in tests/unit/worker/core/test_st_pipeline.py",
    "worker/backend_choice/costs.py": "the backend's cost model, built and calibrated by the worker's start in "
                                      "tests/unit/worker/test_app.py and by `bench --calibrate`",
    "worker/backend_choice/static_choice.py": "a static model's backend, chosen in "
                                              "tests/unit/worker/core/test_static.py through select",
    "worker/backends/openvino.py": "run by name through the Embedder, parity per precision, in "
                                   "tests/unit/worker/test_embedder_parity.py",
    "worker/benchmark/load.py": "run whole by the bench command in tests/unit/worker/benchmark/test_bench.py",
    "worker/benchmark/suite.py": "run whole by the bench command in tests/unit/worker/benchmark/test_bench.py",
    "worker/commands/bench.py": "run whole in tests/unit/worker/benchmark/test_bench.py",
    "worker/commands/build_engine.py": "needs TensorRT; its logic on fakes in tests/unit/worker/backends/test_tensorrt.py",
    "worker/commands/consume.py": "run against the broker by tests/broker/test_produce_consume_cli.py",
    "worker/commands/embed.py": "run by the documented commands in tests/broker/test_docs_commands_kafka.py",
    "worker/commands/export_onnx.py": "run in tests/unit/engines/onnx_export/test_export.py through the CLI",
    "worker/commands/produce.py": "run against the broker by tests/broker/test_produce_consume_cli.py",
    "worker/kafka/admin.py": "creates topics on the broker: used by the broker and system tests",
    "worker/kafka/bounded_calls.py": "the committer's and the group member's deadlines, in "
                                     "tests/unit/worker/test_fault_core.py and tests/system/test_faults_kafka.py",
    "worker/ledger/base.py": "the Delivery interface; both implementations in tests/unit/worker/ledger/test_guarantees.py",
    "worker/ledger/exactly_once/errors.py": "exception types, raised and matched in "
                                            "tests/unit/worker/ledger/exactly_once/test_transactions.py",
    "worker/ledger/exactly_once/transactional_calls.py": "each call of the transaction loop, in "
                                                         "tests/unit/worker/ledger/exactly_once/test_transactions.py",
    "worker/operations/rdkafka_stats.py": "read through the metrics in tests/unit/worker/operations/test_metrics.py",
    "worker/operations/stop_signals.py": "installed in the child processes of "
                                         "tests/unit/worker/operations/test_supervisor_stops.py",
}


def _modules() -> list[str]:
    listed = subprocess.run(["git", "ls-files", "worker", "engines", "benchmarks"], cwd=ROOT, check=True,
                            capture_output=True, text=True).stdout.split()
    return sorted(p for p in listed if p.endswith(".py") and Path(p).name != "__init__.py")


def _imports(test: Path) -> set[str]:
    """Every module a test file imports, `from a.b import c` counting as a.b and a.b.c."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(test.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names |= {node.module, *(f"{node.module}.{a.name}" for a in node.names)}
    return names


def _dotted(module: str) -> str:
    return module.removesuffix(".py").replace("/", ".")


def _mirrored(module: str) -> bool:
    path = Path(module)
    folder = UNIT / path.parent
    tests = sorted(folder.glob("test_*.py"))
    return (any(t.stem == f"test_{path.stem}" or t.stem.startswith(f"test_{path.stem}_") for t in tests)
            or any(_dotted(module) in _imports(t) for t in tests))


def _excused(module: str) -> bool:
    return module in NO_UNIT_TEST or any(k.endswith("/") and module.startswith(k) for k in NO_UNIT_TEST)


def test_every_module_has_its_unit_tests_or_says_where_they_are_or_why_none() -> None:
    missing = [m for m in _modules() if not (_mirrored(m) or m in TESTED_ELSEWHERE or _excused(m))]
    assert not missing, ("modules with no test file under their mirrored folder of tests/unit; add one, or name "
                         "the module in TESTED_ELSEWHERE or NO_UNIT_TEST with its reason:\n" + "\n".join(missing))


def test_a_test_named_elsewhere_imports_its_module() -> None:
    wrong = [f"{m}: {t}" for m, t in TESTED_ELSEWHERE.items()
             if not (ROOT / t).is_file() or _dotted(m) not in _imports(ROOT / t)]
    assert not wrong, "TESTED_ELSEWHERE names a file that does not import the module:\n" + "\n".join(wrong)


def test_the_lists_name_only_modules_that_exist_and_need_the_entry() -> None:
    modules = _modules()
    listed = [*TESTED_ELSEWHERE, *(k for k in NO_UNIT_TEST if not k.endswith("/"))]
    gone = [m for m in listed if m not in modules]
    gone += [k for k in NO_UNIT_TEST if k.endswith("/") and not any(m.startswith(k) for m in modules)]
    assert not gone, "listed but not a module any more:\n" + "\n".join(gone)
    stale = [m for m in listed if _mirrored(m)]
    assert not stale, "tested under the mirrored folder now; drop the entry:\n" + "\n".join(stale)
    both = sorted(TESTED_ELSEWHERE.keys() & NO_UNIT_TEST.keys())
    assert not both, both


def test_test_files_live_in_a_layer() -> None:
    # tests/ itself holds the shared helpers (conftest.py, *_tools.py, fakes/, data/) and no tests
    loose = sorted(p.name for p in TESTS.glob("test_*.py"))
    assert not loose, f"test files outside tests/unit, tests/broker and tests/system: {loose}"
    for layer in LAYERS:
        assert any((TESTS / layer).rglob("test_*.py")), layer
