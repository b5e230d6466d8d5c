"""The OpenAI-compatible HTTP server and the `openinfer` command line."""
from importlib import metadata

try:
    __version__ = metadata.version("openinfer")
except metadata.PackageNotFoundError:     # running from a source tree that was never installed
    __version__ = "0.1.0"
