"""Small llama-architecture GGUF models with random, seeded weights, for llama.cpp's server.

The weights are noise, so the text is too, but the engine does real work: prefill and decode cost
what a model of that shape costs, which is what the gateway's tests and load tests need.

One residual channel (the "bias channel") carries a constant: every token embedding holds the
same large value there, the blocks neither read it (their norms weigh it 0) nor write it (their
output projections have zero rows for it). The final norm passes it on, so it acts as a constant
input to the output layer, and its column there is a per-token output bias: it keeps the
end-of-text token and unprintable bytes from ever being sampled (generations always run to
`max_tokens`; `ignore_eos` is not needed) and favours whole words.
"""

from __future__ import annotations

import hashlib
import math
import os
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

import gguf
import numpy as np
from numpy.typing import NDArray

from .vocab import Bias, Vocab, build_vocab

# Bumped whenever the weights are generated differently, so that cached files are regenerated
# (the presets and the vocabulary are part of a file's cache key already).
FORMAT_VERSION = 1

BIAS_CHANNEL = 0
# Approximate logit shift per bias class; BANNED is far beyond what top-k/top-p/min-p or any
# sane temperature would ever sample.
BIAS_LOGITS = {Bias.BANNED: -60.0, Bias.PIECE: -1.0, Bias.WORD: 2.0}
# Standard deviation of the random part of the logits (before temperature).
LOGIT_SPREAD = 1.5


@dataclass(frozen=True)
class Preset:
    n_embd: int
    n_layer: int
    n_head: int
    n_head_kv: int
    n_ff: int
    dtype: str  # "f32" or "f16": the big matrices' type (f32 makes decoding memory-bound sooner)
    vocab_size: int = 0  # pad the vocabulary up to this many tokens (0: no padding)
    context_length: int = 32768


PRESETS = {
    # Loads in milliseconds and generates thousands of tokens per second: for functional tests.
    "tiny": Preset(n_embd=64, n_layer=2, n_head=4, n_head_kv=2, n_ff=128, dtype="f32"),
    # Tokens and prompts cost real CPU time. With one thread on a 2-core EPYC: about 30 ms per
    # generated token (the 128k-token output layer dominates) and 3.7 s to prefill 1,500 tokens;
    # a 1.2 GB file, written in about 8 s.
    "slow": Preset(
        n_embd=1024,
        n_layer=8,
        n_head=16,
        n_head_kv=4,
        n_ff=2816,
        dtype="f32",
        vocab_size=131072,
    ),
}


def cache_dir() -> Path:
    override = os.environ.get("LLM_GATEWAY_MODEL_DIR")
    return Path(override) if override else Path(tempfile.gettempdir()) / "llm-gateway-models"


def model_path(preset: str) -> Path:
    """The cached model file for `preset`, written first if missing (safe across processes)."""
    spec = PRESETS[preset]
    vocab = build_vocab(spec.vocab_size)
    identity = repr((FORMAT_VERSION, asdict(spec), vocab.tokens, vocab.merges, vocab.bias))
    key = hashlib.sha256(identity.encode()).hexdigest()[:12]
    path = cache_dir() / f"{preset}-{key}.gguf"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        # Written under a unique name, then renamed: a concurrent reader never sees half a file.
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{preset}-", suffix=".gguf")
        os.close(fd)
        try:
            write_model(tmp, preset)
            os.chmod(tmp, 0o644)  # mkstemp's 0600 would hide it from other users' test runs
            os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    return path


def write_model(path: str | os.PathLike[str], preset: str) -> None:
    """Write the `preset` model as a GGUF file at `path`; the same bytes on every call."""
    spec = PRESETS[preset]
    vocab = build_vocab(spec.vocab_size)
    rng = np.random.default_rng(int.from_bytes(hashlib.sha256(preset.encode()).digest()[:8]))
    writer = gguf.GGUFWriter(os.fspath(path), "llama")
    _write_metadata(writer, spec, vocab, preset)
    for name, tensor in _tensors(spec, vocab, rng):
        writer.add_tensor(name, tensor)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _write_metadata(writer: gguf.GGUFWriter, spec: Preset, vocab: Vocab, preset: str) -> None:
    writer.add_name(f"random-{preset}")
    writer.add_context_length(spec.context_length)
    writer.add_embedding_length(spec.n_embd)
    writer.add_block_count(spec.n_layer)
    writer.add_feed_forward_length(spec.n_ff)
    writer.add_head_count(spec.n_head)
    writer.add_head_count_kv(spec.n_head_kv)
    writer.add_rope_dimension_count(spec.n_embd // spec.n_head)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(len(vocab.tokens))
    writer.add_file_type(
        gguf.LlamaFileType.ALL_F32 if spec.dtype == "f32" else gguf.LlamaFileType.MOSTLY_F16
    )
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt-2")
    writer.add_token_list(vocab.tokens)
    writer.add_token_types(vocab.types)
    writer.add_token_merges(vocab.merges)
    writer.add_bos_token_id(vocab.eos_id)
    writer.add_eos_token_id(vocab.eos_id)
    writer.add_add_bos_token(False)


def _tensors(
    spec: Preset, vocab: Vocab, rng: np.random.Generator
) -> list[tuple[str, NDArray[np.float32] | NDArray[np.float16]]]:
    n, n_vocab = spec.n_embd, len(vocab.tokens)
    head_dim = n // spec.n_head
    n_kv = head_dim * spec.n_head_kv
    # Keep the residual stream near unit variance whatever the depth: every block adds at most
    # about 1 / n_layer of variance.
    out_scale = 1.0 / math.sqrt(2 * spec.n_layer)

    def normal(rows: int, cols: int, std: float) -> NDArray[np.float32]:
        return rng.standard_normal((rows, cols), dtype=np.float32) * np.float32(std)

    def matrix(array: NDArray[np.float32]) -> NDArray[np.float32] | NDArray[np.float16]:
        return array.astype(np.float16) if spec.dtype == "f16" else array

    # Rows are output features, columns input features (GGUF stores the transpose of ggml's ne).
    block_norm = np.ones(n, dtype=np.float32)
    block_norm[BIAS_CHANNEL] = 0.0  # the blocks never see the bias channel

    # Only looked up row by row, so half precision costs nothing in speed and halves the file.
    embeddings = normal(n_vocab, n, 1.0).astype(np.float16)
    # The bias channel holds as much energy as all other channels together, so after the final
    # RMS norm it reads about sqrt(n / 2).
    embeddings[:, BIAS_CHANNEL] = math.sqrt(n)

    tensors: list[tuple[str, NDArray[np.float32] | NDArray[np.float16]]] = [
        ("token_embd.weight", embeddings),
        ("output_norm.weight", np.ones(n, dtype=np.float32)),
        ("output.weight", matrix(_output_layer(spec, vocab, rng))),
    ]
    for layer in range(spec.n_layer):
        wo = normal(n, n, out_scale / math.sqrt(n))
        down = normal(n, spec.n_ff, out_scale / math.sqrt(spec.n_ff))
        wo[BIAS_CHANNEL] = 0.0  # nor write to it
        down[BIAS_CHANNEL] = 0.0
        blk = f"blk.{layer}"
        tensors += [
            (f"{blk}.attn_norm.weight", block_norm),
            (f"{blk}.attn_q.weight", matrix(normal(n, n, 1.0 / math.sqrt(n)))),
            (f"{blk}.attn_k.weight", matrix(normal(n_kv, n, 1.0 / math.sqrt(n)))),
            (f"{blk}.attn_v.weight", matrix(normal(n_kv, n, 1.0 / math.sqrt(n)))),
            (f"{blk}.attn_output.weight", matrix(wo)),
            (f"{blk}.ffn_norm.weight", block_norm),
            (f"{blk}.ffn_gate.weight", matrix(normal(spec.n_ff, n, 1.0 / math.sqrt(n)))),
            (f"{blk}.ffn_up.weight", matrix(normal(spec.n_ff, n, 1.0 / math.sqrt(n)))),
            (f"{blk}.ffn_down.weight", matrix(down)),
        ]
    return tensors


def _output_layer(spec: Preset, vocab: Vocab, rng: np.random.Generator) -> NDArray[np.float32]:
    n = spec.n_embd
    # After the final norm the other channels read about 1/sqrt(2) each.
    weights = rng.standard_normal((len(vocab.tokens), n), dtype=np.float32)
    weights *= np.float32(LOGIT_SPREAD / math.sqrt((n - 1) / 2))
    bias_channel_value = math.sqrt(n / 2)
    shifts = np.array([BIAS_LOGITS[bias] for bias in vocab.bias], dtype=np.float32)
    weights[:, BIAS_CHANNEL] = shifts / np.float32(bias_channel_value)
    return weights
