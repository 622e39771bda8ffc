"""The client's local server: `specserve serve` run as a command, its failures reported with what it said."""

from __future__ import annotations

import sys

import pytest

from specserve_client import local_server as ls


def test_a_server_that_cannot_start_is_reported_with_its_output():
    with (pytest.raises(RuntimeError, match="unknown variant"),
          ls.local_server("no_such_variant", startup_timeout_s=120)):
        pass


def test_without_the_server_package_the_error_says_what_is_missing(monkeypatch, tmp_path):
    monkeypatch.setattr(sys, "executable", str(tmp_path / "python"))
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(FileNotFoundError, match="server package"):
        ls.specserve_command()


def test_a_local_server_listens_on_loopback_and_ends_with_its_starter(tmp_path):
    cmd = ls.serve_command("none", (1, 2, 3), tmp_path / "log", parameters={"max_batch_size": "2"})
    assert cmd[1:3] == ["serve", "--variants"] and "--exit-with-parent" in cmd
    assert cmd[cmd.index("--host") + 1] == ls.LOOPBACK == "127.0.0.1"
    ports = [cmd[cmd.index(flag) + 1] for flag in ("--http-port", "--grpc-port", "--metrics-port")]
    assert ports == ["1", "2", "3"]
    assert cmd[cmd.index("--parameter") + 1] == "max_batch_size=2"
