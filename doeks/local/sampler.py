"""The local GPU-metrics sampler process: `python -m doeks.local.sampler ENDPOINT REGION CLUSTER INTERVAL HEARTBEAT`."""
import sys
from pathlib import Path

from ..gpumetrics import run_sampler

if __name__ == "__main__":
    endpoint, region, cluster, interval, heartbeat = sys.argv[1:6]
    run_sampler(endpoint, region, cluster, float(interval), Path(heartbeat))
