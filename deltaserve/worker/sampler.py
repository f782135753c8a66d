"""The batched sampler (its parameters: deltaserve/sampling.py).

`Sampler` turns one step's last-position logits [N, V] into one token per row, applying, in order:

  1. min_tokens: while a row has produced fewer than `min_tokens` tokens, its stop token ids and EOS
     ids are set to -inf (EOS only when `ignore_eos` is off: an ignored EOS stops nothing, as in vLLM).
  2. penalties: repetition (HF/vLLM: positive logits divided, negative multiplied, over prompt + output
     tokens), then frequency and presence (OpenAI: subtract count * frequency + presence over output tokens).
  2b. grammar: a structured-output row's tokens that its grammar forbids are set to -inf (the step's bitmask,
     filled on the host: deltaserve/structured/).
  3. greedy rows (temperature < 1e-5) take the argmax; other rows: temperature, top-k, top-p, min-p, then
     one draw from the resulting distribution.

Returned logprobs are log_softmax of the logits after steps 1 and 2 (2b included) but before temperature and the
top-k/top-p/min-p filters: the model's distribution as penalised for this request, not the truncated one
we drew from, so temperature and the filters never change them. This sits between vLLM's two modes,
"raw" (before any processing, its default) and "processed" (after temperature and the filters).

Sampling uses the exponential race: argmax(p / E) with E ~ Exp(1) i.i.d. picks token t with probability
p_t / sum(p). Every row draws its own [V] noise vector, so a seeded row (own `torch.Generator`) yields
the same tokens whatever else shares the batch and in whatever order.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from deltaserve.device import to_device
from deltaserve.sampling import SamplingParams
from deltaserve.structured.bitmask import GrammarMask, apply_grammar_mask


@dataclass
class SamplerOutput:
    token_ids: list[int]  # [N] sampled token per row
    logprobs: list[float | None]  # [N] logprob of each sampled token (penalised distribution, see module
    # doc); None where the step computed none (greedy rows that asked for no logprobs, see Sampler.sample)
    top_logprobs: list[list[tuple[int, float]] | None]  # per row: top `params.logprobs` (token, logprob)


class PendingSample:
    """One step's samples, still on the device; `result()` waits for their copy to the host.

    On CUDA the copy is queued without blocking (pinned host memory, an event marks its end), so the host
    can prepare the next step while the device works. token_ids stays on the device: async scheduling
    feeds it to the next step as input without a round trip.
    """

    def __init__(self, token_ids: torch.Tensor, logprobs: torch.Tensor | None,
                 top: tuple[torch.Tensor, torch.Tensor] | None, top_counts: dict[int, int]):
        self.token_ids = token_ids  # [N] int64, on the device
        self._top_counts = top_counts  # row -> how many top logprobs it asked for (the rows of `top`, in order)
        self._has_logprobs = logprobs is not None
        # top: values [W, k] and ids [W, k]
        tensors = [token_ids, *([logprobs] if logprobs is not None else []), *(top or ())]
        self._event = None
        if token_ids.is_cuda:
            self._host = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in tensors]
            for host, device_tensor in zip(self._host, tensors):
                host.copy_(device_tensor, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()
        else:
            self._host = tensors

    def result(self) -> SamplerOutput:
        if self._event is not None:
            self._event.synchronize()
        token_ids = self._host[0].tolist()
        logprobs = self._host[1].tolist() if self._has_logprobs else [None] * len(token_ids)
        top_logprobs: list[list[tuple[int, float]] | None] = [None] * len(token_ids)
        if self._top_counts:
            values, ids = self._host[2].tolist(), self._host[3].tolist()
            for (row, count), row_values, row_ids in zip(self._top_counts.items(), values, ids):
                top_logprobs[row] = list(zip(row_ids[:count], row_values[:count]))
        return SamplerOutput(token_ids, logprobs, top_logprobs)


def make_generator(seed: int, device: torch.device | str) -> torch.Generator:
    """A generator on `device` seeded with `seed`, taken modulo 2**64 (two's complement): one to one on the
    int64 seeds SamplingParams accepts; a child's seed + i past 2**63 wraps the same way."""
    generator = torch.Generator(device=device)
    generator.manual_seed(seed & 0xFFFF_FFFF_FFFF_FFFF)
    return generator


class Sampler:
    """Samples one token per row of last-position logits; stateless, so one instance serves all steps."""

    def __call__(self, logits: torch.Tensor, params: list[SamplingParams],
                 generators: list[torch.Generator | None], prompt_token_ids: list[list[int]],
                 output_token_ids: list[list[int]], eos_token_ids: list[set[int]],
                 grammar_mask: GrammarMask | None = None) -> SamplerOutput:
        """`sample`, waiting for the result."""
        return self.sample(logits, params, generators, prompt_token_ids, output_token_ids, eos_token_ids,
                           grammar_mask).result()

    def sample(self, logits: torch.Tensor, params: list[SamplingParams],
               generators: list[torch.Generator | None], prompt_token_ids: list[list[int]],
               output_token_ids: list[list[int]], eos_token_ids: list[set[int]],
               grammar_mask: GrammarMask | None = None) -> PendingSample:
        """Sample one token for each row of `logits` ([N, V], float32 or bf16; not modified).

        Every list has one entry per row: its params, its generator (None: global RNG), its prompt and
        output token ids (Python lists, or int64 numpy arrays, which skip a list -> array conversion
        costing ~30 ns per token, only paid by rows with penalties), and the EOS ids min_tokens blocks.
        `grammar_mask` constrains the rows it lists (structured output); the others sample as without it.
        """
        num_rows = logits.shape[0]
        for name, values in (("params", params), ("generators", generators),
                             ("prompt_token_ids", prompt_token_ids), ("output_token_ids", output_token_ids),
                             ("eos_token_ids", eos_token_ids)):
            if len(values) != num_rows:
                raise ValueError(f"{name} must have one entry per logits row ({num_rows}), got {len(values)}")
        if num_rows == 0:
            empty = torch.empty(0, dtype=torch.long, device=logits.device)
            return PendingSample(empty, empty.float(), None, {})

        if grammar_mask is not None and not grammar_mask.rows:
            grammar_mask = None
        if grammar_mask is None and all(p.greedy and p.logprobs is None and not _edits_logits(p, out)
                                        for p, out in zip(params, output_token_ids)):
            # Greedy with nothing to report but the token (the decode steady state of most servers): the
            # argmax of the logits as they are, without the float32 copy and the softmax below.
            return PendingSample(logits.argmax(dim=-1), None, None, {})

        # Work in float32 on a private copy: bf16 logits would quantise the penalties and the softmax.
        logits = logits.to(torch.float32, copy=True)  # [N, V]
        _mask_min_tokens(logits, params, output_token_ids, eos_token_ids)
        _apply_penalties(logits, params, prompt_token_ids, output_token_ids)
        if grammar_mask is not None:
            apply_grammar_mask(logits, grammar_mask)
        log_normalizer = torch.logsumexp(logits, dim=-1)  # [N]

        device = logits.device
        token_ids = torch.empty(num_rows, dtype=torch.long, device=device)  # [N]
        greedy_rows = [i for i, p in enumerate(params) if p.greedy]
        random_rows = [i for i, p in enumerate(params) if not p.greedy]
        if len(greedy_rows) == num_rows:  # the common case: no index tensors to build and copy
            token_ids = logits.argmax(dim=-1)
        elif greedy_rows:
            index = to_device(greedy_rows, device)
            token_ids[index] = _select_rows(logits, greedy_rows).argmax(dim=-1)
        if random_rows:
            index = to_device(random_rows, device)
            token_ids[index] = _sample(_select_rows(logits, random_rows), [params[i] for i in random_rows],
                                       [generators[i] for i in random_rows])

        sampled_logprobs = logits.gather(1, token_ids[:, None]).squeeze(1) - log_normalizer  # [N]
        wanted_rows = [i for i, p in enumerate(params) if p.logprobs is not None]
        top = None
        if wanted_rows:
            k = min(max(params[i].logprobs for i in wanted_rows), logits.shape[1])
            top_values, top_ids = _select_rows(logits, wanted_rows).topk(k, dim=-1)  # [W, k], descending
            top_values -= log_normalizer[to_device(wanted_rows, device)][:, None]
            top = (top_values, top_ids)
        return PendingSample(token_ids, sampled_logprobs, top, {row: params[row].logprobs for row in wanted_rows})


def _edits_logits(params: SamplingParams, output_token_ids) -> bool:
    """Whether a penalty or min_tokens changes this row's logits this step."""
    return params.has_penalties or len(output_token_ids) < params.min_tokens


def _select_rows(logits: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """logits[rows] ([R, V]); the tensor itself (no copy) when `rows` is every row in order."""
    if len(rows) == logits.shape[0]:
        return logits
    return logits[to_device(rows, logits.device)]


def _mask_min_tokens(logits: torch.Tensor, params: list[SamplingParams], output_token_ids: list[list[int]],
                     eos_token_ids: list[set[int]]) -> None:
    """In place: forbid the tokens that would end a row before it has `min_tokens` outputs."""
    vocab = logits.shape[1]
    rows, tokens = [], []
    for row, (p, output, eos) in enumerate(zip(params, output_token_ids, eos_token_ids)):
        if len(output) >= p.min_tokens:
            continue
        blocked = set(p.stop_token_ids) | (set() if p.ignore_eos else set(eos))
        # An id outside the vocabulary can never be sampled, so there is nothing to block.
        blocked = [t for t in blocked if 0 <= t < vocab]
        rows += [row] * len(blocked)
        tokens += blocked
    if rows:
        device = logits.device
        logits[to_device(rows, device), to_device(tokens, device)] = float("-inf")


def _unique_row_tokens(rows: list[int], token_lists: list, vocab: int, device: torch.device):
    """Distinct (row, token) pairs over each row's token list, and how often each occurs.

    Returns (row_index [P], token_index [P], counts [P]); work is O(tokens), never O(rows * vocab).
    Token lists may be Python lists or int64 numpy arrays (no conversion cost).
    """
    # numpy turns a list of ints into an array several times faster than torch.tensor does.
    keys = np.concatenate([np.asarray(tokens, dtype=np.int64) + row * vocab
                           for row, tokens in zip(rows, token_lists)])  # [T]
    keys, counts = to_device(keys, device).unique(return_counts=True)  # [P], [P]
    return keys // vocab, keys % vocab, counts


def _apply_penalties(logits: torch.Tensor, params: list[SamplingParams], prompt_token_ids: list[list[int]],
                     output_token_ids: list[list[int]]) -> None:
    """In place: repetition penalty, then frequency and presence penalties (only rows that set them)."""
    vocab, device = logits.shape[1], logits.device

    rows = [i for i, p in enumerate(params) if p.repetition_penalty != 1.0]
    rows = [i for i in rows if len(prompt_token_ids[i]) + len(output_token_ids[i]) > 0]
    if rows:
        # Listing each row twice (prompt, then output) lets unique() merge the two histories.
        seen = [prompt_token_ids[i] for i in rows] + [output_token_ids[i] for i in rows]
        row_index, token_index, _ = _unique_row_tokens(rows + rows, seen, vocab, device)
        penalty = to_device([p.repetition_penalty for p in params], device)[row_index]  # [P]
        values = logits[row_index, token_index]  # [P]
        # Dividing a positive logit and multiplying a negative one both make the token less likely (r > 1).
        logits[row_index, token_index] = torch.where(values > 0, values / penalty, values * penalty)

    rows = [i for i, p in enumerate(params) if p.frequency_penalty != 0.0 or p.presence_penalty != 0.0]
    rows = [i for i in rows if len(output_token_ids[i]) > 0]
    if rows:
        row_index, token_index, counts = _unique_row_tokens(rows, [output_token_ids[i] for i in rows],
                                                            vocab, device)
        frequency = to_device([p.frequency_penalty for p in params], device)[row_index]  # [P]
        presence = to_device([p.presence_penalty for p in params], device)[row_index]  # [P]
        logits[row_index, token_index] -= frequency * counts + presence


def _sample(logits: torch.Tensor, params: list[SamplingParams],
            generators: list[torch.Generator | None]) -> torch.Tensor:
    """Draw one token per row of `logits` ([S, V], left unchanged); returns [S] token ids."""
    device, vocab = logits.device, logits.shape[1]
    temperature = to_device([p.temperature for p in params], device)  # [S]
    logits = logits / temperature[:, None]  # [S, V], a new tensor: the filters below edit it in place

    top_k = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]  # vocab: no top-k
    filtered = [i for i, p in enumerate(params) if top_k[i] < vocab or p.top_p < 1.0]
    if filtered:
        index = to_device(filtered, device)
        k = to_device([top_k[i] for i in filtered], device)  # [F]
        top_p = to_device([params[i].top_p for i in filtered], device)  # [F]
        logits[index] = _top_k_top_p(logits[index], k, top_p)

    probs = logits.softmax(dim=-1)  # [S, V]
    if any(p.min_p > 0 for p in params):
        # min-p keeps tokens with p >= min_p * p_max. No renormalising needed: the race below is scale-free.
        min_p = to_device([p.min_p for p in params], device)  # [S]
        threshold = probs.amax(dim=-1, keepdim=True) * min_p[:, None]  # [S, 1]
        probs.masked_fill_(probs < threshold, 0.0)

    noise = torch.empty_like(probs)  # [S, V]
    if any(g is None for g in generators):
        noise.exponential_()  # global RNG; seeded rows are overwritten just below
    for row, generator in enumerate(generators):
        if generator is not None:
            noise[row].exponential_(generator=generator)
    # exponential_ can return exactly 0 (seen on CUDA); that would turn p / E into inf or nan.
    noise.clamp_(min=torch.finfo(noise.dtype).tiny)
    return probs.div_(noise).argmax(dim=-1)


def _top_k_top_p(logits: torch.Tensor, k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Top-k, then top-p on the renormalised survivors; [F, V] -> [F, V] with the rest at -inf.

    k[r] = V means no top-k, top_p[r] = 1 no top-p. Only the max(k) best candidates of each row are
    ranked, with torch.topk: far cheaper than sorting a 250k vocabulary. A full sort happens only when
    some row uses top-p without top-k.
    """
    num_candidates = int(k.max())
    if num_candidates < logits.shape[1]:
        values, ids = logits.topk(num_candidates, dim=-1)  # [F, C], descending
    else:
        values, ids = logits.sort(dim=-1, descending=True)  # [F, V]
    rank = torch.arange(num_candidates, device=logits.device)  # [C]
    values.masked_fill_(rank >= k[:, None], float("-inf"))
    probs = values.softmax(dim=-1)  # [F, C], the distribution renormalised over the top-k survivors
    # Keep the smallest prefix whose mass reaches top_p: a token survives if the mass before it is < top_p,
    # so the first one always does. Rows with top_p = 1 skip this: float rounding can push the running
    # mass to 1.0 before the tail and would cut it.
    mass_before = probs.cumsum(dim=-1) - probs  # [F, C]
    values.masked_fill_((mass_before >= top_p[:, None]) & (top_p[:, None] < 1.0), float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter_(1, ids, values)
