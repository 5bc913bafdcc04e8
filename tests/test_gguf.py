"""The GGUF reader: the embedded file's metadata, dequantization, bad files."""

import struct

import numpy as np
import pytest
import torch

from stallfree.core.model.gguf import Q4_0, Q4_1, Q8_0, GGUFError, GGUFFile, dequantize
from stallfree.core.model.loader import ModelLoadError, _unpermute, embedded_model_path, load_model


def f16(x: float) -> bytes:
    return np.array([x], dtype=np.float16).tobytes()


def test_embedded_model_metadata_and_shapes():
    g = GGUFFile(embedded_model_path())
    m = g.metadata
    assert m["llama.block_count"] == 30
    assert m["llama.embedding_length"] == 576
    assert m["llama.attention.head_count"] == 9
    assert m["llama.attention.head_count_kv"] == 3
    assert m["llama.rope.freq_base"] == 100000.0
    assert len(m["tokenizer.ggml.tokens"]) == 49152
    assert len(m["tokenizer.ggml.merges"]) == 48900
    assert g.tensors["blk.0.attn_k.weight"].shape == (192, 576)
    assert g.type_name("blk.0.attn_q.weight") == "Q4_1"
    assert g.type_name("token_embd.weight") == "Q8_0"
    w = g.array("blk.0.attn_q.weight")
    assert w.shape == (576, 576)
    assert np.isfinite(w).all()
    assert 0.001 < np.abs(w).mean() < 1


def test_dequantize_q8_0_q4_0_q4_1():
    q8 = f16(0.5) + np.arange(-16, 16, dtype=np.int8).tobytes()
    assert np.allclose(dequantize(np.frombuffer(q8, np.uint8), Q8_0, 32), 0.5 * np.arange(-16, 16))
    nib = bytes((lo | (hi << 4)) for lo, hi in zip(range(16), range(15, -1, -1), strict=True))
    expected = np.array(list(range(16)) + list(range(15, -1, -1)), dtype=np.float32)
    q40 = np.frombuffer(f16(2.0) + nib, np.uint8)
    assert np.allclose(dequantize(q40, Q4_0, 32), 2.0 * (expected - 8))
    q41 = np.frombuffer(f16(0.25) + f16(-1.0) + nib, np.uint8)
    assert np.allclose(dequantize(q41, Q4_1, 32), 0.25 * expected - 1.0)


def test_unpermute_inverts_llama_cpp_permutation():
    heads, hd, hidden = 3, 8, 5
    w = torch.randn(heads * hd, hidden)
    # llama.cpp's convert script: reshape(n_head, 2, rows/n_head/2, ...).swapaxes(1, 2)
    permuted = w.reshape(heads, 2, hd // 2, hidden).transpose(1, 2).reshape(w.shape)
    assert torch.equal(_unpermute(permuted, heads), w)


def test_bad_files_name_the_file(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"NOPE" + b"\0" * 64)
    with pytest.raises(GGUFError, match=r"bad\.gguf.*magic"):
        GGUFFile(bad)
    truncated = tmp_path / "cut.gguf"
    truncated.write_bytes(embedded_model_path().read_bytes()[:3_000_000])
    with pytest.raises(GGUFError, match=r"cut\.gguf.*(truncated|past the end)"):
        GGUFFile(truncated)
    header_only = tmp_path / "short.gguf"
    header_only.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 1, 1))
    with pytest.raises(GGUFError, match="truncated"):
        GGUFFile(header_only)
    with pytest.raises(ModelLoadError, match=r"cut\.gguf"):
        load_model(str(truncated))
    with pytest.raises(ModelLoadError, match="not found"):
        load_model(str(tmp_path / "missing.gguf"))
