"""`spillgate plan` end to end through the command dispatcher."""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from gateway.capacity.plan import DEFAULT_TARGET_FILL
from gateway.cli import main
from gateway.config import PoolSettings

LAUNCH = ["plan", "--model", "llama-3.1-8b", "--gpu", "h100", "--rps", "3",
          "--prompt-tokens", "1536", "--output-tokens", "512"]  # fmt: skip


def test_table_by_default(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(LAUNCH) == 0
    out = capsys.readouterr().out
    assert "llama-3.1-8b on 1 x h100" in out
    for label in ("KV cache", "blocks", "sessions at the KV bound", "knee", "GPUs needed"):
        assert label in out
    assert "131,072" in out  # bytes per token


def test_json_output(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*LAUNCH, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["model"] == "llama-3.1-8b" and out["gpus_needed"] == 1
    assert out["kv_bytes_per_token"] == 131072


def test_kv_cache_gib_reproduces_vllm_blocks(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["plan", "--model", "mistral-7b", "--gpu", "h200", "--kv-cache-gib", "102.56",
            "--max-model-len", "32768", "--json"]  # fmt: skip
    assert main(args) == 0
    out = json.loads(capsys.readouterr().out)
    assert (out["num_gpu_blocks"], out["kv_cache_tokens"]) == (52510, 840160)
    assert out["max_concurrency"] == 25.64


def test_model_config_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = tmp_path / "config.json"
    config.write_text(json.dumps({
        "hidden_size": 2048, "intermediate_size": 8192, "num_attention_heads": 32,
        "num_hidden_layers": 16, "num_key_value_heads": 8, "vocab_size": 128256,
        "max_position_embeddings": 8192, "tie_word_embeddings": True,
    }))  # fmt: skip
    assert main(["plan", "--model-config", str(config), "--gpu", "l4", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["kv_bytes_per_token"] == 2 * 16 * 8 * 64 * 2


def test_chart_marks_the_kv_bound_and_knee(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    chart = tmp_path / "plan.svg"
    assert main([*LAUNCH, "--chart", str(chart)]) == 0
    assert capsys.readouterr().err == f"wrote {chart}\n"
    root = ET.fromstring(chart.read_text())
    texts = [t.text or "" for t in root.iter("{http://www.w3.org/2000/svg}text")]
    assert any(t.startswith("KV bound") for t in texts)
    assert any(t.startswith("knee") for t in texts)
    assert len(list(root.iter("{http://www.w3.org/2000/svg}polyline"))) == 2


def test_unknown_model_lists_the_known(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--model", "llama-9", "--gpu", "h100"]) == 2
    err = capsys.readouterr().err
    assert "unknown model 'llama-9'" in err and "mixtral-8x7b" in err


def test_model_too_big_for_the_gpu(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--model", "llama-3.1-70b", "--gpu", "l40s"]) == 2
    assert "does not fit on 1 x l40s" in capsys.readouterr().err


def test_context_too_long_for_the_cache(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--model", "llama-3.1-8b", "--gpu", "l4"]) == 2
    assert "max_model_len 131072 is larger than" in capsys.readouterr().err


def test_list(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--list"]) == 0
    out = capsys.readouterr().out
    assert "deepseek-v3" in out and "mi300x" in out


# A 16,384-token cache of 128 blocks of 128 tokens: 2 GiB at 16 MiB a block.
SMALL_CACHE = ["plan", "--model", "llama-3.1-8b", "--gpu", "h100", "--kv-cache-gib", "2",
               "--block-size", "128", "--max-model-len", "16384",
               "--prompt-tokens", "1547", "--output-tokens", "1"]  # fmt: skip


def test_shared_prompt_json(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*SMALL_CACHE, "--shared-prompt-tokens", "1487", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["num_gpu_blocks"] == 128
    assert (out["shared_prompt_tokens"], out["shared_share"], out["shared_prompt_blocks"]) == (
        1487, 1.0, 11,
    )  # fmt: skip
    assert out["sessions_per_replica"] == 58  # (128 - 11) // (13 - 11)
    assert out["sessions_per_replica_without_sharing"] == 9  # 128 // 13
    assert out["sessions_at_fill"] == 52  # floor(58 x 0.9)


def test_shared_prompt_carried_by_half_the_requests(capsys: pytest.CaptureFixture[str]) -> None:
    args = [*SMALL_CACHE, "--shared-prompt-tokens", "1487", "--shared-share", "0.5", "--json"]
    assert main(args) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["shared_share"] == 0.5
    assert out["sessions_per_replica"] == 15  # 117 / (0.5 x 2 + 0.5 x 13) = 15.6


def test_shared_prompt_table(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*SMALL_CACHE, "--shared-prompt-tokens", "1487", "--shared-share", "0.5"]) == 0
    lines = capsys.readouterr().out.splitlines()
    start = lines.index("Shared prompt: 1,487 tokens, carried by 50% of requests")
    assert [" ".join(line.split()) for line in lines[start + 1 : start + 6]] == [
        "whole blocks, held once 11",
        "blocks of a session carrying it 2 of 13",
        "sessions at the KV bound 15",
        "without sharing 9",
        "",
    ]


def test_no_shared_prompt_no_section(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(LAUNCH) == 0
    assert "Shared prompt" not in capsys.readouterr().out


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--shared-prompt-tokens", "1547"], "--shared-prompt-tokens (1547) must be less than"),
        (["--shared-prompt-tokens", "-5"], "--shared-prompt-tokens must be at least 0, not -5"),
        (["--shared-prompt-tokens", "10", "--shared-share", "2"], "--shared-share must be in"),
        (["--shared-share", "0.5"], "--shared-share needs --shared-prompt-tokens"),
    ],
)
def test_shared_prompt_errors(
    flags: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main([*SMALL_CACHE, *flags]) == 2
    assert capsys.readouterr().err.startswith(f"spillgate plan: error: {message}")


def test_the_fill_is_the_gateways_own_and_the_plan_says_so(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert PoolSettings.model_fields["target_fill"].default == DEFAULT_TARGET_FILL
    argv = ["plan", "--model", "llama-3.1-8b", "--gpu", "h100", "--sessions", "200",
            "--prompt-tokens", "2048", "--output-tokens", "500"]  # fmt: skip
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "replicas at 90% fill (the gateway's default target_fill)" in out
    assert "replicas needed at 90% fill" in out and "(assumed" not in out
    assert main([*argv, "--target-fill", "0.6"]) == 0
    out = capsys.readouterr().out
    assert "replicas at 60% fill\n" in out and "replicas needed at 60% fill" in out


def test_a_workload_not_given_is_named_as_assumed(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--model", "llama-3.1-8b", "--gpu", "h100", "--output-tokens", "300"]) == 0
    out = capsys.readouterr().out
    assert "sessions of 1,536 prompt + 300 output tokens (assumed: no --prompt-tokens given)" in out
    assert main(["plan", "--model", "llama-3.1-8b", "--gpu", "h100", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["assumed"] == ["--prompt-tokens", "--output-tokens"]


def test_help_shows_every_default(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["plan", "--help"])
    shown = " ".join(capsys.readouterr().out.split())
    for default in ("--tp TP tensor-parallel GPUs per replica (default: 1)",
                    "(default: 0.9)", "--block-size BLOCK_SIZE tokens per KV block (default: 16)",
                    "a session's prompt (default 1536)", "a session's answer (default 512)",
                    "(default: 0.65)", "(default: 0.5)"):  # fmt: skip
        assert default in shown
