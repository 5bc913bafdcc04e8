"""``stallfree export``: write a model as a Hugging Face directory (safetensors + tokenizer.json)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any


def add_parser(sub: Any) -> argparse.ArgumentParser:
    ex: argparse.ArgumentParser = sub.add_parser("export", help=__doc__.split(": ", 1)[1].rstrip("."))
    ex.add_argument("out", type=Path)
    ex.add_argument("--model", help="GGUF file or HF directory (default: the embedded SmolLM2)")
    return ex


def run(args: argparse.Namespace) -> None:
    from stallfree.core.model.export import export_hf_dir
    from stallfree.core.model.loader import load_model

    loaded = load_model(args.model)
    export_hf_dir(loaded, args.out)
    print(f"wrote {loaded.config.name} ({loaded.source}) to {args.out}", file=sys.stderr)
