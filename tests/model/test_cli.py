"""The `specserve` CLI on the real model: output, and one-line errors naming the field."""

from __future__ import annotations

from specserve.cli import main


def test_generate_streams_text_and_stats(smollm2_dir, capsys):
    # eager: the compiled programs are the model tests' subject; here, what the command prints
    args = ["generate", "--prompt", "Say hi.", "--max-new-tokens", "8", "--disable-cpu-compile"]
    assert main([*args, "--model-dir", str(smollm2_dir)]) == 0
    captured = capsys.readouterr()
    assert captured.out.strip()
    assert "tokens, accept length" in captured.err


def test_generate_errors_name_the_field(smollm2_dir, capsys):
    assert main(["generate", "--prompt", "x", "--max-new-tokens", "0", "--model-dir", str(smollm2_dir)]) == 2
    assert "max_tokens" in capsys.readouterr().err
    assert main(["generate", "--variant", "eagle3", "--prompt", "x", "--model-dir", str(smollm2_dir)]) == 2
    assert "algorithm" in capsys.readouterr().err


def test_bench_rejects_a_missing_dataset(smollm2_dir, capsys, tmp_path):
    args = ["bench", "--dataset", str(tmp_path / "none.jsonl"), "--no-hf", "--model-dir", str(smollm2_dir)]
    assert main(args) == 2
    assert "dataset" in capsys.readouterr().err


def test_bench_rejects_fewer_slots_than_its_batch(smollm2_dir, capsys):
    args = ["bench", "--batch-size", "4", "--slots", "2", "--no-hf", "--model-dir", str(smollm2_dir)]
    assert main(args) == 2
    assert "slots: 2 is fewer than --batch-size 4" in capsys.readouterr().err
