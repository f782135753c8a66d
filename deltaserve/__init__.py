"""deltaserve: a serving engine for hybrid linear-attention LLMs (Qwen3.5, Qwen3-Next).

Imports are lazy (module __getattr__): `import deltaserve.cache.block_pool` or the scheduler pulls in no torch,
and `from deltaserve import LLM` loads the engine only when asked for.
"""

from importlib import import_module
from importlib.metadata import PackageNotFoundError, version

try:  # pyproject.toml holds the version; the installed package's metadata carries it here
    __version__ = version("deltaserve")
except PackageNotFoundError:  # imported from a source tree that was never installed
    __version__ = "0+unknown"
__all__ = ["LLM", "RequestOutputKind", "SamplingParams", "__version__"]

_LAZY = {"LLM": "deltaserve.llm", "RequestOutputKind": "deltaserve.sampling", "SamplingParams": "deltaserve.sampling"}


def __getattr__(name):
    if name in _LAZY:
        return getattr(import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'deltaserve' has no attribute {name!r}")
