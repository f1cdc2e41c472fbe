"""The tiny model families of Baton's independent references, shared by scripts/hf_reference.py
(transformers makes and runs them) and scripts/py_reference.py (the pure-Python second
implementation): COMMON settings, and per family its transformers model_type and its own
settings. Both scripts must build the same configurations, so they live here once."""
import json
import os

COMMON = dict(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              max_position_embeddings=256, rms_norm_eps=1e-6, initializer_range=0.2,
              bos_token_id=1, eos_token_id=2)

FAMILIES = {
    "llama_gqa": ("llama", dict(num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)),
    "llama3_rope_scaled": ("llama", dict(num_attention_heads=4, num_key_value_heads=1, rope_llama3=dict(
        rope_theta=500000.0, rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
        original_max_position_embeddings=32))),
    "mistral": ("mistral", dict(num_attention_heads=4, num_key_value_heads=2, sliding_window=None)),
    "qwen2_bias_tied": ("qwen2", dict(num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)),
    "qwen3_qk_norm": ("qwen3", dict(num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                                    tie_word_embeddings=False)),
    # Issue 13: multi-head latent attention and experts. V2 as V2-Lite (no q_lora_rank) with
    # group-limited softmax routing (3 experts per token from the 4 of the best 2 groups: with
    # no more experts per token than groups kept, the grouping could never change a choice); V3
    # with q_lora_rank and noaux_tc routing (sigmoid scores, the correction bias, groups ranked by
    # their top two). One dense layer first, then MoE layers.
    "deepseek_v2_mla_moe": ("deepseek_v2", dict(
        num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=None, kv_lora_rank=32,
        qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=8, n_shared_experts=2,
        num_experts_per_tok=3, moe_intermediate_size=32, first_k_dense_replace=1,
        topk_method="group_limited_greedy", n_group=4, topk_group=2, routed_scaling_factor=1.5,
        tie_word_embeddings=False)),
    "deepseek_v3_mla_moe": ("deepseek_v3", dict(
        num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=32,
        qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=8, n_shared_experts=1,
        num_experts_per_tok=2, moe_intermediate_size=32, first_k_dense_replace=1, n_group=4, topk_group=2,
        norm_topk_prob=True, routed_scaling_factor=2.5, rope_interleave=True, tie_word_embeddings=False)),
}


def kept_names(index_path, only):
    """With --only: the families an existing index.json names that are not being made again
    (kept as they are); without: none (the index is written afresh)."""
    if not only or not os.path.exists(index_path):
        return []
    with open(index_path) as f:
        return [n for n in json.load(f) if n not in only]
