"""``gspo export``: a trained checkpoint as a standard Hugging Face model directory that transformers, vLLM and other
tools load without gspo: the weights (in the dtype asked for), the config, the tokenizer with its chat template, and a
generation config that stops at the chat template's end-of-turn token as gspo's engines do.

A LoRA checkpoint is exported as its peft adapter as trained (fp32, with the tokenizer; loadable with
``PeftModel.from_pretrained`` on the base model the run trained, named by its ``base_model_name_or_path``), or with
``merge_lora`` as the base model with the adapter merged in: a whole model like any other export.

:func:`new_directory` is how a command writes a directory the user named (``gspo export --out``, ``gspo upcycle
--out``): whole or not at all, never over an existing one.
"""
from __future__ import annotations

import fcntl
import logging
import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from gspo.checkpoint import MARKER, complete_checkpoints, fsync_tree, verify
from gspo.errors import UserError

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp16": torch.float16}
GGUF_FILE = "model.gguf"
# In OUT.tmp from its first moment: the writer's pid. It tells gspo's own unfinished directory from a user's, and the
# flock held on OUT.tmp tells a live writer from one that was killed (whose leftover the next run clears).
WRITING = ".gspo-writing"

log = logging.getLogger("gspo")


def checkpoint_of(path: Path) -> Path:
    """``path`` itself when it is a complete checkpoint, the newest complete one when it is a run directory."""
    if (path / MARKER).is_file():
        damaged = verify(path)
        if damaged:
            raise UserError(f"checkpoint {str(path)!r} is damaged: {damaged}; export another checkpoint of the run.")
        return path
    done = complete_checkpoints(path / "checkpoints")
    for ckpt in reversed(done):  # the newest one that is as it was written, as --resume takes it
        damaged = verify(ckpt)
        if not damaged:
            return ckpt
        log.warning("skipping checkpoint %s: %s", ckpt, damaged)
    if done:
        raise UserError(f"checkpoint {str(done[-1])!r} is damaged: {verify(done[-1])}, and no earlier complete "
                        f"checkpoint of {str(path)!r} is intact; there is no model to export.")
    raise UserError(f"{str(path)!r} is neither a complete checkpoint nor a run directory with one; pass "
                    "runs/NAME or runs/NAME/checkpoints/step-N.")


def export(source: Path, out: Path, *, dtype: str = "bf16", merge_lora: bool = False, gguf: bool = False) -> Path:
    """Write the model of checkpoint (or run directory) ``source`` to the new directory ``out`` (with ``gguf``, also
    as ``out/model.gguf``); returns the checkpoint exported. Written through :func:`new_directory`, so ``out`` is
    whole or absent."""
    from gspo.models import lora
    from gspo.models import load_model, load_tokenizer, stop_token_ids

    if dtype not in DTYPES:
        raise UserError(f"--dtype {dtype!r} is not one of {', '.join(DTYPES)}; pick one of them.")
    ckpt = checkpoint_of(source)
    adapter = lora.is_adapter(ckpt)
    if merge_lora and not adapter:
        raise UserError(f"--merge-lora: {str(ckpt)!r} holds full weights, not a LoRA adapter, so there is nothing to "
                        "merge; drop --merge-lora.")
    if adapter and gguf and not merge_lora:
        raise UserError("--gguf writes a whole model: add --merge-lora to export a LoRA checkpoint as GGUF.")
    if adapter:
        lora.read_adapter(ckpt)  # a damaged adapter is named here, before anything is written
    with new_directory(out) as tmp:
        if adapter and not merge_lora:
            for name in (lora.ADAPTER_CONFIG, lora.ADAPTER_WEIGHTS):
                shutil.copy2(ckpt / name, tmp / name)
            load_tokenizer(str(ckpt)).save_pretrained(tmp)
        else:
            model, tokenizer = load_model(str(ckpt), dtype=torch.float32)
            model = model.to(DTYPES[dtype])
            stops = stop_token_ids(tokenizer, model)
            model.generation_config.eos_token_id = stops[0] if len(stops) == 1 else stops
            model.generation_config.pad_token_id = tokenizer.pad_token_id
            if gguf:  # first: a family or tokenizer it cannot write is refused before the HF files are written
                write_gguf(model, tokenizer, tmp / GGUF_FILE, dtype)
            model.save_pretrained(tmp, safe_serialization=True)
            tokenizer.save_pretrained(tmp)
    return ckpt


def export_critic(source: Path, out: Path, *, dtype: str = "bf16") -> Path:
    """Write the value model of PPO checkpoint (or run directory) ``source`` to the new directory ``out`` as
    ``<Arch>ForTokenClassification`` with one label: the layout in which transformers (and verl, whose critics are
    ``AutoModelForTokenClassification`` with ``num_labels = 1``) load a value model. Its decoder is the critic's, its
    ``score`` layer the critic's scalar head; the values it gives are the trainer's. Returns the checkpoint."""
    import json

    from transformers import AutoConfig, AutoModelForTokenClassification

    from gspo.models import load_tokenizer
    from gspo.models.load import load_model_config

    if dtype not in DTYPES:
        raise UserError(f"--dtype {dtype!r} is not one of {', '.join(DTYPES)}; pick one of them.")
    ckpt = checkpoint_of(source)
    state = torch.load(ckpt / "trainer_state.pt", map_location="cpu", weights_only=False).get("critic")
    if state is None:
        raise UserError(f"checkpoint {str(ckpt)!r} has no value model (its run was not algorithm = 'ppo'); drop "
                        "--critic to export the policy.")
    run_config = ckpt.parent.parent / "config.json"  # the run's settings: ppo.critic_model names another model
    critic_model = (json.loads(run_config.read_text()).get("ppo", {}).get("critic_model")
                    if run_config.is_file() else None)
    config = load_model_config(critic_model) if critic_model else AutoConfig.from_pretrained(ckpt)
    config.num_labels = 1
    try:
        model = AutoModelForTokenClassification.from_config(config).float()
    except ValueError as e:
        raise UserError(f"transformers has no token-classification model for {config.model_type!r} to export the "
                        f"value model as ({e}); the critic's weights stay in {str(ckpt / 'trainer_state.pt')!r}.") from e
    prefix = model.base_model_prefix
    weights = {f"{prefix}.{k[len('backbone.'):]}": v for k, v in state.items() if k.startswith("backbone.")}
    weights.update({"score.weight": state["head.weight"], "score.bias": state["head.bias"]})
    missing, unexpected = model.load_state_dict(weights, strict=False)
    if missing or unexpected:
        raise UserError(f"the value model of {str(ckpt)!r} does not fit {type(model).__name__} (missing {missing[:3]}, "
                        f"unexpected {unexpected[:3]}); was the run's ppo.critic_model changed since?")
    with new_directory(out) as tmp:
        model.to(DTYPES[dtype]).save_pretrained(tmp, safe_serialization=True)
        load_tokenizer(str(ckpt)).save_pretrained(tmp)
    return ckpt


@contextmanager
def new_directory(out: Path, flag: str = "--out") -> Iterator[Path]:
    """The new directory ``out``, written whole or not at all: the body writes into ``OUT.tmp``, which is fsynced and
    renamed to ``out`` when the body returns and removed when it raises. An existing ``out`` is refused (nothing is
    overwritten); so is an ``OUT.tmp`` that another live gspo process is writing (two commands given one ``flag``) or
    that gspo did not make. One left by a gspo process that was killed is cleared, so the same command run again
    works; until then its name and its ``WRITING`` file mark it unfinished."""
    if out.exists() or out.is_symlink():
        raise UserError(f"{str(out)!r} exists; name a new {flag} directory (nothing is overwritten).")
    tmp = out.with_name(out.name + ".tmp")
    fd = _claim(tmp, flag)
    try:
        yield tmp
        fsync_tree(tmp)  # whole on disk before it takes its name
        os.rename(tmp, out)
    except BaseException as e:
        _remove(tmp)
        from safetensors import SafetensorError

        if not isinstance(e, (OSError, SafetensorError)):  # safetensors reports a full disk as its own error
            raise
        reason = getattr(e, "strerror", None) or str(e)
        raise UserError(f"Writing {str(out)!r} failed ({reason}); nothing was left there. Free disk space or pick "
                        f"another {flag}.") from e
    finally:
        os.close(fd)
    (out / WRITING).unlink(missing_ok=True)  # after the rename: OUT.tmp carries it until its last moment


def _claim(tmp: Path, flag: str) -> int:
    """Make ``tmp`` this process's (created, flocked, marked); returns the descriptor holding the lock."""
    busy = UserError(f"{str(tmp)!r} is being written by another gspo process (two commands with the same {flag}); "
                     f"wait for it to finish, or name another {flag}.")
    try:
        tmp.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UserError(f"{str(tmp.parent)!r} cannot be made a directory ({e.strerror or e}); pick another "
                        f"{flag}.") from e
    for _ in range(3):
        try:
            os.mkdir(tmp)
        except FileExistsError:
            _clear_stale(tmp, flag, busy)
            continue
        except OSError as e:
            raise UserError(f"{str(tmp)!r} cannot be created ({e.strerror or e}); pick another {flag}.") from e
        fd = os.open(tmp, os.O_RDONLY | os.O_DIRECTORY)
        # Another process may have cleared an empty OUT.tmp and made its own between this mkdir and this open.
        if _lock(fd) is False or os.fstat(fd).st_ino != os.stat(tmp).st_ino:
            os.close(fd)
            raise busy
        (tmp / WRITING).write_text(f"{os.getpid()}\n")
        return fd
    raise busy


def _clear_stale(tmp: Path, flag: str, busy: UserError) -> None:
    """Remove ``tmp`` when a killed gspo process left it (marked, or still empty, and unlocked); refuse otherwise."""
    try:
        fd = os.open(tmp, os.O_RDONLY | os.O_DIRECTORY)
    except FileNotFoundError:  # its writer finished or gave up meanwhile
        return
    except OSError as e:
        raise UserError(f"{str(tmp)!r} exists and is not a directory gspo made; remove it or name another "
                        f"{flag}.") from e
    try:
        held = _lock(fd)
        if held is False:
            raise busy
        entries = os.listdir(tmp)
        if entries and WRITING not in entries:
            raise UserError(f"{str(tmp)!r} exists and was not made by gspo; remove it or name another {flag} "
                            "(nothing is overwritten).")
        if held is None:
            raise UserError(f"{str(tmp)!r} exists and this file system cannot tell whether a gspo process still "
                            f"writes it (no flock); remove it if none does, or name another {flag}.")
        log.warning("removing %s, left unfinished by a gspo process that was stopped while writing it", tmp)
        _remove(tmp)
    finally:
        os.close(fd)


def _remove(tmp: Path) -> None:
    """Delete ``tmp`` with its ``WRITING`` mark last, so a kill midway leaves it still recognisably gspo's."""
    try:
        entries = [p for p in tmp.iterdir() if p.name != WRITING]
    except OSError:
        return
    for p in entries:
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p, ignore_errors=True)
        else:
            p.unlink(missing_ok=True)
    (tmp / WRITING).unlink(missing_ok=True)
    try:
        os.rmdir(tmp)
    except OSError:
        pass


def _lock(fd: int) -> bool | None:
    """An exclusive flock on ``fd`` without waiting: True when taken, False when another process holds it, None on a
    file system without flock (the lock goes with the process, whatever ends it)."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False
    except OSError:
        return None


# GGUF tensor types for --dtype; 1-D tensors (norms) stay F32 as llama.cpp's own converter writes them.
_GGUF_TYPES = {"fp32": ("F32", "ALL_F32"), "fp16": ("F16", "MOSTLY_F16"), "bf16": ("BF16", "MOSTLY_BF16")}


def _permute_rope(w: torch.Tensor, heads: int) -> torch.Tensor:
    """llama.cpp's row order of a Q or K projection: within each head, the interleaved rotary pairs of its GGUF
    layout instead of HF's two halves (transformers' GGUF loader undoes exactly this)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(model, tokenizer, path: Path, dtype: str = "bf16") -> None:
    """``model`` (a Llama-family HF model: ``llama`` or ``mistral`` without sliding windows) and ``tokenizer`` (a
    byte-level BPE tokenizer) as one GGUF file, metadata and tensor names as llama.cpp's converter writes them.

    Written here with the ``gguf`` package's writer and name map (the package llama.cpp publishes): transformers can
    read GGUF but not write it, and llama.cpp's converter script is not an installable library."""
    import json

    import gguf
    import numpy as np

    config = model.config
    if config.model_type not in ("llama", "mistral") or getattr(config, "sliding_window", None):
        raise UserError(f"GGUF export writes Llama-family models; this one is {config.model_type!r}. Export the HF "
                        "directory (without --gguf) and convert it with llama.cpp's convert_hf_to_gguf.py.")
    tok_json = json.loads(tokenizer.backend_tokenizer.to_str()) if getattr(tokenizer, "is_fast", False) else None
    if tok_json is None or tok_json.get("model", {}).get("type") != "BPE":
        raise UserError("GGUF export needs a fast byte-level BPE tokenizer (tokenizer.json); this one is not. Export "
                        "the HF directory (without --gguf) and convert it with llama.cpp's convert_hf_to_gguf.py.")
    tensor_type, file_type = _GGUF_TYPES[dtype]
    heads, kv_heads = config.num_attention_heads, getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name(getattr(config, "_name_or_path", "") or "gspo export")
    w.add_context_length(config.max_position_embeddings)
    w.add_embedding_length(config.hidden_size)
    w.add_block_count(config.num_hidden_layers)
    w.add_feed_forward_length(config.intermediate_size)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_layer_norm_rms_eps(config.rms_norm_eps)
    w.add_rope_freq_base(getattr(config, "rope_theta", None) or config.rope_parameters["rope_theta"])
    w.add_rope_dimension_count(head_dim)
    w.add_vocab_size(config.vocab_size)
    w.add_file_type(getattr(gguf.LlamaFileType, file_type))
    # The tokenizer: every id's token, its type, the BPE merges, special ids and the chat template.
    vocab = {i: t for t, i in tokenizer.get_vocab().items()}
    special = set(tokenizer.all_special_ids)
    tokens = [vocab.get(i, f"[PAD{i}]") for i in range(config.vocab_size)]
    types = [gguf.TokenType.CONTROL if i in special else gguf.TokenType.NORMAL if i in vocab else
             gguf.TokenType.UNUSED for i in range(config.vocab_size)]
    merges = [" ".join(m) if isinstance(m, list) else m for m in tok_json["model"]["merges"]]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    for add, token_id in ((w.add_bos_token_id, tokenizer.bos_token_id), (w.add_eos_token_id, tokenizer.eos_token_id),
                          (w.add_pad_token_id, tokenizer.pad_token_id), (w.add_unk_token_id, tokenizer.unk_token_id)):
        if token_id is not None:
            add(token_id)
    w.add_add_bos_token(False)
    if tokenizer.chat_template:
        w.add_chat_template(tokenizer.chat_template)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, config.num_hidden_layers)
    state = model.state_dict()
    if getattr(config, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)  # llama.cpp reads the embedding as the output layer when there is none
    for name, tensor in state.items():
        if name.endswith("rotary_emb.inv_freq"):
            continue
        new = names.get_name(name, try_suffixes=(".weight", ".bias"))
        if new is None:
            raise UserError(f"GGUF export has no llama.cpp name for the tensor {name!r}; export the HF directory "
                            "(without --gguf) instead.")
        t = tensor.detach().float()
        if name.endswith("q_proj.weight"):
            t = _permute_rope(t, heads)
        elif name.endswith("k_proj.weight"):
            t = _permute_rope(t, kv_heads)
        if t.dim() == 1 or tensor_type == "F32":
            w.add_tensor(new, t.numpy())
        elif tensor_type == "F16":
            w.add_tensor(new, t.half().numpy())
        else:  # bf16 has no numpy dtype: its raw 16 bits, typed for the writer
            w.add_tensor(new, t.bfloat16().view(torch.int16).numpy().view(np.uint16),
                         raw_dtype=gguf.GGMLQuantizationType.BF16)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
