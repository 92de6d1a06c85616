"""What a prefill leg sends, and what of its answer goes on to the decode leg."""

from gateway.front.parse import decode_body
from gateway.front.prefill import REMOTE_DECODE, handed_on, prefill_body


def test_a_prefill_leg_is_one_token_not_streamed_and_keeps_the_prompt() -> None:
    body = {
        "model": "big",
        "messages": [{"role": "user", "content": "hi"}],
        "stream": True,
        "stream_options": {"include_usage": True},
        "max_tokens": 500,
        "max_completion_tokens": 500,
        "min_tokens": 20,
        "temperature": 0.3,
    }
    leg = prefill_body(body, kv_transfer="params")
    assert leg == {
        "model": "big",
        "messages": [{"role": "user", "content": "hi"}],
        "stream": False,
        "max_tokens": 1,
        "max_completion_tokens": 1,
        "temperature": 0.3,
        "kv_transfer_params": REMOTE_DECODE,
    }
    assert body["max_tokens"] == 500 and body["stream"] is True  # the decode leg's, untouched


def test_a_shared_store_needs_no_handshake() -> None:
    leg = prefill_body({"prompt": "hi", "max_tokens": 9}, kv_transfer="shared")
    assert leg == {"prompt": "hi", "max_tokens": 1, "stream": False}


def test_what_goes_on_is_an_object_of_a_sane_size_or_nothing() -> None:
    params = {"do_remote_prefill": True, "remote_block_ids": [1, 2], "remote_engine_id": "e"}
    assert handed_on({"kv_transfer_params": params}) == params
    assert handed_on({"kv_transfer_params": None}) is None
    assert handed_on({}) is None
    assert handed_on({"kv_transfer_params": [1, 2]}) is None
    assert handed_on({"kv_transfer_params": {"remote_block_ids": list(range(400_000))}}) is None


def test_a_client_cannot_tell_an_engine_where_to_load_kv_from() -> None:
    body = decode_body(
        b'{"model": "big", "prompt": "hi", "kv_transfer_params": '
        b'{"do_remote_prefill": true, "remote_host": "10.0.0.1", "remote_port": 22}}'
    )
    assert body == {"model": "big", "prompt": "hi"}
