"""The command line shared by the synthetic tokenizers (vocab_tokenizer, bpe_tokenizer): MODEL OUT_DIR, a
tokenizer built for the model's config written into OUT_DIR."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path


def write_for_model(argv: list[str] | None, prog: str, description: str, build_for: Callable) -> int:
    """Parse MODEL OUT_DIR, save `build_for(model_config)`'s tokenizer into OUT_DIR and print its summary
    (`build_for` returns (tokenizer, summary))."""
    parser = argparse.ArgumentParser(prog=prog, description=description,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", help="checkpoint or config.json directory, or a hub id (e.g. Qwen/Qwen3.5-27B)")
    parser.add_argument("out", help="directory to write the tokenizer into (created)")
    args = parser.parse_args(argv)
    from deltaserve.config import ConfigError, ModelConfig
    from deltaserve.model_configs import resolve_model

    try:
        cfg = ModelConfig.from_pretrained(resolve_model(args.model, need_weights=False))
    except ConfigError as exc:
        parser.error(str(exc))
    tokenizer, summary = build_for(cfg)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(args.out)
    print(f"{args.out}: {summary}")
    return 0
