"""The compiled parts of the worker (everything else is in pyproject.toml; its
`[tool.setuptools.ext-modules]` table would do the same, but setuptools still calls it experimental
and says so at every build).

Both are optional: where no C compiler is found the build goes on without them and the worker runs
the same code in Python (`keyword-embedder run` logs which, as `tokenizer_fast_path` and
`delivery_reports`):
- worker/intake/_wordpiece.c, the WordPiece fast path's loop (worker/intake/wordpiece.py);
- worker/kafka/_reports.c, each produced record's delivery callback (worker/kafka/reports.py).
"""

from setuptools import Extension, setup

setup(ext_modules=[Extension("worker.intake._wordpiece", ["worker/intake/_wordpiece.c"], optional=True),
                   Extension("worker.kafka._reports", ["worker/kafka/_reports.c"], optional=True)])
