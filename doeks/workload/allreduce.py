"""An all_reduce bandwidth sweep with torch.distributed, printed in nccl-tests' all_reduce_perf format.

Run under torchrun (gloo on CPU, nccl on GPUs): `torchrun --nproc-per-node 2 allreduce.py -b 8 -e 64M -f 2`.
Rank 0 prints the table, so the nccl-tests parser reads both this and the real thing.
"""
from __future__ import annotations

import argparse
import os
import sys
import time


def size_arg(text: str) -> int:
    units = {"K": 1024, "M": 1024**2, "G": 1024**3}
    text = text.strip().upper()
    return int(float(text[:-1]) * units[text[-1]]) if text[-1] in units else int(text)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("-b", "--minbytes", type=size_arg, default=8)
    p.add_argument("-e", "--maxbytes", type=size_arg, default=64 * 1024**2)
    p.add_argument("-f", "--stepfactor", type=int, default=2)
    p.add_argument("-n", "--iters", type=int, default=5)
    p.add_argument("-w", "--warmup_iters", type=int, default=1)
    args = p.parse_args(argv)

    import torch
    import torch.distributed as dist

    cuda = torch.cuda.is_available()
    backend = "nccl" if cuda else "gloo"
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group(backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    out = sys.stdout if rank == 0 else open(os.devnull, "w")
    print(f"# doeks all_reduce sweep: {world} ranks, transport: {backend}{'/tcp' if backend == 'gloo' else ''}", file=out)
    print("#                                                              out-of-place                       in-place", file=out)
    print("#       size         count      type   redop    root     time   algbw   busbw #wrong     time   algbw   busbw #wrong", file=out)
    print("#        (B)    (elements)                               (us)  (GB/s)  (GB/s)            (us)  (GB/s)  (GB/s)", file=out)
    factor = 2 * (world - 1) / world
    busbws = []
    size = args.minbytes
    while size <= args.maxbytes:
        count = max(1, size // 4)
        results = []
        for in_place in (False, True):
            data = torch.ones(count, dtype=torch.float32, device=device)
            for _ in range(args.warmup_iters):
                dist.all_reduce(data if in_place else data.clone())
            if cuda:
                torch.cuda.synchronize()
            start = time.perf_counter()
            for _ in range(args.iters):
                buffer = data if in_place else data.clone()
                dist.all_reduce(buffer)
            if cuda:
                torch.cuda.synchronize()
            elapsed = (time.perf_counter() - start) / args.iters
            algbw = count * 4 / elapsed / 1e9
            results.append((elapsed * 1e6, algbw, algbw * factor))
        busbws.append(results[0][2])
        (ot, oa, ob), (it, ia, ib) = results
        print(f"{count * 4:12d}  {count:12d}     float     sum      -1  {ot:7.1f}  {oa:6.2f}  {ob:6.2f}      0  {it:7.1f}  {ia:6.2f}  {ib:6.2f}      0", file=out, flush=True)
        size *= args.stepfactor
    print("# Out of bounds values : 0 OK", file=out)
    print(f"# Avg bus bandwidth    : {sum(busbws) / len(busbws):.5f}", file=out)
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
