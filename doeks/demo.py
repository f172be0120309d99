"""`invoke demo`, the main job on the local target: data, etcd, a 2-node x 2-process elastic job run to the end, a
plot, and a teardown that leaves no process behind. It goes through the local target like `elasticjob.deploy`."""
from __future__ import annotations

from . import elastic, machine, plots, targets, ui
from .errors import DoeksError
from . import services
from .runner import Runner


def run(base, keep: bool = False, dry_run: bool = False, verbose: bool = False) -> dict:
    """The demo; its job's logs are followed briefly (rank 0's steps, no torchelastic INFO) unless `verbose`."""
    s = base.with_overrides(target="local", replicas=2, nproc_per_node=2,
                            min_replicas=min(base.min_replicas, 2), max_replicas=max(base.max_replicas, 2))
    target = targets.get(s)
    if dry_run:
        runner = Runner(dry_run=True, secrets=s.secrets())
        elastic.make_data(s, runner)
        target.plan(target.job(fresh=True, dry_run=True)).show(runner)
        runner.step("follow the job to the end, write the plot, stop the job and etcd", lambda: None)
        return {}
    machine.require_training()
    runner = Runner(secrets=s.secrets())
    ui.say(f"doeks demo: {s.arch} on synthetic data, {s.replicas} nodes x {s.nproc_per_node} processes, "
           f"rendezvous {s.rdzv_backend}, state in {s.state_dir}", style="bold")
    elastic.make_data(s, runner)
    etcd_was_running = services.etcd(s.state_dir).info() is not None
    submitted = False
    try:
        quiet = Runner(echo=False, secrets=s.secrets())
        target.submit(target.plan(target.job(fresh=True)), quiet)
        submitted = True
        if not verbose:
            from .targets.follow import brief

            target.shown_lines = brief
        status = target.wait()
        if status.state != "Succeeded":
            raise DoeksError(f"the job ended {status.state}" + (f": {status.reason} (fix: {status.fix})" if status.reason else f": see {elastic.home(s)}/runs/{status.run}/replicas/*/agent.log"))
        result = elastic.final_result(s) or {}
        png = plots.training(elastic.metrics_dir(s) / "metrics.csv", plots.plot_path(s, f"{s.job_name}-training.png"),
                             title=f"{s.job_name}: {s.arch}, {s.replicas}x{s.nproc_per_node} processes")
        chance = 1 / s.data_classes
        ui.say(f"final validation accuracy: {result.get('val_accuracy', 0):.3f} (chance {chance:.3f}) "
               f"after {result.get('step')} steps", style="bold green")
        ui.say(f"plot: {png}")
        ui.say(f"checkpoints: {elastic.checkpoint_uri(s)} (`latest` names the newest)")
        return result
    finally:
        if not keep:
            if submitted:  # never a job of the same name that was running before the demo
                target.cancel(Runner(echo=False))
            if not etcd_was_running:
                services.etcd(s.state_dir).stop()
            ui.say("torn down: job processes and etcd stopped (data, checkpoints and metrics kept)")
