"""The published configs of the model family, shipped in the package, and what a MODEL argument names.

Each folder here holds one model's `config.json` (the NVFP4 ones also `hf_quant_config.json`): shapes and
quantization settings, no weights and no tokenizer. Plain folders are the bf16 models; `-fp8`, `-awq` and
`-nvfp4` are the same shapes with the `quantization_config` of Qwen's official FP8 (128x128 weight blocks),
compressed-tensors W4A16 (int4, group 128) and NVIDIA ModelOpt NVFP4 checkpoints. With them
`deltaserve plan Qwen/Qwen3.5-27B` and `deltaserve serve Qwen/Qwen3.5-27B --load-format dummy` run offline.

`resolve_model` turns a MODEL argument into a folder, in this order: an existing local path; the hub id's
snapshot in the local Hugging Face cache (a real checkpoint, e.g. after `hf download`); the shipped config of
a known hub id (only where no weights are needed); else a ConfigError saying what would work. Nothing is
ever downloaded.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from deltaserve.config import ConfigError

CONFIGS_DIR = Path(__file__).resolve().parent
_HUB_ID = re.compile(r"[\w.-]+/[\w.-]+")  # owner/name, as the Hugging Face Hub spells repository ids


@dataclass(frozen=True)
class KnownModel:
    hub_id: str
    folder: str  # the shipped config's folder under CONFIGS_DIR
    confirmed: bool  # True: a published repository we are sure of; False: a plausible name, unchecked


KNOWN_MODELS = (
    # Qwen's own releases (bf16, and the official block-wise FP8 ones)
    KnownModel("Qwen/Qwen3.5-0.8B", "qwen3.5-0.8b", True),
    KnownModel("Qwen/Qwen3.5-4B", "qwen3.5-4b", True),
    KnownModel("Qwen/Qwen3.5-9B", "qwen3.5-9b", True),
    KnownModel("Qwen/Qwen3.5-27B", "qwen3.5-27b", True),
    KnownModel("Qwen/Qwen3.5-35B-A3B", "qwen3.5-35b-a3b", True),
    KnownModel("Qwen/Qwen3.5-122B-A10B", "qwen3.5-122b-a10b", True),
    KnownModel("Qwen/Qwen3.5-397B-A17B", "qwen3.5-397b-a17b", True),
    KnownModel("Qwen/Qwen3-Next-80B-A3B-Instruct", "qwen3-next-80b-a3b", True),
    KnownModel("Qwen/Qwen3-Next-80B-A3B-Thinking", "qwen3-next-80b-a3b", True),  # the same shapes
    KnownModel("Qwen/Qwen3.5-27B-FP8", "qwen3.5-27b-fp8", True),
    KnownModel("Qwen/Qwen3.5-35B-A3B-FP8", "qwen3.5-35b-a3b-fp8", True),
    KnownModel("Qwen/Qwen3.5-122B-A10B-FP8", "qwen3.5-122b-a10b-fp8", True),
    # community quantizations users serve (../shared/COMMAND_LINES.md names the two 27B ones)
    KnownModel("cyankiwi/Qwen3.5-27B-AWQ-4bit", "qwen3.5-27b-awq", True),
    KnownModel("Kbenkhaled/Qwen3.5-27B-NVFP4", "qwen3.5-27b-nvfp4", True),
    # names seen in public serving scripts, not checked against the hub
    KnownModel("cyankiwi/Qwen3.5-35B-A3B-AWQ-4bit", "qwen3.5-35b-a3b-awq", False),
    KnownModel("AxionML/Qwen3.5-35B-A3B-NVFP4", "qwen3.5-35b-a3b-nvfp4", False),
    KnownModel("Sehyo/Qwen3.5-35B-A3B-NVFP4", "qwen3.5-35b-a3b-nvfp4", False),
)
_BY_ID = {m.hub_id.lower(): m for m in KNOWN_MODELS}  # the Hub matches repository ids case-insensitively


def shipped_config(hub_id: str) -> Path | None:
    """The shipped config folder of a known hub id, else None."""
    known = _BY_ID.get(hub_id.lower())
    return None if known is None else CONFIGS_DIR / known.folder


def is_shipped_config(path: str | Path) -> bool:
    """Whether `path` is one of the shipped config folders (a config, no weights, no tokenizer)."""
    return Path(path).resolve().parent == CONFIGS_DIR and (Path(path) / "config.json").is_file()


def resolve_model(model: str, need_weights: bool, flag: str = "MODEL") -> Path:
    """The folder (or config.json file) that `model` names; see the module docstring for the order.

    need_weights: the caller loads the checkpoint's weights (not `--load-format dummy`, not a plan), so a
    shipped config, which has none, does not do. Raises ConfigError naming `flag` and `model`.
    """
    path = Path(model).expanduser()
    if path.exists():
        return path
    if _HUB_ID.fullmatch(model):
        cached = _hf_cache_snapshot(model)
        if cached is not None:
            return cached
    shipped = shipped_config(model)
    if shipped is not None and not need_weights:
        return shipped
    if shipped is not None:
        raise ConfigError(
            f"{flag} {model!r} is a hub id with no local copy (no such directory, not in the Hugging Face cache) "
            "and deltaserve downloads nothing: pass a local checkpoint directory (config.json, safetensors, "
            "tokenizer), e.g. one made by `hf download`, or add --load-format dummy for random weights of its "
            "published shape")
    if not _HUB_ID.fullmatch(model):
        # e.g. ../shared/configs/qwen3.5-27b from an older README: the same config ships under a hub id
        same = next((m.hub_id for m in KNOWN_MODELS if m.folder == path.name.lower()), None)
        hint = f"; its published config ships with deltaserve as {same!r}" if same else ""
        raise ConfigError(f"{flag} {model!r}: no such file or directory{hint}")
    known = ", ".join(m.hub_id for m in KNOWN_MODELS)
    raise ConfigError(
        f"{flag} {model!r} is neither a local directory nor a hub id in the Hugging Face cache or among the "
        f"published configs shipped with deltaserve ({known}); pass a local checkpoint directory")


def _hf_cache_snapshot(hub_id: str) -> Path | None:
    """The hub id's snapshot in the local Hugging Face cache, if one with a config.json is there."""
    try:
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import LocalEntryNotFoundError
    except ImportError:  # transformers brings huggingface_hub; without it there is no cache to look in
        return None
    try:
        folder = Path(snapshot_download(hub_id, local_files_only=True))
    except (LocalEntryNotFoundError, ValueError, OSError):  # not cached, or not a valid repository id
        return None
    return folder if (folder / "config.json").is_file() else None
