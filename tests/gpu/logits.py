"""Teacher-forced logits of a checkpoint, the helpers the GPU parity tests (test_engine_gpu, test_quant_engine_gpu)
compare the GPU against the CPU float32 reference with."""

import torch

from deltaserve.config import ModelConfig
from deltaserve.layers.batch import ForwardBatch
from deltaserve.layers.quant import detect_weight_format
from deltaserve.model.loader import load_model
from deltaserve.worker.kv_cache import CacheShape, bind_caches


def prompt(n: int, seed: int, vocab: int = 1024) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def chunked_logits(path, dtype, device, ids: list[int], chunks: list[int]) -> torch.Tensor:
    """Logits of every position [len(ids), vocab], the prompt fed in `chunks` then one token at a time (decode
    steps), the weights quantized as the checkpoint says (bf16 ones: as they are)."""
    model = load_model(path, ModelConfig.from_pretrained(path), dtype, device, weight_format=detect_weight_format(path))
    bind_caches(model, CacheShape(64, 16, 4, dtype, torch.float32), device)
    out, done = [], 0
    for size in chunks + [1] * (len(ids) - sum(chunks)):
        blocks = list(range(1, 1 + -(-(done + size) // 16)))
        batch = ForwardBatch.build([done], [size], [blocks], [1], 16, device)
        with torch.inference_mode():
            hidden = model(torch.tensor(ids[done:done + size], device=device), batch)
            out.append(model.compute_logits(hidden).float().cpu())
        done += size
    return torch.cat(out)
