"""`spillgate serve -c FILE --check` refuses exactly what `spillgate serve` refuses, and both
tell each problem on one line (file, line, key path, "did you mean"), never a traceback."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[4]
SPILLGATE = Path(sys.executable).with_name("spillgate")  # the console script pip installed

GOOD = """\
tenants:
  - name: acme
    key_sha256: 9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08
pools:
  - name: big
    overflow: [queue, reject]
    backends:
      - url: http://127.0.0.1:1
  - name: small
    backends:
      - url: http://127.0.0.1:2
"""


@dataclass(frozen=True)
class Ran:
    code: int
    out: str
    err: str


def spillgate(*args: str, cwd: Path, env: dict[str, str] | None = None) -> Ran:
    environ = {k: v for k, v in os.environ.items() if k not in ("ACME_API_KEY",)}
    environ.pop("SPILLGATE_REDIS_URL", None)
    done = subprocess.run(
        [str(SPILLGATE), *args],
        cwd=cwd,
        env={**environ, **(env or {})},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    return Ran(done.returncode, done.stdout, done.stderr)


BAD = {
    "misspelt policy": (
        GOOD.replace("[queue, reject]", "[queue, degrad]"),
        [
            "gw.yaml:6: pools[0].overflow[1]: unknown overflow policy 'degrad'; "
            "did you mean 'degrade'?"
        ],
    ),
    "misspelt key, bad value and dangling references, all at once": (
        GOOD.replace("    overflow: [queue, reject]", "    overflow: [degrade, provider]\n"
                     "    targetfill: 0.5\n    degrade_to: smal\n    provider: hosted")
        .replace("      - url: http://127.0.0.1:2", "      - url: http://127.0.0.1:2\n"
                 "        capacity: lots"),
        [
            "gw.yaml:7: pools[0].targetfill: unknown key 'targetfill'; did you mean 'target_fill'?",
            "gw.yaml:8: pools[0].degrade_to: no pool named 'smal'; did you mean 'small'?",
            "gw.yaml:9: pools[0].provider: no provider named 'hosted': the file has no providers",
            "gw.yaml:15: pools[1].backends[0].capacity: should be a positive number of tokens "
            "or 'auto', not 'lots'",
        ],
    ),
    "a backend url with the API's /v1, as a provider's base_url has it": (
        GOOD.replace("http://127.0.0.1:2", "http://127.0.0.1:2/v1/"),
        [
            "gw.yaml:11: pools[1].backends[0].url: drop the `/v1` (the gateway adds the paths "
            "it calls): 'http://127.0.0.1:2'"
        ],
    ),
    "a chain policy without what it needs": (
        GOOD.replace("[queue, reject]", "[queue, provider, reject]"),
        ["gw.yaml:6: pools[0].overflow[1]: 'provider' needs pools[0].provider"],
    ),
    "two pools of one name": (
        GOOD.replace("name: small", "name: big"),
        [
            "gw.yaml:9: pools[1].name: 'big' is the name of pools[0] already",
            "gw.yaml:11: pools[1].backends[0]: backend name 'big-0' is taken by "
            "pools[0].backends[0] already: metrics and the shared ledger tell backends apart "
            "by name",
        ],
    ),
    "YAML that does not parse": (
        GOOD.replace("    overflow:", "   overflow:"),
        [
            "gw.yaml:6:4: not valid YAML: expected <block end>, but found '<block mapping start>' "
            "(while parsing a block collection from line 5, column 3)"
        ],
    ),
}  # fmt: skip


@pytest.mark.parametrize("case", list(BAD))
def test_check_and_serve_refuse_the_same_file_with_the_same_lines(
    tmp_path: Path, case: str
) -> None:
    text, lines = BAD[case]
    (tmp_path / "gw.yaml").write_text(text)
    checked = spillgate("serve", "-c", "gw.yaml", "--check", cwd=tmp_path)
    served = spillgate("serve", "-c", "gw.yaml", "--port", "0", cwd=tmp_path)
    assert checked == Ran(2, "", "\n".join(lines) + "\n")
    assert served == checked


def test_the_docs_check_command_works_as_written_and_warns_of_unset_secrets() -> None:
    """A new user has none of the example's secrets: `--check` says the file is good and
    which variables `serve` will need; `serve` refuses to start without them."""
    config = "deploy/examples/gateway.yaml"
    for readme in ("docs/configuration.md", "deploy/README.md"):
        assert f"spillgate serve -c {config} --check" in (ROOT / readme).read_text().replace(
            "\n", " "
        )
    checked = spillgate("serve", "-c", config, "--check", cwd=ROOT)
    unset = "tenants[0].key_env: $ACME_API_KEY is not set"
    assert checked == Ran(
        0,
        f"{config}: ok (2 pools, 2 tenants); serve needs the variables above\n",
        f"{config}:19: warning: {unset}\n",
    )
    assert spillgate("serve", "-c", config, cwd=ROOT) == Ran(2, "", f"{config}:19: {unset}\n")
    with_key = spillgate("serve", "-c", config, "--check", cwd=ROOT, env={"ACME_API_KEY": "sk-1"})
    assert with_key == Ran(0, f"{config}: ok (2 pools, 2 tenants)\n", "")


def test_a_redis_url_that_cannot_work_is_refused_by_both_without_showing_it(
    tmp_path: Path,
) -> None:
    (tmp_path / "gw.yaml").write_text(GOOD)
    env = {"SPILLGATE_REDIS_URL": "secret-host:6379"}
    checked = spillgate("serve", "-c", "gw.yaml", "--check", cwd=tmp_path, env=env)
    served = spillgate("serve", "-c", "gw.yaml", "--port", "0", cwd=tmp_path, env=env)
    line = (
        "gw.yaml: redis.url_env: $SPILLGATE_REDIS_URL is not a Redis URL: it should start with "
        "redis://, rediss:// or unix://\n"
    )
    assert checked == served == Ran(2, "", line)
