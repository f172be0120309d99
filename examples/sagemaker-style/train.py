"""A script written for SageMaker: hyperparameters as `--key value` arguments, data in SM_CHANNEL_<NAME>, the model
to SM_MODEL_DIR, the cluster from SM_HOSTS / SM_CURRENT_HOST. doeks sets the same names on every target, so it runs
unchanged on local, docker, kubernetes/eks and SageMaker (docs/your-own-script.md):

    TRAIN_SCRIPT=examples/sagemaker-style/train.py TRAIN_ARGS="--epochs 2 --learning-rate 0.1" invoke elasticjob.deploy
"""
import argparse
import json
import os
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

try:
    from doeks import report  # progress for `invoke elasticjob.status` (optional: the fallback prints the same line)
except ImportError:
    def report(step, loss=None, samples=None, total=None):
        print(f"doeks: step={step}" + (f" loss={loss:.6g}" if loss is not None else ""), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--learning-rate", type=float, default=0.1)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--model-dir", default=os.environ.get("SM_MODEL_DIR", "model"))
    parser.add_argument("--train", default=os.environ.get("SM_CHANNEL_TRAINING", "data"))
    args = parser.parse_args()

    hosts = json.loads(os.environ.get("SM_HOSTS", '["localhost"]'))
    current = os.environ.get("SM_CURRENT_HOST", hosts[0])
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    channels = {name: os.environ.get(f"SM_CHANNEL_{name.upper()}", "")
                for name in json.loads(os.environ.get("SM_CHANNELS", '["training"]'))}
    files = sum(1 for _ in Path(args.train).rglob("*")) if Path(args.train).is_dir() else 0
    print(f"[rank {rank}] host {current} of {hosts}, world {world}, channels {channels}, {files} entries in "
          f"{args.train}", flush=True)

    torch.manual_seed(0)
    x = torch.randn(256, 4)
    y = (x.sum(dim=1, keepdim=True) > 0).float()
    model = torch.nn.Linear(4, 1)
    ddp = DistributedDataParallel(model)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=args.learning_rate)
    shard = x[rank::world], y[rank::world]
    step = 0
    steps = args.epochs * max(1, len(shard[0]) // args.batch_size)
    for _ in range(args.epochs):
        for i in range(0, len(shard[0]) - args.batch_size + 1, args.batch_size):
            loss = torch.nn.functional.binary_cross_entropy_with_logits(
                ddp(shard[0][i:i + args.batch_size]), shard[1][i:i + args.batch_size])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            step += 1
            if rank == 0:
                report(step=step, loss=loss.item(), samples=args.batch_size, total=steps)
    if rank == 0:
        os.makedirs(args.model_dir, exist_ok=True)
        torch.save(model.state_dict(), os.path.join(args.model_dir, "model.pt"))
        print(f"saved {args.model_dir}/model.pt after {step} steps", flush=True)
    dist.barrier()  # every rank leaves together
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
