"""The main job's model and step in PyTorch, one process: the peer `meshrun bench train --workers 1`
is compared with (bench/torch/compare.sh runs both in one run).

The same step as examples/main_job.json: Fashion-MNIST images u8 [784] scaled by 1/255,
Linear(784, 512), SiLU, Dropout(0.1), Linear(512, 10), softmax cross-entropy with integer labels,
AdamW (lr 1e-3, betas (0.9, 0.999), eps 1e-8, weight decay 1e-4), a global batch of 128 as 4
minibatches of 32 (--minibatches) whose gradients are accumulated before the update, shuffled
per epoch. --flush-denormal flushes denormals to zero, as meshrun's workers and XLA do. The
dataset is read into memory once (the fastest input a PyTorch user has; meshrun's workers read
their blocks of each batch themselves). --bf16 runs forward and loss under
torch.autocast("cpu", dtype=torch.bfloat16), PyTorch's mixed precision (f32 parameters and
optimizer state). Prints steady-state samples/s (the first `--warmup` steps are not timed).

Usage: python bench/torch/main_job_torch.py [--steps 600] [--bf16] [--minibatches 4] [--threads N]
       [--flush-denormal]
       [--data /usr/share/datasets/fashion-mnist]
A benchmark, not a test: nothing is asserted. Needs torch (pip install torch; not a dependency).
"""
import argparse
import gzip
import os
import struct
import time

import numpy as np
import torch


def read_idx(path):
    """An IDX file (gzipped) as a numpy array (../shared/REFERENCE.md's IDX format)."""
    with gzip.open(path, "rb") as f:
        data = f.read()
    zero, dtype_code, ndim = struct.unpack(">HBB", data[:4])
    if zero != 0 or dtype_code != 0x08:
        raise ValueError(f"{path}: not an unsigned-byte IDX file (magic {data[:4].hex()})")
    dims = struct.unpack(f">{ndim}I", data[4:4 + 4 * ndim])
    return np.frombuffer(data, dtype=np.uint8, offset=4 + 4 * ndim).reshape(dims)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--warmup", type=int, default=50)
    ap.add_argument("--bf16", action="store_true")
    ap.add_argument("--minibatches", type=int, default=4, choices=(1, 2, 4, 8))
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--flush-denormal", action="store_true")
    ap.add_argument("--data", default="/usr/share/datasets/fashion-mnist")
    args = ap.parse_args()
    if args.steps <= args.warmup:
        ap.error(f"--steps {args.steps}: expected more than --warmup ({args.warmup})")
    torch.set_num_threads(args.threads)
    if args.flush_denormal:
        torch.set_flush_denormal(True)
    torch.manual_seed(42)
    images = torch.from_numpy(read_idx(os.path.join(args.data, "train-images-idx3-ubyte.gz")).reshape(-1, 784).copy())
    labels = torch.from_numpy(read_idx(os.path.join(args.data, "train-labels-idx1-ubyte.gz")).astype(np.int64))
    model = torch.nn.Sequential(torch.nn.Linear(784, 512), torch.nn.SiLU(), torch.nn.Dropout(0.1),
                                torch.nn.Linear(512, 10))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-4)
    loss_fn = torch.nn.CrossEntropyLoss()
    batch, minibatches = 128, args.minibatches
    mb = batch // minibatches
    steps_per_epoch = images.shape[0] // batch
    order = torch.randperm(images.shape[0])
    t0, loss = None, float("nan")
    for step in range(args.steps):
        if step == args.warmup:
            t0 = time.perf_counter()
        k = step % steps_per_epoch
        if k == 0 and step > 0:
            order = torch.randperm(images.shape[0])
        idx = order[k * batch:(k + 1) * batch]
        x = images[idx].float().mul_(1.0 / 255.0)
        y = labels[idx]
        opt.zero_grad(set_to_none=True)
        total = 0.0
        for m in range(minibatches):
            xs, ys = x[m * mb:(m + 1) * mb], y[m * mb:(m + 1) * mb]
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.bf16):
                l = loss_fn(model(xs), ys) / minibatches
            l.backward()
            total += l.item()
        opt.step()
        loss = total
    seconds = time.perf_counter() - t0
    timed = args.steps - args.warmup
    print(f"torch {torch.__version__} {'bf16 autocast' if args.bf16 else 'f32'} threads {args.threads} "
          f"minibatches {minibatches}{' flush-denormal' if args.flush_denormal else ''}: "
          f"{timed * batch / seconds:.0f} samples/s over {timed} steps ({seconds / timed * 1e3:.2f} ms/step), "
          f"loss {loss:.4f}")


if __name__ == "__main__":
    main()
