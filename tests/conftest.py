import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

# Embedded models are built once per test session into a private cache, never the user's.
os.environ.setdefault("DIFFSERVE_CACHE_DIR", str(Path(__file__).resolve().parent.parent / ".cache"))
