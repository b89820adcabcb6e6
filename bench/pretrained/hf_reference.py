#!/usr/bin/env python3
"""Tiny GPT-2, Llama, Qwen 2/3, Mistral, Gemma 2/3, Mixtral and Qwen 3 MoE checkpoints by PyTorch.

The modules follow Hugging Face's published structure and parameter names (modeling_gpt2.py,
modeling_llama.py): GPT-2's Conv1D weights stored [in, out], c_attn holding q, k and v side by
side, the head tied to wte; Llama's q/k/v/o, gate/up/down projections, two RMSNorms, rotary
positions in the rotate-half layout with Llama 3's frequency scaling, and grouped key/value
heads; Qwen 2 (modeling_qwen2.py) is Llama with biases on the q, k and v projections (not on
o_proj); Qwen 3 (modeling_qwen3.py) is Llama with an RMSNorm of each query and key head (q_norm,
k_norm, over head_dim, before the rotary embedding) and a head_dim of its own (here twice
hidden_size / num_attention_heads); Mistral (modeling_mistral.py) is Llama with a sliding
window: query i sees keys j with i - sliding_window < j <= i (Hugging Face's sliding-window mask;
the Qwens use it on layers max_window_layers onwards with use_sliding_window, and layer_types,
where given, says which layers). Gemma 2/3 (modeling_gemma2.py, modeling_gemma3.py): (1 + w)
RMSNorms before and after attention and MLP, GeGLU (tanh), embedding times sqrt(hidden_size) in its
dtype, tied head, scores scaled by query_pre_attn_scalar^-1/2 and soft-capped (cap tanh(s / cap);
the logits too), windowed local layers, Gemma 3's q/k norms and rope_local_base_freq. Mixtral and
Qwen 3 MoE: reference_moe.py. The newer models' logits are in float64 from float32 weights.
PyTorch 1.13 (Debian's python3-torch) runs it; neither transformers nor safetensors is needed.

  hf_reference.py write OUT_DIR      # OUT_DIR/<each model>: config.json, two shards,
                                     # model.safetensors.index.json, logits.safetensors
  hf_reference.py check DIR          # loads DIR (a model weave exported), recomputes its logits
                                     # on the fixed tokens, compares with DIR/logits.safetensors
  hf_reference.py edited DIR JSON OUT  # float64 logits of DIR's weights, config updated by JSON
  hf_reference.py bf16 DIR OUT       # DIR rounded to bfloat16 in one file, float64 logits of it
  hf_reference.py gradients DIR OUT  # float64 gradients of the next-token loss, some parameters
"""
import json
import math
import os
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

from reference_configs import (GEMMA2_CONFIG, GEMMA3_CONFIG, GPT2_CONFIG, LLAMA_CONFIG,
                               MISTRAL_CONFIG, QWEN2_CONFIG, QWEN3_CONFIG)
from reference_moe import MIXTRAL_CONFIG, QWEN2_MOE_CONFIG, QWEN3_MOE_CONFIG, SparseMoeBlock
from safetensors_io import load_safetensors, save_safetensors


class Conv1D(nn.Module):  # GPT-2's linear layer: weight [in, out]
    def __init__(self, nf, nx):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(nx, nf) * 0.02)
        self.bias = nn.Parameter(torch.randn(nf) * 0.02)

    def forward(self, x):
        return x @ self.weight + self.bias


class GPT2Attention(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.heads, self.dim = c["n_head"], c["n_embd"]
        self.c_attn = Conv1D(3 * self.dim, self.dim)
        self.c_proj = Conv1D(self.dim, self.dim)

    def forward(self, x):
        B, T, _ = x.shape
        q, k, v = self.c_attn(x).split(self.dim, dim=2)
        heads = lambda t: t.view(B, T, self.heads, -1).transpose(1, 2)
        q, k, v = heads(q), heads(k), heads(v)
        scores = q @ k.transpose(-1, -2) / math.sqrt(q.size(-1))
        mask = torch.ones(T, T, dtype=torch.bool).tril()
        scores = scores.masked_fill(~mask, float("-inf"))
        y = (scores.softmax(-1) @ v).transpose(1, 2).reshape(B, T, self.dim)
        return self.c_proj(y)


class GPT2MLP(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.c_fc = Conv1D(4 * c["n_embd"], c["n_embd"])
        self.c_proj = Conv1D(c["n_embd"], 4 * c["n_embd"])

    def forward(self, x):
        return self.c_proj(F.gelu(self.c_fc(x), approximate="tanh"))  # gelu_new


class GPT2Block(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.ln_1 = nn.LayerNorm(c["n_embd"], eps=c["layer_norm_epsilon"])
        self.attn = GPT2Attention(c)
        self.ln_2 = nn.LayerNorm(c["n_embd"], eps=c["layer_norm_epsilon"])
        self.mlp = GPT2MLP(c)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT2Model(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.wte = nn.Embedding(c["vocab_size"], c["n_embd"])
        self.wpe = nn.Embedding(c["n_positions"], c["n_embd"])
        self.h = nn.ModuleList([GPT2Block(c) for _ in range(c["n_layer"])])
        self.ln_f = nn.LayerNorm(c["n_embd"], eps=c["layer_norm_epsilon"])

    def forward(self, ids):
        x = self.wte(ids) + self.wpe(torch.arange(ids.size(1)))
        for block in self.h:
            x = block(x)
        return self.ln_f(x)


class GPT2LMHeadModel(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.transformer = GPT2Model(c)

    def forward(self, ids):  # the head tied to wte (no lm_head.weight of its own)
        return self.transformer(ids) @ self.transformer.wte.weight.t()


def head_dim_of(c):
    return c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]


def llama_inv_freq(c):
    head_dim = head_dim_of(c)
    inv = 1.0 / (c["rope_theta"] ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    s = c.get("rope_scaling")
    if s and s.get("rope_type") == "llama3":  # Llama 3.1's frequency scaling
        old = s["original_max_position_embeddings"]
        low, high = old / s["low_freq_factor"], old / s["high_freq_factor"]
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > low, inv / s["factor"], inv)
        smooth = (old / wavelen - s["low_freq_factor"]) / (s["high_freq_factor"] - s["low_freq_factor"])
        smoothed = (1 - smooth) * scaled / s["factor"] + smooth * scaled
        medium = (wavelen >= high) & (wavelen <= low)
        inv = torch.where(medium, smoothed, scaled)
    return inv


def layer_window(c, index):
    """The sliding window of layer `index` (None: it sees every earlier position)."""
    if c["model_type"] in ("qwen2", "qwen3"):
        window = c.get("sliding_window") if c.get("use_sliding_window") else None
        if window and index < c.get("max_window_layers", c["num_hidden_layers"]):
            window = None
    else:
        window = c.get("sliding_window")
    types = c.get("layer_types")
    if types is not None and window is None and types[index] == "sliding_attention":
        window = c.get("sliding_window")
    if types is not None and types[index] == "full_attention":
        window = None
    return window


def attention_mask(T, window):
    i, j = torch.arange(T)[:, None], torch.arange(T)[None, :]
    allowed = j <= i
    return allowed if window is None else allowed & (i - j < window)


def rotate_half(x):
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


class LlamaRMSNorm(nn.Module):
    def __init__(self, dim, eps):
        super().__init__()
        self.weight = nn.Parameter(1 + 0.1 * torch.randn(dim))
        self.eps = eps

    def forward(self, x):
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))


class LlamaAttention(nn.Module):
    def __init__(self, c, index=0):
        super().__init__()
        self.window = layer_window(c, index)
        self.heads, self.kv_heads = c["num_attention_heads"], c["num_key_value_heads"]
        self.head_dim = head_dim_of(c)
        d, bias = c["hidden_size"], c["model_type"] in ("qwen2", "qwen2_moe")
        self.q_proj = nn.Linear(d, self.heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(d, self.kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(d, self.kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.heads * self.head_dim, d, bias=False)
        self.qk_norm = c["model_type"] in ("qwen3", "qwen3_moe")
        if self.qk_norm:
            self.q_norm = LlamaRMSNorm(self.head_dim, c["rms_norm_eps"])
            self.k_norm = LlamaRMSNorm(self.head_dim, c["rms_norm_eps"])
        self.scaling, self.softcap = None, None  # 1 / sqrt(head_dim); no soft-cap (Gemma's differ)

    def forward(self, x, cos, sin):
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.heads, self.head_dim)
        k = self.k_proj(x).view(B, T, self.kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.kv_heads, self.head_dim).transpose(1, 2)
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        group = self.heads // self.kv_heads
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        scores = q @ k.transpose(-1, -2)
        scores = scores / math.sqrt(self.head_dim) if self.scaling is None else scores * self.scaling
        if self.softcap:
            scores = torch.tanh(scores / self.softcap) * self.softcap
        scores = scores.masked_fill(~attention_mask(T, self.window), float("-inf"))
        return self.o_proj((scores.softmax(-1) @ v).transpose(1, 2).reshape(B, T, -1))


class LlamaMLP(nn.Module):
    def __init__(self, c):
        super().__init__()
        d, f = c["hidden_size"], c["intermediate_size"]
        self.gate_proj = nn.Linear(d, f, bias=False)
        self.up_proj = nn.Linear(d, f, bias=False)
        self.down_proj = nn.Linear(f, d, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, c, index=0):
        super().__init__()
        self.input_layernorm = LlamaRMSNorm(c["hidden_size"], c["rms_norm_eps"])
        self.self_attn = LlamaAttention(c, index)
        self.post_attention_layernorm = LlamaRMSNorm(c["hidden_size"], c["rms_norm_eps"])
        if c["model_type"] == "mixtral":  # its name for the experts
            self.block_sparse_moe = SparseMoeBlock(c)
        else:
            self.mlp = SparseMoeBlock(c) if c["model_type"].endswith("_moe") else LlamaMLP(c)

    def forward(self, x, cos, sin):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        mlp = self.block_sparse_moe if hasattr(self, "block_sparse_moe") else self.mlp
        return x + mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.embed_tokens = nn.Embedding(c["vocab_size"], c["hidden_size"])
        self.layers = nn.ModuleList([LlamaDecoderLayer(c, i) for i in range(c["num_hidden_layers"])])
        self.norm = LlamaRMSNorm(c["hidden_size"], c["rms_norm_eps"])
        self.inv_freq = llama_inv_freq(c)

    def forward(self, ids):
        angles = torch.arange(ids.size(1), dtype=torch.float64)[:, None] * self.inv_freq[None, :]
        angles = torch.cat((angles, angles), dim=-1)
        dtype = self.embed_tokens.weight.dtype
        cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
        x = self.embed_tokens(ids)
        for layer in self.layers:
            x = layer(x, cos, sin)
        return self.norm(x)


class LlamaForCausalLM(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.model = LlamaModel(c)
        self.lm_head = nn.Linear(c["hidden_size"], c["vocab_size"], bias=False)

    def forward(self, ids):
        return self.lm_head(self.model(ids))


class GemmaRMSNorm(nn.Module):  # (1 + weight), the weight around 0
    def __init__(self, dim, eps):
        super().__init__()
        self.weight = nn.Parameter(0.1 * torch.randn(dim))
        self.eps = eps

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * (1.0 + self.weight)


def gemma_layer_types(c):
    if c.get("layer_types") is not None:
        return c["layer_types"]
    pattern = c.get("sliding_window_pattern", 6) if c["model_type"] == "gemma3_text" else 2
    return ["sliding_attention" if (i + 1) % pattern else "full_attention"
            for i in range(c["num_hidden_layers"])]


class GemmaAttention(LlamaAttention):  # Llama's, scaled, soft-capped, local or global, (1 + w) norms
    def __init__(self, c, index):
        super().__init__(c, index)
        self.scaling = c["query_pre_attn_scalar"] ** -0.5
        self.softcap = c.get("attn_logit_softcapping")
        self.local = gemma_layer_types(c)[index] == "sliding_attention"
        self.window = c["sliding_window"] if self.local else None
        self.qk_norm = c["model_type"] == "gemma3_text"
        if self.qk_norm:
            self.q_norm = GemmaRMSNorm(self.head_dim, c["rms_norm_eps"])
            self.k_norm = GemmaRMSNorm(self.head_dim, c["rms_norm_eps"])

    def forward(self, x, rotations):
        return super().forward(x, *rotations["local" if self.local else "global"])


class GemmaMLP(LlamaMLP):
    def forward(self, x):
        return self.down_proj(F.gelu(self.gate_proj(x), approximate="tanh") * self.up_proj(x))


class GemmaDecoderLayer(nn.Module):  # norms before and after the attention and the MLP
    def __init__(self, c, index):
        super().__init__()
        d, eps = c["hidden_size"], c["rms_norm_eps"]
        self.input_layernorm = GemmaRMSNorm(d, eps)
        self.self_attn = GemmaAttention(c, index)
        self.post_attention_layernorm = GemmaRMSNorm(d, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(d, eps)
        self.mlp = GemmaMLP(c)
        self.post_feedforward_layernorm = GemmaRMSNorm(d, eps)

    def forward(self, x, rotations):
        x = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), rotations))
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


def rotations(c, base, factor, T, dtype):
    inv = 1.0 / (base ** (torch.arange(0, c["head_dim"], 2, dtype=torch.float64) / c["head_dim"]))
    angles = torch.arange(T, dtype=torch.float64)[:, None] * (inv / factor)[None, :]
    angles = torch.cat((angles, angles), dim=-1)
    return angles.cos().to(dtype), angles.sin().to(dtype)


class GemmaModel(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.c = c
        self.embed_tokens = nn.Embedding(c["vocab_size"], c["hidden_size"])
        self.layers = nn.ModuleList([GemmaDecoderLayer(c, i) for i in range(c["num_hidden_layers"])])
        self.norm = GemmaRMSNorm(c["hidden_size"], c["rms_norm_eps"])

    def forward(self, ids):
        c, T, dtype = self.c, ids.size(1), self.embed_tokens.weight.dtype
        scaling = c.get("rope_scaling") or {}
        factor = scaling.get("factor", 1.0) if scaling.get("rope_type") == "linear" else 1.0
        local_base = c.get("rope_local_base_freq", c["rope_theta"])
        r = {"global": rotations(c, c["rope_theta"], factor, T, dtype),
             "local": rotations(c, local_base if c["model_type"] == "gemma3_text" else c["rope_theta"],
                                1.0 if c["model_type"] == "gemma3_text" else factor, T, dtype)}
        x = self.embed_tokens(ids) * torch.tensor(c["hidden_size"] ** 0.5, dtype=dtype)
        for layer in self.layers:
            x = layer(x, r)
        return self.norm(x)


class GemmaForCausalLM(nn.Module):  # the head tied to embed_tokens
    def __init__(self, c):
        super().__init__()
        self.model = GemmaModel(c)
        self.softcap = c.get("final_logit_softcapping")

    def forward(self, ids):
        logits = self.model(ids) @ self.model.embed_tokens.weight.t()
        return torch.tanh(logits / self.softcap) * self.softcap if self.softcap else logits


FLOAT64_LOGITS = ("qwen3", "mistral", "gemma2", "gemma3_text", "mixtral", "qwen3_moe", "qwen2_moe")


def fixed_tokens(vocab):  # two rows of 24 tokens, the same for every reader
    g = torch.Generator().manual_seed(1234)
    return torch.randint(0, vocab, (2, 24), generator=g)


def write_checkpoint(directory, model, config):
    os.makedirs(directory, exist_ok=True)
    with torch.no_grad():  # norms away from 1 and 0, so that a reader that drops them shows
        for name, p in model.named_parameters():
            if "ln_" in name or "norm" in name or (".self_attn." in name and name.endswith("bias")):
                p.add_(0.1 * torch.randn(p.shape))
            elif "wte" in name or "wpe" in name or "embed_tokens" in name:
                p.normal_(0, 0.02)  # Hugging Face's initializer_range
    state = {k: v for k, v in model.state_dict().items() if k != "model.inv_freq"}
    names = sorted(state)
    shards = [names[: len(names) // 2], names[len(names) // 2:]]
    weight_map, total = {}, 0
    for i, shard in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_safetensors(os.path.join(directory, file), {n: state[n] for n in shard}, {"format": "pt"})
        for n in shard:
            weight_map[n] = file
            total += state[n].numel() * state[n].element_size()
    with open(os.path.join(directory, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    ids = fixed_tokens(config["vocab_size"])
    with torch.no_grad():  # Qwen 3's and Mistral's in float64 (float32 weights widened), the rest float32
        logits = model.double()(ids) if config["model_type"] in FLOAT64_LOGITS else model(ids)
        save_safetensors(os.path.join(directory, "logits.safetensors"),
                         {"tokens": ids, "logits": logits})


def load_checkpoint(directory, edit=None):
    with open(os.path.join(directory, "config.json")) as f:
        config = json.load(f)
    config.update(edit or {})
    kinds = {"gpt2": GPT2LMHeadModel, "gemma2": GemmaForCausalLM, "gemma3_text": GemmaForCausalLM}
    model = kinds.get(config["model_type"], LlamaForCausalLM)(config)
    index = os.path.join(directory, "model.safetensors.index.json")
    files = sorted(set(json.load(open(index))["weight_map"].values())) if os.path.exists(index) \
        else ["model.safetensors"]
    state = {}
    for file in files:
        state.update(load_safetensors(os.path.join(directory, file)))
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [m for m in missing if m != "model.inv_freq"]
    if missing or unexpected:
        sys.exit(f"{directory}: missing {missing}, unexpected {unexpected}")
    return model


def write_gradients(directory, out):  # mean cross-entropy of each next token, in float64
    model = load_checkpoint(directory).double()
    tokens = load_safetensors(os.path.join(directory, "logits.safetensors"))["tokens"]
    logits = model(tokens)
    F.cross_entropy(logits[:, :-1].reshape(-1, logits.size(-1)), tokens[:, 1:].reshape(-1)).backward()
    kept = ("layers.0.self_attn.q_proj.", "layers.1.self_attn.k_proj.", "layers.1.input_layernorm",
            "layers.0.self_attn.q_norm", "layers.1.post_feedforward_layernorm", "layers.0.mlp.down",
            "experts.1.w2", "experts.1.down_proj", "layers.0.block_sparse_moe.gate",
            "layers.0.mlp.gate.", "shared_expert_gate", "model.norm.")
    grads = {n: p.grad for n, p in model.named_parameters() if any(k in n for k in kept)}
    save_safetensors(out, grads)
    print(f"wrote {out}: {len(grads)} gradients")


def write_bf16(directory, out):
    model = load_checkpoint(directory)
    os.makedirs(out, exist_ok=True)
    state = {k: v.to(torch.bfloat16) for k, v in model.state_dict().items() if k != "model.inv_freq"}
    save_safetensors(os.path.join(out, "model.safetensors"), state, {"format": "pt"})
    with open(os.path.join(directory, "config.json")) as f:
        config = json.load(f)
    config["torch_dtype"] = "bfloat16"
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    model.load_state_dict({k: v.to(torch.float32) for k, v in state.items()}, strict=False)
    tokens = load_safetensors(os.path.join(directory, "logits.safetensors"))["tokens"]
    with torch.no_grad():
        save_safetensors(os.path.join(out, "logits.safetensors"),
                         {"tokens": tokens, "logits": model.double()(tokens)})
    print(f"wrote {out}")


def main():
    torch.manual_seed(0)
    if len(sys.argv) == 3 and sys.argv[1] == "write":
        write_checkpoint(os.path.join(sys.argv[2], "gpt2"), GPT2LMHeadModel(GPT2_CONFIG), GPT2_CONFIG)
        write_checkpoint(os.path.join(sys.argv[2], "llama"), LlamaForCausalLM(LLAMA_CONFIG), LLAMA_CONFIG)
        write_checkpoint(os.path.join(sys.argv[2], "qwen2"), LlamaForCausalLM(QWEN2_CONFIG), QWEN2_CONFIG)
        write_checkpoint(os.path.join(sys.argv[2], "qwen3"), LlamaForCausalLM(QWEN3_CONFIG), QWEN3_CONFIG)
        write_checkpoint(os.path.join(sys.argv[2], "mistral"), LlamaForCausalLM(MISTRAL_CONFIG),
                         MISTRAL_CONFIG)
        write_checkpoint(os.path.join(sys.argv[2], "gemma2"), GemmaForCausalLM(GEMMA2_CONFIG),
                         GEMMA2_CONFIG)
        write_checkpoint(os.path.join(sys.argv[2], "gemma3"), GemmaForCausalLM(GEMMA3_CONFIG),
                         GEMMA3_CONFIG)
        for name, config in (("mixtral", MIXTRAL_CONFIG), ("qwen3_moe", QWEN3_MOE_CONFIG),
                             ("qwen2_moe", QWEN2_MOE_CONFIG)):
            write_checkpoint(os.path.join(sys.argv[2], name), LlamaForCausalLM(config), config)
        print(f"wrote {sys.argv[2]}: every model's folder")
    elif len(sys.argv) == 3 and sys.argv[1] == "check":
        model = load_checkpoint(sys.argv[2])
        expected = load_safetensors(os.path.join(sys.argv[2], "logits.safetensors"))
        with torch.no_grad():
            logits = model.to(expected["logits"].dtype)(expected["tokens"])
        diff = (logits - expected["logits"]).abs().max().item()
        print(f"{sys.argv[2]}: max |logits - expected| = {diff:.3g}")
        sys.exit(0 if diff < 1e-5 else 1)
    elif len(sys.argv) == 5 and sys.argv[1] == "edited":
        model = load_checkpoint(sys.argv[2], json.loads(sys.argv[3])).double()
        tokens = load_safetensors(os.path.join(sys.argv[2], "logits.safetensors"))["tokens"]
        with torch.no_grad():
            save_safetensors(sys.argv[4], {"tokens": tokens, "logits": model(tokens)})
        print(f"wrote {sys.argv[4]}")
    elif len(sys.argv) == 4 and sys.argv[1] == "gradients":
        write_gradients(sys.argv[2], sys.argv[3])
    elif len(sys.argv) == 4 and sys.argv[1] == "bf16":
        write_bf16(sys.argv[2], sys.argv[3])
    else:
        sys.exit(__doc__)


if __name__ == "__main__":
    main()
