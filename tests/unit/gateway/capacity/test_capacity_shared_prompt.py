"""A shared prompt in the KV bound, counted as vLLM's prefix cache holds it.

Every figure is worked by hand from the blocks: the shared prompt's whole blocks are held
once per replica, a session carrying it holds the rest of its ceil((P + O) / block_size)
blocks, a session without it holds them all.
"""

from __future__ import annotations

import pytest

from gateway.capacity import CapacityError, kv, load_catalog, throughput
from gateway.capacity.plan import Demand, Plan, make_plan, plan_json
from gateway.capacity.profile import ReplicaOptions
from gateway.capacity.throughput import Workload

CATALOG = load_catalog()


def sessions(
    *, num_blocks: int = 128, tokens: int = 1548, shared: int = 1487, share: float = 1.0
) -> int:
    return kv.sessions_at_kv_bound(
        num_blocks=num_blocks,
        block_size=128,
        tokens=tokens,
        shared_prompt_tokens=shared,
        shared_share=share,
    )


def test_a_system_prompt_carried_by_every_request() -> None:
    # 16,384 tokens = 128 blocks of 128; 1,487 shared tokens = 11 whole blocks held once;
    # 1,547 + 1 tokens = 13 blocks, 2 of them a session's own: 117 // 2 = 58, not 128 // 13 = 9.
    assert sessions() == 58
    assert sessions(shared=0) == 9


def test_only_whole_blocks_are_shared() -> None:
    assert sessions(shared=127) == 9  # less than a block: nothing shared
    assert sessions(shared=1408) == 58  # exactly 11 blocks
    assert sessions(shared=1535) == 58  # 11 blocks and a partial one, held by each session
    assert sessions(shared=1536) == 116  # 12 blocks: (128 - 12) // 1


def test_a_share_of_requests_carries_it() -> None:
    # (128 - 11) / (0.5 x 2 + 0.5 x 13) = 117 / 7.5 = 15.6
    assert sessions(share=0.5) == 15
    # (128 - 11) / (0.25 x 2 + 0.75 x 13) = 117 / 10.25 = 11.4
    assert sessions(share=0.25) == 11
    assert sessions(share=0.0) == 9  # no request holds the shared blocks


def test_never_fewer_sessions_than_without_sharing() -> None:
    # 130 blocks hold 10 sessions of 13 blocks; with one carrier among them, 11 + 2 + 9 x 13 =
    # 130 still fit, where the mean form gives (130 - 11) / (13 - 0.01 x 11) = 9.2.
    assert sessions(num_blocks=130, share=0.01) == 10


def test_a_whole_number_of_sessions_is_not_lost_to_rounding() -> None:
    # 1 shared block of 16, 5 blocks a session, 0.1 of requests carrying it, 148 blocks:
    # 147 / (5 - 0.1) = 30 exactly, which floats give as 29.999999999999996.
    assert kv.sessions_at_kv_bound(
        num_blocks=148, block_size=16, tokens=80, shared_prompt_tokens=16, shared_share=0.1
    ) == 30  # fmt: skip
    # (28,063 - 64) / (128 - 0.25 x 64) = 27,999 / 112 = 249.99: 249, not 250.
    assert kv.sessions_at_kv_bound(
        num_blocks=28063, block_size=16, tokens=2048, shared_prompt_tokens=1024, shared_share=0.25
    ) == 249  # fmt: skip


def plan(workload: Workload, **demand: float) -> Plan:
    return make_plan(
        CATALOG.model("llama-3.1-8b"),
        CATALOG.gpu("h100"),
        options=ReplicaOptions(),
        workload=workload,
        demand=Demand(**demand),  # type: ignore[arg-type]
    )


def launch(*, shared: int = 0, share: float = 1.0) -> Workload:
    return Workload(
        prompt_tokens=1536, output_tokens=512, shared_prompt_tokens=shared, shared_share=share
    )


def test_the_plan_runs_the_sessions_the_shared_prompt_leaves_room_for() -> None:
    # 28,063 blocks of 16; 2,048 tokens = 128 blocks; 1,024 shared = 64 held once:
    # (28,063 - 64) // 64 = 437 sessions, against 28,063 // 128 = 219.
    shared = plan(launch(shared=1024), rps=42)
    assert shared.profile.num_gpu_blocks == 28063
    assert (shared.sessions_per_replica, shared.sessions_without_sharing) == (437, 219)
    assert shared.shared_prompt_blocks == 64
    assert shared.running_limit == 437 and shared.sessions_at_fill == 393  # floor(437 x 0.9)
    at_fill = throughput.predict(shared.profile, shared.workload, 393)
    assert shared.replica_tokens_per_s == pytest.approx(at_fill.output_tokens_per_s * 2048 / 512)
    assert shared.replicas_needed == 5
    unshared = plan(launch(), rps=42)
    assert unshared.sessions_per_replica == 219 and unshared.replicas_needed == 6


def test_a_quarter_of_requests_carrying_it() -> None:
    p = plan(launch(shared=1024, share=0.25))
    assert (p.sessions_per_replica, p.sessions_without_sharing) == (249, 219)


def test_no_shared_prompt_leaves_the_plan_as_it_was() -> None:
    assert plan_json(plan(launch(), rps=3)) == plan_json(
        plan(Workload(prompt_tokens=1536, output_tokens=512), rps=3)
    )
    out = plan_json(plan(launch(), rps=3))
    assert out["shared_prompt_tokens"] == 0 and out["shared_share"] == 1.0
    assert out["shared_prompt_blocks"] == 0
    assert out["sessions_per_replica"] == out["sessions_per_replica_without_sharing"] == 219


@pytest.mark.parametrize(
    ("shared", "share", "message"),
    [
        (-1, 1.0, r"--shared-prompt-tokens must be at least 0, not -1"),
        (1536, 1.0, r"--shared-prompt-tokens \(1536\) must be less than --prompt-tokens \(1536\)"),
        (1024, 1.5, r"--shared-share must be in \[0, 1\], not 1.5"),
        (1024, -0.1, r"--shared-share must be in \[0, 1\], not -0.1"),
    ],
)
def test_a_shared_prompt_out_of_range_is_refused(shared: int, share: float, message: str) -> None:
    with pytest.raises(CapacityError, match=message):
        launch(shared=shared, share=share)
