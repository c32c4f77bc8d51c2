"""diffserve: an async diffusion inference server with a dynamic-batching scheduler."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("diffserve")  # the one version: the package's own metadata
except PackageNotFoundError:  # run from a source tree that was never installed
    __version__ = "0+unknown"
