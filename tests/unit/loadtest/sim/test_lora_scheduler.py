"""LoRA in the simulated scheduler: `max_loras` slots, the active adapters, per-adapter blocks."""

from loadtest.sim.blocks import hash_blocks
from loadtest.sim.config import Adapter
from loadtest.sim.scheduler import Scheduler, SchedulerLimits, SeqState, Sequence

A1 = Adapter(name="a1", path="/loras/a1", lora_id=1)
A2 = Adapter(name="a2", path="/loras/a2", lora_id=2)
A3 = Adapter(name="a3", path="/loras/a3", lora_id=3)


def make(max_loras: int, *, blocks: int = 64, seqs: int = 256) -> Scheduler[Sequence]:
    limits = SchedulerLimits(
        num_blocks=blocks + 1, block_size=16, max_num_seqs=seqs, max_loras=max_loras
    )
    return Scheduler(limits)


def seq(adapter: Adapter | None, out: int = 4, ids: list[int] | None = None) -> Sequence:
    prompt = 16 if ids is None else len(ids)
    return Sequence(prompt_tokens=prompt, max_tokens=out, adapter=adapter, prompt_token_ids=ids)


def test_a_request_for_a_third_adapter_waits_while_two_slots_are_busy() -> None:
    s = make(2)
    a1, a2, a3, base = seq(A1), seq(A2), seq(A3), seq(None)
    for each in (a1, a2, a3, base):
        s.add(each)
    step = s.schedule()
    # a3 is skipped, not a barrier: the base-model request behind it runs
    assert step.prefills == [a1, a2, base]
    assert list(s.waiting) == [a3] and a3.state is SeqState.WAITING


def test_a_request_for_an_adapter_already_running_takes_no_new_slot() -> None:
    s = make(1)
    first = seq(A1, out=8)
    s.add(first)
    s.complete(s.schedule())
    later, other = seq(A1), seq(A2)
    s.add(other)
    s.add(later)
    step = s.schedule()
    assert step.prefills == [later] and list(s.waiting) == [other]


def test_skipped_requests_keep_their_order_at_the_front_of_the_queue() -> None:
    s = make(1, seqs=2)
    first, b, c, d = seq(A1, out=2), seq(A2), seq(A3), seq(A2)
    for each in (first, b, c, d):
        s.add(each)
    s.schedule()
    assert list(s.waiting) == [b, c, d]


def test_the_waiting_adapter_runs_once_its_slot_frees() -> None:
    s = make(1)
    a1, a2 = seq(A1, out=2), seq(A2, out=2)
    s.add(a1)
    s.add(a2)
    first = s.schedule()
    assert first.prefills == [a1]
    s.complete(first)
    second = s.schedule()  # a1's second token ends it; its slot was still taken
    assert second.prefills == [] and s.complete(second) == [a1]
    assert s.schedule().prefills == [a2]


def test_active_adapters_are_those_begun_in_the_order_they_began() -> None:
    s = make(1)
    a2, a1, more_a2 = seq(A2, out=2), seq(A1, out=2), seq(A2, out=2)
    for each in (a2, a1, more_a2):
        s.add(each)
    assert s.active_adapters == {}  # waiting only: vLLM's front-end has not heard of them
    s.complete(s.schedule())
    assert s.active_adapters == {"a2": 2}
    s.complete(s.schedule())  # both a2 requests end
    assert s.active_adapters == {}
    s.complete(s.schedule())
    assert s.active_adapters == {"a1": 1}


def test_an_abort_ends_an_adapter_only_for_a_request_that_had_begun() -> None:
    s = make(1)
    running, waiting = seq(A1, out=8), seq(A2)
    s.add(running)
    s.add(waiting)
    s.complete(s.schedule())
    s.abort(waiting)
    assert s.active_adapters == {"a1": 1}
    s.abort(running)
    assert s.active_adapters == {}


def test_an_adapter_hashes_its_blocks_apart_from_the_base_model_and_other_adapters() -> None:
    ids = list(range(40))
    base, one, two = (hash_blocks(ids, 16, adapter=a) for a in (None, A1, A2))
    assert len(base) == len(one) == len(two) == 2
    assert not {*base} & {*one} and not {*one} & {*two}
    assert hash_blocks(ids, 16, adapter=A1) == one
    # the same name at another path is another adapter's weights, as vLLM keys it
    moved = Adapter(name="a1", path="/loras/a1-v2", lora_id=1)
    assert hash_blocks(ids, 16, adapter=moved) != one


def test_a_prompt_hits_only_the_blocks_its_own_adapter_computed() -> None:
    s = make(2)
    ids = list(range(49))  # three full blocks and a token
    for adapter, hit in ((A1, 0), (None, 0), (A1, 48), (A2, 0)):
        before = s.stats.prefix_cache_hits
        s.add(seq(adapter, out=1, ids=ids))
        s.complete(s.schedule())
        assert s.stats.prefix_cache_hits - before == hit, adapter


def test_a_preempted_request_stays_active_and_counts_once() -> None:
    s = make(1, blocks=3)
    older, newer = seq(A1, out=20), seq(A1, out=20)
    s.add(older)
    s.add(newer)
    while not s.stats.preemptions:
        s.complete(s.schedule())
    assert newer.state is SeqState.WAITING and s.active_adapters == {"a1": 2}
    while s.has_work:
        s.complete(s.schedule())
    assert s.active_adapters == {} and s.stats.finished == 2
