import os
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parent
# The tests' helpers, and the repository's tools (the shapes model's dataset and evaluation).
sys.path.insert(0, str(TESTS))
sys.path.insert(1, str(TESTS.parent))

# Embedded models are built once per test session into a private cache, never the user's.
os.environ.setdefault("DIFFSERVE_CACHE_DIR", str(TESTS.parent / ".cache"))
