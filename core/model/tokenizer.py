"""Tokenizer: byte-level BPE (HF ``tokenizers``), chat template, token bytes.

Built either from a GGUF file's metadata (vocabulary, merges, token types,
chat template) or from a Hugging Face ``tokenizer.json``. ``token_bytes``
gives every token's raw bytes, so streaming can detokenize one token at a time
(see ``core.model.detokenizer``).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import json
import os
from functools import cache
from pathlib import Path
from typing import Any

from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

CONTROL = 3  # GGUF token type of control tokens (<|im_start|>, ...)
PIECE_CHARS = 8192  # longer text is encoded in pieces of about this size, off the GIL
TRIM_CHARS = 1 << 17  # after encoding text this long, the C heap gives its free memory back
# one encoding thread: the other cores belong to the engine's compute threads
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def _pieces(text: str) -> list[str]:
    """text cut into pieces of at most about PIECE_CHARS, each cut before a
    single space between two non-space characters: byte-level BPE
    pre-tokenizes " word" as one unit there, and no special token holds a space."""
    out, start = [], 0
    while len(text) - start > PIECE_CHARS:
        cut = min(start + PIECE_CHARS, len(text) - 2)
        while cut > start and not (text[cut] == " " and not text[cut - 1].isspace() and not text[cut + 1].isspace()):
            cut -= 1
        if cut == start:  # no such space in this stretch: the rest goes whole
            break
        out.append(text[start:cut])
        start = cut
    out.append(text[start:])
    return out


@cache
def _malloc_trim() -> Any:
    """glibc's malloc_trim, or None elsewhere."""
    name = ctypes.util.find_library("c")
    libc = ctypes.CDLL(name) if name else None
    return getattr(libc, "malloc_trim", None)


def _give_back_freed_memory() -> None:
    """Encoding 900 kB of text allocates about 190 MB in the tokenizer's own
    (Rust, C heap) structures; freed, glibc kept it in the thread's arena, so
    a few such prompts left the server 260 MB larger for good. malloc_trim
    returns it (20-50 ms, without the GIL, in the tokenizing thread)."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


@cache
def _byte_decoder() -> dict[str, int]:
    """GPT-2's reversible bytes <-> printable unicode mapping, reversed."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs, strict=True)}


def _byte_level_bytes(token: str) -> bytes:
    dec = _byte_decoder()
    try:
        return bytes(dec[ch] for ch in token)
    except KeyError:  # not a byte-level token (an added token's literal text)
        return token.encode()


def _metaspace_bytes(token: str) -> bytes:
    if len(token) == 6 and token.startswith("<0x") and token.endswith(">"):
        return bytes([int(token[3:5], 16)])  # byte fallback
    return token.replace("▁", " ").encode()


class Tokenizer:
    def __init__(
        self,
        tokenizer: HFTokenizer,
        eos_token_ids: frozenset[int],
        chat_template: str | None,
        special_ids: frozenset[int],
        bos_token: str = "",
        eos_token: str = "",
    ) -> None:
        self._tok = tokenizer
        self.eos_token_ids = eos_token_ids
        self.chat_template = chat_template
        self.special_ids = special_ids
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
        byte_level = isinstance(tokenizer.decoder, decoders.ByteLevel)
        to_bytes = _byte_level_bytes if byte_level else _metaspace_bytes
        self.token_bytes: list[bytes] = []
        for i in range(self.vocab_size):
            piece = tokenizer.id_to_token(i)
            self.token_bytes.append(b"" if piece is None or i in special_ids else to_bytes(piece))
        self._template = None
        if chat_template:
            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
            self._template = env.from_string(chat_template)

    # -- text <-> ids ------------------------------------------------------
    def encode(self, text: str) -> list[int]:
        """Token ids. ``tokenizers`` holds the GIL through a single ``encode``
        (0.5 s for 900 kB, a stall for every stream, and for the step thread
        with ``--engine thread``) but
        not through ``encode_batch``: long text goes in pieces, cut where the
        pre-tokenizer cuts anyway, so the ids are the same."""
        if len(text) <= PIECE_CHARS:
            return self._tok.encode(text, add_special_tokens=False).ids
        ids = [i for e in self._tok.encode_batch(_pieces(text), add_special_tokens=False) for i in e.ids]
        if len(text) >= TRIM_CHARS:
            _give_back_freed_memory()
        return ids

    def decode(self, ids: list[int]) -> str:
        return b"".join(self.token_bytes[i] for i in ids).decode("utf-8", errors="replace")

    @property
    def takes_tools(self) -> bool:
        """Does the chat template render a ``tools`` list itself (Qwen2, Llama 3)?"""
        return bool(self.chat_template) and "tools" in (self.chat_template or "")

    def render_chat(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
    ) -> str:
        """The prompt text for a conversation, by the model's own chat template."""
        if self._template is None:
            raise ValueError("this model has no chat template; send a raw prompt instead")
        return self._template.render(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token,
            eos_token=self.eos_token,
            tools=tools,
        )

    def to_hf_json(self) -> str:
        return self._tok.to_str()

    # -- construction ------------------------------------------------------
    @classmethod
    def from_gguf_metadata(cls, meta: dict[str, Any]) -> Tokenizer:
        kind = meta.get("tokenizer.ggml.model")
        if kind != "gpt2":
            raise ValueError(f"unsupported GGUF tokenizer model {kind!r} (only byte-level BPE, 'gpt2')")
        tokens: list[str] = meta["tokenizer.ggml.tokens"]
        types: list[int] = meta.get("tokenizer.ggml.token_type", [1] * len(tokens))
        merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
        bpe = models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges, fuse_unk=False)
        tok = HFTokenizer(bpe)
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),  # the GPT-2 regex
            ]
        )
        tok.decoder = decoders.ByteLevel()
        special = [i for i, t in enumerate(types) if t == CONTROL]
        tok.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False) for i in special])
        eos = meta.get("tokenizer.ggml.eos_token_id")
        bos = meta.get("tokenizer.ggml.bos_token_id")
        return cls(
            tok,
            frozenset([eos] if eos is not None else []),
            meta.get("tokenizer.chat_template"),
            frozenset(special),
            bos_token=tokens[bos] if bos is not None else "",
            eos_token=tokens[eos] if eos is not None else "",
        )

    @classmethod
    def from_hf_dir(cls, path: Path) -> Tokenizer:
        tok = HFTokenizer.from_file(str(path / "tokenizer.json"))
        config = _read_json(path / "tokenizer_config.json")
        vocab = tok.get_vocab(with_added_tokens=True)

        def token_text(value: Any) -> str:
            return value.get("content", "") if isinstance(value, dict) else (value or "")

        eos_text, bos_text = token_text(config.get("eos_token")), token_text(config.get("bos_token"))
        eos_ids = {vocab[eos_text]} if eos_text in vocab else set()
        generation = _read_json(path / "generation_config.json")
        gen_eos = generation.get("eos_token_id")
        eos_ids |= set(gen_eos if isinstance(gen_eos, list) else [gen_eos] if gen_eos is not None else [])
        template = config.get("chat_template")
        if template is None and (path / "chat_template.jinja").exists():
            template = (path / "chat_template.jinja").read_text()
        added = json.loads(tok.to_str()).get("added_tokens", [])
        special = frozenset(t["id"] for t in added if t.get("special"))
        return cls(tok, frozenset(eos_ids), template, special, bos_text, eos_text)


def _read_json(path: Path) -> dict[str, Any]:
    if not path.exists():
        return {}
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: invalid JSON ({exc})") from None
