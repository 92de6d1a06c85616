"""The batch tier through the official openai client: files and batches created, run on
spare room with exact results, cancelled, expired, and seen only by their own tenant."""

from __future__ import annotations

import time
from pathlib import Path

import openai
import pytest

from tests.support.batch import (
    batch_fleet,
    chat_line,
    client,
    jsonl,
    lines_of,
    submit,
    tokens_held,
    wait_status,
)


def test_batch_runs_in_a_valley_with_exact_results(tmp_path: Path) -> None:
    with batch_fleet(tmp_path) as fleet:
        api = client(fleet)
        lines = [chat_line(f"req-{i}", max_tokens=3 + i) for i in range(3)]
        batch = wait_status(api, submit(api, lines))
        assert batch.status == "completed"
        assert (batch.request_counts.total, batch.request_counts.completed) == (3, 3)
        assert batch.request_counts.failed == 0
        assert batch.error_file_id is None
        assert batch.metadata == {"job": "test"}
        assert batch.completed_at is not None and batch.in_progress_at is not None
        out = {line["custom_id"]: line for line in lines_of(api, batch.output_file_id)}
        assert sorted(out) == ["req-0", "req-1", "req-2"]
        direct = api.chat.completions.create(
            model="chat", messages=[{"role": "user", "content": "hello there"}], max_tokens=4
        )
        answer = out["req-1"]["response"]
        assert answer["status_code"] == 200
        assert answer["body"]["choices"][0]["message"]["content"] == (
            direct.choices[0].message.content
        )
        used = [out[f"req-{i}"]["response"]["body"]["usage"] for i in range(3)]
        assert [u["completion_tokens"] for u in used] == [3, 4, 5]
        assert out["req-0"]["error"] is None
        assert tokens_held(fleet) == {"chat-0": 0}
        with pytest.raises(openai.BadRequestError, match="status 'completed'"):
            api.batches.cancel(batch.id)


def test_bad_lines_are_openai_400s(tmp_path: Path) -> None:
    with batch_fleet(tmp_path) as fleet:
        api = client(fleet)
        bad = [chat_line("a"), {**chat_line("b"), "url": "/v1/moderations"}]
        with pytest.raises(openai.BadRequestError) as caught:
            api.files.create(file=("in.jsonl", jsonl(bad)), purpose="batch")
        assert caught.value.body == {
            "message": "Line 2: 'url' should be one of /v1/chat/completions, "
            "/v1/completions, /v1/embeddings.",
            "type": "invalid_request_error",
            "param": "file",
            "code": "invalid_batch_line",
        }
        dup = [chat_line("a"), chat_line("a")]
        with pytest.raises(openai.BadRequestError, match="Line 2: the custom_id 'a'"):
            api.files.create(file=("in.jsonl", jsonl(dup)), purpose="batch")
        unknown = [{**chat_line("a"), "body": {"model": "nope", "messages": []}}]
        upload = api.files.create(file=("in.jsonl", jsonl(unknown)), purpose="batch")
        with pytest.raises(openai.BadRequestError, match="Line 1: the model 'nope' does not"):
            api.batches.create(
                input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h"
            )


def test_a_tenant_sees_only_its_own(tmp_path: Path) -> None:
    with batch_fleet(tmp_path, max_fill=0.001) as fleet:
        mine, theirs = client(fleet), client(fleet, "other")
        batch_id = submit(mine, [chat_line("a")])
        file_id = mine.batches.retrieve(batch_id).input_file_id
        with pytest.raises(openai.NotFoundError):
            theirs.batches.retrieve(batch_id)
        with pytest.raises(openai.NotFoundError):
            theirs.files.retrieve(file_id)
        with pytest.raises(openai.NotFoundError):
            theirs.files.content(file_id)
        with pytest.raises(openai.NotFoundError):
            theirs.batches.cancel(batch_id)
        assert [b.id for b in theirs.batches.list()] == []
        assert [b.id for b in mine.batches.list()] == [batch_id]
        assert mine.files.retrieve(file_id).purpose == "batch"


def test_list_pages_newest_first(tmp_path: Path) -> None:
    with batch_fleet(tmp_path, max_fill=0.001) as fleet:
        api = client(fleet)
        ids = [submit(api, [chat_line("a")]) for _ in range(3)]
        first = api.batches.list(limit=2)
        assert first.has_more is True
        assert len(first.data) == 2
        rest = api.batches.list(limit=2, after=first.data[-1].id)
        seen = [b.id for b in first.data] + [b.id for b in rest.data]
        assert sorted(seen) == sorted(ids)
        assert rest.has_more is False


def test_cancel_ends_a_batch_that_could_not_run(tmp_path: Path) -> None:
    with batch_fleet(tmp_path, max_fill=0.001) as fleet:
        api = client(fleet)
        batch_id = submit(api, [chat_line("a"), chat_line("b")])
        assert api.batches.cancel(batch_id).status == "cancelling"
        batch = wait_status(api, batch_id)
        assert batch.status == "cancelled"
        assert batch.cancelled_at is not None
        assert (batch.request_counts.completed, batch.request_counts.failed) == (0, 0)
        errors = lines_of(api, batch.error_file_id)
        assert [(e["custom_id"], e["error"]["code"]) for e in errors] == [
            ("a", "batch_cancelled"),
            ("b", "batch_cancelled"),
        ]
        assert api.batches.cancel(batch_id).status == "cancelled"  # already: as it is


def test_a_batch_not_run_within_its_window_expires(tmp_path: Path) -> None:
    with batch_fleet(tmp_path, max_fill=0.001, window_s=1) as fleet:
        api = client(fleet)
        batch_id = submit(api, [chat_line("a")])
        batch = wait_status(api, batch_id, within_s=10)
        assert batch.status == "expired"
        assert batch.expired_at is not None
        assert batch.output_file_id is None
        errors = lines_of(api, batch.error_file_id)
        assert [(e["custom_id"], e["error"]["code"]) for e in errors] == [("a", "batch_expired")]


def test_results_expire_after_their_ttl(tmp_path: Path) -> None:
    with batch_fleet(tmp_path, results_ttl_s=2) as fleet:
        api = client(fleet)
        batch = wait_status(api, submit(api, [chat_line("a")]))
        assert [line["custom_id"] for line in lines_of(api, batch.output_file_id)] == ["a"]
        output = api.files.retrieve(batch.output_file_id)
        assert output.expires_at == output.created_at + 2
        assert output.purpose == "batch_output"
        time.sleep(3.1)
        with pytest.raises(openai.NotFoundError):
            api.files.content(batch.output_file_id)
        assert not (tmp_path / "blobs" / batch.output_file_id).exists()


def test_per_tenant_limits_on_files_and_queued_tokens(tmp_path: Path) -> None:
    with batch_fleet(tmp_path, max_fill=0.001, max_files=2, max_queued_tokens=100) as fleet:
        api = client(fleet)
        big = [chat_line(f"r{i}", max_tokens=40) for i in range(3)]  # over 100 tokens
        upload = api.files.create(file=("in.jsonl", jsonl(big)), purpose="batch")
        with pytest.raises(openai.RateLimitError) as caught:
            api.batches.create(
                input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h"
            )
        assert caught.value.body["code"] == "token_limit_exceeded"  # type: ignore[index]
        submit(api, [chat_line("small")])  # the second file
        with pytest.raises(openai.RateLimitError) as caught:
            api.files.create(file=("in.jsonl", jsonl([chat_line("x")])), purpose="batch")
        assert caught.value.body["code"] == "file_limit_exceeded"  # type: ignore[index]
        deleted = api.files.delete(upload.id)
        assert (deleted.id, deleted.deleted) == (upload.id, True)
        with pytest.raises(openai.NotFoundError):
            api.files.retrieve(upload.id)
        assert api.files.create(file=("in.jsonl", jsonl([chat_line("x")])), purpose="batch").id
        other = client(fleet, "other")  # another tenant's limits are its own
        assert other.files.create(file=("in.jsonl", jsonl([chat_line("x")])), purpose="batch").id


def test_items_are_charged_to_their_tenant_at_settlement(tmp_path: Path) -> None:
    # a bucket that refills a token a minute: what it lacks is what was charged
    metered = {"tokens_per_minute": 1, "token_burst": 5000}
    with batch_fleet(tmp_path, tenants={"acme": metered, "other": metered}) as fleet:
        api = client(fleet)
        batch = wait_status(api, submit(api, [chat_line("a"), chat_line("b", max_tokens=9)]))
        used = sum(
            line["response"]["body"]["usage"]["total_tokens"]
            for line in lines_of(api, batch.output_file_id)
        )
        ask = {"model": "chat", "messages": [{"role": "user", "content": "x"}], "max_tokens": 1}
        left = {}
        for tenant in ("other", "acme"):
            raw = client(fleet, tenant).chat.completions.with_raw_response.create(**ask)
            left[tenant] = int(raw.headers["x-ratelimit-remaining-tokens"])
        assert left["other"] - left["acme"] == used
