"""`kvtier generate` end to end on random weights (no model files), through argparse like the CLI."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from engine_adapter import generate_cli


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    generate_cli.add_arguments(parser)
    return parser.parse_args(list(argv))


def test_generate_prints_ids_and_tier_usage(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    prompt = tmp_path / "prompt.txt"
    prompt.write_text("kvtier keeps the cold blocks of a long context somewhere cheaper. " * 12, encoding="utf-8")
    args = parse("--model", "smollm2-135m", "--random-weights", "--num-layers", "2", "--prompt-file", str(prompt),
                 "--mode", "topk", "--budget", "256", "--max-new-tokens", "5", "--hot-tokens", "128",
                 "--gpu-mib", "16", "--cpu-mib", "16", "--chunk-tokens", "300", "--device", "cpu")
    assert generate_cli.run(args) == 0
    out, err = capsys.readouterr()
    ids = out.split()
    assert len(ids) == 5 and all(0 <= int(i) < 32000 for i in ids)
    for tier in ("hot", "warm", "cpu", "ssd"):
        assert f"\n{tier} " in err
    assert "prefill" in err and "tok/s" in err


def test_generate_refuses_bad_arguments() -> None:
    with pytest.raises(SystemExit, match="--budget must be positive"):
        generate_cli.run(parse("--prompt", "hi", "--budget", "0"))
    with pytest.raises(SystemExit, match="--random-weights"):
        generate_cli.run(parse("--prompt", "hi", "--num-layers", "2"))
    with pytest.raises(SystemExit):
        parse("--prompt", "hi", "--mode", "sparse")
