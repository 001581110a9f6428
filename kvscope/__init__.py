"""kvscope: was the KV of earlier turns reused — and if not, why, what did keeping it cost?"""

from __future__ import annotations

# The one place the version is written: pyproject.toml reads it from here (setuptools'
# ``attr:``), so that no command pays for importlib.metadata (a fifth of ``kvscope version``).
__version__ = "0.1.0"

# Public modules (none is imported with the package: the vLLM plugin path stays light).
__all__ = [
    "__version__", "boundary_key", "child", "cli", "errors", "exposition", "files", "fit", "lazy",
    "progress", "published", "reuse", "semconv", "serving", "settings", "store", "tables",
]
