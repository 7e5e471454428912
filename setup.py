"""The one compiled part of the worker (everything else is in pyproject.toml; its
`[tool.setuptools.ext-modules]` table would do the same, but setuptools still calls it experimental
and says so at every build).

worker/intake/_wordpiece.c, the WordPiece fast path's loop, is optional: where no C compiler is
found the build goes on without it and the worker runs the same path in Python
(worker/intake/wordpiece.py says which, and `keyword-embedder run` logs it).
"""

from setuptools import Extension, setup

setup(ext_modules=[Extension("worker.intake._wordpiece", ["worker/intake/_wordpiece.c"], optional=True)])
