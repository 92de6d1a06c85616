"""`spillgate bench restart` on the simulators, in tiny sizes: the plumbing
(two backends, a gateway, clients, a restart, the count of what the clients saw, the
report and its JSON), not a measurement; and the judging of each answer, one fault at a
time."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gateway.cli import main
from loadtest.bench.restart_answers import KINDS, Fault, Seen, Tally, ask
from loadtest.sim.tokens import FillerText

FILLER = FillerText()


def test_the_bench_counts_what_its_clients_saw_across_a_restart(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "restart.json"
    args = ["--duration", "3.5", "--warmup", "1", "--restarts", "1", "--clients", "4",
            "--max-tokens", "30", "--json", str(out)]  # fmt: skip
    code = main(["bench", "restart", *args])
    figures = json.loads(out.read_text())
    assert code == (1 if figures["failed"] else 0)  # fails loudly, unless told not to
    assert figures["arm"] == "simulator"
    assert figures["requests"] > 8 and figures["requests"] == figures["ok"] + figures["failed"]
    assert list(figures["faults"]) == [fault.value for fault in Fault]
    assert sorted(figures["by_kind"]) == sorted(KINDS)
    assert sum(k["requests"] for k in figures["by_kind"].values()) == figures["requests"]
    assert 0 < figures["latency_p50_s"] <= figures["latency_p99_s"]
    (restart,) = figures["restarts"]
    assert restart["backend"] == "sim-0" and restart["stopped_by"] in ("SIGTERM", "SIGKILL")
    assert restart["gone_after_s"] < restart["ready_after_s"]
    printed = capsys.readouterr().out
    assert "requests sent" in printed and "dishonest usage" in printed


def good(kind: str, words: int = 30) -> Seen:
    """What a correct answer to `ask(kind, 0, ...)` looks like to its client."""
    asked = ask(kind, 0, model="sim", max_tokens=words, real=False)
    usage = {"prompt_tokens": asked.prompt_tokens or 0, "completion_tokens": words}
    return Seen(status=200, text=FILLER.text(0, words), events=words, finish_reason="length",
                done=True, usage=usage)  # fmt: skip


@pytest.mark.parametrize(
    ("change", "fault"),
    [
        ({}, None),
        ({"status": 503}, Fault.NON_200),
        ({"status": None}, Fault.NO_ANSWER),
        ({"error_event": True}, Fault.ERROR_EVENT),
        ({"done": False}, Fault.CUT),
        ({"finish_reason": None}, Fault.CUT),
        ({"text": FILLER.text(0, 10) + FILLER.text(11, 31)}, Fault.DISCONTINUOUS),
        ({"finish_reason": "stop"}, Fault.WRONG_LENGTH),
        ({"usage": {"prompt_tokens": 9, "completion_tokens": 30}}, Fault.DISHONEST_USAGE),
        ({"usage": None}, Fault.DISHONEST_USAGE),
    ],
)
def test_each_answer_is_judged_by_what_its_client_saw(
    change: dict[str, object], fault: Fault | None
) -> None:
    tally = Tally(real=False)
    for kind in KINDS:
        seen = good(kind)
        for name, value in change.items():
            setattr(seen, name, value)
        tally.add(ask(kind, 0, model="sim", max_tokens=30, real=False), seen)
    figures = tally.figures()
    assert figures["requests"] == 4
    assert figures["failed"] == (0 if fault is None else 4)
    assert {f for f, n in figures["faults"].items() if n} == (set() if fault is None else {fault})
    if fault is Fault.NON_200:
        assert figures["statuses"] == {"503": 4}


def test_a_short_answer_is_counted_whatever_its_usage_says() -> None:
    tally = Tally(real=False)
    seen = good("chat-stream", words=20)
    tally.add(ask("chat-stream", 0, model="sim", max_tokens=30, real=False), seen)
    assert tally.figures()["faults"][Fault.WRONG_LENGTH] == 1
