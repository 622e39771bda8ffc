"""The compile cache of CPU programs (`runtime/compile_cache.py`): keys that cover the code programs are
traced from, stale packages removed, packages that do not load set aside and compiled again once."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import torch

from specserve.runtime import compile_cache
from specserve.runtime.compile_cache import CORRUPT_SUFFIX, STALE_AFTER_DAYS, load_or_compile, program_key, remove_stale

pytestmark = pytest.mark.skipif(not compile_cache.can_compile(torch.device("cpu")),
                                reason="needs g++ (make setup installs it)")


def test_the_key_covers_the_code_the_programs_are_traced_from(monkeypatch):
    """An edit to the model's or a head's code is another program, not a stale one from the cache."""
    import specserve.models.eagle_head as eagle_model
    import specserve.models.llama as llama
    import specserve.models.mtp_head as mtp_model
    import specserve.runtime.compiled as compiled

    sources = compile_cache.traced_sources()
    for module in (compiled, llama, eagle_model, mtp_model):
        assert Path(module.__file__).read_bytes() in sources, module.__name__
    weights = [("w", torch.ones(2))]
    before = program_key(weights, "target")
    monkeypatch.setattr(compile_cache, "traced_sources", lambda: sources + b"# edited")
    assert program_key(weights, "target") != before


def test_packages_unused_for_weeks_are_removed(tmp_path):
    now = time.time()
    for name, days in [("old", STALE_AFTER_DAYS + 1), ("recent", STALE_AFTER_DAYS - 1)]:
        (tmp_path / f"target-{name}.pt2").write_bytes(b"")
        (tmp_path / f"target-{name}.pt2.lock").write_bytes(b"")
        os.utime(tmp_path / f"target-{name}.pt2", (now, now - days * 86400))
    (tmp_path / "target-gone.pt2.corrupt").write_bytes(b"")  # set aside long ago
    os.utime(tmp_path / "target-gone.pt2.corrupt", (now, now - (STALE_AFTER_DAYS + 1) * 86400))
    remove_stale(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["target-recent.pt2", "target-recent.pt2.lock"]


class _Double(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor]:
        return (x * 2,)


def _export_double() -> torch.export.ExportedProgram:
    return torch.export.export(_Double(), (torch.ones(2, 3),))


def test_a_stored_package_that_does_not_load_is_set_aside_and_compiled_again(tmp_path, caplog):
    """A package cut short or overwritten under its key is moved out of it (`.corrupt`, named in a
    warning) and compiled afresh in the same call; the next load finds the new one."""
    path = tmp_path / "double-key.pt2"
    garbage = b"not a package " * 64
    path.write_bytes(garbage)
    with caplog.at_level("WARNING", logger="specserve.runtime.compiled"):
        runner, compiled_now = load_or_compile(path, _export_double)
    assert compiled_now
    assert (tmp_path / f"double-key.pt2{CORRUPT_SUFFIX}").read_bytes() == garbage
    assert path.read_bytes() != garbage and "double-key.pt2" in caplog.text and "set aside" in caplog.text
    x = torch.arange(6.0).reshape(2, 3)
    torch.testing.assert_close(runner(x)[0], 2 * x)
    again, compiled_again = load_or_compile(path, _export_double)
    assert again is runner and not compiled_again


def test_a_package_that_does_not_load_after_compiling_is_compiled_once_and_set_aside(tmp_path, monkeypatch):
    """At most one rebuild: a rebuilt package that does not load either raises (the caller runs
    eagerly) and leaves nothing under the key, so that the next build compiles it afresh."""
    path = tmp_path / "double-key.pt2"
    path.write_bytes(b"garbage")
    compiles = []

    def compile_garbage(target: Path, export, inductor_configs=None) -> None:  # noqa: ANN001
        compiles.append(target)
        target.write_bytes(b"garbage again")

    monkeypatch.setattr(compile_cache, "compile_package", compile_garbage)
    with pytest.raises(RuntimeError, match="zip"):
        load_or_compile(path, _export_double)
    assert compiles == [path] and not path.exists()
    assert (tmp_path / f"double-key.pt2{CORRUPT_SUFFIX}").read_bytes() == b"garbage again"
    with pytest.raises(RuntimeError):  # nothing stored: compiled (here: garbage again), never retried
        load_or_compile(path, _export_double)
    assert compiles == [path, path] and not path.exists()
