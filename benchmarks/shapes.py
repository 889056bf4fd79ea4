"""Random-initialised models of a real model's shape, for benchmarks that must not be tuned to one model."""
import torch


def qwen25_05b_shape():
    """A Qwen2.5-0.5B-shaped Qwen2 model (896 hidden, 24 layers, 14 heads, 2 KV heads, 151,936 vocabulary), seed 0."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    return Qwen2ForCausalLM(Qwen2Config(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                                        num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=4096,
                                        tie_word_embeddings=True))


def bench_model(name: str):
    """``(model, tokenizer)`` for a benchmark's ``--model``: ``qwen2.5-0.5b-shape`` (random init, with SmolLM2's
    shipped tokenizer: ids are clamped to the vocabulary) or anything ``gspo.models.load_model`` takes."""
    from gspo.models import load_model, load_tokenizer

    if name == "qwen2.5-0.5b-shape":
        return qwen25_05b_shape(), load_tokenizer()
    return load_model(name)


def bench_on_device(name: str, device: str):
    """``(device, autocast dtype, model in eval mode on it, tokenizer, card name)`` for a rollout benchmark's
    ``--model`` and ``--device``: bf16 autocast on CUDA, none on a CPU."""
    dev = torch.device(device)
    model, tok = bench_model(name)
    model.to(dev).eval()
    card = torch.cuda.get_device_name(0) if dev.type == "cuda" else "cpu"
    return dev, torch.bfloat16 if dev.type == "cuda" else None, model, tok, card
