#!/usr/bin/python3
"""The PyTorch peer of `fashion_mnist_ddp --recipe small`: the same MLP (784-256-128-10, ReLU),
Adam at a constant 1e-3, global batch 64 split over the ranks, DistributedSampler, 10 epochs,
DistributedDataParallel over gloo, one compute thread per rank. Prints the same closing line,
`test_accuracy=0.XXXX`, and `wall_s=` (from before the data is read to the end).

    python3 bench/training/torch_ddp_fashion_mnist.py --ranks 2 [--epochs 10]

Only a benchmark peer: weave never needs PyTorch to build or test.
"""
import argparse
import gzip
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn

DATA = "/usr/share/datasets/fashion-mnist"


def read_idx(name):
    with gzip.open(os.path.join(DATA, name), "rb") as f:
        raw = f.read()
    dims = raw[3]
    shape = [int.from_bytes(raw[4 + 4 * i:8 + 4 * i], "big") for i in range(dims)]
    return np.frombuffer(raw, dtype=np.uint8, offset=4 + 4 * dims).reshape(shape)


def normalize(images):
    x = torch.from_numpy(images.astype(np.float32)).reshape(images.shape[0], -1)
    return (x / 255.0 - 0.2860) / 0.3530


def worker(rank, ranks, epochs, port, start):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=ranks)
    torch.manual_seed(0)
    train_x = normalize(read_idx("train-images-idx3-ubyte.gz"))
    train_y = torch.from_numpy(read_idx("train-labels-idx1-ubyte.gz").astype(np.int64))
    test_x = normalize(read_idx("t10k-images-idx3-ubyte.gz"))
    test_y = torch.from_numpy(read_idx("t10k-labels-idx1-ubyte.gz").astype(np.int64))
    dataset = torch.utils.data.TensorDataset(train_x, train_y)
    sampler = torch.utils.data.distributed.DistributedSampler(dataset, seed=0)
    loader = torch.utils.data.DataLoader(dataset, batch_size=64 // ranks, sampler=sampler)
    model = nn.Sequential(nn.Linear(784, 256), nn.ReLU(), nn.Linear(256, 128), nn.ReLU(),
                          nn.Linear(128, 10))
    ddp = nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.Adam(ddp.parameters(), lr=1e-3)
    loss_fn = nn.CrossEntropyLoss()
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        for x, y in loader:
            optimizer.zero_grad(set_to_none=False)
            loss_fn(ddp(x), y).backward()
            optimizer.step()
    with torch.no_grad():
        accuracy = (model(test_x).argmax(1) == test_y).float().mean().item()
    dist.barrier()
    if rank == 0:
        print(f"test_accuracy={accuracy:.4f}")
        print(f"wall_s={time.time() - start:.2f}", flush=True)
    dist.destroy_process_group()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--port", type=int, default=29517)
    args = parser.parse_args()
    mp.spawn(worker, args=(args.ranks, args.epochs, args.port, time.time()), nprocs=args.ranks)


if __name__ == "__main__":
    main()
