"""`specserve_client` stands alone: no module imports torch, the server package or transformers at
import time, so `pip install ./client` gives a working `specserve-client` without them; and no
module under client/ imports the server package at all, not even inside a function, so the
dependency runs one way (the server reads the client's datasets) and the packages form no cycle."""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
import textwrap
import venv
from pathlib import Path

import pytest

CLIENT_DIR = Path(__file__).resolve().parents[2] / "client"
PACKAGE_DIR = CLIENT_DIR / "specserve_client"
SERVER_SIDE = ("torch", "specserve", "specserve_kernels", "transformers")
SERVER_PACKAGES = ("specserve", "specserve_kernels")  # the project's own server-side packages
INSTALL_TIMEOUT_S = 180
# pip's messages when the package index (or a mirror of it) cannot serve the dependencies.
NO_INDEX = (
    "No matching distribution found",
    "Could not find a version that satisfies",
    "Failed to establish a new connection",
    "Temporary failure in name resolution",
    "ProxyError",
)


def module_level_imports(tree: ast.Module) -> list[tuple[int, str]]:
    """(line, top-level package) of each import run when the module is imported: everything
    outside function bodies (class bodies, `if` and `try` blocks included)."""
    found: list[tuple[int, str]] = []

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
                continue
            if isinstance(child, ast.Import):
                found.extend((child.lineno, alias.name.split(".")[0]) for alias in child.names)
            elif isinstance(child, ast.ImportFrom) and child.level == 0 and child.module:
                found.append((child.lineno, child.module.split(".")[0]))
            visit(child)

    visit(tree)
    return found


def test_no_module_imports_server_side_packages_at_import_time():
    offending = [
        f"{path.relative_to(CLIENT_DIR)}:{line}: import {name}"
        for path in sorted(PACKAGE_DIR.rglob("*.py"))
        for line, name in module_level_imports(ast.parse(path.read_text(), filename=str(path)))
        if name in SERVER_SIDE
    ]
    assert not offending, "server-side imports at module level:\n" + "\n".join(offending)


def every_import(tree: ast.Module) -> list[tuple[int, str]]:
    """(line, top-level package) of every absolute import statement in the module, function and
    class bodies included."""
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.extend((node.lineno, alias.name.split(".")[0]) for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.lineno, node.module.split(".")[0]))
    return found


def test_every_import_sees_function_bodies():
    tree = ast.parse("import os\ndef f():\n    from specserve.config import X\n"
                     "    class C:\n        import specserve\n")
    assert every_import(tree) == [(1, "os"), (3, "specserve"), (5, "specserve")]


def test_nothing_under_client_imports_the_server_package():
    modules = sorted(CLIENT_DIR.rglob("*.py"))
    assert PACKAGE_DIR / "servebench.py" in modules
    offending = [
        f"{path.relative_to(CLIENT_DIR)}:{line}: import {name}"
        for path in modules
        for line, name in every_import(ast.parse(path.read_text(), filename=str(path)))
        if name in SERVER_PACKAGES
    ]
    assert not offending, "the client imports the server package:\n" + "\n".join(offending)


def loads_by_name(tree: ast.Module) -> list[int]:
    """Lines that import a module named at run time (`importlib.import_module`, `__import__`): a
    way around `every_import`."""
    return sorted(n.lineno for n in ast.walk(tree)
                  if isinstance(n, ast.Name) and n.id in ("__import__", "import_module")
                  or isinstance(n, ast.Attribute) and n.attr == "import_module")


def test_nothing_under_client_loads_a_module_by_name():
    tree = ast.parse("import importlib\nx = __import__('a')\ny = importlib.import_module('b')\n"
                     "importlib.util.find_spec('c')\n")
    assert loads_by_name(tree) == [2, 3]
    offending = [f"{path.relative_to(CLIENT_DIR)}:{line}" for path in sorted(CLIENT_DIR.rglob("*.py"))
                 for line in loads_by_name(ast.parse(path.read_text(), filename=str(path)))]
    assert not offending, "the client loads modules by name (start the server as a command):\n" + "\n".join(offending)


BLOCKED_IMPORT_SCRIPT = textwrap.dedent(
    """
    import contextlib, importlib, io, pkgutil, sys

    BLOCKED = set(sys.argv[1].split(","))

    class Blocker:
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in BLOCKED:
                raise ImportError(f"{name} is blocked: the client must not need it")
            return None

    sys.meta_path.insert(0, Blocker())
    import specserve_client

    for info in pkgutil.walk_packages(specserve_client.__path__, "specserve_client."):
        module = importlib.import_module(info.name)
        main = getattr(module, "main", None)
        if main is None:
            continue
        with contextlib.redirect_stdout(io.StringIO()) as out:
            try:
                main(["--help"])
            except SystemExit as e:
                assert e.code in (0, None), f"{info.name} --help exited with {e.code}"
        assert "usage:" in out.getvalue(), info.name
        print(info.name)
    """
)


def test_every_module_imports_and_answers_help_without_server_side_packages():
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = str(CLIENT_DIR)  # this checkout's client, ahead of any installed copy
    proc = subprocess.run(
        [sys.executable, "-c", BLOCKED_IMPORT_SCRIPT, ",".join(SERVER_SIDE)],
        capture_output=True, text=True, env=env, timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert "specserve_client.cli" in proc.stdout.split()


@pytest.mark.slow
def test_pip_install_client_in_a_fresh_venv_gives_the_cli_without_torch(tmp_path):
    """`pip install ./client` into a venv without system site-packages: the CLI runs, torch is absent."""
    source = tmp_path / "client"  # a copy: building in place would leave build/ and egg-info behind
    shutil.copytree(CLIENT_DIR, source, ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
    env_dir = tmp_path / "venv"
    venv.EnvBuilder(with_pip=True, system_site_packages=False, clear=True).create(env_dir)
    python = env_dir / "bin" / "python"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
    try:
        install = subprocess.run(
            [python, "-m", "pip", "install", "-q", str(source)],
            capture_output=True, text=True, env=env, timeout=INSTALL_TIMEOUT_S,
        )
    except subprocess.TimeoutExpired:
        pytest.skip(f"pip install ./client took over {INSTALL_TIMEOUT_S}s (slow or unreachable package index)")
    if install.returncode != 0 and any(marker in install.stderr for marker in NO_INDEX):
        pytest.skip(f"pip install ./client: package index unreachable or incomplete:\n{install.stderr[-2000:]}")
    assert install.returncode == 0, install.stderr

    cli = subprocess.run([env_dir / "bin" / "specserve-client", "--help"], capture_output=True, text=True,
                         env=env, timeout=60)
    assert cli.returncode == 0, cli.stderr
    assert "usage: specserve-client" in cli.stdout

    for absent in SERVER_SIDE:
        probe = subprocess.run([python, "-c", f"import {absent}"], capture_output=True, text=True, env=env,
                               timeout=60)
        assert probe.returncode != 0, f"{absent} is importable in the client-only venv"
