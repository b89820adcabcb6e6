#!/usr/bin/python3
"""torch.matmul in float32 and bfloat16 on bench_reduced_gemm's shapes, one thread.

  torch_gemm.py [trials=5]

Prints `name=... m= k= n= dtype= ms= gflops=` per case (median of the trials), like
build/bench/bench_reduced_gemm.
"""
import sys
import time

import torch

# The same list as bench/bench_reduced_gemm.cpp.
SHAPES = [
    ("square512", 512, 512, 512), ("square1024", 1024, 1024, 1024),
    ("square2048", 2048, 2048, 2048), ("square4096", 4096, 4096, 4096),
    ("gpt_qkv", 2048, 256, 768), ("gpt_qkv_dx", 2048, 768, 256),
    ("gpt_qkv_dw", 768, 2048, 256), ("gpt_fc1", 2048, 256, 1024),
    ("gpt_fc2", 2048, 1024, 256), ("gpt_fc2_dw", 256, 2048, 1024),
    ("gpt_out_proj", 2048, 256, 256),
]


def main():
    trials = int(sys.argv[1]) if len(sys.argv) > 1 else 5
    torch.set_num_threads(1)
    for name, m, k, n in SHAPES:
        flops = 2.0 * m * k * n
        reps = 1 if flops > 1e11 else 3 if flops > 1e10 else 10
        a, b = torch.randn(m, k), torch.randn(k, n)
        for label, dtype in (("float32", torch.float32), ("bfloat16", torch.bfloat16)):
            x, y = a.to(dtype), b.to(dtype)
            torch.matmul(x, y)
            times = []
            for _ in range(trials):
                start = time.perf_counter()
                for _ in range(reps):
                    torch.matmul(x, y)
                times.append(time.perf_counter() - start)
            t = sorted(times)[len(times) // 2]
            print(f"name={name} m={m} k={k} n={n} dtype={label} ms={t * 1e3 / reps:.3f} "
                  f"gflops={flops * reps / t * 1e-9:.1f}", flush=True)


if __name__ == "__main__":
    main()
