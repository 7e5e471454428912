"""The CUDA-graph shapes of the PyTorch backend: now the worker's own (worker/backends/torch_plan.py).

The benchmark's own torch_backend module became the worker backend `--backend torch`
(worker/backends/torch_cuda.py); its shape and staging logic moved with it. Kept as an import path
for the GPU scripts.
"""

from worker.backends.torch_plan import GraphShape, graph_shapes, shape_for, stage_rows

__all__ = ["GraphShape", "graph_shapes", "shape_for", "stage_rows"]
