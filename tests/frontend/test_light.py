"""The frontend is light: building the app and validating and pricing requests of every guidance
rule imports neither torch, diffusers nor transformers, nor the step engine's families, whose
knowledge reaches the frontend in the model info (checked in a fresh interpreter, where nothing
else could have imported them first)."""

from __future__ import annotations

import subprocess
import sys

PROGRAM = """
import sys
from diffserve.config.flags import ServerConfig
from diffserve.wire.costs import GUIDANCE_RULES
from diffserve.serving.backend import Backend  # the host both `diffserve serve` and a Ray replica use
from diffserve.frontend.app import create_app
from diffserve.frontend.schemas import ImageGenerationRequest
from diffserve.frontend.spec import generation_spec
from diffserve.frontend.validation import to_engine_request
from diffserve.metrics import FrontendMetrics
from diffserve.wire.protocol import ModelInfo
from diffserve.wire.tasks import GENERATE
import diffserve.serving.server, diffserve.ray

create_app(ServerConfig(), None, FrontendMetrics(), lambda: (b"", "text/plain"))
for rule in GUIDANCE_RULES:
    info = ModelInfo("m", "P", 64, 64, 16, 4, 1000, 4.0, True, "cpu", "float32", "step",
                     ["generate"], True, guidance_rule=rule, max_batch_cost=16.0)
    body = ImageGenerationRequest(prompt="x", negative_prompt="y", size="64x64")
    r = to_engine_request(generation_spec(body), "id", info, ServerConfig(), GENERATE)
    print(rule, r.cost)
# The family tables are read here (they import nothing heavy); the step adapters never are.
heavy = sorted(m for m in sys.modules if m in ("torch", "diffusers", "transformers")
               or m == "diffserve.executor.families.known" or m.endswith(".step")
               and m.startswith("diffserve.executor.families."))
print("HEAVY", heavy)
"""


def test_the_frontend_imports_no_model_library():
    done = subprocess.run([sys.executable, "-c", PROGRAM], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert "HEAVY []" in done.stdout, done.stdout
    costs = dict(line.split() for line in done.stdout.splitlines() if not line.startswith("HEAVY"))
    assert costs == {"above_one": "2.0", "above_zero": "2.0", "with_negative": "2.0", "never": "1.0"}
