"""kvscope: was the KV of earlier turns reused — and if not, why, what did keeping it cost?"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("kvscope")
except PackageNotFoundError:  # running from a source tree that is not installed
    __version__ = "0+unknown"

# Public modules (none is imported with the package: the vLLM plugin path stays light).
__all__ = [
    "__version__", "boundary_key", "child", "cli", "errors", "exposition", "files", "fit",
    "progress",
    "published", "reuse", "semconv", "serving", "settings", "store", "tables",
]
