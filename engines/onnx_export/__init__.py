"""The torch-free ONNX exporter of a sentence encoder, one module per concern.

- export.py: the entry points (build_model, export_onnx, ensure_onnx, cached_path), the cache key
  and the metadata written into the file; what the rest of the project imports.
- graph.py: the graph builder and what every part builds with (linear, layer norm, GELU, the
  weights reader), the input and output names, ExportError.
- encoder.py: the encoder families (a table of tensor names each), embeddings, attention masks
  and biases, the encoder layer. A new family goes here.
- pooling.py: the pooling modes and the prompt a pooling leaves out. A new mode goes here.
- head.py: the modules after the encoder in order (pooling, Dense, Normalize) and the names an
  FP16 TensorRT build keeps in FP32.
- mlm.py: a sparse model's masked-language-model head (per family), tied decoder included.
- splade.py: SPLADE pooling of the MLM logits onto the vocabulary (max or sum, relu or log1p_relu).
- fusion.py: ONNX Runtime's offline transformer fusion and its checks (the `--fused` variant).

They import one way: export uses encoder, head, mlm, splade and fusion; head uses pooling; splade
uses mlm; all of them use graph.
"""
