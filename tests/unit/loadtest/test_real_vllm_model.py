from pathlib import Path

import pytest

from loadtest import real_vllm
from loadtest.real_vllm import tiny_model


def test_a_model_that_fails_half_made_leaves_nothing_behind(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def fail(out: str) -> None:
        (Path(out) / "tokenizer.json").write_text("{}")
        raise RuntimeError("no corpus")

    monkeypatch.setattr(tiny_model, "main", fail)
    with pytest.raises(RuntimeError, match="no corpus"):
        real_vllm.model_dir(tmp_path / "tiny")
    assert list(tmp_path.iterdir()) == []


def test_a_complete_model_is_used_as_it_is(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for name in real_vllm.MODEL_FILES:
        (tmp_path / name).write_text("{}")
    monkeypatch.setattr(tiny_model, "main", lambda out: pytest.fail("made again"))
    assert real_vllm.model_dir(tmp_path) == tmp_path
    assert real_vllm.has_model(tmp_path)
    (tmp_path / "generation_config.json").write_text("")
    assert not real_vllm.has_model(tmp_path)  # serve.sh's check: empty counts as missing
