#!/usr/bin/python3
"""The GPT of examples/gpt/gpt.cpp in PyTorch, for bench/compare_gpt.sh.

Same text and split, same windows per step (splitmix64 of seed and step), same model (pre-LN
blocks, one fused q/k/v projection, exact GELU, untied output layer), same initialization
scheme (weights N(0, 0.02), biases 0), AdamW, warmup + cosine schedule and clipping at 1.0.
PyTorch 1.13 has no fused attention, so attention is written as its users write it: scores,
a causal mask, softmax, and a product with v.

  gpt_torch.py [--layers 4] [--dim 256] [--heads 4] [--context 128] [--batch 16] [--steps 600]
               [--threads 1] [--log-every 20] [--eval-every 100] [--seed 0] [--autocast bf16]

--autocast bf16 runs forward and the loss under torch.autocast(device, torch.bfloat16), as
examples/gpt does under weave's AutocastGuard.

--device cuda runs on the GPU as PyTorch 2.x users write it: F.scaled_dot_product_attention
(FlashAttention/cuDNN) and the fused AdamW; --vocab widens the head as examples/gpt's does.
At the end it prints `peak_memory_mb=` (torch.cuda.max_memory_allocated) on a GPU.

--arch llama trains examples/gpt's Llama (--arch llama): RMSNorm, rotary positions (the halves
layout, base 10000), grouped-query attention with --kv-heads key/value heads (each shared by a
group of query heads), SwiGLU with Llama's hidden width (or --ffn), no biases, an untied head.
--pack makes each fortune a document ended by an end-of-text token; positions restart and
attention stays within each document, as examples/gpt --pack does. On a GPU attention takes
PyTorch's fastest eager path: F.scaled_dot_product_attention with enable_gqa (no repeated keys
and values) for plain windows, and for packed ones FlexAttention with a document block mask
(compiled, as its documentation prescribes; the dense-mask SDPA where FlexAttention is missing).

--compile runs the model through torch.compile (the next line to beat; information only).
--matmul-precision sets torch.set_float32_matmul_precision, as examples/gpt's flag does weave's.

Prints the same lines as the weave example: `step S/N loss L lr R tokens/s T`, and at the end
`heldout_loss=X.XXXX`.
"""
import argparse
import math
import os
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

MASK64 = (1 << 64) - 1


def splitmix64(x):
    x = (x + 0x9E3779B97F4A7C15) & MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK64
    return x ^ (x >> 31)


def load_corpus(directory, pack=False):
    names = sorted(n for n in os.listdir(directory)
                   if not n.endswith(".dat") and not os.path.islink(os.path.join(directory, n))
                   and os.path.isfile(os.path.join(directory, n)))
    text = bytearray()
    separators = []
    for name in names:
        with open(os.path.join(directory, name), "rb") as f:
            lines = f.read().split(b"\n")
        if lines and lines[-1] == b"":  # a last line without its newline still gets one
            lines.pop()
        for line in lines:
            if line == b"%":
                separators.append(len(text))
            text += b"\n" if line == b"%" else line + b"\n"
    chars = sorted(set(text))
    end_of_text = len(chars) if pack else -1
    vocab = (len(chars) + (1 if pack else 0) + 7) // 8 * 8
    id_of = {c: i for i, c in enumerate(chars)}
    ids = torch.tensor([id_of[c] for c in text], dtype=torch.int64)
    if pack:
        ids[torch.tensor(separators, dtype=torch.int64)] = end_of_text
    split = len(text) * 9 // 10
    return ids[:split], ids[split:], vocab, end_of_text


class Block(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.out = nn.Linear(dim, dim)
        self.norm2 = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, 4 * dim)
        self.fc2 = nn.Linear(4 * dim, dim)

    def forward(self, x, mask):
        b, t, d = x.shape
        hd = d // self.heads
        qkv = self.qkv(self.norm1(x)).view(b, t, self.heads, 3, hd)
        q, k, v = (qkv[:, :, :, i].transpose(1, 2) for i in range(3))
        if x.is_cuda:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            scores = (q @ k.transpose(-1, -2)) * (1.0 / math.sqrt(hd))
            scores = scores.masked_fill(mask[:t, :t], float("-inf"))
            y = F.softmax(scores, dim=-1) @ v
        y = y.transpose(1, 2).reshape(b, t, d)
        x = x + self.out(y)
        return x + self.fc2(F.gelu(self.fc1(self.norm2(x))))


class Gpt(nn.Module):
    def __init__(self, vocab, context, dim, heads, layers):
        super().__init__()
        self.tokens = nn.Embedding(vocab, dim)
        self.positions = nn.Embedding(context, dim)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab)
        self.register_buffer("mask", torch.triu(torch.ones(context, context, dtype=torch.bool), 1))
        with torch.no_grad():
            for name, p in self.named_parameters():
                if name.endswith(".bias"):
                    p.zero_()
                elif "norm" not in name:
                    p.normal_(0.0, 0.02)

    def forward(self, ids):
        t = ids.shape[1]
        x = self.tokens(ids) + self.positions(torch.arange(t, device=ids.device))
        for block in self.blocks:
            x = block(x, self.mask)
        return self.head(self.norm(x))


class RMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-5):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rotate(x, positions, base=10000.0):
    """Rotary embeddings of x [B, T, H, D] at positions [B, T]: dim i turns with i + D/2."""
    half = x.shape[-1] // 2
    freqs = base ** (-torch.arange(half, dtype=torch.float64, device=x.device) * 2 / x.shape[-1])
    angles = positions[..., None].double() * freqs
    cos, sin = (f(angles).to(x.dtype)[:, :, None, :] for f in (torch.cos, torch.sin))
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1)


def flex_attention_fn():
    """FlexAttention compiled once (None before PyTorch 2.5)."""
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    except ImportError:
        return None
    return torch.compile(flex_attention, dynamic=False), create_block_mask


FLEX = None


class LlamaBlock(nn.Module):
    def __init__(self, dim, heads, kv_heads, hidden):
        super().__init__()
        self.heads, self.kv_heads, self.hd = heads, kv_heads, dim // heads
        self.norm1 = RMSNorm(dim)
        self.q = nn.Linear(dim, dim, bias=False)
        self.kv = nn.Linear(dim, 2 * kv_heads * self.hd, bias=False)
        self.out = nn.Linear(dim, dim, bias=False)
        self.norm2 = RMSNorm(dim)
        self.gate_up = nn.Linear(dim, 2 * hidden, bias=False)
        self.down = nn.Linear(hidden, dim, bias=False)

    def forward(self, x, positions, allowed):
        b, t, d = x.shape
        h = self.norm1(x)
        q = rotate(self.q(h).view(b, t, self.heads, self.hd), positions).transpose(1, 2)
        k, v = self.kv(h).view(b, t, 2, self.kv_heads, self.hd).unbind(2)
        k = rotate(k, positions).transpose(1, 2)
        v = v.transpose(1, 2)
        group = self.heads // self.kv_heads  # query head i reads key/value head i // group
        if x.is_cuda and allowed is None:  # one document a window
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=group > 1)
        elif x.is_cuda and not torch.is_tensor(allowed):  # a FlexAttention block mask
            y = FLEX[0](q, k, v, block_mask=allowed, enable_gqa=group > 1)
        elif x.is_cuda:
            k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed)
        else:
            k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
            scores = (q @ k.transpose(-1, -2)) * (1.0 / math.sqrt(self.hd))
            y = F.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1) @ v
        x = x + self.out(y.transpose(1, 2).reshape(b, t, d))
        gate, up = self.gate_up(self.norm2(x)).chunk(2, -1)
        return x + self.down(F.silu(gate) * up)


class Llama(nn.Module):
    def __init__(self, vocab, dim, heads, kv_heads, layers, end_of_text, ffn=0):
        super().__init__()
        hidden = ffn or ((8 * dim + 2) // 3 + 63) // 64 * 64  # 8 dim / 3, up to a multiple of 64
        self.end_of_text = end_of_text
        self.tokens = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(LlamaBlock(dim, heads, kv_heads or heads, hidden)
                                    for _ in range(layers))
        self.norm = RMSNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        with torch.no_grad():
            for name, p in self.named_parameters():
                if "norm" not in name:
                    p.normal_(0.0, 0.02)

    def forward(self, ids):
        b, t = ids.shape
        index = torch.arange(t, device=ids.device).expand(b, t)
        if self.end_of_text >= 0:  # an end-of-text token opens the next document
            opens = (ids == self.end_of_text) & (index > 0)
            documents = opens.cumsum(1)
            starts = torch.where(opens, index, torch.zeros_like(index)).cummax(1).values
            positions = index - starts
        else:
            documents, positions = torch.zeros_like(index), index
        if ids.is_cuda and self.end_of_text < 0:
            allowed = None
        elif ids.is_cuda and FLEX is not None:
            def same_document(b_, h_, q_, k_):
                return (q_ >= k_) & (documents[b_, q_] == documents[b_, k_])
            allowed = FLEX[1](same_document, b, None, t, t, device=ids.device)
        else:
            causal = torch.ones(t, t, dtype=torch.bool, device=ids.device).tril()
            allowed = (causal & (documents[:, :, None] == documents[:, None, :]))[:, None]
        x = self.tokens(ids)
        for block in self.blocks:
            x = block(x, positions, allowed)
        return self.head(self.norm(x))


def main():
    parser = argparse.ArgumentParser()
    for name, default in [("layers", 4), ("dim", 256), ("heads", 4), ("context", 128),
                          ("batch", 16), ("steps", 600), ("warmup", 60), ("threads", 1),
                          ("log-every", 20), ("eval-every", 100), ("eval-windows", 64),
                          ("seed", 0)]:
        parser.add_argument("--" + name, type=int, default=default)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--min-lr", type=float, default=1e-4)
    parser.add_argument("--data", default="/usr/share/games/fortunes")
    parser.add_argument("--autocast", choices=["bf16"], default=None)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--vocab", type=int, default=0)
    parser.add_argument("--arch", choices=["gpt", "llama"], default="gpt")
    parser.add_argument("--kv-heads", type=int, default=0)
    parser.add_argument("--pack", action="store_true")
    parser.add_argument("--ffn", type=int, default=0)
    parser.add_argument("--compile", action="store_true")
    parser.add_argument("--matmul-precision", choices=["highest", "high"], default="highest")
    a = parser.parse_args()
    torch.set_float32_matmul_precision(a.matmul_precision)
    global FLEX
    if a.device == "cuda" and a.pack:
        FLEX = flex_attention_fn()
    if a.pack and a.arch != "llama":
        parser.error("--pack needs --arch llama (GPT-2's learned positions take one document)")
    autocast = lambda: torch.autocast(a.device, dtype=torch.bfloat16, enabled=a.autocast == "bf16")
    torch.set_num_threads(a.threads)
    torch.manual_seed(a.seed)
    train, heldout, vocab, end_of_text = load_corpus(a.data, a.pack)
    vocab = max(vocab, (a.vocab + 7) // 8 * 8)
    if a.arch == "llama":
        model = Llama(vocab, a.dim, a.heads, a.kv_heads, a.layers, end_of_text, a.ffn).to(a.device)
    else:
        model = Gpt(vocab, a.context, a.dim, a.heads, a.layers).to(a.device)
    # The GPT recipe's groups, as examples/gpt's optim::weight_decay_groups: no decay on biases,
    # norms and embeddings.
    exempt = set()
    for module in model.modules():
        if isinstance(module, (nn.Embedding, nn.LayerNorm, RMSNorm)):
            exempt.update(id(p) for p in module.parameters(recurse=False))
    decay = [p for p in model.parameters() if p.dim() >= 2 and id(p) not in exempt]
    no_decay = [p for p in model.parameters() if p.dim() < 2 or id(p) in exempt]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": 0.01},
                                   {"params": no_decay, "weight_decay": 0.0}], lr=a.lr,
                                  **({"fused": True} if a.device == "cuda" else {}))
    forward = torch.compile(model) if a.compile else model

    def lr_at(step):
        if step < a.warmup:
            return a.lr * (step + 1) / a.warmup
        progress = min(1.0, (step - a.warmup) / max(1, a.steps - a.warmup))
        return a.min_lr + 0.5 * (a.lr - a.min_lr) * (1 + math.cos(math.pi * progress))

    def windows(tokens, offsets):
        return torch.stack([tokens[o:o + a.context + 1] for o in offsets]).to(a.device)

    def heldout_loss():
        model.eval()
        span = len(heldout) - a.context - 1
        offsets = [i * span // a.eval_windows for i in range(a.eval_windows)]
        total = 0.0
        with torch.no_grad():
            for first in range(0, len(offsets), a.batch):
                w = windows(heldout, offsets[first:first + a.batch])
                with autocast():
                    logits = model(w[:, :-1])
                    loss = F.cross_entropy(logits.reshape(-1, vocab), w[:, 1:].reshape(-1))
                total += loss.item() * w.shape[0]
        model.train()
        return total / a.eval_windows

    print(f"gpt_torch {torch.__version__}: {a.arch}{', packed' if a.pack else ''}, {a.layers} layers, dim {a.dim}, {a.heads} heads, "
          f"context {a.context}, batch {a.batch}, vocab {vocab}, threads {a.threads}", flush=True)
    span = len(train) - a.context - 1
    started, loss_sum, losses = time.perf_counter(), 0.0, 0
    for step in range(a.steps):
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step)
        offsets = [splitmix64((a.seed << 40) + step * a.batch + i) % span for i in range(a.batch)]
        w = windows(train, offsets)
        with autocast():
            logits = forward(w[:, :-1])
            loss = F.cross_entropy(logits.reshape(-1, vocab), w[:, 1:].reshape(-1))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        loss_sum += loss.item()
        losses += 1
        done = step + 1
        if done % a.log_every == 0 or done == a.steps:
            seconds = time.perf_counter() - started
            print(f"step {done}/{a.steps} loss {loss_sum / losses:.4f} lr {lr_at(done):.2e} "
                  f"tokens/s {losses * a.batch * a.context / seconds:.0f}", flush=True)
            started, loss_sum, losses = time.perf_counter(), 0.0, 0
        if done % a.eval_every == 0 and done < a.steps:
            print(f"step {done} heldout_loss {heldout_loss():.4f}", flush=True)
    if a.device == "cuda":
        print(f"peak_memory_mb={torch.cuda.max_memory_allocated() / 1e6:.1f}", flush=True)
    print(f"heldout_loss={heldout_loss():.4f}", flush=True)


if __name__ == "__main__":
    main()
