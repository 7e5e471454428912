"""The fake tensorrt module (tests/fakes/gpu.py) under its real name, for a subprocess."""

import sys

from _shared import fakes

sys.modules[__name__] = fakes()[1]
