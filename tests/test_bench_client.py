"""`deepserve bench serve`'s client against a real server: it counts every streamed token, times
them, and reports failures instead of hiding them."""

from __future__ import annotations

import asyncio

import pytest
from server_harness import engine_for, running_server

from deepserve.server.bench import BenchConfig, bench, bench_prompts, request_body, sse_lines


@pytest.fixture(scope="module")
def tiny_server():
    with engine_for("tiny-deepseek") as engine, running_server(engine, "tiny") as srv:
        yield srv


def _bench(srv, **overrides) -> dict:
    cfg = BenchConfig(base_url=srv.base_url, concurrency=3, num_prompts=6, input_len=8)
    return asyncio.run(bench(BenchConfig(**{**cfg.__dict__, "output_len": 5, **overrides})))


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_bench_counts_every_streamed_token(tiny_server, endpoint):
    summary = _bench(tiny_server, endpoint=endpoint)
    assert (summary["completed"], summary["failed"]) == (6, 0)
    assert summary["total_output_tokens"] == 6 * 5
    assert summary["median_ttft_ms"] > 0 and summary["median_itl_ms"] > 0


def test_bench_reports_rejected_requests_as_failed(tiny_server):
    summary = _bench(tiny_server, model="no-such-model")
    assert (summary["completed"], summary["failed"]) == (0, 6)
    assert summary["first_error"].startswith("404")


def test_prompts_file_prompts_are_sent_in_turn(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text('"Rewrite: a b"\n\n"Copy:\\nline two"\n')
    cfg = BenchConfig(num_prompts=5, prompts_file=str(path))
    assert bench_prompts(cfg) == ["Rewrite: a b", "Copy:\nline two"] * 2 + ["Rewrite: a b"]


def test_no_ignore_eos_lets_replies_end_at_eos():
    cfg = BenchConfig(ignore_eos=False)
    assert request_body(cfg, "m", "hi", None)["ignore_eos"] is False
    assert request_body(BenchConfig(), "m", "hi", None)["ignore_eos"] is True


def test_sse_lines_joins_lines_split_across_chunks_and_keeps_long_ones():
    long = b"data: " + b"x" * 200_000

    async def chunks():
        for part in (b"data: {}\n\nda", b"ta: [DONE]\n", long[:70_000], long[70_000:] + b"\n"):
            yield part

    async def collect() -> list[bytes]:
        return [line async for line in sse_lines(chunks())]

    assert asyncio.run(collect()) == [b"data: {}", b"", b"data: [DONE]", long]
