"""The synchronous engine core: admit requests, run steps, stream deltas, abort, report load.

`LLMEngine` wires the parts together (model, block manager, scheduler, model runner) and applies
each step's results: progress of every scheduled chunk, sampled tokens, stop conditions, and the
per-request output deltas. It is single-threaded by design; `AsyncEngine` runs it on its own thread
and `LLM` drives it in a loop. Requests are admitted (engine/admission.py) before anything is queued.
A request whose own step raises is failed alone and the engine goes on serving the others
(engine/step_isolation.py). With async scheduling (engine/async_scheduling.py) a plain decode
step is left in flight and applied during the next `step()`, once that one is launched.
"""

from __future__ import annotations

import itertools
import logging
import secrets
import threading
import time
from collections.abc import Callable

import torch

from deepserve.engine.admission import AdmittedRequest, EngineLimits, check_request
from deepserve.engine.async_scheduling import (
    OverlapStats,
    continuation,
    drop_placeholder,
    feed_ids,
    hold_placeholders,
    may_run_ahead,
)
from deepserve.engine.block_manager import BlockManager
from deepserve.engine.config import EngineConfig
from deepserve.engine.contract import EngineStats, ModelCard
from deepserve.engine.cuda_graphs import BUCKETS
from deepserve.engine.errors import InvalidRequestError
from deepserve.engine.model_runner import LaunchedStep, ModelRunner, StepResult, num_kv_blocks
from deepserve.engine.outputs import CompletionOutput, EngineLoad, RequestOutput, TokenLogprob
from deepserve.engine.request import Request, Sequence, derive_seed
from deepserve.engine.sampling_params import SamplingParams
from deepserve.engine.scheduler import Scheduler, SchedulerOutput
from deepserve.engine.step_isolation import find_failing, is_fatal, only
from deepserve.engine.threads import ThreadPolicy
from deepserve.kernels.kernel_set import KernelSet
from deepserve.kernels.registry import kernels_in_use

log = logging.getLogger(__name__)
# The default `EngineConfig.prefill_gather_s` with CUDA graphs: a few graph decode steps (8-12 ms
# each for V2-Lite at 64 rows on the H200), against the 60-80 ms of an eager step with prompts in
# it there (the p99 inter-token gap; benchmarks/RESULTS.md, runs 6 and 7).
PREFILL_GATHER_S = 0.03
# The default `EngineConfig.prefill_group_tokens` on the CPU: the native linear is at its ceiling
# from ~64 rows, so a step of ~1,000 prompt tokens gains nothing from another prompt; short
# prompts arriving together (a few dozen tokens each) still share one step, fixed costs and all.
PREFILL_GROUP_TOKENS_CPU = 1024


def prefill_group_tokens(config: EngineConfig) -> int | None:
    """The scheduler's limit on prompt tokens shared by one step (None: the token budget)."""
    limit = config.prefill_group_tokens
    if limit is None:
        return PREFILL_GROUP_TOKENS_CPU if config.device == "cpu" else None
    return limit or None


def thread_policy(config: EngineConfig) -> ThreadPolicy | None:
    """The kernels' CPU thread count (engine/threads.py): `num_threads` when given, else chosen by
    the host's load; None off the CPU. Under `--batch-invariant` it is kept as chosen at start
    until `follow_load_while_native` sees the model's kernels."""
    if config.device != "cpu":
        return None
    return ThreadPolicy(fixed=config.num_threads, adapt=not config.batch_invariant)


def follow_load_while_native(
    policy: ThreadPolicy, config: EngineConfig, kernels: KernelSet | None
) -> None:
    """Under `--batch-invariant`, let the count follow the load for as long as the model's set
    hands no call to torch, where the set records those calls, on one process (the ranks of a
    tensor-parallel model have sets of their own)."""
    calls = kernels.torch_calls if kernels is not None else None
    if config.batch_invariant and calls is not None and config.tensor_parallel_size == 1:
        policy.adapt_until_torch(calls)


class LLMEngine:
    def __init__(self, config: EngineConfig, loaded=None) -> None:
        self.threads = thread_policy(config)
        if self.threads is not None:
            self.threads.start()
        if loaded is None:
            from deepserve.engine.loading.loader import load_model

            loaded = load_model(config)
        if self.threads is not None:
            follow_load_while_native(self.threads, config, loaded.kernels)
        self.config = config
        self.model = loaded.model
        self.tokenizer = loaded.tokenizer
        self.model_info = loaded.info
        self.vocab_size = loaded.info.vocab_size
        self.max_model_len = loaded.info.max_model_len
        if config.max_model_len is not None:  # a preloaded model may come from another config
            self.max_model_len = min(self.max_model_len, config.max_model_len)
        self.eos_token_ids = tuple(loaded.info.eos_token_ids)
        num_blocks = config.num_kv_blocks or num_kv_blocks(
            self.model, config.block_size, config.kv_cache_bytes
        )
        self.kv_tiering = _make_kv_tiering(config, self.model, loaded.info.fingerprint)
        self.block_manager = BlockManager(
            num_blocks,
            config.block_size,
            loaded.info.fingerprint,
            config.enable_prefix_caching,
            tier=self.kv_tiering,
            role_keys=getattr(self.model, "kv_follows_row_role", False),
        )
        self.spec = _make_speculative(config, self.model, self.block_manager, self.max_model_len)
        graphs = _graphs_wanted(config, self.model)
        gather = config.prefill_gather_s
        if gather is None:
            gather = PREFILL_GATHER_S if graphs else 0.0
        self.scheduler = Scheduler(
            self.block_manager,
            config.max_num_seqs,
            config.max_num_batched_tokens,
            gather,
            prefill_group_tokens=prefill_group_tokens(config),
        )
        self.runner = ModelRunner(
            self.model,
            num_blocks,
            config.block_size,
            torch.device(config.device),
            self.eos_token_ids,
            keep_hidden=self.spec is not None and self.spec.needs_hidden,
            graph_rows=graph_rows(config) if graphs else 0,
            max_blocks_per_seq=-(-self.max_model_len // config.block_size),
        )
        if self.kv_tiering is not None:
            self.kv_tiering.bind_cache(self.runner.kv_cache)
        self.requests: dict[str, Request] = {}
        self.async_scheduling = _async_wanted(config, graphs)
        self.overlap = OverlapStats()
        self._in_flight: LaunchedStep | None = None  # a decode step whose ids are not applied
        self._seq_ids = itertools.count()
        self._grammars = None
        self._grammar_lock = threading.Lock()

    # ---- admission ------------------------------------------------------------------------

    @property
    def limits(self) -> EngineLimits:
        return EngineLimits(
            self.vocab_size,
            self.max_model_len,
            self.block_manager.num_blocks * self.block_manager.block_size,
            self.config.max_num_seqs,
        )

    def card(self) -> ModelCard:
        cache = self.runner.kv_cache  # [layers, blocks, block_size, width]
        return ModelCard(
            self.model_info,
            self.limits,
            self.config.batch_invariant,
            self.config.block_size,
            cache[:, 0].numel() * cache.element_size(),
            kernels_in_use(self.config.device),
            str(cache.dtype).removeprefix("torch."),
        )

    def stats(self) -> EngineStats:
        registry = self.kv_tiering.registry if self.kv_tiering is not None else None
        spec = self.spec.stats if self.spec is not None else None
        overlap = self.overlap if self.async_scheduling else None
        return EngineStats(self.scheduler.num_preemptions, spec, registry, overlap)

    def check_request(
        self, prompt_token_ids: list[int], params: SamplingParams, resume_token_ids=()
    ) -> int:
        """Validate a request; return its resolved max_tokens. Raises InvalidRequestError."""
        return check_request(self.limits, prompt_token_ids, params, resume_token_ids)

    def admit(
        self, prompt_token_ids: list[int], params: SamplingParams, resume_token_ids=()
    ) -> AdmittedRequest:
        """Validate, resolve max_tokens and compile the output constraint, once."""
        max_tokens = self.check_request(prompt_token_ids, params, resume_token_ids)
        grammar = self.compile_grammar(params)
        return AdmittedRequest(
            list(prompt_token_ids), params, max_tokens, list(resume_token_ids), grammar
        )

    def compile_grammar(self, params: SamplingParams):
        """Compile a structured-output constraint (InvalidRequestError when it is bad)."""
        if params.structured is None:
            return None
        with self._grammar_lock:  # callers compile on their own threads (AsyncEngine)
            if self._grammars is None:
                from deepserve.engine.structured import GrammarCache

                self._grammars = GrammarCache(
                    self.tokenizer, self.vocab_size, stop_token_ids=list(self.eos_token_ids) or None
                )
        return self._grammars.compile(params.structured)

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        resume_token_ids=(),
    ) -> Request:
        """Admit and queue (offline use; `AsyncEngine` admits on the caller's side)."""
        return self.add_admitted(request_id, self.admit(prompt_token_ids, params, resume_token_ids))

    def add_admitted(self, request_id: str, admitted: AdmittedRequest) -> Request:
        """Queue a request that passed `admit`.

        `admitted.resume_token_ids`: output tokens this request already produced elsewhere (a
        prefill worker's first token), never emitted again. They count as outputs everywhere
        colocated decoding counts them (max/min_tokens, penalties, the seeded noise's output
        position, the grammar), so with the same seed the continuation equals a colocated run's."""
        if request_id in self.requests:
            raise InvalidRequestError(f"request id {request_id!r} is already running")
        params = admitted.params
        seed = params.seed if params.seed is not None else secrets.randbits(64)
        request = Request(
            request_id,
            list(admitted.prompt_token_ids),
            params,
            seed,
            admitted.max_tokens,
            time.monotonic(),
        )
        request.compiled_grammar = admitted.grammar
        request.sequences = [self._new_sequence(request, i) for i in range(params.n)]
        if admitted.resume_token_ids:
            _resume(request.sequences[0], list(admitted.resume_token_ids))
        self.requests[request_id] = request
        self.scheduler.add(request)
        return request

    def _new_sequence(self, request: Request, index: int) -> Sequence:
        matcher = None
        if request.compiled_grammar is not None:
            from deepserve.engine.structured import GrammarMatcherState

            matcher = GrammarMatcherState(request.compiled_grammar)
        prompt = request.prompt_token_ids
        return Sequence(
            seq_id=next(self._seq_ids),
            request=request,
            index=index,
            seed=derive_seed(request.seed, index),
            token_ids=list(prompt),
            num_prompt_tokens=len(prompt),
            matcher=matcher,
        )

    # ---- running --------------------------------------------------------------------------

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def step(self, on_launched: Callable[[], None] | None = None) -> list[RequestOutput]:
        """Schedule and run one step; return a delta for every request that progressed.
        `on_launched`: see ModelRunner.execute (not called when nothing runs or a request fails).
        With async scheduling a plain decode step's deltas come with the next call's."""
        if self._in_flight is not None:
            return self._step_ahead(on_launched)
        out = self._schedule()
        if out.is_empty:
            return []
        return self._run(out, on_launched, {})

    def _schedule(self) -> SchedulerOutput:
        out = self.scheduler.schedule()
        _mark_first_scheduled(out, time.monotonic())
        if self.kv_tiering is not None:  # lower-tier prefix hits land in their blocks first
            loads = self.block_manager.take_pending_loads()
            self.kv_tiering.load_pending(loads, [item.seq for item in out.scheduled])
        return out

    def _run(
        self,
        out: SchedulerOutput,
        on_launched: Callable[[], None] | None,
        touched: dict[int, Request],
    ) -> list[RequestOutput]:
        """Run `out` (leaving it in flight when it may run ahead); the deltas of `touched` and of
        every request it progressed."""
        if self.threads is not None:
            self.threads.before_step()
        if self.async_scheduling and may_run_ahead(out) and self._drafts_paused(out):
            launched = self._try_launch(out, on_launched)
            if launched is not None:
                self._skip_drafting(out)
                self._apply_progress(out)
                self._hold(launched)
                return self._outputs(touched)
        result, out, failed = self._execute(out, on_launched)
        for request in failed:
            touched[id(request)] = request
        if result is not None:
            self._apply_progress(out)
            for request in self._apply_samples(result):
                touched[id(request)] = request
            if self.spec is not None:  # drafts for the next step
                self.spec.propose(out, result.hidden, self.runner.kv_cache)
        return self._outputs(touched)

    def _step_ahead(self, on_launched: Callable[[], None] | None) -> list[RequestOutput]:
        """A step after one left in flight: launch the next decode step first when it is a plain
        continuation, then apply the in-flight ids while it runs; else apply them and run the
        step as usual, without the rows that stopped."""
        prev, self._in_flight = self._in_flight, None
        out = self._schedule()
        ahead = continuation(out, self._at_length)  # a pending token that ends it for sure
        launched = None
        if ahead is not None and self._drafts_paused(ahead):
            if self.threads is not None:
                self.threads.before_step()
            launched = self._try_launch(ahead, on_launched, feed_ids(prev, ahead))
            if launched is not None:
                self._skip_drafting(ahead)
        touched = self._apply_in_flight(prev)
        if launched is None:
            self.overlap.fallbacks += 1
            out = _without_finished(out)
            return (
                self._run(out, on_launched, touched) if not out.is_empty else self._outputs(touched)
            )
        self.overlap.ahead += 1
        # A row run ahead for a sequence that stopped on the ids just applied is wasted: its
        # sample is dropped when this step is applied. Its blocks were freed by that stop, which
        # is safe although the launched step still writes that row's KV into one of them: the
        # write targets the slot after the sequence's last computed token, in a block that is
        # not full (so never registered in the prefix cache), and any later owner of the block
        # writes and reads it only in later steps, which the stream runs after this one.
        live = [item for item in ahead.scheduled if not item.seq.is_finished]
        self.overlap.wasted_rows += len(ahead.scheduled) - len(live)
        self._apply_progress(SchedulerOutput(live))
        self._hold(launched, [item.seq for item in live])
        return self._outputs(touched)

    def _drafts_paused(self, out: SchedulerOutput) -> bool:
        """No sequence of `out` drafts after it (always so without speculation): its ids may
        stay on the device while the next step is scheduled."""
        return self.spec is None or self.spec.may_run_ahead([i.seq for i in out.scheduled])

    def _skip_drafting(self, out: SchedulerOutput) -> None:
        if self.spec is not None:
            self.spec.skip_opportunities([i.seq for i in out.scheduled])

    def _try_launch(
        self,
        out: SchedulerOutput,
        on_launched: Callable[[], None] | None,
        feed: torch.Tensor | None = None,
    ) -> LaunchedStep | None:
        """Launch a step to leave in flight; None when it raised (the synchronous step then
        runs it, failing the requests that raise alone)."""
        try:
            # Only steps whose sequences all pause drafting are left in flight: their drafting
            # opportunities are skipped, so no MTP forward reads their hidden states.
            return self.runner.launch(out, on_launched, feed, keep_hidden=False)
        except Exception as e:
            if is_fatal(e):
                raise
            log.warning("a step launched ahead raised; running it synchronously: %r", e)
            return None

    def _hold(self, launched: LaunchedStep, live: list[Sequence] | None = None) -> None:
        hold_placeholders(launched.seqs if live is None else live)
        self._in_flight = launched

    def _apply_in_flight(self, launched: LaunchedStep) -> dict[int, Request]:
        """Wait for an in-flight step's ids and apply them; rows of sequences that stopped (or
        were aborted) since it was launched are dropped."""
        result = launched.result()
        touched: dict[int, Request] = {}
        for seq, token, lp in zip(
            result.seqs, result.sampled.token_ids, result.sampled.logprobs, strict=True
        ):
            if not seq.sample_pending:  # it stopped before this row was launched
                continue
            drop_placeholder(seq)
            if seq.is_finished:  # aborted while the row ran
                continue
            self._append_token(seq, token, lp)
            touched[id(seq.request)] = seq.request
        return touched

    def _at_length(self, seq: Sequence) -> bool:
        """No room for another token: max_tokens reached, or the context full."""
        return (
            seq.num_output_tokens >= seq.request.max_tokens or seq.num_tokens >= self.max_model_len
        )

    def _outputs(self, touched: dict[int, Request]) -> list[RequestOutput]:
        return [self._make_output(r) for r in touched.values()]

    def _execute(
        self, out: SchedulerOutput, on_launched: Callable[[], None] | None = None
    ) -> tuple[StepResult | None, SchedulerOutput, list[Request]]:
        """Run the step; if it raises, fail the requests that raise alone and run the rest.
        Returns the result (None when no request is left), what ran, and the failed requests."""
        try:
            return self.runner.execute(out, on_launched), out, []
        except Exception as e:
            if is_fatal(e):
                raise
            failing = find_failing(out, self.runner.execute)
            if not failing:
                raise
        for request, error in failing.values():
            self._fail(request, error)
        rest = only(out, lambda r: id(r) not in failing)
        result = None if rest.is_empty else self.runner.execute(rest)
        return result, rest, [request for request, _ in failing.values()]

    def _fail(self, request: Request, error: Exception) -> None:
        """End a request the engine could not run; its blocks are freed now."""
        log.warning("request %s failed in the engine: %r", request.request_id, error)
        request.error = f"the engine could not run this request: {type(error).__name__}: {error}"
        for seq in request.sequences:
            if not seq.is_finished:
                self.scheduler.finish(seq, "error")
        request.forked = True  # samples never forked are finished too

    def _apply_progress(self, out: SchedulerOutput) -> None:
        for item in out.scheduled:
            seq = item.seq
            # Draft rows count once verified (SpeculativeDecoder.commit_accepted).
            seq.num_computed_tokens += item.num_new_tokens - len(seq.spec_token_ids)
            self.block_manager.register_computed(seq)

    def _apply_samples(self, result: StepResult) -> list[Request]:
        touched: dict[int, Request] = {}
        logprobs = result.sampled.logprobs
        rows = list(zip(result.seqs, result.sampled.token_ids, logprobs, strict=True))
        i = 0
        while i < len(rows):
            seq, token, lp = rows[i]
            num_rows = 1 + len(seq.spec_token_ids)  # a speculating sequence's rows are adjacent
            if num_rows == 1:
                self._append_token(seq, token, lp)
            else:
                self._apply_verified(seq, rows[i : i + num_rows])
            touched[id(seq.request)] = seq.request
            i += num_rows
        return list(touched.values())

    def _apply_verified(self, seq: Sequence, rows: list) -> None:
        """Append the accepted drafts and the target's next token, stopping where plain decoding
        would have stopped; then roll the KV slots of rejected drafts back."""
        emitted = self.spec.verify(seq, [token for _, token, _ in rows])
        for token, (_, _, lp) in zip(emitted, rows, strict=False):
            if seq.is_finished:
                break
            self._append_token(seq, token, lp)
        self.spec.commit_accepted(seq, len(emitted) - 1)

    def _append_token(self, seq: Sequence, token: int, lp: TokenLogprob | None) -> None:
        seq.token_ids.append(token)
        if lp is not None:
            seq.logprobs.append(lp)
        reason = self._stop_reason(seq, token)
        if reason is not None:
            if reason == "stop" and self._is_stop_token(seq, token):
                seq.stop_token_id = token
            self.scheduler.finish(seq, reason)

    def _is_stop_token(self, seq: Sequence, token: int) -> bool:
        params = seq.params  # no set built per token: this runs for every row of every step
        return token in params.stop_token_ids or (
            not params.ignore_eos and token in self.eos_token_ids
        )

    def _stop_reason(self, seq: Sequence, token: int) -> str | None:
        params = seq.params
        if seq.matcher is not None:
            seq.matcher.accept(token)
            if seq.matcher.is_terminated():
                return "stop"
        if seq.num_output_tokens >= params.min_tokens and self._is_stop_token(seq, token):
            return "stop"
        if self._at_length(seq):
            return "length"
        return None

    def _make_output(self, request: Request) -> RequestOutput:
        outputs = [c for s in request.sequences if (c := _delta(s)) is not None]
        finished = request.is_finished
        if finished:
            self.requests.pop(request.request_id, None)
        # a resumed token may complete a cached block: only prompt tokens count as cached
        cached = min(max(request.num_cached_tokens, 0), len(request.prompt_token_ids))
        by_tier = {"device": request.num_device_cached_tokens}
        if self.kv_tiering is not None:
            by_tier |= self.kv_tiering.cached_tokens_by_tier(request.request_id, finished)
        elif cached > request.num_device_cached_tokens:
            by_tier["tier"] = cached - request.num_device_cached_tokens
        return RequestOutput(
            request_id=request.request_id,
            outputs=outputs,
            prompt_tokens=len(request.prompt_token_ids),
            cached_tokens=cached,
            cached_tokens_by_tier=by_tier,
            finished=finished,
            queue_time=_queue_time(request),
            error=request.error,
        )

    # ---- control --------------------------------------------------------------------------

    def abort(self, request_id: str) -> RequestOutput | None:
        """Stop a request now and free its blocks; returns its final delta (None if unknown)."""
        request = self.requests.get(request_id)
        if request is None:
            return None
        # A row of it may still run on the device (async scheduling): its blocks are freed now
        # all the same, as for a row run ahead (`_step_ahead`), and its sample is dropped.
        for seq in request.sequences:
            if not seq.is_finished:
                self.scheduler.finish(seq, "abort")
        request.forked = True  # samples never forked are finished too
        return self._make_output(request)

    def load(self) -> EngineLoad:
        blocks = self.block_manager
        return EngineLoad(
            running=self.scheduler.num_running,
            waiting=self.scheduler.num_waiting,
            kv_usage=blocks.usage,
            num_blocks=blocks.num_blocks,
            num_free_blocks=blocks.num_free_blocks,
        )

    def close(self) -> None:
        self.runner.close()
        stop_ranks = getattr(self.model, "close", None)  # tensor parallel: ranks 1..N-1
        if stop_ranks is not None:
            stop_ranks()
        if self.kv_tiering is not None:
            self.kv_tiering.close()


def _mark_first_scheduled(out: SchedulerOutput, now: float) -> None:
    for item in out.scheduled:
        if item.seq.request.first_scheduled is None:
            item.seq.request.first_scheduled = now


def _queue_time(request: Request) -> float | None:
    if request.first_scheduled is None:
        return None
    return request.first_scheduled - request.arrival


def _make_speculative(config: EngineConfig, model, block_manager, max_model_len: int):
    """The speculative decoder (engine/spec_decode), or None when off or --batch-invariant."""
    if config.speculative is None:
        return None
    from deepserve.engine.spec_decode.decoder import create_speculative_decoder

    return create_speculative_decoder(config, model, block_manager, max_model_len)


def _make_kv_tiering(config: EngineConfig, model, fingerprint: str):
    """The KV tiers below the device pool (engine/kv_tiering.py), or None when not configured."""
    if config.kv_tiers is None:  # EngineConfig refuses tiers without prefix caching
        return None
    from deepserve.engine.kv_tiering import KVTiering

    return KVTiering.from_config(
        config.kv_tiers, model.kv_cache_spec, config.block_size, fingerprint
    )


def _delta(seq: Sequence) -> CompletionOutput | None:
    """New tokens (and the finish) of one sample since the last delta; None when nothing is new."""
    # Sliced from token_ids directly: copying the whole output first cost O(length) a step.
    start = seq.num_prompt_tokens + seq.num_emitted_tokens
    new_tokens = seq.token_ids[start : seq.num_tokens - seq.sample_pending]
    finishing = seq.is_finished and not seq.finish_emitted
    if not new_tokens and not finishing:
        return None
    logprobs = None
    if seq.params.logprobs is not None:
        logprobs = seq.logprobs[seq.num_emitted_logprobs :]
        seq.num_emitted_logprobs = len(seq.logprobs)
    seq.num_emitted_tokens += len(new_tokens)
    seq.finish_emitted = seq.is_finished
    return CompletionOutput(
        index=seq.index,
        token_ids=new_tokens,
        logprobs=logprobs,
        finish_reason=seq.finish_reason if seq.is_finished else None,
        stop_token_id=seq.stop_token_id,
    )


def _resume(seq: Sequence, tokens: list[int]) -> None:
    if seq.matcher is not None and not all(seq.matcher.accept(t) for t in tokens):
        raise InvalidRequestError("a resumed token is not allowed by the request's grammar")
    seq.token_ids += tokens
    seq.num_emitted_tokens = len(tokens)


def _without_finished(out: SchedulerOutput) -> SchedulerOutput:
    """`out` without the rows of sequences that stopped since it was scheduled (their blocks are
    freed already; nothing of theirs was launched)."""
    if all(not item.seq.is_finished for item in out.scheduled):
        return out
    kept = [item for item in out.scheduled if not item.seq.is_finished]
    return SchedulerOutput(kept, out.forks, out.block_copies, out.preempted)


def _async_wanted(config: EngineConfig, graphs: bool) -> bool:
    """Async scheduling when asked; by default wherever decode steps replay CUDA graphs (on the
    CPU the forward is synchronous: nothing would overlap). With speculation only steps of
    sequences whose drafting is paused run ahead (`SpeculativeDecoder.may_run_ahead`)."""
    if config.async_scheduling is None:
        return graphs and config.tensor_parallel_size == 1
    return config.async_scheduling


def graph_rows(config: EngineConfig) -> int:
    """Rows of the largest decode graph: one per sequence, and with speculation room for the
    drafts too (a verification's rows replay as decode rows, engine/cuda_graphs.py), within the
    step's token budget and the largest standard bucket."""
    rows = config.max_num_seqs
    if config.speculative is not None:
        with_drafts = rows * (1 + config.speculative.num_speculative_tokens)
        rows = max(rows, min(with_drafts, config.max_num_batched_tokens, BUCKETS[-1]))
    return rows


def _graphs_wanted(config: EngineConfig, model) -> bool:
    """Decode steps (speculative verifications included) replay from CUDA graphs on a GPU whose
    kernels allow it, unless asked not to."""
    kernels = getattr(model, "k", None)
    return (
        torch.device(config.device).type == "cuda"
        and not config.enforce_eager
        and kernels is not None
        and kernels.graph_safe
        and getattr(model, "graph_safe", True)
    )
