"""`keyword-embedder backfill`: embed a range of the input topic's history into an output topic, and stop.

`range.py` captures and keeps the range (and where a restart resumes), `gate.py` bounds the poll loop
to it, `rate.py` is `--max-rate`'s token bucket, `progress.py` the bar and the summary; the command
(worker/commands/backfill.py) runs them around `run`'s own pipeline (worker/app.py).
"""
