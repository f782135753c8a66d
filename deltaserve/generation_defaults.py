"""Default sampling parameters from a checkpoint's generation_config.json, as vLLM reads them.

Used by the server (request fields win over these) and by `LLM.generate` when no sampling params are given.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from deltaserve.config import ConfigError
from deltaserve.sampling import SamplingParams

logger = logging.getLogger(__name__)

# Keys of generation_config.json that vLLM takes as sampling defaults (max_new_tokens becomes max_tokens).
_GENERATION_CONFIG_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "max_new_tokens")
# --override-generation-config may also set these (vLLM ignores them there; we honour them).
_OVERRIDE_ONLY_KEYS = ("presence_penalty", "frequency_penalty", "max_tokens")


def sampling_defaults(model_dir: str | Path, generation_config: str, override: dict) -> dict[str, Any]:
    """Default SamplingParams fields from the checkpoint and --override-generation-config.

    `generation_config`: "auto" reads `model_dir`/generation_config.json, "vllm" reads nothing, anything else
    is a folder holding a generation_config.json. Raises ConfigError naming the flag for a bad value.
    """
    found: dict[str, Any] = {}
    if generation_config != "vllm":
        folder = Path(model_dir) if generation_config == "auto" else Path(generation_config)
        if generation_config != "auto" and not folder.is_dir():
            raise ConfigError(f"--generation-config {generation_config!r}: no such folder")
        file = folder / "generation_config.json"
        if file.is_file():
            try:
                raw = json.loads(file.read_text())
            except (OSError, json.JSONDecodeError) as exc:
                raise ConfigError(f"cannot read '{file}': {exc}") from exc
            found = {k: raw[k] for k in _GENERATION_CONFIG_KEYS if raw.get(k) is not None}
    if not isinstance(override, dict):
        raise ConfigError(f"--override-generation-config must be a JSON object, got {override!r}")
    unknown = sorted(set(override) - set(_GENERATION_CONFIG_KEYS) - set(_OVERRIDE_ONLY_KEYS))
    if unknown:
        logger.warning("--override-generation-config: ignoring key(s) %s (known: %s)", unknown,
                       sorted(_GENERATION_CONFIG_KEYS + _OVERRIDE_ONLY_KEYS))
    found.update({k: v for k, v in override.items() if k not in unknown and v is not None})
    if "max_new_tokens" in found:  # Hugging Face's name; an explicit max_tokens override wins over it
        found.setdefault("max_tokens", found.pop("max_new_tokens"))
    try:
        SamplingParams(**found)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"generation config defaults {found}: {exc} (see --generation-config and "
                          "--override-generation-config)") from exc
    if found:
        logger.info("default sampling parameters from the generation config: %s (--generation-config vllm "
                    "ignores the checkpoint's)", found)
    return found
