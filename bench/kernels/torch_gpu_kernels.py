#!/usr/bin/env python3
"""The work of bench/kernels/bench_gpu_kernels.cpp in PyTorch 2.x on the same GPU (the peer of
scripts/gpu-check.sh). Prints the same `kernel=NAME us=MEDIAN` lines, timed the same way: the
median over trials of the mean over a batch of calls between device synchronizations.

  torch_gpu_kernels.py [--trials 7] [--only NAME]
"""
import argparse
import statistics
import time

import torch
import torch.nn.functional as F


def time_us(fn, trials, calls):
    fn()
    torch.cuda.synchronize()
    samples = []
    for _ in range(trials):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
        samples.append(1e6 * (time.perf_counter() - start) / calls)
    return statistics.median(samples)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--trials", type=int, default=7)
    parser.add_argument("--only", default="")
    a = parser.parse_args()
    dev = torch.device("cuda")
    torch.manual_seed(0)
    n64m = 1 << 26
    big, big_out = torch.randn(n64m, device=dev), torch.empty(n64m, device=dev)
    square = torch.randn(8192, 8192, device=dev)
    ln_x = torch.randn(8192, 768, device=dev, dtype=torch.bfloat16)
    ln_g = torch.randn(8192, 768, device=dev, dtype=torch.bfloat16)
    ln_w = torch.ones(768, device=dev, dtype=torch.bfloat16)
    ln_b = torch.zeros(768, device=dev, dtype=torch.bfloat16)
    logits = torch.randn(4096, 32768, device=dev)
    targets = torch.randint(0, 32768, (4096,), device=dev)
    act = torch.randn(8192, 3072, device=dev, dtype=torch.bfloat16)
    act_bias = torch.randn(3072, device=dev, dtype=torch.bfloat16)
    param = torch.randn(124 << 20, device=dev)
    param.grad = torch.randn(124 << 20, device=dev)
    adam = torch.optim.AdamW([param], lr=1e-4, fused=True)

    def layer_norm():
        x, w, b = (t.detach().requires_grad_() for t in (ln_x, ln_w, ln_b))
        F.layer_norm(x, (768,), w, b).backward(ln_g)

    def layer_norm_kernels():  # the forward and backward kernels alone, no autograd
        y, mean, rstd = torch.ops.aten.native_layer_norm(ln_x, (768,), ln_w, ln_b, 1e-5)
        torch.ops.aten.native_layer_norm_backward(ln_g, ln_x, (768,), mean, rstd, ln_w, ln_b,
                                                  [True, True, True])

    def cross_entropy():
        l = logits.detach().requires_grad_()
        F.cross_entropy(l, targets).backward()

    rows = [
        ("copy_f32_64M", 2.0 * 4 * n64m, lambda: big_out.copy_(big), 10),
        ("sum_f32_64M", 4.0 * n64m, lambda: big.sum(), 10),
        ("rowsum_f32_8192x8192", 4.0 * 8192 * 8192, lambda: square.sum(1), 10),
        ("colsum_f32_8192x8192", 4.0 * 8192 * 8192, lambda: square.sum(0), 10),
        ("max_f32_64M", 4.0 * n64m, lambda: big.max(), 10),
        ("argmax_rows_f32_8192x8192", 4.0 * 8192 * 8192, lambda: square.argmax(1), 10),
        ("layer_norm_fwd_bwd_bf16_8192x768", 5.0 * 2 * 8192 * 768, layer_norm, 10),
        ("layer_norm_kernels_bf16_8192x768", 5.0 * 2 * 8192 * 768, layer_norm_kernels, 10),
        ("softmax_f32_4096x32768", 2.0 * 4 * 4096 * 32768, lambda: torch.softmax(logits, -1), 10),
        ("cross_entropy_fwd_bwd_f32_4096x32768", 3.0 * 4 * 4096 * 32768, cross_entropy, 10),
        ("bias_gelu_bf16_8192x3072", 2.0 * 2 * 8192 * 3072, lambda: F.gelu(act + act_bias), 10),
        ("adamw_f32_124M", 7.0 * 4 * (124 << 20), adam.step, 10),
    ]
    for b, h, t, d in [(8, 12, 1024, 64), (8, 6, 1024, 128), (2, 12, 4096, 64), (2, 6, 4096, 128)]:
        q, k, v, g = (torch.randn(b, h, t, d, device=dev, dtype=torch.bfloat16) for _ in range(4))

        def sdpa(q=q, k=k, v=v, g=g):
            qq, kk, vv = (x.detach().requires_grad_() for x in (q, k, v))
            F.scaled_dot_product_attention(qq, kk, vv, is_causal=True).backward(g)

        rows.append((f"sdpa_causal_fwd_bwd_bf16_b{b}_h{h}_t{t}_d{d}", 0, sdpa, 5))
    copy_bandwidth = None
    for name, moved, fn, calls in rows:
        if a.only and a.only not in name and name != rows[0][0]:
            continue
        us = time_us(fn, a.trials, calls)
        if copy_bandwidth is None:
            copy_bandwidth = moved / us
        if moved:
            print(f"kernel={name} us={us:.1f} bytes={moved:.0f} gbps={moved / us / 1e3:.0f} "
                  f"copy_fraction={moved / us / copy_bandwidth:.3f}", flush=True)
        else:
            print(f"kernel={name} us={us:.1f}", flush=True)


if __name__ == "__main__":
    main()
