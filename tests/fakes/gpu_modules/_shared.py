"""One FakeCuda and one FakeTrt per process, shared by the fake `tensorrt` and `pycuda.driver` modules."""

from __future__ import annotations

import functools
import os

from tests.fakes.gpu import FakeCuda, FakeTrt


@functools.cache
def fakes() -> tuple[FakeCuda, FakeTrt]:
    cuda = FakeCuda()
    # FAKE_TRT_VERSION: 10.x (the default) or 11.x, the API the fake models.
    trt = FakeTrt(cuda, os.environ.get("FAKE_TRT_VERSION", "10.3.0"), compute="onnxruntime")
    fail = os.environ.get("FAKE_TRT_FAIL", "")
    trt.fail_build = fail == "build"
    trt.fail_deserialize = fail == "deserialize"
    if fail.startswith("nan-profile-"):
        trt.nan_profiles.add(int(fail.rsplit("-", 1)[1]))
    trt.deserialize_sleep_s = float(os.environ.get("FAKE_TRT_DESERIALIZE_SLEEP_S", "0"))
    return cuda, trt
