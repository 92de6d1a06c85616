"""The plumbing of `spillgate bench tools`, without the tools: their configs as the
runner fills them, and their result files (captured from real runs) as it reads them."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import yaml

from loadtest.tools import CONFIGS, TOOLS, configs, results, run
from loadtest.tools.configs import Target

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "tools"
DIRECT = Target(url="http://127.0.0.1:9001", model="meta-llama/Llama-3.1-70B-Instruct")
GATEWAY = Target(url="http://127.0.0.1:18080", model="llama-3.1-70b", api_key="sk-test")


def test_guidellm_results_come_from_its_own_metrics() -> None:
    f = results.guidellm(FIXTURES / "guidellm-0.8.1.json")
    assert (f.tool, f.ok, f.errors) == ("guidellm", 28, 0)
    assert f.ttft_p50_ms == pytest.approx(22.750, abs=1e-3)
    assert f.ttft_p99_ms == pytest.approx(33.502, abs=1e-3)
    assert f.itl_p50_ms == pytest.approx(8.075, abs=1e-3)
    assert (f.requests_per_s, f.output_tokens_per_s) == (3.5, 448.0)
    assert (f.goodput_per_s, f.goodput_share) == (3.5, 1.0)


def test_inference_perf_itl_is_per_request_not_per_chunk(tmp_path: Path) -> None:
    (tmp_path / "summary_lifecycle_metrics.json").write_bytes(
        (FIXTURES / "inference-perf-0.7.0-summary_lifecycle_metrics.json").read_bytes()
    )
    f = results.inference_perf(tmp_path)
    assert (f.tool, f.ok, f.errors) == ("inference-perf", 32, 0)
    assert f.ttft_p50_ms == pytest.approx(24.503, abs=1e-3)
    # time_per_output_token (8 ms a token), not inter_token_latency (microseconds: the gap
    # between chunks spread over what the local tokenizer finds in each)
    assert f.itl_p50_ms == pytest.approx(8.123, abs=1e-3)
    assert f.requests_per_s == pytest.approx(3.955, abs=1e-3)
    assert f.goodput_share == 1.0
    assert f.goodput_per_s == pytest.approx(3.955, abs=1e-3)


def test_a_run_without_goodput_constraints_reports_none(tmp_path: Path) -> None:
    text = (FIXTURES / "inference-perf-0.7.0-summary_lifecycle_metrics.json").read_text()
    data = json.loads(text)
    del data["successes"]["goodput_metrics"]
    (tmp_path / "summary_lifecycle_metrics.json").write_text(json.dumps(data))
    f = results.inference_perf(tmp_path)
    assert f.goodput_share is None and f.goodput_per_s is None


def test_the_table_has_both_arms_and_their_ratio() -> None:
    arms = {
        "direct": results.guidellm(FIXTURES / "guidellm-0.8.1.json"),
        "spillgate": results.guidellm(FIXTURES / "guidellm-0.8.1.json"),
    }
    text = results.report("t", arms, slo="TTFT <= 200 ms", hit_rates={"direct": 0.5})
    lines = text.splitlines()
    assert lines[0] == "t (times in ms; goodput: TTFT <= 200 ms)"
    assert lines[1].split()[:4] == ["arm", "ok", "err", "TTFT"]
    assert lines[3].split()[0] == "direct" and lines[3].split()[-1] == "0.500"
    assert lines[4].split()[-1] == "-"  # no hit rate for that arm
    ratio = "spillgate / direct: TTFT p50 1.00x, TTFT p99 1.00x, ITL p50 1.00x, out tok/s 1.00x"
    assert lines[-1] == ratio


@pytest.mark.parametrize("tool", TOOLS)
@pytest.mark.parametrize("workload", configs.WORKLOADS)
def test_every_config_is_there_and_parses(tool: str, workload: str) -> None:
    assert (CONFIGS / f"{tool}-{workload}.yaml").is_file()
    assert isinstance(configs.template(tool, workload), dict)


def test_guidellm_scenario_per_arm(tmp_path: Path) -> None:
    base = configs.template("guidellm", "steady")
    gateway = configs.guidellm_scenario(base, GATEWAY, out=tmp_path, seed=2, rate=6.0,
                                        duration_s=12, tokenizer=Path("/tok"))  # fmt: skip
    spec = gateway["spec"]
    assert spec["backend"]["target"] == GATEWAY.url
    assert spec["backend"]["model"] == "llama-3.1-70b"
    assert spec["backend"]["api_key"] == "sk-test"
    assert spec["backend"]["api_routes"] == {"/health": "v1/models"}  # a gateway has /healthz
    assert spec["tokenizer"] == {"kind": "huggingface_auto", "model": "/tok"}
    assert spec["seed"] == {"kind": "static", "value": 2}
    assert spec["outputs"] == [{"kind": "json", "path": str(tmp_path / "guidellm.json")}]
    assert spec["profile"]["rate"] == [6.0]
    assert spec["constraints"] == [{"kind": "max_duration", "seconds": 12}]
    assert spec["metrics"]["slo"] == {"ttft_ms": 200, "tpot_ms": 20}
    direct = configs.guidellm_scenario(base, DIRECT, out=tmp_path, seed=1)
    assert "api_key" not in direct["spec"]["backend"]
    assert direct["spec"]["profile"] == base["spec"]["profile"]  # the template's rate
    assert base["spec"]["backend"]["target"] != GATEWAY.url  # the template is untouched


def test_inference_perf_config_per_arm(tmp_path: Path) -> None:
    base = configs.template("inference-perf", "shared-prefix")
    config = configs.inference_perf_config(base, GATEWAY, out=tmp_path, seed=3, rate=2.0,
                                           duration_s=9, tokenizer=Path("/tok"))  # fmt: skip
    assert config["server"] == {"type": "vllm", "model_name": "llama-3.1-70b",
                                "base_url": GATEWAY.url, "ignore_eos": True,
                                "api_key": "sk-test"}  # fmt: skip
    assert config["tokenizer"]["pretrained_model_name_or_path"] == "/tok"
    assert config["load"]["base_seed"] == 3
    assert config["data"]["shared_prefix"]["seed"] == 3
    assert config["load"]["stages"] == [{"rate": 2.0, "duration": 9}]
    assert config["storage"] == {"local_storage": {"path": str(tmp_path / "inference-perf")}}
    assert config["report"]["request_lifecycle"]["use_server_output_tokens"] is True
    assert config["report"]["goodput"]["constraints"] == {"ttft": 0.05, "tpot": 0.02}
    direct = configs.inference_perf_config(base, DIRECT, out=tmp_path, seed=1)
    assert "api_key" not in direct["server"]


def test_write_gives_the_command_and_a_config_it_reads(tmp_path: Path) -> None:
    cmd = configs.write("inference-perf", "steady", DIRECT, out=tmp_path / "a", seed=1)
    assert cmd[0].endswith("/bin/inference-perf") and cmd[1:] == [
        "--config_file", str(tmp_path / "a" / "inference-perf.yaml")]  # fmt: skip
    written = yaml.safe_load((tmp_path / "a" / "inference-perf.yaml").read_text())
    assert written["server"]["base_url"] == DIRECT.url
    cmd = configs.write("guidellm", "shared-prefix", GATEWAY, out=tmp_path / "b", seed=1)
    assert cmd[1:3] == ["run", "--scenario"] and Path(cmd[3]).is_file()
    with pytest.raises(ValueError, match="unknown workload"):
        configs.template("guidellm", "spike")


def test_the_demo_banner_names_the_large_pools_backends() -> None:
    banner = (
        "  backends:     llama-3.1-70b: http://127.0.0.1:35423  http://127.0.0.1:41867  "
        "(serving meta-llama/Llama-3.1-70B-Instruct)\n"
        "                llama-3.1-8b: http://127.0.0.1:58971  "
        "(serving meta-llama/Llama-3.1-8B-Instruct)\n"
    )
    urls, served = run.parse_banner(banner)
    assert urls == ["http://127.0.0.1:35423", "http://127.0.0.1:41867"]
    assert served == "meta-llama/Llama-3.1-70B-Instruct"
    with pytest.raises(ValueError):
        run.parse_banner("Spillgate demo is serving on http://127.0.0.1:8080")


def test_unknown_tools_are_refused() -> None:
    with pytest.raises(SystemExit):
        run.parse_args(["demo", "--tools", "guidellm,locust"])
    assert run.parse_args(["prefix", "--tools", "inference-perf"]).tools == ["inference-perf"]


def test_setup_script_parses() -> None:
    script = CONFIGS.parent / "setup.sh"
    assert subprocess.run(["bash", "-n", str(script)], check=False).returncode == 0
