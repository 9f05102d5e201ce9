"""Router retries, 4xx handling, aborts and timeouts against scripted workers on loopback.

The scripted workers speak the real internal protocol over real HTTP; only the model is missing.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket

import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from deepserve.disagg import protocol as P
from deepserve.disagg.client import ClientTimeouts
from deepserve.disagg.errors import NoWorkerError, WorkerRejectedError, WorkerUnavailableError
from deepserve.disagg.flow import GenerationFlow
from deepserve.engine.sampling_params import SamplingParams
from deepserve.router.pool import HealthPolicy
from deepserve.router.router import Router, RouterConfig

TOKEN = "s3cret"


class ScriptedWorker:
    """behaviour: ok | fail (500) | reject (400) | die_mid (cut after one token) | hang."""

    def __init__(self, behaviour: str = "ok") -> None:
        self.behaviour = behaviour
        self.requests: list[str] = []
        self.resumed: list[list[int]] = []  # resume_token_ids of each generate call
        self.client_ports: list[int] = []  # one per generate call: the connection it came on
        self.aborts: list[str] = []
        self.bad_auth = 0
        self.app = self._build()

    def _build(self) -> FastAPI:
        app = FastAPI()

        @app.middleware("http")
        async def auth(request: Request, call_next):
            if request.headers.get("authorization") != f"Bearer {TOKEN}":
                self.bad_auth += 1
                return JSONResponse({"error": {"message": "bad token"}}, status_code=401)
            return await call_next(request)

        @app.post(P.GENERATE_PATH)
        async def generate(body: dict, request: Request):
            req = P.GenerateRequest.from_json(body)
            self.requests.append(req.request_id)
            self.resumed.append(req.resume_token_ids)
            self.client_ports.append(request.client.port)
            if self.behaviour == "fail":
                return JSONResponse({"error": {"message": "boom"}}, status_code=500)
            if self.behaviour == "reject":
                return JSONResponse({"error": {"message": "prompt too long"}}, status_code=400)
            return StreamingResponse(self._events(req), media_type="application/x-ndjson")

        @app.post(P.ABORT_PATH)
        async def abort(body: dict):
            self.aborts.append(body["request_id"])
            return {"ok": True}

        @app.get(P.HEALTH_PATH)
        async def health():
            return P.WorkerHealth("ok", "mixed", "fake", f"w{id(self)}", 4).to_json()

        @app.get(P.LOAD_PATH)
        async def load():
            return P.WorkerLoad("mixed", 0, 0, 0.0).to_json()

        return app

    async def _events(self, req: P.GenerateRequest):
        n = int(req.sampling.get("max_tokens") or 3)
        for i in range(len(req.resume_token_ids), n):  # a resumed request continues
            if self.behaviour == "hang":
                await asyncio.sleep(3600)
            if self.behaviour == "die_mid" and i == 1:
                raise RuntimeError("worker died")
            last = i == n - 1
            out = {
                "index": 0,
                "token_ids": [i],
                "logprobs": None,
                "finish_reason": "length" if last else None,
                "stop_token_id": None,
            }
            yield (
                json.dumps(P.StreamEvent(req.request_id, [out], 5, 0, finished=last).to_json())
                + "\n"
            )
            await asyncio.sleep(0.01)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.asynccontextmanager
async def serving(*workers: ScriptedWorker, keep_alive_s: float = 5):
    servers, urls = [], []
    for w in workers:
        port = _free_port()
        config = uvicorn.Config(
            w.app, host="127.0.0.1", port=port, log_level="error", timeout_keep_alive=keep_alive_s
        )
        server = uvicorn.Server(config)
        servers.append((server, asyncio.create_task(server.serve())))
        urls.append(f"http://127.0.0.1:{port}")
    for server, _ in servers:
        while not server.started:
            await asyncio.sleep(0.01)
    try:
        yield urls
    finally:
        for server, task in servers:
            server.should_exit = True
            await task


def router_for(urls: list[str], **kw) -> Router:
    timeouts = kw.pop("timeouts", ClientTimeouts(first_event=5, between_events=5))
    config = RouterConfig(
        workers={"mixed": tuple(urls)},
        internal_token=TOKEN,
        timeouts=timeouts,
        health=HealthPolicy(eject_after=2, readmit_after=1),
        health_interval=0.1,
        **kw,
    )
    return Router(config)


def request(rid: str = "r1", max_tokens: int = 3) -> P.GenerateRequest:
    return P.GenerateRequest(rid, [1, 2, 3], {"max_tokens": max_tokens})


async def collect(router: Router, req: P.GenerateRequest) -> list[int]:
    return [
        t
        for ev in [e async for e in router.stream("mixed", req)]
        for o in ev.outputs
        for t in o["token_ids"]
    ]


async def test_request_failing_before_first_token_is_retried_on_another_worker():
    bad, good = ScriptedWorker("fail"), ScriptedWorker("ok")
    async with serving(bad, good) as urls:
        router = router_for(urls)
        for i in range(2):  # round robin tries the failing worker first for one of the two
            assert await collect(router, request(f"r{i}")) == [0, 1, 2]
        assert bad.requests and good.requests == ["r0", "r1"]
        await router.close()


async def test_refused_connection_is_retried_and_charged_to_the_worker():
    good = ScriptedWorker("ok")
    async with serving(good) as urls:
        dead = f"http://127.0.0.1:{_free_port()}"
        router = router_for([dead, *urls])
        for i in range(4):
            assert await collect(router, request(f"r{i}")) == [0, 1, 2]
        assert not next(w for w in router.pool.workers() if w.url == dead).healthy
        await router.close()


async def test_failure_after_first_token_surfaces_as_error_not_silent_end():
    w = ScriptedWorker("die_mid")
    async with serving(w) as urls:
        router = router_for(urls)
        got = []
        with pytest.raises(WorkerUnavailableError) as err:
            async for ev in router.stream("mixed", request()):
                got.append(ev)
        assert err.value.started and len(got) == 1
        await router.close()


async def test_flow_resumes_on_another_worker_after_a_mid_stream_death():
    dying, good = ScriptedWorker("die_mid"), ScriptedWorker("ok")
    async with serving(dying, good) as urls:
        router = router_for(urls)
        flow = GenerationFlow(router, max_model_len=64)
        for i in range(2):  # round robin sends one of the two to the dying worker first
            events = [
                ev async for ev in flow.stream(f"r{i}", [1, 2, 3], SamplingParams(max_tokens=3))
            ]
            assert [t for ev in events for t in ev.outputs[0]["token_ids"]] == [0, 1, 2]
            assert events[-1].finished
        assert dying.requests and [0] in good.resumed
        await router.close()


async def test_4xx_is_not_retried_and_never_ejects_the_worker():
    w = ScriptedWorker("reject")
    async with serving(w) as urls:
        router = router_for(urls)
        for i in range(10):
            with pytest.raises(WorkerRejectedError, match="prompt too long"):
                await collect(router, request(f"r{i}"))
        assert len(w.requests) == 10 and router.pool.workers()[0].healthy
        await router.close()


async def test_all_workers_down_gives_no_worker_error():
    router = router_for([f"http://127.0.0.1:{_free_port()}", f"http://127.0.0.1:{_free_port()}"])
    with pytest.raises(NoWorkerError):
        await collect(router, request())
    await router.close()


async def test_consumer_stopping_early_aborts_on_the_worker():
    w = ScriptedWorker("ok")
    async with serving(w) as urls:
        router = router_for(urls)
        async with contextlib.aclosing(router.stream("mixed", request("gone", 50))) as events:
            async for _ in events:
                break
        await asyncio.sleep(0.2)
        assert w.aborts == ["gone"]
        await router.close()


async def test_consumer_stopping_at_the_finished_event_sends_no_abort():
    w = ScriptedWorker("ok")
    async with serving(w) as urls:
        router = router_for(urls)
        async with contextlib.aclosing(router.stream("mixed", request("done", 3))) as events:
            async for ev in events:
                if ev.finished:
                    break
        await asyncio.sleep(0.2)
        assert w.aborts == []
        await router.close()


async def test_generate_streams_reuse_one_kept_alive_connection():
    w = ScriptedWorker("ok")
    async with serving(w) as urls:
        router = router_for(urls)
        for i in range(3):
            assert await collect(router, request(f"r{i}")) == [0, 1, 2]
        assert len(set(w.client_ports)) == 1
        await router.close()


async def test_connection_the_worker_closed_while_idle_is_replaced_not_failed():
    w = ScriptedWorker("ok")
    async with serving(w, keep_alive_s=0.05) as urls:
        router = router_for(urls)
        assert await collect(router, request("first")) == [0, 1, 2]
        await asyncio.sleep(0.3)  # the worker drops the kept-alive connection meanwhile
        assert await collect(router, request("second")) == [0, 1, 2]
        assert w.requests == ["first", "second"]
        assert router.pool.workers()[0].consecutive_failures == 0
        await router.close()


async def test_hung_worker_times_out_and_request_moves_on():
    hung, good = ScriptedWorker("hang"), ScriptedWorker("ok")
    async with serving(hung, good) as urls:
        router = router_for(urls, timeouts=ClientTimeouts(first_event=0.5, between_events=0.5))
        for i in range(2):
            assert await asyncio.wait_for(collect(router, request(f"r{i}")), 5) == [0, 1, 2]
        await asyncio.sleep(0.2)
        assert hung.requests and sorted(hung.aborts) == sorted(hung.requests)
        await router.close()


async def test_health_checks_eject_dead_and_readmit_restarted_worker():
    w = ScriptedWorker("ok")
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    router = router_for([url])
    await router.start()
    await asyncio.sleep(0.4)
    assert not router.pool.workers()[0].healthy
    server = uvicorn.Server(uvicorn.Config(w.app, host="127.0.0.1", port=port, log_level="error"))
    task = asyncio.create_task(server.serve())
    await asyncio.sleep(0.6)
    assert router.pool.workers()[0].healthy
    assert await collect(router, request()) == [0, 1, 2]
    await router.close()
    server.should_exit = True
    await task


async def test_every_call_carries_the_shared_secret():
    w = ScriptedWorker("ok")
    async with serving(w) as urls:
        router = router_for(urls)
        await router.health.probe_all()
        await collect(router, request())
        assert w.bad_auth == 0
        wrong = Router(RouterConfig(workers={"mixed": tuple(urls)}, internal_token="nope"))
        with pytest.raises(NoWorkerError):
            await collect(wrong, request())
        assert w.bad_auth == 1
        await router.close()
        await wrong.close()
