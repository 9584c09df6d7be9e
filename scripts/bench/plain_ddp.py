"""Plain torch DDP training of the Fashion-MNIST MLP, structured like the classic ``resnet_ddp.py``.

    python -m scripts.bench.plain_ddp --nproc 2 --epochs 3        # mp.spawn, gloo, one process per rank
    torchrun --nproc_per_node=2 -m scripts.bench.plain_ddp        # or join the ranks torchrun started

``setup`` joins a gloo process group, a ``DistributedSampler`` shards the same 55,000 training
samples the project uses (global batch 128 split over the ranks), the model is wrapped in
``DistributedDataParallel``; after every epoch each rank validates its shard of the validation set
(the sums are all-reduced, so every rank has the exact whole-set values, as Lightning's DDP has) and
rank 0 saves a checkpoint (model and optimizer state, ``torch.save``); a sharded test pass ends the
run. Batches are ``index_select`` on in-memory tensors with the sampler's indices.
"""

from __future__ import annotations

import argparse
import os
import socket
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DistributedSampler

from scripts.bench.plain_loop import (
    build_mlp,
    checkpoint_file,
    load_split,
    normalize,
    save_checkpoint,
    train_val_split,
    work_arguments,
)
from scripts.bench.timeline import Timeline, rank_path


def free_port() -> int:
    """A TCP port free on this machine now (a plain script picks its own, without Lightning's helper)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def setup(rank: int, world_size: int, port: int) -> None:
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world_size)


def cleanup() -> None:
    dist.destroy_process_group()


@torch.no_grad()
def evaluate(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, batch: int) -> tuple[float, float]:
    """Each rank evaluates a contiguous shard; the sums are all-reduced: exact whole-set loss and accuracy."""
    rank, world = dist.get_rank(), dist.get_world_size()
    shard = torch.arange(rank, len(x), world)
    model.eval()
    sums = torch.zeros(3, dtype=torch.float64)  # loss sum, correct, count
    for start in range(0, len(shard), batch):
        idx = shard[start:start + batch]
        out, yb = model.module(x.index_select(0, idx)), y.index_select(0, idx)
        sums += torch.stack([F.cross_entropy(out, yb, reduction="sum").double(),
                             (out.argmax(1) == yb).sum().double(), torch.tensor(len(idx), dtype=torch.float64)])
    model.train()
    dist.all_reduce(sums)
    return float(sums[0] / sums[2]), float(sums[1] / sums[2])


def train(rank: int, world_size: int, args: argparse.Namespace) -> None:
    setup(rank, world_size, args.port)
    if args.threads:
        torch.set_num_threads(args.threads)
    timeline = Timeline(rank_path(args.timeline, rank), rank=rank) if args.timeline else None
    torch.manual_seed(args.seed)  # same seed on every rank: replicas start identical (DDP also broadcasts)
    x, y, train_idx, val_idx = train_val_split(args.data_dir, args.seed)
    x_train, y_train, x_val, y_val = normalize(x[train_idx]), y[train_idx], normalize(x[val_idx]), y[val_idx]
    x_test, y_test = load_split(args.data_dir, train=False)
    x_test = normalize(x_test)
    per_rank = args.batch_size // world_size

    model = DDP(build_mlp())
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr, fused=True)
    checkpoint = checkpoint_file(args, "plain_ddp")
    sampler = DistributedSampler(range(len(x_train)), num_replicas=world_size, rank=rank, shuffle=True, seed=args.seed)
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        if timeline:
            timeline.epoch_start()
        start = time.perf_counter()
        order = torch.tensor(list(sampler))  # this rank's shuffled shard, once per epoch
        steps = len(order) // per_rank  # the last incomplete batch dropped
        if args.limit_train_batches:
            steps = min(steps, args.limit_train_batches)
        for step in range(steps):
            idx = order[step * per_rank:(step + 1) * per_rank]
            xb, yb = x_train.index_select(0, idx), y_train.index_select(0, idx)
            loss = F.cross_entropy(model(xb), yb)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            if timeline:
                timeline.step_end(len(yb))
        seconds = time.perf_counter() - start
        val_loss, val_acc = evaluate(model, x_val, y_val, per_rank)
        if rank == 0:  # the others go on: the next step's all-reduce waits for rank 0
            save_checkpoint(checkpoint, epoch, model.module, optimizer)
        if timeline:
            timeline.epoch_end()
        if rank == 0:
            print(f"epoch {epoch}: training {seconds:.2f} s, with validation and checkpoint "
                  f"{time.perf_counter() - start:.2f} s  val/loss={val_loss:.4f}  val/acc={val_acc:.4f}", flush=True)
    test_loss, test_acc = evaluate(model, x_test, y_test, per_rank)
    if rank == 0:
        print(f"test/loss={test_loss:.4f}  test/acc={test_acc:.4f}", flush=True)
    if timeline:
        timeline.meta["test_metrics"] = {"test/loss": test_loss, "test/acc": test_acc}
        timeline.dump()
    cleanup()


def main(argv: list[str] | None = None) -> None:
    parser = work_arguments(__doc__.split("\n")[0])
    parser.add_argument("--nproc", type=int, default=2, help="processes to spawn (ignored under torchrun)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    parser.add_argument("--port", type=int, default=0, help="rendezvous port (0 = a free one)")
    args = parser.parse_args(argv)
    if args.batch_size % args.nproc:
        parser.error(f"--batch-size {args.batch_size} must divide evenly across --nproc {args.nproc}")

    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # started by torchrun / srun
        train(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), args)
        return
    args.port = args.port or free_port()
    mp.spawn(train, args=(args.nproc, args), nprocs=args.nproc, join=True)


if __name__ == "__main__":
    main()
