"""The torch-free ONNX exporter of a sentence encoder (the entry points are in `export`)."""
