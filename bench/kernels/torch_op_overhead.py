#!/usr/bin/env python3
"""The work of bench/kernels/bench_op_overhead.cpp in PyTorch (1.13 on the CPU, 2.x on a GPU):
the same ops on the same tiny tensors, timed the same way; prints `op=NAME device=D us=MEDIAN`.

  torch_op_overhead.py [--device cpu|cuda] [--trials 7] [--calls 2000]
"""
import argparse
import statistics
import time

import torch
import torch.nn.functional as F


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--trials", type=int, default=7)
    parser.add_argument("--calls", type=int, default=2000)
    a = parser.parse_args()
    dev = torch.device(a.device)
    torch.manual_seed(0)
    x, y = torch.randn(4, 64, device=dev), torch.randn(4, 64, device=dev)
    w1, b1 = torch.randn(64, 64, device=dev), torch.randn(64, device=dev)
    w2, b2 = torch.randn(64, 64, device=dev), torch.randn(64, device=dev)
    gamma, beta = torch.ones(64, device=dev), torch.zeros(64, device=dev)

    def leaf(t):
        return t.detach().requires_grad_()

    def no_grad(fn):
        def run():
            with torch.no_grad():
                fn()
        return run

    def layer_norm_fwd_bwd():
        F.layer_norm(leaf(x), (64,), leaf(gamma), leaf(beta)).backward(y)

    def mlp_fwd_bwd():
        a, c, d, e = leaf(w1), leaf(b1), leaf(w2), leaf(b2)
        F.linear(F.gelu(F.linear(x, a, c)), d, e).sum().backward()

    rows = [
        ("add_nograd", no_grad(lambda: x + y)),
        ("linear_nograd", no_grad(lambda: F.linear(x, w1, b1))),
        ("layer_norm_nograd", no_grad(lambda: F.layer_norm(x, (64,), gamma, beta))),
        ("softmax_nograd", no_grad(lambda: torch.softmax(x, -1))),
        ("layer_norm_fwd_bwd", layer_norm_fwd_bwd),
        ("mlp_fwd_bwd", mlp_fwd_bwd),
    ]

    def sync():
        if dev.type == "cuda":
            torch.cuda.synchronize()

    for name, fn in rows:
        fn()
        sync()
        samples = []
        for _ in range(a.trials):
            start = time.perf_counter()
            for _ in range(a.calls):
                fn()
            sync()
            samples.append(1e6 * (time.perf_counter() - start) / a.calls)
        print(f"op={name} device={a.device} us={statistics.median(samples):.2f}", flush=True)


if __name__ == "__main__":
    main()
