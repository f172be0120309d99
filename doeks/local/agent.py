"""torchrun for a local node: `python -m doeks.local.agent [torchrun args]`.

Exactly torch.distributed.run, with one change for the etcd rendezvous on one machine: the workers' keep-alive
lease is 3 s instead of 10 s. After a failure, re-joining agents wait for the old round's leases to lapse before a
new round can start; on one machine a node that stops renewing for 3 s is really gone, so recovery waits less.
"""
from torch.distributed.elastic.rendezvous import etcd_rendezvous
from torch.distributed.run import main

KEEPALIVE_TTL = 3

etcd_rendezvous.CONST_WORKER_KEEPALIVE_TTL = KEEPALIVE_TTL

if __name__ == "__main__":
    main()
