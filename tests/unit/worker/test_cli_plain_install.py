"""The CLI where nothing imported `importlib.util` before it: a plain (non-editable) install.

The development venv installs the package editable, and the editable finder's .pth file imports
importlib.util at every interpreter start, which hid that worker/cli.py used it after a bare
`import importlib`: in the image (`pip install .`) every `keyword-embedder` command failed with
AttributeError, the image build's own export-onnx step first (found by tests/system/test_image.py).
Here the interpreter runs without site (-S, so no .pth file), with only the repository on its path.
"""

from __future__ import annotations

import subprocess
import sys

from tests.conftest import ROOT

SCRIPT = """
import sys
assert "importlib.util" not in sys.modules, "importlib.util is imported at start: this check cannot fail"
sys.path.insert(0, sys.argv[1])
from worker.cli import main
sys.exit(main(["--help"]))
"""


def test_the_cli_lists_its_commands_without_sites_imports() -> None:
    out = subprocess.run([sys.executable, "-S", "-c", SCRIPT, str(ROOT)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "export-onnx" in out.stdout and "run" in out.stdout
