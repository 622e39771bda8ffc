"""KV-cache slots against a device's memory (`runtime.memory`): the configured slots fit, or loading
fails with an error that says how many would; the copies of the weights a compiled engine still
allocates are counted, and a CPU's check reads the host's memory. Device memory is a stand-in
here; the engine on the "meta" device runs the GPU path's build."""

from __future__ import annotations

import pytest
import torch

import specserve.runtime.memory as memory
from specserve.config import EngineConfig, SpecConfig
from specserve.engine.engine import Engine
from specserve.model_config import ModelConfig
from specserve.runtime.memory import (
    DeviceMemory,
    check_kv_cache_fits,
    compiled_weight_copies,
    host_memory,
    kv_bytes_per_token,
    weight_bytes,
)
from specserve.runtime.plan import RuntimePlan

GIB = 2**30
LLAMA_8B = ModelConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32,
                       num_heads=32,
                       num_kv_heads=8, head_dim=128, rms_norm_eps=1e-5, rope_theta=500000.0,
                       max_position_embeddings=131072, tie_word_embeddings=False)


def _config(**kw) -> EngineConfig:
    return EngineConfig(model_dir="m", device="cuda:0", dtype="bfloat16", **kw)


def test_llama_8b_kv_cache_bytes():
    """128 KiB a token in bf16 (32 layers x 8 KV heads x 128 x K and V x 2 bytes), as vLLM counts it."""
    assert kv_bytes_per_token(LLAMA_8B, 32, torch.bfloat16) == 128 * 1024


def test_slots_that_fit_pass_and_too_many_name_how_many_fit():
    """An H100 (80 GiB) with 8B's weights loaded (16 GiB in use): at 0.9, 56 GiB are left; a slot of
    8,192 + 64 positions is 1.04 GiB with an EAGLE-3 head's layer, so 53 slots fit beside 0.73 GiB of
    workspace: 52 requests and the padding slot."""
    h100 = DeviceMemory(free=64 * GIB, total=80 * GIB)
    config = _config(max_batch_size=48, max_seq_len=8192, spec=SpecConfig(algorithm="eagle3"))
    check_kv_cache_fits(config, LLAMA_8B, 49, 8192 + 64, 8, h100)
    too_many = _config(max_batch_size=64, max_seq_len=8192, spec=SpecConfig(algorithm="eagle3"))
    with pytest.raises(ValueError,
                       match=r"^max_batch_size: 64 requests x 8192 tokens need .* 52 slots of 8192 tokens "
                             r"fit"):
        check_kv_cache_fits(too_many, LLAMA_8B, 65, 8192 + 64, 8, h100)
    lower = _config(max_batch_size=64, max_seq_len=8192, gpu_memory_utilization=0.5,
                    spec=SpecConfig(algorithm="eagle3"))
    with pytest.raises(ValueError, match=r"gpu_memory_utilization 0.5 .* leaves 24\.00 GiB .* 21 slots"):
        check_kv_cache_fits(lower, LLAMA_8B, 65, 8192 + 64, 8, h100)


def test_nothing_is_checked_without_device_memory():
    check_kv_cache_fits(_config(max_batch_size=10**6), LLAMA_8B, 10**6, 8192, 8, None)
    assert DeviceMemory.of(torch.device("meta")) is None
    host = DeviceMemory.of(torch.device("cpu"))
    assert host is not None and host.host and 0 < host.free <= host.total


def test_weight_bytes_count_every_parameter(tiny_target_dir):
    """Llama 3 8B's 8,030,261,248 parameters (untied); the tiny target's checkpoint (tied) exactly."""
    from safetensors.torch import load_file

    assert weight_bytes(LLAMA_8B, torch.bfloat16) == 2 * 8_030_261_248
    tensors = load_file(tiny_target_dir / "model.safetensors")
    assert weight_bytes(ModelConfig.from_dir(tiny_target_dir), torch.float32) == 4 * sum(
        t.numel() for t in tensors.values())


def test_the_weight_copies_still_to_come_are_counted():
    """A compiled engine's programs hold their own copies of the weights (two for the target),
    allocated after the check: on the H100 above, 30 GiB of them leave room for 23 requests, not 52."""
    h100 = DeviceMemory(free=64 * GIB, total=80 * GIB)
    config = _config(max_batch_size=48, max_seq_len=8192, spec=SpecConfig(algorithm="eagle3"))
    check_kv_cache_fits(config, LLAMA_8B, 49, 8192 + 64, 8, h100, weight_copies=0)
    with pytest.raises(ValueError, match=r"KV cache, step workspace and 2 compiled copies of the weights "
                                         r"on cuda:0, .* 23 slots of 8192"):
        check_kv_cache_fits(config, LLAMA_8B, 49, 8192 + 64, 8, h100, weight_copies=2)
    plan = RuntimePlan.from_config(EngineConfig(model_dir="m", device="cpu", cpu_compile=True))
    assert compiled_weight_copies(plan) == (2 if plan.compile_cache_dir is not None else 0)
    eager = RuntimePlan.from_config(EngineConfig(model_dir="m", device="cpu", cpu_compile=False))
    assert compiled_weight_copies(eager) == 0


def test_the_host_check_counts_all_that_is_available(tmp_path):
    """On a CPU: MemAvailable (whatever gpu_memory_utilization says), within a cgroup's limit."""
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       33554432 kB\nMemFree:         1048576 kB\n"
                       "MemAvailable:   16777216 kB\n")
    no_cgroup = tmp_path / "none"
    assert host_memory(meminfo, no_cgroup) == DeviceMemory(free=16 * GIB, total=32 * GIB, host=True)
    v2 = tmp_path / "v2"
    v2.mkdir()
    (v2 / "memory.max").write_text(f"{8 * GIB}\n")
    (v2 / "memory.current").write_text(f"{6 * GIB}\n")
    (v2 / "memory.stat").write_text(f"anon {5 * GIB}\nfile {GIB}\n")  # page cache: reclaimable
    assert host_memory(meminfo, v2) == DeviceMemory(free=3 * GIB, total=8 * GIB, host=True)
    (v2 / "memory.max").write_text("max\n")
    assert host_memory(meminfo, v2).total == 32 * GIB
    v1 = tmp_path / "v1"
    (v1 / "memory").mkdir(parents=True)
    (v1 / "memory" / "memory.limit_in_bytes").write_text(f"{4 * GIB}\n")
    (v1 / "memory" / "memory.usage_in_bytes").write_text(f"{3 * GIB}\n")
    (v1 / "memory" / "memory.stat").write_text(f"cache 0\ntotal_cache {GIB}\n")
    assert host_memory(meminfo, v1) == DeviceMemory(free=2 * GIB, total=4 * GIB, host=True)
    assert host_memory(tmp_path / "absent", v1) is None

    host = DeviceMemory(free=16 * GIB, total=32 * GIB, host=True)
    cpu = EngineConfig(model_dir="m", device="cpu", dtype="bfloat16", max_batch_size=15, max_seq_len=8192,
                       gpu_memory_utilization=0.1)
    check_kv_cache_fits(cpu, LLAMA_8B, 15, 8192, 1, host)  # 15 GiB of cache: the knob does not apply
    with pytest.raises(ValueError,
                       match=r"in host memory, but 16\.00 GiB of its 32\.0 GiB are available: 0 slots"):
        check_kv_cache_fits(cpu, LLAMA_8B, 15, 8192, 1, host, weight_copies=2)


def test_the_utilization_knob_is_checked():
    with pytest.raises(ValueError, match=r"^gpu_memory_utilization: must be in \(0, 1\]"):
        _config(gpu_memory_utilization=1.5)


def test_an_engine_whose_cache_does_not_fit_fails_at_load_with_the_slots_that_fit(tiny_target_dir,
                                                                                  monkeypatch):
    """The GPU path's build on the "meta" device, its memory reported as a small GPU's: the engine
    refuses before allocating, naming how many slots would fit; enough memory builds it."""
    cfg = ModelConfig.from_dir(tiny_target_dir)
    per_slot = (128 + 64) * kv_bytes_per_token(cfg, cfg.num_layers, torch.bfloat16)
    workspace = 3 * 4 * 1 * cfg.vocab_size * 4
    small = DeviceMemory(free=3 * per_slot + workspace, total=3 * per_slot + workspace)
    monkeypatch.setattr(memory.DeviceMemory, "of", classmethod(lambda cls, device, host=False: small))
    config = EngineConfig(model_dir=str(tiny_target_dir), device="meta", dtype="bfloat16", max_batch_size=4,
                          max_seq_len=128, graph_mode="static", gpu_memory_utilization=1.0)
    with pytest.raises(ValueError,
                       match=r"^max_batch_size: 4 requests x 128 tokens .* 2 slots of 128 tokens fit"):
        Engine(config)
    roomy = DeviceMemory(free=10 * per_slot + workspace, total=10 * per_slot + workspace)
    monkeypatch.setattr(memory.DeviceMemory, "of", classmethod(lambda cls, device, host=False: roomy))
    assert Engine(config).cache.num_slots == 5
