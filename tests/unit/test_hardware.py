"""Hardware detection: what the bench records and what dtype="auto" picks."""

from __future__ import annotations

from specserve import hardware


def test_auto_dtype_follows_native_bf16(monkeypatch):
    monkeypatch.setattr(hardware, "cpu_flags", lambda: frozenset({"avx512f", "avx512_bf16"}))
    assert hardware.native_bf16() and hardware.auto_dtype("cpu") == "bfloat16"
    monkeypatch.setattr(hardware, "cpu_flags", lambda: frozenset({"avx512f", "avx512_vnni"}))
    assert not hardware.native_bf16() and hardware.auto_dtype("cpu") == "float32"
    assert hardware.auto_dtype("cuda") == "bfloat16"
    assert hardware.describe()["bf16_flags"] == []


def test_describe_reads_this_machine():
    info = hardware.describe()
    assert info["cores"] >= 1 and info["torch_threads"] >= 1
    assert set(info["bf16_flags"]) <= set(hardware.BF16_FLAGS)
    assert info["native_bf16"] == bool({"avx512_bf16", "amx_bf16"} & hardware.cpu_flags())
    assert set(info["flags"]) == hardware.cpu_flags() & set(hardware.RECORDED_FLAGS)
    assert info["cpu_family_model"].count("/") == 1
