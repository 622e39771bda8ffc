"""An engine's CPU programs compiled (or loaded) by a process of its own, so that a server answers
at once with an eager engine meanwhile (`EngineConfig.serve_while_compiling`).

`start(config)` launches `python -m specserve.engine.precompile` at a low CPU priority (`NICENESS`). It
builds the engine `config` describes with its step programs pinned and its tree fixed, so no
start-up timing runs: building it compiles each program into the compile cache, or finds it
there, and the process exits. An engine the server builds afterwards from the same
config loads every program from the cache. `eager_config` is the engine that serves meanwhile, on a
core fewer (`with_threads` names the served engine's threads, which it takes back).
A stored program that does not load is set aside and compiled again by this process
(`runtime.compile_cache.load_or_compile`, once); where the target's programs still did not build, the
process fails, and the server keeps its eager engine rather than compiling them on its own
serving thread.

This module does not switch engines (`loop.EngineLoop.upgrade_when_ready` does) and does
nothing where the plan compiles nothing (CUDA, `cpu_compile` off).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import replace

from specserve.config import EngineConfig, engine_config
from specserve.engine.engine import Engine
from specserve.runtime.compile_cache import can_compile

log = logging.getLogger(__name__)


def wanted(config: EngineConfig) -> bool:
    """Whether the config asks to serve while compiling and there is something to compile."""
    import torch

    return config.serve_while_compiling and config.cpu_compile and config.graph_mode != "static" and \
        can_compile(torch.device(config.device))


def with_threads(config: EngineConfig) -> EngineConfig:
    """`config` with its torch threads named (torch's default where it names none): the served engine, built
    after the eager one, takes them back."""
    import torch

    return replace(config, num_threads=config.num_threads or torch.get_num_threads())


def eager_config(config: EngineConfig) -> EngineConfig:
    """The engine that serves while the programs compile: eager forwards, the configured tree, and a KV cache
    of the model's own numbers: the eager attention agrees across batch shapes to the last bits only, which a
    narrower cache's rounding turns into different near-tie tokens (a tree's against its decodes'). It runs on
    one torch thread fewer than `with_threads(config)`, leaving a core to the compiling process: beside a model
    keeping every core busy, that process at its niceness got about a tenth of one and did not finish in 10
    minutes (on 2 cores)."""
    threads = max(1, with_threads(config).num_threads - 1)
    return replace(config, cpu_compile=False, kv_cache_dtype=config.dtype, spec=replace(config.spec, adaptive=False),
                   num_threads=threads)


def program_config(config: EngineConfig) -> EngineConfig:
    """The engine whose building compiles `config`'s programs and times nothing."""
    return replace(config, compiled_steps="always", spec=replace(config.spec, adaptive=False), max_queue_size=0)


def _python() -> str:
    """This interpreter, or the `python3` on PATH where this runs embedded (a Triton stub)."""
    if os.path.basename(sys.executable).startswith("python"):
        return sys.executable
    return shutil.which("python3") or "python3"


# The compiling process's niceness: the serving threads come first, but not so far first that it never ends. At
# the lowest priority (19) it got 1-3 % of a core beside a served model keeping both cores busy, and a 10-minute
# soak at concurrency 8 never switched to the compiled programs; at 10 the scheduler gives it about a tenth.
NICENESS = 10


def start(config: EngineConfig) -> subprocess.Popen:
    """The compiling process, started in the background (its log goes where this process's does)."""
    values = dataclasses.asdict(program_config(config))
    spec = values.pop("spec")
    env = os.environ | {"PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    proc = subprocess.Popen([_python(), "-m", "specserve.engine.precompile", json.dumps(values | spec)], env=env,
                            stdin=subprocess.DEVNULL)
    # never below this process's own niceness (lowering it needs a privilege)
    os.setpriority(os.PRIO_PROCESS, proc.pid, max(NICENESS, os.getpriority(os.PRIO_PROCESS, 0)))
    return proc


def ready(proc: subprocess.Popen, served: EngineConfig) -> bool | None:
    """`finished(proc)`, asked on the engine thread: where the process failed, the eager engine keeps serving and
    takes back the thread it left (`with_threads(served)`'s)."""
    state = finished(proc)
    if state is False:
        _every_thread_again(served)
    return state


def build_served(build: Callable[[EngineConfig], Engine], served: EngineConfig) -> Engine:
    """`build(served)` on the engine thread (its engine sets its own threads); where it fails, the eager engine
    keeps serving and takes back the thread it left."""
    try:
        return build(served)
    except Exception:
        _every_thread_again(served)
        raise


def _every_thread_again(served: EngineConfig) -> None:
    """served: as `with_threads` names it (the eager engine's count is one fewer)."""
    import torch

    torch.set_num_threads(served.num_threads)


def finished(proc: subprocess.Popen) -> bool | None:
    """None while it runs; then whether it succeeded."""
    rc = proc.poll()
    if rc is None:
        return None
    if rc != 0:
        log.warning("precompile: the compiling process exited with %d; the eager engine keeps serving", rc)
    return rc == 0


def main(argv: list[str]) -> int:
    parent = os.getppid()

    def orphaned() -> None:  # a server that died (or was killed) takes its compiling process with it
        while os.getppid() == parent:
            time.sleep(1)
        os._exit(1)

    threading.Thread(target=orphaned, daemon=True).start()
    if not programs_built(Engine(engine_config(json.loads(argv[0])))):
        log.warning("the target's compiled programs did not build (see above); "
                    "the server keeps its eager engine")
        return 1
    return 0


def programs_built(engine: Engine) -> bool:
    """Whether the engine's target runs compiled programs, its step program included (an engine
    built from the same config would otherwise compile the missing ones itself)."""
    compiled = engine.runner.compiled
    return compiled is not None and compiled.step_runner is not None


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(asctime)s precompile %(levelname)s %(message)s")
    sys.exit(main(sys.argv[1:]))
