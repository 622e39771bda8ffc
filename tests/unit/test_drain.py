"""The drain file between launcher and models: written whole, read as a deadline, watched by a
thread that drains once, says so in its marker and stops with the model; the launcher waits for
every marker, never past its timeout."""

from __future__ import annotations

import threading
import time

from specserve.serving.drain import DrainWatch, drained_marker, read_deadline, request_drain, wait_drained


def test_the_deadline_is_written_whole_and_read_back(tmp_path):
    path = tmp_path / "drain"
    assert read_deadline(path) is None
    request_drain(path, 7.0)
    assert abs(read_deadline(path) - (time.time() + 7.0)) < 1.0
    assert [p.name for p in tmp_path.iterdir()] == ["drain"]  # no temporary file left
    path.write_text("not a time")
    assert read_deadline(path) is None


def test_the_watch_drains_once_with_the_time_left(tmp_path):
    path, closing, calls = tmp_path / "drain", threading.Event(), []
    watch = DrainWatch(str(path), "llm_x", calls.append, closing)
    time.sleep(0.3)
    assert calls == []  # no file, no drain
    request_drain(path, 3.0)
    deadline = time.monotonic() + 5
    while not calls and time.monotonic() < deadline:
        time.sleep(0.05)
    watch.join(1.0)
    assert len(calls) == 1 and 2.0 < calls[0] <= 3.0
    assert not watch._thread.is_alive()  # type: ignore[union-attr]
    assert drained_marker(path, "llm_x").exists()  # written once drain returned


def test_the_launcher_waits_for_every_model_and_no_longer_than_the_timeout(tmp_path):
    path = tmp_path / "drain"
    request_drain(path, 0.0)
    drained_marker(path, "llm_a").touch()
    assert wait_drained(path, ["llm_a"], 5.0)
    started = time.monotonic()
    assert not wait_drained(path, ["llm_a", "llm_b"], 0.3)  # llm_b never answers
    assert 0.3 <= time.monotonic() - started < 2
    started = time.monotonic()
    assert not wait_drained(path, ["llm_b"], 30.0, keep_waiting=lambda: False)  # the server is gone
    assert time.monotonic() - started < 1


def test_the_watch_ends_with_the_model_and_without_a_path_never_starts(tmp_path):
    closing = threading.Event()
    watch = DrainWatch(str(tmp_path / "drain"), "llm_x", lambda s: None, closing)
    closing.set()
    watch.join(2.0)
    assert not watch._thread.is_alive()  # type: ignore[union-attr]
    assert DrainWatch(None, "llm_x", lambda s: None, closing)._thread is None
