"""A plain PyTorch DDP script, nothing doeks-specific: strict argparse, torchrun's environment, a checkpoint folder it
resumes from, the final model in a model folder. Runs unchanged on every doeks target (docs/your-own-script.md):

    TRAIN_SCRIPT=examples/ddp-plain/train.py TRAIN_ARGS="--steps 50" invoke elasticjob.deploy --follow

or by hand: `torchrun --nproc-per-node 2 examples/ddp-plain/train.py --steps 50`.
"""
import argparse
import json
import os
import sys
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, required=True, help="optimizer steps in all")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--batch-size", type=int, default=64, help="per process")
    parser.add_argument("--checkpoint-every", type=int, default=5)
    parser.add_argument("--step-delay", type=float, default=0.0, help="seconds to sleep each step (to watch it)")
    parser.add_argument("--fail-at", type=int, default=-1, help="raise RuntimeError at this step (to see a failure)")
    parser.add_argument("--note", default="", help="any text; printed back")
    args = parser.parse_args()  # strict: an argument it does not know exits 2

    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{int(os.environ['LOCAL_RANK'])}" if cuda else "cpu")
    checkpoints = os.environ.get("DOEKS_CHECKPOINT_DIR", "checkpoints")
    model_dir = os.environ.get("DOEKS_MODEL_DIR", os.environ.get("SM_MODEL_DIR", "model"))
    if rank == 0:
        print(f"argv: {json.dumps(sys.argv[1:])}", flush=True)
        print(f"world={world} master={os.environ.get('MASTER_ADDR')} run={os.environ.get('DOEKS_RUN_ID')} "
              f"cwd={os.getcwd()} checkpoints={checkpoints}", flush=True)

    torch.manual_seed(0)
    true_w = torch.randn(10, 1)
    model = torch.nn.Linear(10, 1).to(device)
    ddp = DistributedDataParallel(model, device_ids=[device.index] if cuda else None)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=args.lr)
    step, path = 0, os.path.join(checkpoints, "checkpoint.pt")
    if os.path.exists(path):  # resume where the last run (or the last restart) stopped
        state = torch.load(path, map_location=device)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        step = state["step"]
        print(f"[rank {rank}] resumed from {path} at step {step}", flush=True)
        if rank == 0:
            print(f"doeks: step={step} total={args.steps}", flush=True)  # where it stands, for `elasticjob.status`

    generator = torch.Generator().manual_seed(1000 * rank + step)
    loss = None  # a job deployed again after its last step resumes there and trains no step
    while step < args.steps:
        if step == args.fail_at:
            raise RuntimeError(f"--fail-at {args.fail_at}: failing on purpose at step {step}")
        x = torch.randn(args.batch_size, 10, generator=generator).to(device)
        loss = torch.nn.functional.mse_loss(ddp(x), (x @ true_w.to(device)))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        step += 1
        if rank == 0:
            print(f"doeks: step={step} loss={loss.item():.4f} world={world} total={args.steps}", flush=True)
            if step % args.checkpoint_every == 0 or step == args.steps:
                os.makedirs(checkpoints, exist_ok=True)
                torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step}, path + ".tmp")
                os.replace(path + ".tmp", path)
        time.sleep(args.step_delay)
    if rank == 0:
        os.makedirs(model_dir, exist_ok=True)
        torch.save(model.state_dict(), os.path.join(model_dir, "model.pt"))
        print(f"done steps={step}" + (f" loss={loss.item():.4f}" if loss is not None else " (resumed at the end)")
              + f" model={model_dir}/model.pt", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
