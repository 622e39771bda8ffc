"""`cpp_build.OpLibrary`, what every CPU kernel's `load` goes through: one build per process, a failed
build says False with a warning naming what the caller keeps, and registers nothing."""

from __future__ import annotations

import logging
from pathlib import Path

from specserve_kernels import cpp_build


def test_a_failed_build_falls_back_once_and_registers_nothing(monkeypatch, tmp_path, caplog):
    builds, fakes = [], []

    def no_compiler(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        builds.append(args)
        raise RuntimeError("g++ not found")

    monkeypatch.setattr(cpp_build, "build", no_compiler)
    monkeypatch.setattr(cpp_build, "can_build_for", lambda flags: True)
    library = cpp_build.OpLibrary("specserve_test_op", Path("op.cpp"), frozenset({"avx2"}), ["-mavx2"],
                                  "the plain torch path", lambda: fakes.append(1))
    with caplog.at_level(logging.WARNING):
        assert library.load(tmp_path) is False
    assert "specserve_test_op not built, keeping the plain torch path" in caplog.text and "g++ not found" in caplog.text
    assert library.load(tmp_path) is False and not library.loaded()
    assert len(builds) == 1 and fakes == []


def test_a_machine_without_the_flags_never_builds(monkeypatch, tmp_path):
    monkeypatch.setattr(cpp_build, "build", lambda *a, **k: (_ for _ in ()).throw(AssertionError("built")))
    monkeypatch.setattr(cpp_build, "can_build_for", lambda flags: False)
    library = cpp_build.OpLibrary("specserve_test_op", Path("op.cpp"), frozenset({"avx512f"}), [], "SDPA", lambda: None)
    assert not library.supported() and library.load(tmp_path) is False
