"""Model engines: the torch-free ONNX exporter, the TensorRT engine builder, and the bucket profiles."""
