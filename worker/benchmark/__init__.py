"""The offline batching benchmark (no Kafka): monolithic vs bucketed vs sorted, on any backend.

- `policies`: the timed passes (monolithic, sorted, the worker's bucketer behind an in-flight
  window, the direct-call replay of the bucketer's own batches);
- `load`: open-loop Poisson arrivals and their latency percentiles;
- `loadgen`: the open-loop schedules themselves (also behind `keyword-embedder produce --rate`);
- `suite`: the rounds in rotating order and the JSON report with paired ratios;
- `report`: the report as Markdown.

`keyword-embedder bench` (worker/commands/bench.py) is a thin command over `suite`; the
Kafka-vs-offline and GPU scripts under benchmarks/ reuse the same pieces. Nothing in the
worker's runtime imports this package.
"""
