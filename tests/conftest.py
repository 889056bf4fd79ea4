"""Shared fixtures: the real SmolLM2 tokenizer and tiny random Llama models that run in milliseconds on a CPU."""
from __future__ import annotations

import sys
from pathlib import Path

import os

import pytest
import torch

# model.precision = "auto" on a CPU with native bf16 (AVX512-BF16, AMX) would autocast to bf16: the suite's CPU runs
# stay fp32, so they compute the same numbers on every CPU (subprocesses inherit it).
os.environ.setdefault("GSPO_CPU_BF16", "0")

# Without a GPU, Triton kernels run in Triton's interpreter (it must be chosen before a kernel is defined).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Lets the tests run from a plain checkout, before `pip install -e .`.
_SRC = Path(__file__).resolve().parents[1] / "src"
if str(_SRC) not in sys.path:
    sys.path.insert(0, str(_SRC))

from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM  # noqa: E402

ASSETS = _SRC / "gspo" / "assets" / "smollm2-135m-instruct"


# With the usual 0.02 init and tied embeddings, greedy decoding just repeats the last prompt token and sampling is
# near-uniform; 0.3 gives varied, peaked next-token distributions, so exactness tests can actually fail.
INIT_STD = 0.3


def tiny_llama(vocab_size: int = 512, seed: int = 0, init_std: float = INIT_STD) -> LlamaForCausalLM:
    """A 2-layer Llama (hidden 64, 4 heads, 2 KV heads) with weights fixed by ``seed``, in eval mode, float32."""
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        initializer_range=init_std,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).float().eval()
    return model


@pytest.fixture(scope="session")
def tokenizer():
    """The real SmolLM2-135M-Instruct tokenizer (EOS and pad ``<|im_end|>``, id 2) from the shipped assets."""
    return AutoTokenizer.from_pretrained(ASSETS)


@pytest.fixture
def tiny_model(tokenizer):
    """A fresh tiny random Llama whose vocabulary matches the SmolLM2 tokenizer (49152 ids)."""
    return tiny_llama(vocab_size=len(tokenizer), seed=0)


@pytest.fixture
def make_tiny_model(tokenizer):
    """A factory for tiny random Llamas: ``make_tiny_model(seed=1, vocab_size=512, init_std=0.02)``."""

    def make(seed: int = 0, vocab_size: int | None = None, init_std: float = INIT_STD) -> LlamaForCausalLM:
        return tiny_llama(vocab_size=vocab_size or len(tokenizer), seed=seed, init_std=init_std)

    return make


@pytest.fixture
def user_folder(tmp_path, monkeypatch):
    """The current folder is ``tmp_path`` and, as under the ``gspo`` command (whose first import path is its own
    script's folder), it is not on the import path."""
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", os.getcwd(), str(tmp_path))])
    monkeypatch.chdir(tmp_path)
    return tmp_path
