"""The tritonserver launcher's pure parts: repository discovery, command line, parameter copies."""

from __future__ import annotations

from pathlib import Path

from specserve.serving.server import (
    TritonInstall,
    TritonProcess,
    copy_repository,
    default_repository,
    list_variants,
    models_for,
    read_parameters,
)


def test_variants_and_models():
    variants = list_variants(default_repository())
    assert "none" in variants
    assert models_for(["none", "ngram"]) == ["preprocessing", "llm_none", "ensemble_none", "llm_ngram", "ensemble_ngram"]


def test_command_line():
    p = TritonProcess(Path("/repo"), ["preprocessing", "llm_none", "ensemble_none"], 1, 2, 3)
    cmd = p.command(TritonInstall(Path("/bin/tritonserver"), Path("/cache/backends"), {}))
    assert cmd[0] == "/bin/tritonserver"
    assert "--model-control-mode=explicit" in cmd
    assert [c for c in cmd if c.startswith("--load-model=")] == [
        "--load-model=preprocessing", "--load-model=llm_none", "--load-model=ensemble_none"
    ]
    assert {"--http-port=1", "--grpc-port=2", "--metrics-port=3", "--backend-directory=/cache/backends"} <= set(cmd)
    assert any(c.startswith("--exit-timeout-secs=") for c in cmd)
    # the llm models' tensors come from their auto_complete_config: auto-complete stays on
    assert not any(c.startswith(("--disable-auto-complete-config", "--strict-model-config")) for c in cmd)
    other = TritonProcess(Path("/repo"), [], 4, 5, 6).command(TritonInstall(Path("/bin/tritonserver"), None, {}))
    shm = {c for c in cmd + other if "shm-region-prefix-name=" in c}
    assert len(shm) == 2, "two servers on one host need distinct shared-memory prefixes"

def test_copy_repository_overrides_parameters(tmp_path: Path):
    dst = copy_repository(
        default_repository(), tmp_path / "repo",
        {"llm_none": {"max_batch_size": "2", "dtype": "float32", "ngram_capacity": "100"}},
    )
    params = read_parameters(dst / "llm_none" / "config.pbtxt")
    assert (params["max_batch_size"], params["dtype"], params["ngram_capacity"]) == ("2", "float32", "100")
    assert "max_batch_size" not in read_parameters(default_repository() / "llm_none" / "config.pbtxt")
    assert (dst / "llm_none" / "1" / "model.py").is_file()


def test_every_model_has_a_version_folder_in_the_checkout():
    """Triton refuses a model without a version; git drops empty folders (hence the .gitkeep files)."""
    repo = default_repository()
    for config in repo.glob("*/config.pbtxt"):
        assert (config.parent / "1").is_dir(), f"{config.parent.name}/1 is missing"
        assert any((config.parent / "1").iterdir()), f"{config.parent.name}/1 is empty (not tracked by git)"

def test_serve_sets_parameters_on_a_copy_of_the_repository(monkeypatch):
    import specserve.serving.server as server

    seen = {}

    def run(process, chosen):  # stands in for starting tritonserver
        seen["params"] = read_parameters(process.repository / "llm_none" / "config.pbtxt")
        seen["models"], seen["log"] = process.models, process.log
        return 0

    monkeypatch.setattr(server, "_run_until_stopped", run)
    assert server.serve(None, ["none"], parameters={"max_batch_size": "3"}, log=Path("/tmp/x.log")) == 0
    assert seen["params"]["max_batch_size"] == "3" and seen["log"] == Path("/tmp/x.log")
    assert seen["models"] == models_for(["none"])
    assert "max_batch_size" not in read_parameters(default_repository() / "llm_none" / "config.pbtxt")


def test_serve_command_takes_parameters_as_key_value(capsys):
    from specserve.cli import main

    assert main(["serve", "--variants", "none", "--parameter", "max_batch_size"]) == 2
    assert "KEY=VALUE" in capsys.readouterr().err
