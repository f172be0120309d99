"""The Go modules of `invoke setup --kubernetes`'s later builds, fetched in the background while the first one
(doeks-node: minutes of compiling on both cores) runs. Each build used to fetch its own modules before it compiled,
one after another with the CPUs idle (~60-80 s of downloads in series on a cold machine).

For each later build that is missing, its build module is written where its build writes it and the go command that
resolves it is run there, as the build runs it (same environment): `go mod tidy` where the build starts with one
(etcd, CoreDNS, the registry), `go list -deps PACKAGE` where it is a `go build` with -mod=mod (the operators: the
modules of the packages it compiles, no more), `go mod download` for eksctl's module (its schema). The build then
finds every module in Go's module cache, whose file locks make sharing it between go commands safe. A build waits
for its own prefetch before it starts (`ready`), so two go commands never write the same go.mod. A prefetch that
failed is said in one line with its log, and its build fetches the modules itself, as before. The binaries are the
same: what is compiled, and how, does not change."""
from __future__ import annotations

from .. import ui
from ..background import Background
from ..errors import DoeksError
from . import build, versions

STEP_LIMIT = 900   # one go command's limit (s): a cold module download on a slow line
WAIT_LIMIT = 3600  # the longest a build waits for the prefetch before it (each step's own limit comes first)


def _tidy(module: str):
    def step(bg: Background) -> str:
        with open(bg.log, "a") as log:
            where = build.write_module(module, versions.build_dir() / "src" / module, log)
        bg.run([build.go(), "mod", "tidy"], STEP_LIMIT, cwd=where, env=build._env())
        return f"{module}: modules fetched"
    return step


def _operator(op):
    def step(bg: Background) -> str:
        from . import operators

        where = operators.write_build_module(op)
        bg.run([build.go(), "list", "-deps", operators.main_package(op)], STEP_LIMIT, cwd=where, env=build._env())
        return f"{op.name}: modules fetched"
    return step


def _registry(bg: Background) -> str:
    from . import registry

    bg.run([build.go(), "mod", "tidy"], STEP_LIMIT, cwd=registry.write_module(), env=build._env())
    return "registry: modules fetched"


def _eksctl(bg: Background) -> str:
    from . import eksctl

    versions.cache_dir().mkdir(parents=True, exist_ok=True)
    bg.run([build.go(), "mod", "download", f"{eksctl.MODULE}@{eksctl.VERSION}"], STEP_LIMIT, cwd=versions.cache_dir(),
           env=build._env())
    return "eksctl: module fetched"


def plan() -> list[tuple[str, object]]:
    """(build, its prefetch step) for each Go build after doeks-node that is not built yet, in the order setup builds
    them; eksctl's module too when anything is to be built."""
    from . import operators, registry

    todo = build.missing()
    steps = [(name, _tidy(name)) for name in ("etcd", "coredns") if name in todo]
    steps += [(op.name, _operator(op)) for op in operators.OPERATORS.values() if not operators.binary(op).exists()]
    steps += [("registry", _registry)] if not registry.built() else []
    if steps or "doeks-node" in todo:
        steps.append(("eksctl", _eksctl))
    return steps


class Prefetch:
    """Started (`start`) once the first compile runs, or at the first build that waits for it (`ready`)."""

    def __init__(self, runner=None, steps=None):
        self.bg: Background | None = None
        self.waited: set[str] = set()
        if runner is not None and runner.dry_run:
            return
        steps = plan() if steps is None else steps
        if steps:
            self.bg = Background("prefetch of the Go modules of the later builds", versions.build_dir() / "prefetch.log")
            for name, step in steps:
                self.bg.add(name, step)

    def start(self) -> None:
        if self.bg is not None and not self.bg.started:
            self.bg.start()
            ui.say(f"  fetching the modules of {', '.join(n for n, _ in self.bg.steps)} in the background "
                   f"(log: {self.bg.log})", style="dim")

    def ready(self, name: str) -> None:
        """Before `name`'s build: its prefetch has ended (waited for, with progress lines); a failed one is a warning,
        and the build fetches what it needs itself."""
        if self.bg is None or name not in self.bg.done or name in self.waited:
            return
        self.waited.add(name)
        self.start()
        try:
            self.bg.wait(name, limit=WAIT_LIMIT)
        except DoeksError as error:
            ui.warn(f"{error} (its build fetches the modules itself)")

    def finish(self) -> None:
        """After the builds: every prefetch has ended (none is left running past setup); failures not said yet are."""
        for name in list(self.bg.done) if self.bg is not None else []:
            self.ready(name)  # said once: one waited for already returns at once

    def cancel(self) -> None:
        if self.bg is not None:
            self.bg.cancel()
