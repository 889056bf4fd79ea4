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


def qwen3_moe_shape():
    """A small Qwen3-MoE (Qwen3-30B-A3B's layout at 1024 hidden: 16 layers, 16 heads, 4 KV heads, head_dim 128, q/k
    norms, 64 experts of 384, top-8 renormalised, 151,936 vocabulary), seed 0."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    return Qwen3MoeForCausalLM(Qwen3MoeConfig(vocab_size=151936, hidden_size=1024, num_hidden_layers=16,
                                              num_attention_heads=16, num_key_value_heads=4, head_dim=128,
                                              num_experts=64, num_experts_per_tok=8, moe_intermediate_size=384,
                                              norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
                                              max_position_embeddings=4096, tie_word_embeddings=True))


def qwen2_moe_shape():
    """A small Qwen2-MoE (Qwen1.5-MoE-A2.7B's layout at 1024 hidden: 12 layers, 16 heads, 60 experts of 352, top-4
    not renormalised, a gated shared expert of 1408, qkv biases, 151,936 vocabulary), seed 0."""
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    torch.manual_seed(0)
    return Qwen2MoeForCausalLM(Qwen2MoeConfig(vocab_size=151936, hidden_size=1024, intermediate_size=2816,
                                              num_hidden_layers=12, num_attention_heads=16, num_key_value_heads=16,
                                              num_experts=60, num_experts_per_tok=4, moe_intermediate_size=352,
                                              shared_expert_intermediate_size=1408, norm_topk_prob=False,
                                              decoder_sparse_step=1, mlp_only_layers=[],
                                              max_position_embeddings=4096, tie_word_embeddings=True))


SHAPES = {"qwen2.5-0.5b-shape": qwen25_05b_shape, "qwen3-0.6b-shape": qwen3_06b_shape,
          "mistral-small-shape": mistral_small_shape, "qwen3-moe-shape": qwen3_moe_shape,
          "qwen2-moe-shape": qwen2_moe_shape}


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
