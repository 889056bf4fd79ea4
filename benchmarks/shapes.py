"""Random-initialised models of a real model's shape, for benchmarks that must not be tuned to one model."""
import torch


def qwen25_05b_shape():
    """A Qwen2.5-0.5B-shaped Qwen2 model (896 hidden, 24 layers, 14 heads, 2 KV heads, 151,936 vocabulary), seed 0."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    return Qwen2ForCausalLM(Qwen2Config(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                                        num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=4096,
                                        tie_word_embeddings=True))


def qwen3_06b_shape():
    """A Qwen3-0.6B-shaped Qwen3 model (1024 hidden, 28 layers, 16 heads, 8 KV heads, head_dim 128, q/k norms), seed 0."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    return Qwen3ForCausalLM(Qwen3Config(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                                        num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                                        max_position_embeddings=4096, tie_word_embeddings=True))


def mistral_small_shape():
    """A small Mistral model (1024 hidden, 16 layers, 16 heads, 8 KV heads, 32,768 vocabulary, no sliding window),
    seed 0: the family's code path at a size that runs in seconds."""
    from transformers import MistralConfig, MistralForCausalLM

    torch.manual_seed(0)
    return MistralForCausalLM(MistralConfig(vocab_size=32768, hidden_size=1024, intermediate_size=3584,
                                            num_hidden_layers=16, num_attention_heads=16, num_key_value_heads=8,
                                            max_position_embeddings=4096, sliding_window=None))


SHAPES = {"qwen2.5-0.5b-shape": qwen25_05b_shape, "qwen3-0.6b-shape": qwen3_06b_shape,
          "mistral-small-shape": mistral_small_shape}


def bench_model(name: str):
    """``(model, tokenizer)`` for a benchmark's ``--model``: a name of ``SHAPES`` (random init, with SmolLM2's
    shipped tokenizer: ids are clamped to the vocabulary) or anything ``gspo.models.load_model`` takes."""
    from gspo.models import load_model, load_tokenizer

    if name in SHAPES:
        return SHAPES[name](), load_tokenizer()
    return load_model(name)


def bench_on_device(name: str, device: str):
    """``(device, autocast dtype, model in eval mode on it, tokenizer, card name)`` for a rollout benchmark's
    ``--model`` and ``--device``: bf16 autocast on CUDA, none on a CPU."""
    dev = torch.device(device)
    model, tok = bench_model(name)
    model.to(dev).eval()
    card = torch.cuda.get_device_name(0) if dev.type == "cuda" else "cpu"
    return dev, torch.bfloat16 if dev.type == "cuda" else None, model, tok, card
