"""Mixture-of-experts MLPs of Hugging Face's Mixtral (modeling_mixtral.py: block_sparse_moe, experts
w1/w3/w2), Qwen 3 MoE (modeling_qwen3_moe.py: mlp, experts gate_proj/up_proj/down_proj) and Qwen 2
MoE (modeling_qwen2_moe.py: Qwen 3 MoE's, plus a shared_expert every token passes through scaled by
sigmoid(shared_expert_gate x)), by plain PyTorch, for hf_reference.py: router logits through a bias-free gate [experts, hidden], softmax over
every expert in float32 (float64 for a float64 reference), the top num_experts_per_tok, their gates renormalized to sum to 1 (always
in Mixtral, where norm_topk_prob says in Qwen 3 MoE), each chosen expert a SwiGLU MLP, the token's
output the gate-weighted sum. Written token by token, as a reference should be."""
import torch
import torch.nn as nn
import torch.nn.functional as F


class Expert(nn.Module):
    def __init__(self, d, f, names):
        super().__init__()
        gate, up, down = names
        setattr(self, gate, nn.Linear(d, f, bias=False))
        setattr(self, up, nn.Linear(d, f, bias=False))
        setattr(self, down, nn.Linear(f, d, bias=False))
        self.names = names

    def forward(self, x):
        gate, up, down = (getattr(self, n) for n in self.names)
        return down(F.silu(gate(x)) * up(x))


class SparseMoeBlock(nn.Module):
    def __init__(self, c):
        super().__init__()
        mixtral = c["model_type"] == "mixtral"
        d = c["hidden_size"]
        f = c["intermediate_size"] if mixtral else c["moe_intermediate_size"]
        experts = c["num_local_experts"] if mixtral else c["num_experts"]
        self.top_k = c["num_experts_per_tok"]
        self.renormalize = mixtral or c.get("norm_topk_prob", False)
        self.gate = nn.Linear(d, experts, bias=False)
        names = ("w1", "w3", "w2") if mixtral else ("gate_proj", "up_proj", "down_proj")
        self.experts = nn.ModuleList([Expert(d, f, names) for _ in range(experts)])
        if c.get("shared_expert_intermediate_size"):  # Qwen 2 MoE's, gated
            self.shared_expert = Expert(d, c["shared_expert_intermediate_size"], names)
            self.shared_expert_gate = nn.Linear(d, 1, bias=False)

    def forward(self, x):
        shape = x.shape
        tokens = x.reshape(-1, shape[-1])
        logits = self.gate(tokens)  # softmax in float32 at least (Hugging Face's dtype=float)
        probs = F.softmax(logits if logits.dtype == torch.float64 else logits.float(), dim=-1)
        weights, chosen = torch.topk(probs, self.top_k, dim=-1)
        if self.renormalize:
            weights = weights / weights.sum(-1, keepdim=True)
        out = torch.zeros_like(tokens)
        for t in range(tokens.size(0)):
            for j in range(self.top_k):
                expert = self.experts[int(chosen[t, j])]
                out[t] += weights[t, j].to(tokens.dtype) * expert(tokens[t])
        if hasattr(self, "shared_expert"):
            out += torch.sigmoid(self.shared_expert_gate(tokens)) * self.shared_expert(tokens)
        return out.reshape(shape)


# Mixtral: 4 experts, 2 a token. Qwen 3 MoE: 8 experts of width 48, 3 a token, gates
# renormalized, q/k norms and head_dim 32.
MIXTRAL_CONFIG = {"model_type": "mixtral", "architectures": ["MixtralForCausalLM"],
                  "vocab_size": 512, "hidden_size": 64, "intermediate_size": 96,
                  "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                  "num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": None,
                  "router_aux_loss_coef": 0.02, "router_jitter_noise": 0.0, "rms_norm_eps": 1e-5,
                  "rope_theta": 1000000.0, "max_position_embeddings": 128,
                  "tie_word_embeddings": False, "hidden_act": "silu", "attention_dropout": 0.0,
                  "torch_dtype": "float32"}
QWEN3_MOE_CONFIG = {"model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"],
                    "vocab_size": 512, "hidden_size": 64, "intermediate_size": 176,
                    "moe_intermediate_size": 48, "num_hidden_layers": 2,
                    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
                    "num_experts": 8, "num_experts_per_tok": 3, "norm_topk_prob": True,
                    "decoder_sparse_step": 1, "mlp_only_layers": [], "router_aux_loss_coef": 0.001,
                    "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "max_position_embeddings": 128,
                    "rope_scaling": None, "attention_bias": False, "attention_dropout": 0.0,
                    "use_sliding_window": False, "sliding_window": None, "max_window_layers": 2,
                    "tie_word_embeddings": False, "hidden_act": "silu", "torch_dtype": "float32"}
# Qwen 2 MoE: q/k/v biases, 4 experts of width 32, 2 a token, raw gates, a gated shared expert.
QWEN2_MOE_CONFIG = {"model_type": "qwen2_moe", "architectures": ["Qwen2MoeForCausalLM"],
                    "vocab_size": 512, "hidden_size": 64, "intermediate_size": 176,
                    "moe_intermediate_size": 32, "shared_expert_intermediate_size": 80,
                    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                    "num_experts": 4, "num_experts_per_tok": 2, "norm_topk_prob": False,
                    "decoder_sparse_step": 1, "mlp_only_layers": [], "router_aux_loss_coef": 0.001,
                    "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "max_position_embeddings": 128,
                    "use_sliding_window": False, "sliding_window": 4096, "max_window_layers": 2,
                    "tie_word_embeddings": False, "hidden_act": "silu", "torch_dtype": "float32"}
