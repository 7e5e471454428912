"""The lowest layer: what the model is, how keywords are bucketed, and the backend error type.

Layers import one way (tests/test_layers.py checks it):

    kwe_core  <-  engines (ONNX export, TensorRT build)  <-  worker (runtime, CLI, benchmark)  <-  benchmarks

`kwe_core` imports nothing of the project, `engines` only `kwe_core`, and the runtime reads
the same model description and bucket profiles the engine build reads.
"""
