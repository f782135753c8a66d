"""Structured output: grammar-constrained decoding with xgrammar (docs/structured_output.md).

    params.py    StructuredOutputsParams: what a request's output must match (vLLM's field names)
    compiler.py  GrammarCompiler: a constraint -> a compiled grammar, once per constraint (cached)
    matcher.py   GrammarState: one sequence's progress through its grammar; the batch's bitmask fill
    bitmask.py   the bitmask's host buffer and its application to the logits (inside the Sampler)

The server (or `LLM`) puts a StructuredOutputsParams on SamplingParams; the engine gives each sequence a
GrammarState (`Request.grammar`); the scheduler only carries it to the step's rows; after each step's samples
are read back the engine advances the states, fills the next step's bitmask on the host while the device runs
that step's forward, and the sampler applies it to the logits before sampling.
"""

from deltaserve.structured.params import StructuredOutputsParams

__all__ = ["StructuredOutputsParams"]
