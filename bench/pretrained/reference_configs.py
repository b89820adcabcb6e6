"""The tiny configurations hf_reference.py writes (config.json of each reference checkpoint):
hidden_size 64 and 2 or 3 layers, each with the settings that make its architecture differ from
Llama's at values these 24-token inputs feel (windows of 5, soft-caps that bend the logits, a
query_pre_attn_scalar apart from head_dim, a head_dim apart from hidden_size / heads)."""

GPT2_CONFIG = {"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "vocab_size": 512,
               "n_embd": 64, "n_layer": 2, "n_head": 4, "n_positions": 128,
               "layer_norm_epsilon": 1e-5, "activation_function": "gelu_new",
               "tie_word_embeddings": True, "torch_dtype": "float32"}
LLAMA_CONFIG = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 512,
                "hidden_size": 64, "intermediate_size": 176, "num_hidden_layers": 2,
                "num_attention_heads": 4, "num_key_value_heads": 2, "rms_norm_eps": 1e-5,
                "rope_theta": 10000.0, "max_position_embeddings": 128,
                "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                 "high_freq_factor": 4.0, "original_max_position_embeddings": 32},
                "tie_word_embeddings": False, "hidden_act": "silu", "attention_bias": False,
                "torch_dtype": "float32"}
QWEN2_CONFIG = {"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], "vocab_size": 512,
                "hidden_size": 64, "intermediate_size": 176, "num_hidden_layers": 2,
                "num_attention_heads": 4, "num_key_value_heads": 2, "rms_norm_eps": 1e-6,
                "rope_theta": 1000000.0, "max_position_embeddings": 128, "rope_scaling": None,
                "use_sliding_window": False, "sliding_window": 4096, "max_window_layers": 2,
                "tie_word_embeddings": False, "hidden_act": "silu", "torch_dtype": "float32"}
QWEN3_CONFIG = {"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], "vocab_size": 512,
                "hidden_size": 64, "intermediate_size": 176, "num_hidden_layers": 2,
                "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
                "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "max_position_embeddings": 128,
                "rope_scaling": None, "attention_bias": False, "attention_dropout": 0.0,
                "use_sliding_window": False, "sliding_window": None, "max_window_layers": 2,
                "tie_word_embeddings": False, "hidden_act": "silu", "torch_dtype": "float32"}

# Mistral with a head_dim of its own and a window of 5 over the 24 reference tokens.
MISTRAL_CONFIG = {"model_type": "mistral", "architectures": ["MistralForCausalLM"],
                  "vocab_size": 512, "hidden_size": 64, "intermediate_size": 176,
                  "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                  "head_dim": 32, "sliding_window": 5, "rms_norm_eps": 1e-5,
                  "rope_theta": 1000000.0, "max_position_embeddings": 128,
                  "tie_word_embeddings": False, "hidden_act": "silu", "attention_dropout": 0.0,
                  "torch_dtype": "float32"}
# Gemma 2: local layer 0, global layer 1, both soft-caps small enough to bend these logits, and a
# query_pre_attn_scalar apart from head_dim.
GEMMA2_CONFIG = {"model_type": "gemma2", "architectures": ["Gemma2ForCausalLM"], "vocab_size": 512,
                 "hidden_size": 64, "intermediate_size": 176, "num_hidden_layers": 2,
                 "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
                 "query_pre_attn_scalar": 24, "sliding_window": 5, "rms_norm_eps": 1e-6,
                 "rope_theta": 10000.0, "max_position_embeddings": 128,
                 "attn_logit_softcapping": 1.0, "final_logit_softcapping": 0.5,
                 "hidden_activation": "gelu_pytorch_tanh", "attention_bias": False,
                 "attention_dropout": 0.0, "tie_word_embeddings": True, "torch_dtype": "float32"}
# Gemma 3 (text): layers 0 and 1 local (rope_local_base_freq), 2 global (rope_theta with linear
# scaling), q/k norms, no soft-caps.
GEMMA3_CONFIG = {"model_type": "gemma3_text", "architectures": ["Gemma3ForCausalLM"],
                 "vocab_size": 512, "hidden_size": 64, "intermediate_size": 176,
                 "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 1,
                 "head_dim": 32, "query_pre_attn_scalar": 32, "sliding_window": 5,
                 "sliding_window_pattern": 3, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
                 "rope_local_base_freq": 10000.0,
                 "rope_scaling": {"rope_type": "linear", "factor": 4.0},
                 "max_position_embeddings": 128, "attn_logit_softcapping": None,
                 "final_logit_softcapping": None, "hidden_activation": "gelu_pytorch_tanh",
                 "attention_bias": False, "attention_dropout": 0.0, "tie_word_embeddings": True,
                 "torch_dtype": "float32"}
