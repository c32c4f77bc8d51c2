"""The device is one layer: ``torch.cuda`` is written in at most three files of the package (the
CUDA kind, ``diffserve/device/cuda.py``, first), the layer sits below the executor, and importing
it (as the frontend and scheduler do, to count GPUs) does not import torch."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import diffserve
from test_imports import ROOT, imports, module_name

# Any spelling: torch.cuda (also as self.torch.cuda), from torch import cuda, import torch.cuda.
CUDA = re.compile(r"\btorch\s*\.\s*cuda\b|from\s+torch\s+import\s+(\([^)]*)?\bcuda\b")


def cuda_files(root: Path = ROOT) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*.py") if CUDA.search(p.read_text()))


def test_the_finder_sees_every_spelling(tmp_path):
    for i, line in enumerate(["x = torch.cuda.Event()", "c = self.torch.cuda", "from torch import cuda",
                              "from torch import (nn,\n cuda)", "import torch.cuda as c"]):
        (tmp_path / f"m{i}.py").write_text(line + "\n")
    (tmp_path / "clean.py").write_text("from diffserve.device import of\nx = of('cuda:0')\n")
    assert cuda_files(tmp_path) == [f"m{i}.py" for i in range(5)]


def test_torch_cuda_is_written_in_at_most_three_files():
    found = cuda_files()
    assert "device/cuda.py" in found
    assert len(found) <= 3, found


def test_the_device_layer_imports_nothing_above_it():
    """``diffserve.device`` sits below the executor: it imports torch and the house's low
    modules, never the executor, the frontend or the scheduler."""
    modules = {module_name(p): p for p in ROOT.rglob("*.py")}
    above = ("diffserve.executor", "diffserve.frontend", "diffserve.scheduler")
    upward = [f"{module} -> {target}" for module, targets in imports(modules).items()
              if module.startswith("diffserve.device") for target in targets
              if target.startswith(above)]
    assert upward == []


def test_importing_the_layer_and_the_topology_does_not_import_torch():
    code = ("import sys, diffserve.device, diffserve.device.choice, diffserve.config.executors;"
            "n = diffserve.device.choice.visible_gpus();"
            "assert 'torch' not in sys.modules, 'torch imported'")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=Path(diffserve.__file__).parent.parent)
    assert done.returncode == 0, done.stderr
