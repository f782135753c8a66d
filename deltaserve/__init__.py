"""deltaserve: a serving engine for hybrid linear-attention LLMs (Qwen3.5, Qwen3-Next)."""

from importlib.metadata import PackageNotFoundError, version

from deltaserve.sampling import RequestOutputKind, SamplingParams

try:  # pyproject.toml holds the version; the installed package's metadata carries it here
    __version__ = version("deltaserve")
except PackageNotFoundError:  # imported from a source tree that was never installed
    __version__ = "0+unknown"
__all__ = ["LLM", "RequestOutputKind", "SamplingParams", "__version__"]


def __getattr__(name):
    # LLM pulls in the whole engine; import it only when asked for
    if name == "LLM":
        from deltaserve.llm import LLM
        return LLM
    raise AttributeError(name)
