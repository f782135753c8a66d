"""deltaserve: a serving engine for hybrid linear-attention LLMs (Qwen3.5, Qwen3-Next)."""

from deltaserve.sampling import RequestOutputKind, SamplingParams

__version__ = "0.1.0"
__all__ = ["LLM", "RequestOutputKind", "SamplingParams", "__version__"]


def __getattr__(name):
    # LLM pulls in the whole engine; import it only when asked for
    if name == "LLM":
        from deltaserve.llm import LLM
        return LLM
    raise AttributeError(name)
