"""The lowest floor: what the model is, how keywords are bucketed, what is kept on disk, and the
errors' one root.

Layers import one way (tests/unit/repo/test_layers.py checks it):

    worker.core  <-  engines (ONNX export, TensorRT build)  <-  the rest of worker (runtime, CLI)  <-  benchmarks

`worker.core` imports nothing of the project outside itself, `engines` only `worker.core`, and the
runtime reads the same model description and bucket profiles the engine build reads.
"""
