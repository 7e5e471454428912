"""Names shared across floors: the `Literal` types of enum-like settings whose values the
settings (worker/settings/schema.py) and the code that acts on them (worker/backends/, worker/kafka/)
both know. Nothing here imports anything of the project, so every module can import it without
an arrow going back up.
"""

from __future__ import annotations

from typing import Literal

# The backends the worker can run on; the settings add "auto" (worker.settings.schema.BackendSetting).
# worker/backends/base.py re-exports it beside the Backend protocol.
BackendName = Literal["onnxruntime", "openvino", "tensorrt", "torch"]
# OpenVINO's arithmetic: bf16 on the CPU's bf16 matrix units (INFERENCE_PRECISION_HINT), or f32.
OvPrecision = Literal["bf16", "f32"]
# The torch backend's encoder arithmetic; "auto": the first of fp16, bf16, fp32 that passes the parity gate.
TorchPrecision = Literal["auto", "fp16", "bf16", "fp32"]

# The Schema Registry formats (worker/formats/schema_registry.py): confluent-kafka's serdes, the
# registry's wire format (magic byte, schema ID, payload).
RegistryFormat = Literal["avro", "json-schema", "protobuf"]
REGISTRY_FORMATS: tuple[str, ...] = ("avro", "json-schema", "protobuf")
InputFormat = Literal["json", "raw", "avro", "json-schema", "protobuf"]
OutputFormat = Literal["json", "avro", "json-schema", "protobuf"]
OutputEncoding = Literal["float-list", "base64-f32", "base64-f16", "int8", "binary"]
