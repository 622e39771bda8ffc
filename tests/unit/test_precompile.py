"""The compiling process a served CPU model starts beside its eager engine: it fills the compile
cache with exactly the programs the model's own engine then loads, and it times nothing."""

from __future__ import annotations

import json
import os
import time
from types import SimpleNamespace

import pytest
import torch

from specserve.config import EngineConfig, SpecConfig
from specserve.engine import precompile
from specserve.engine.engine import Engine


def test_the_eager_and_program_configs_differ_from_the_served_one_only_where_they_must(tiny_target_dir):
    config = EngineConfig(model_dir=str(tiny_target_dir), device="cpu", spec=SpecConfig(algorithm="ngram"))
    assert precompile.wanted(config)
    eager = precompile.eager_config(config)
    assert not eager.cpu_compile and not eager.spec.adaptive and eager.max_queue_size == config.max_queue_size
    programs = precompile.program_config(config)
    assert programs.cpu_compile and programs.compiled_steps == "always" and not programs.spec.adaptive
    assert not precompile.wanted(EngineConfig(model_dir="m", device="cpu", serve_while_compiling=False))
    assert not precompile.wanted(EngineConfig(model_dir="m", device="cpu", cpu_compile=False))


def test_the_eager_engine_leaves_a_core_to_the_compiling_process_and_the_served_one_takes_it_back(monkeypatch):
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    served = precompile.with_threads(EngineConfig(model_dir="m", device="cpu"))
    assert served.num_threads == 2 and precompile.eager_config(served).num_threads == 1
    for threads, eager in ((1, 1), (16, 15)):  # never none
        config = EngineConfig(model_dir="m", device="cpu", num_threads=threads)
        assert precompile.with_threads(config) == config and precompile.eager_config(config).num_threads == eager


def test_where_the_programs_do_not_come_the_eager_engine_takes_its_thread_back(monkeypatch):
    """A compiling process that failed, or a served engine that did not build: the eager engine keeps serving,
    on every thread again; while the process runs, nothing changes."""
    threads: list[int] = []
    monkeypatch.setattr(torch, "set_num_threads", threads.append)
    served = EngineConfig(model_dir="m", device="cpu", num_threads=2)
    running, failed = SimpleNamespace(poll=lambda: None), SimpleNamespace(poll=lambda: 1)
    assert precompile.ready(running, served) is None and threads == []
    assert precompile.ready(failed, served) is False and threads == [2]

    def broken(config: EngineConfig) -> Engine:
        raise RuntimeError("no programs")

    with pytest.raises(RuntimeError, match="no programs"):
        precompile.build_served(broken, served)
    assert threads == [2, 2]
    assert precompile.build_served(lambda config: "engine", served) == "engine" and threads == [2, 2]


def test_the_eager_engine_keeps_the_models_numbers_in_its_kv_cache():
    """The served GGUF engine's float16 cache (kv_cache_dtype auto) needs the compiled programs' attention: the
    engine serving while they build keeps float32, whether the cache was chosen by auto or by name."""
    for kv in ("auto", "float16"):
        served = EngineConfig(model_dir="m", device="cpu", load_format="gguf", kv_cache_dtype=kv)
        assert served.kv_cache_dtype == "float16"
        eager = precompile.eager_config(served)
        assert (eager.kv_cache_dtype, eager.dtype) == ("float32", "float32")
        assert eager.kv_torch_dtype == torch.float32


def test_the_process_fills_the_cache_the_served_engine_loads(fresh_compile_cache, tiny_target_dir):
    config = EngineConfig(model_dir=str(tiny_target_dir), device="cpu", dtype="float32", max_batch_size=2,
                          max_seq_len=128, compile_cache_dir=str(fresh_compile_cache))
    proc = precompile.start(config)
    assert precompile.finished(proc) is None  # running
    # behind the serving threads, never lower than this process
    assert os.getpriority(os.PRIO_PROCESS, proc.pid) == max(precompile.NICENESS, os.getpriority(os.PRIO_PROCESS, 0))
    proc.wait(timeout=900)
    assert precompile.finished(proc) is True
    programs = {p.name: p.stat().st_ino for p in fresh_compile_cache.glob("*.pt2")}  # a compile writes a new file
    assert programs
    start = time.perf_counter()
    engine = Engine(config)
    assert engine.runner.compiled is not None
    assert {p.name: p.stat().st_ino for p in fresh_compile_cache.glob("*.pt2")} == programs  # loaded, not compiled
    assert time.perf_counter() - start < 60
    assert engine.runner.compiled.step_runner is not None
    # a stored program that does not load is set aside and compiled again: tests/unit/test_compile_cache.py


def test_the_process_fails_where_the_target_programs_did_not_build(tiny_target_dir, monkeypatch):
    """Then the server keeps its eager engine: one built from the same config would compile the
    missing programs on the serving thread."""
    cases = [(SimpleNamespace(step_runner=object()), 0), (SimpleNamespace(step_runner=None), 1), (None, 1)]
    for compiled, rc in cases:
        monkeypatch.setattr(precompile, "Engine", lambda config, c=compiled: SimpleNamespace(
            runner=SimpleNamespace(compiled=c)))
        assert precompile.main([json.dumps({"model_dir": str(tiny_target_dir), "device": "cpu"})]) == rc
