"""Inference backends: the protocol in base.py, ONNX Runtime (CPU) and TensorRT (GPU)."""
