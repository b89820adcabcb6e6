#!/usr/bin/python3
"""The PyTorch peer of bench_recipe: MLP 784-256-128-10 (ReLU), Adam 1e-3, cross-entropy,
Fashion-MNIST scaled to [0, 1], one thread. Prints, like bench_recipe:
  step_us batch=64 / batch=1024   median of timed training steps on fixed data
  epochs=10 wall_s=... best_test_accuracy=...   the training run (shuffled batches of 64,
                                                sliced from the tensors: no per-sample loader)

    python3 bench/training/torch_recipe.py [--epochs 10] [--steps 200]

Only a benchmark peer: weave never needs PyTorch to build or test.
"""
import argparse
import os
import statistics
import sys
import time

import numpy as np
import torch
import torch.nn as nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from torch_ddp_fashion_mnist import read_idx  # noqa: E402  (the same IDX reader)


def images(name):
    x = torch.from_numpy(read_idx(name).astype(np.float32))
    return x.reshape(x.shape[0], -1) / 255.0


def make_model():
    return nn.Sequential(nn.Linear(784, 256), nn.ReLU(), nn.Linear(256, 128), nn.ReLU(),
                         nn.Linear(128, 10))


def step_us(batch, steps, train_x, train_y):
    torch.manual_seed(0)
    model = make_model()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    loss_fn = nn.CrossEntropyLoss()
    x, y = train_x[:batch].contiguous(), train_y[:batch].contiguous()
    times = []
    for i in range(steps + 10):
        start = time.perf_counter()
        optimizer.zero_grad(set_to_none=False)
        loss_fn(model(x), y).backward()
        optimizer.step()
        if i >= 10:
            times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--steps", type=int, default=200)
    args = parser.parse_args()
    torch.set_num_threads(1)
    start = time.time()
    train_x, test_x = images("train-images-idx3-ubyte.gz"), images("t10k-images-idx3-ubyte.gz")
    train_y = torch.from_numpy(read_idx("train-labels-idx1-ubyte.gz").astype(np.int64))
    test_y = torch.from_numpy(read_idx("t10k-labels-idx1-ubyte.gz").astype(np.int64))
    for batch in (64, 1024):
        print(f"torch step batch={batch} step_us={step_us(batch, args.steps, train_x, train_y):.1f}",
              flush=True)
    if args.epochs == 0:
        return
    start = time.time()
    torch.manual_seed(0)
    model = make_model()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    loss_fn = nn.CrossEntropyLoss()
    best = 0.0
    for epoch in range(args.epochs):
        order = torch.randperm(train_x.shape[0])
        for i in range(0, train_x.shape[0], 64):
            index = order[i:i + 64]
            optimizer.zero_grad(set_to_none=False)
            loss_fn(model(train_x[index]), train_y[index]).backward()
            optimizer.step()
        with torch.no_grad():
            best = max(best, (model(test_x).argmax(1) == test_y).float().mean().item())
    print(f"torch epochs={args.epochs} wall_s={time.time() - start:.2f} "
          f"best_test_accuracy={best:.4f}", flush=True)


if __name__ == "__main__":
    main()
