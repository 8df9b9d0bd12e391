"""The `slo` scheduler: request targets, the observe contract, the cost model, urgency
ordering, chunk sizing, attainment counters, and the bench's report."""

from __future__ import annotations

import asyncio
import math
import random

import msgspec
import pytest

from tokenloom import SamplingParams
from tokenloom.core.errors import ClientError, ConfigError
from tokenloom.core.hookspecs import hookimpl
from tokenloom.core.outputs import Finished, RequestMetrics, Usage
from tokenloom.core.plugins import PluginManager
from tokenloom.core.sequence import Sequence
from tokenloom.plugins.cache.paged import PagedCacheManager
from tokenloom.plugins.schedulers.continuous import ContinuousOptions, ContinuousScheduler
from tokenloom.plugins.schedulers.cost_model import StepCostModel, StepWork
from tokenloom.plugins.schedulers.slo import SloClass, SloOptions, SloScheduler

# tiny-model engines: one torch thread (conftest.one_thread)
pytestmark = pytest.mark.usefixtures("one_thread")

BEST_EFFORT = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
INTERACTIVE = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, slo_class="interactive")


# ---- request targets --------------------------------------------------------------------
@pytest.mark.parametrize("data, param", [
    ({"slo_class": ""}, "slo_class"),
    ({"slo_class": "has space"}, "slo_class"),
    ({"slo_class": "x" * 65}, "slo_class"),
    ({"slo_class": 5}, "slo_class"),
    ({"ttft_ms": 0}, "ttft_ms"),
    ({"ttft_ms": -5.0}, "ttft_ms"),
    ({"ttft_ms": float("nan")}, "ttft_ms"),
    ({"ttft_ms": float("inf")}, "ttft_ms"),
    ({"ttft_ms": "500"}, "ttft_ms"),
    ({"ttft_ms": True}, "ttft_ms"),
    ({"tpot_ms": 0.0}, "tpot_ms"),
    ({"tpot_ms": 1e12}, "tpot_ms"),
])
def test_bad_targets_name_the_parameter(data, param):
    with pytest.raises(ClientError) as info:
        SamplingParams.from_dict(data)
    assert info.value.param == param
    assert param in str(info.value)


def test_targets_accepted_and_carried_over_the_websocket():
    from tokenloom.protocols.websocket.messages import Error, Generate, decode_client

    p = SamplingParams.from_dict({"slo_class": "interactive", "ttft_ms": 250, "tpot_ms": 80.5})
    assert (p.slo_class, p.ttft_ms, p.tpot_ms) == ("interactive", 250, 80.5)
    msg = decode_client(b'{"type":"generate","id":"q","prompt":"hi","params":{"slo_class":"batch","ttft_ms":300}}')
    assert isinstance(msg, Generate) and msg.params.slo_class == "batch" and msg.params.ttft_ms == 300
    bad = decode_client(b'{"type":"generate","id":"q","prompt":"hi","params":{"tpot_ms":"fast"}}')
    assert isinstance(bad, Error) and bad.param == "tpot_ms"


def test_class_options_are_checked():
    cache = PagedCacheManager(None, 16, 16)
    with pytest.raises(ConfigError, match="classes.fast.ttft_ms"):
        SloScheduler(SloOptions(classes={"fast": SloClass(ttft_ms=-1.0)}), cache)
    with pytest.raises(ConfigError, match="class name"):
        SloScheduler(SloOptions(classes={"a b": SloClass(ttft_ms=1.0)}), cache)
    from tokenloom.core.config import build_config

    with pytest.raises(ConfigError, match=r"unknown key 'ttft' in scheduler\.classes"):
        build_config(PluginManager(load_entry_points=False), {"scheduler": {"name": "slo", "classes": {"c": {"ttft": 1}}}})
    opts = msgspec.convert({"classes": {"chat": {"ttft_ms": 300}}}, SloOptions)
    sched = SloScheduler(opts, cache)
    seq = Sequence("r", [1, 2], SamplingParams(slo_class="chat", tpot_ms=40))
    assert sched.targets(seq) == (300, 40)  # the class's TTFT, the request's own TPOT
    assert sched.targets(Sequence("s", [1], SamplingParams())) == (None, None)


# ---- the observe contract -----------------------------------------------------------------
class _StepTimes:
    def __init__(self):
        self.ms = []

    @hookimpl
    def step_finished(self, stats):
        self.ms.append(stats.step_time_ms)


@pytest.mark.parametrize("scheduler", ["continuous", "static", "slo"])
def test_observe_is_called_after_every_step_before_results(make_llm, scheduler):
    times = _StepTimes()
    llm = make_llm(scheduler=scheduler, cache_manager="contiguous" if scheduler == "static" else "paged",
                   plugin_manager=PluginManager(load_entry_points=False, extra=[times]))
    sched = llm.engine.scheduler
    seen, finished = [], []
    inner = sched.observe

    def observe(batch, step_time_s):
        # the step's results are not applied yet: the batch starts at each num_computed_tokens
        seen.append((step_time_s, [(s.request_id, s.num_computed_tokens, n)
                                   for s, n in zip(batch.seqs, batch.num_scheduled_tokens, strict=True)]))
        inner(batch, step_time_s)

    sched.observe = observe
    sched.on_finished = lambda seq, output: finished.append((seq.request_id, output.finish_reason))
    outs = llm.generate([[3] * 20, [4] * 9], [BEST_EFFORT, INTERACTIVE])
    assert len(seen) == llm.engine.counters.steps == len(times.ms)
    assert [round(t * 1e3, 6) for t, _ in seen] == [round(ms, 6) for ms in times.ms]
    first = dict((rid, (c, n)) for rid, c, n in seen[0][1])
    assert all(c == 0 and n in (20, 9) for c, n in first.values())  # whole prompts, nothing computed yet
    assert sorted(finished) == sorted((o.request_id, "length") for o in outs)


# ---- the cost model -------------------------------------------------------------------
def _steps(rng, n):
    """Synthetic steps: decode-only ones and ones with a prefill chunk, at varied contexts."""
    for _ in range(n):
        work = StepWork()
        for _ in range(rng.randint(1, 12)):
            work.add(rng.randint(0, 900), 1 if rng.random() < 0.7 else rng.randint(2, 256))
        yield work


def _time(coef, work):
    return sum(c * x for c, x in zip(coef, work.features(), strict=True))


def test_cost_model_recovers_known_coefficients():
    rng = random.Random(0)
    # a (s), e per prefill step, b per prefill token, c per decode, d per KV token read
    truth = (0.008, 0.030, 4e-4, 2.5e-3, 3e-7)
    model = StepCostModel(decay=0.99)
    assert model.predict(StepWork(100, 4, 5000)) == 0.0  # cold: no constraint
    for work in _steps(rng, 400):
        model.observe(work, _time(truth, work) * (1 + rng.gauss(0, 0.002)))
    for got, want in zip(model.fit(), truth, strict=True):
        assert got == pytest.approx(want, rel=0.03)
    for probe in (StepWork(300, 7, 90_000), StepWork(0, 3, 2000)):
        assert model.predict(probe) == pytest.approx(_time(truth, probe), rel=0.01)


def test_cost_model_never_fits_a_negative_coefficient_and_clips_spikes():
    model = StepCostModel()
    rng = random.Random(1)
    for work in _steps(rng, 150):  # time depends on decodes only; noise would pull other terms below 0
        model.observe(work, 0.02 + 0.003 * work.num_decodes + rng.gauss(0, 0.002))
    coef = model.fit()
    assert all(c >= 0 for c in coef)
    assert coef[3] == pytest.approx(0.003, rel=0.2)
    before = model.predict(StepWork(0, 4, 1000))
    model.observe(StepWork(0, 4, 1000), 30.0)  # another process took the cores for 30 s
    assert model.predict(StepWork(0, 4, 1000)) < 1.2 * before  # entered as 4x the prediction, weighed in


def test_step_work_counts_attention_reads():
    work = StepWork()
    work.add(10, 1)  # a decode reads its 10 cached tokens and itself
    work.add(4, 3)  # a chunk of 3 after 4: 3*4 + (1 + 2 + 3)
    assert (work.num_prefill_tokens, work.num_decodes, work.num_kv_reads) == (3, 1, 11 + 18)


# ---- scheduling, without a model -------------------------------------------------------
def _simulate(sched, seqs, *, until, max_steps=200):
    """Run schedule() and apply each step as the engine would (one token per sequence that
    reaches its end); returns the step at which ``until()`` became true."""
    for seq in seqs:
        sched.add(seq)
    for step in range(1, max_steps + 1):
        _apply(sched, sched.schedule())
        if until():
            return step
    raise AssertionError("never happened")


def _apply(sched, batch) -> dict[str, int]:
    """What the engine does with a step's results; returns the tokens each request ran."""
    for seq, n in zip(batch.seqs, batch.num_scheduled_tokens, strict=True):
        seq.num_computed_tokens += n
        if seq.num_computed_tokens == seq.num_tokens:
            seq.append_token(7)
            if seq.num_output_tokens >= seq.params.max_tokens:
                sched.finish(seq)
    return {s.request_id: n for s, n in zip(batch.seqs, batch.num_scheduled_tokens, strict=True)}


@pytest.mark.parametrize("make", [
    lambda cache: ContinuousScheduler(ContinuousOptions(max_num_batched_tokens=64), cache),
    lambda cache: SloScheduler(SloOptions(max_num_batched_tokens=64), cache),
], ids=["continuous", "slo"])
def test_interactive_request_jumps_a_long_best_effort_prefill(make):
    sched = make(PagedCacheManager(None, 128, 16))
    long_job = Sequence("batch", [5] * 1000, BEST_EFFORT)
    chat = Sequence("chat", [6] * 12, INTERACTIVE)  # arrives after the batch job
    steps = _simulate(sched, [long_job, chat], until=lambda: chat.num_output_tokens > 0)
    if isinstance(sched, SloScheduler):
        assert steps == 1  # admitted ahead of the 1,000-token prefill
    else:
        assert steps == 16  # FCFS: behind 1000 / 64 chunks of the batch job


def _trained(sched, a, b, c=0.0, d=0.0, e=0.0):
    """Teach the scheduler's cost model t = a + e*S + b*P + c*D + d*K from varied synthetic steps."""
    rng = random.Random(2)
    for _ in range(80):
        work = StepWork(rng.choice([0, rng.randint(1, 500)]), rng.randint(0, 20), rng.randint(0, 20_000))
        sched.cost.observe(work, _time((a, e, b, c, d), work))
    return sched


@pytest.mark.parametrize("first_token_ago, margin, chunk", [
    (None, 1.0, 38),  # no first-token time seen: one target's worth, 50.5 - 10 - 2 ms for the decode
    (None, 0.9, 33),  # planned against 90% of the target: 45.45 - 12 ms
    (0.0505, 1.0, 38),  # 2 tokens, the first one target ago: the mean allows one target more
    (0.0005, 1.0, 88),  # 2 tokens in 0.5 ms: the room banked lets a larger chunk fit (100.5 ms in all)
    (0.2000, 1.0, 0),  # behind its target: no best-effort prefill at all this step
])
def test_best_effort_chunk_keeps_a_running_stream_within_its_mean_tpot(first_token_ago, margin, chunk):
    cache = PagedCacheManager(None, 256, 16)
    opts = SloOptions(max_num_batched_tokens=512, target_margin=margin)
    sched = _trained(SloScheduler(opts, cache), a=0.010, b=0.001, c=0.002)
    chat = Sequence("chat", [6] * 8, SamplingParams(max_tokens=50, tpot_ms=50.5))
    _simulate(sched, [chat], until=lambda: chat.num_output_tokens >= 2)  # now decoding, TPOT applies
    sched.clock = lambda: 100.0
    if first_token_ago is not None:
        sched.first_token_time[chat.seq_id] = 100.0 - first_token_ago
    sched.add(Sequence("batch", [5] * 2000, BEST_EFFORT))
    batch = sched.schedule()
    chunks = dict(zip((s.request_id for s in batch.seqs), batch.num_scheduled_tokens, strict=True))
    assert chunks["chat"] == 1 and chunks.get("batch", 0) == chunk


def test_observe_notes_first_token_times_and_on_finished_forgets_them():
    sched = SloScheduler(None, PagedCacheManager(None, 16, 16))
    sched.clock = lambda: 7.0
    seq = Sequence("r", [1] * 20, SamplingParams(max_tokens=4))
    sched.add(seq)
    batch = sched.schedule()
    sched.observe(batch, 0.01)
    assert sched.first_token_time == {seq.seq_id: 7.0}
    sched.on_finished(seq, _final("stop", 1, 1))
    assert sched.first_token_time == {}


def test_best_effort_prefill_held_back_gets_a_chunk_every_few_steps():
    cache = PagedCacheManager(None, 256, 16)
    opts = SloOptions(max_best_effort_skips=3, min_best_effort_tokens=32)
    sched = _trained(SloScheduler(opts, cache), a=0.010, b=0.001, c=0.050)
    chat = Sequence("chat", [6] * 8, SamplingParams(max_tokens=50, tpot_ms=40))  # a decode alone is over
    _simulate(sched, [chat], until=lambda: chat.num_output_tokens >= 2)
    sched.add(Sequence("batch", [5] * 300, BEST_EFFORT))
    ran = [_apply(sched, sched.schedule()).get("batch", 0) for _ in range(8)]
    assert ran == [0, 0, 0, 32, 0, 0, 0, 32]


def test_best_effort_chunk_fits_before_an_interactive_deadline():
    cache = PagedCacheManager(None, 256, 16)
    opts = SloOptions(max_num_batched_tokens=512, arrival_guard_s=0, target_margin=1.0)
    sched = _trained(SloScheduler(opts, cache), a=0.010, b=0.001)
    batch_job = Sequence("batch", [5] * 2000, BEST_EFFORT)
    chat = Sequence("chat", [6] * 20, SamplingParams(max_tokens=4, ttft_ms=100.5))
    sched.clock = lambda: chat.arrival_time + 0.040  # 60.5 ms left before the chat's deadline
    for seq in (batch_job, chat):
        sched.add(seq)
    batch = sched.schedule()
    assert [s.request_id for s in batch.seqs] == ["chat", "batch"]
    # 60.5 ms - 10 ms - 20 chat tokens leave 30.5 ms: 30 tokens of the batch prompt
    assert batch.num_scheduled_tokens == [20, 30]


def test_arrival_guard_bounds_best_effort_steps_while_targeted_requests_arrive():
    cache = PagedCacheManager(None, 256, 16)
    sched = _trained(SloScheduler(SloOptions(arrival_guard_s=30, max_num_batched_tokens=512), cache), a=0.010, b=0.001)
    now = [0.0]
    sched.clock = lambda: now[0]
    chat = Sequence("chat", [6] * 10, SamplingParams(max_tokens=1, ttft_ms=1001), arrival_time=0.0)
    sched.add(Sequence("batch", [5] * 2000, BEST_EFFORT, arrival_time=0.0))
    sched.add(chat)
    # the guard is half the chat's TTFT target: 500.5 ms - 10 ms - 10 chat tokens = 480 tokens
    assert _apply(sched, sched.schedule()) == {"chat": 10, "batch": 480}
    assert chat not in sched.running
    now[0] = 1.0  # the chat is gone, but targeted traffic was seen: keep room for the next one
    assert _apply(sched, sched.schedule()) == {"batch": 490}
    now[0] = 40.0  # nothing targeted for 30 s: full chunks again
    assert _apply(sched, sched.schedule()) == {"batch": 512}


@pytest.mark.parametrize("make, victim", [
    # max_num_seqs set: auto would fit it to the 6-block pool (one at a time) and never preempt
    (lambda cache: ContinuousScheduler(ContinuousOptions(max_num_seqs=8), cache), "chat"),  # the newest
    (lambda cache: SloScheduler(SloOptions(max_num_seqs=8), cache), "batch"),  # the best-effort one, though older
], ids=["continuous", "slo"])
def test_preemption_takes_best_effort_before_targeted_work(make, victim):
    sched = make(PagedCacheManager(None, 6, 16))  # 96 token slots
    job = Sequence("batch", [5] * 47, SamplingParams(max_tokens=40, ignore_eos=True))
    chat = Sequence("chat", [6] * 40, SamplingParams(max_tokens=40, tpot_ms=100, ignore_eos=True))
    # step 3: the batch job's 49th token needs a fourth block and none is free
    _simulate(sched, [job, chat], until=lambda: job.num_preemptions + chat.num_preemptions > 0)
    assert {s.request_id: s.num_preemptions for s in (job, chat)}[victim] == 1


# ---- attainment -----------------------------------------------------------------------------
def _final(reason: str, ttft: float | None, tpot: float | None) -> Finished:
    return Finished(request_id="r", finish_reason=reason, text="", token_ids=[],
                    usage=Usage(prompt_tokens=1, cached_tokens=0, completion_tokens=2),
                    metrics=RequestMetrics(ttft_ms=ttft, tpot_ms=tpot, e2e_ms=1.0, queue_ms=0.0))


def test_attainment_counts_per_class():
    opts = SloOptions(classes={"interactive": SloClass(ttft_ms=500, tpot_ms=100)})
    sched = SloScheduler(opts, PagedCacheManager(None, 16, 16))
    chat = Sequence("a", [1], SamplingParams(slo_class="interactive"))
    own = Sequence("b", [1], SamplingParams(ttft_ms=50))  # class "default", its own target only
    for seq, final in [
        (chat, _final("stop", 400, 90)),  # both met
        (chat, _final("length", 600, 90)),  # TPOT only
        (chat, _final("length", 400, 150)),  # TTFT only
        (chat, _final("stop", 400, None)),  # one token: no TPOT to miss
        (chat, _final("timeout", 100, 10)),  # timed out: neither
        (chat, _final("aborted", 100, 10)),  # the client left: not counted
        (chat, _final("error", None, None)),  # not counted
        (own, _final("stop", 40, 10_000)),  # no TPOT target: met
        (own, _final("stop", 60, 1)),
    ]:
        sched.on_finished(seq, final)
    s = sched.stats()
    assert [s[f"slo_interactive_{k}"] for k in ("finished", "ttft_met", "tpot_met", "both_met")] == [5, 3, 3, 2]
    assert [s[f"slo_default_{k}"] for k in ("finished", "ttft_met", "tpot_met", "both_met")] == [2, 1, 2, 1]


def test_unconfigured_class_names_are_bounded():
    sched = SloScheduler(SloOptions(), PagedCacheManager(None, 16, 16))
    for i in range(40):
        sched.on_finished(Sequence("r", [1], SamplingParams(slo_class=f"c{i}")), _final("stop", 1, 1))
    assert len(sched.counts) == 17 and sched.counts["other"]["finished"] == 24


def test_attainment_in_engine_stats_and_metrics(make_llm):
    from tokenloom.protocols.metrics import ServerMetrics

    llm = make_llm(scheduler={"name": "slo", "classes": {"tight": {"ttft_ms": 1e-3},
                                                         "loose": {"ttft_ms": 1e6, "tpot_ms": 1e6}}})
    params = [SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, slo_class=c)
              for c in ("tight", "loose", "loose")]
    params.append(SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, tpot_ms=1e-3))
    llm.generate([[5] * 10] * 4, params)
    s = llm.engine.stats()
    assert (s["scheduler_slo_tight_finished"], s["scheduler_slo_tight_ttft_met"]) == (1, 0)
    assert (s["scheduler_slo_loose_finished"], s["scheduler_slo_loose_both_met"]) == (2, 2)
    assert (s["scheduler_slo_default_finished"], s["scheduler_slo_default_ttft_met"],
            s["scheduler_slo_default_tpot_met"]) == (1, 1, 0)
    assert s["scheduler_cost_base_ms"] >= 0
    text = ServerMetrics(llm.engine).render()
    assert 'tokenloom_slo_requests{outcome="both_met",slo_class="loose"} 2.0' in text
    assert 'tokenloom_slo_requests{outcome="ttft_met",slo_class="tight"} 0.0' in text
    assert 'tokenloom_scheduler_stat{stat="cost_base_ms"}' in text


# ---- the engine, end to end ---------------------------------------------------------------
def test_interactive_first_token_in_fewer_steps_than_continuous(make_llm):
    def first_token_step(scheduler: str) -> int:
        llm = make_llm(scheduler={"name": scheduler, "max_num_batched_tokens": 32})
        steps = []  # per step: the requests whose scheduled tokens reach their end (they sample)
        inner = llm.engine.scheduler.observe

        def observe(batch, step_time_s):
            steps.append({s.request_id for s, n in zip(batch.seqs, batch.num_scheduled_tokens, strict=True)
                          if s.num_computed_tokens + n == s.num_tokens})
            inner(batch, step_time_s)

        llm.engine.scheduler.observe = observe

        async def run():  # the batch job is queued first; both wait when the first step is planned
            reqs = [llm.engine.submit([5] * 400, BEST_EFFORT, request_id="batch"),
                    llm.engine.submit([6] * 10, INTERACTIVE, request_id="chat")]
            for req in reqs:
                async for _ in llm.engine.stream(req):
                    pass

        llm.run(run())
        return next(i for i, sampled in enumerate(steps, 1) if "chat" in sampled)

    cont, slo = first_token_step("continuous"), first_token_step("slo")
    assert (cont, slo) == (13, 1)  # continuous: behind 400 / 32 chunks of the batch prompt


def test_mixed_run_with_preemption_ends_every_request_once_and_frees_every_block(make_llm):
    class Integrity:
        @hookimpl
        def step_finished(self, stats):
            llm.engine.cache.check_integrity()

    llm = make_llm(scheduler={"name": "slo", "max_num_batched_tokens": 48, "max_num_seqs": 64}, num_kv_blocks=14,
                   plugin_manager=PluginManager(load_entry_points=False, extra=[Integrity()]))
    rng = random.Random(3)
    jobs = []
    for i in range(14):
        interactive = i % 2 == 1
        prompt = [rng.randrange(0, 256) for _ in range(rng.randint(4, 20) if interactive else rng.randint(60, 120))]
        params = SamplingParams(temperature=0, max_tokens=rng.randint(8, 40), ignore_eos=True,
                                **({"slo_class": "interactive"} if interactive else {}))
        jobs.append((prompt, params))

    async def run():
        reqs = [llm.engine.submit(p, params) for p, params in jobs]
        counts = []
        for req in reqs:
            events = []
            while not events or not isinstance(events[-1], Finished):
                events.append(await asyncio.wait_for(req.queue.get(), 60))
            counts.append(events)
        await asyncio.sleep(0.05)
        return counts

    results = llm.run(run())
    assert all(sum(isinstance(e, Finished) for e in ev) == 1 for ev in results)
    assert all(ev[-1].finish_reason == "length" for ev in results)
    assert llm.engine.stats()["preemptions"] > 0  # the small pool really forced recompute
    assert llm.engine.cache.stats().num_used_blocks == 0
    assert llm.engine.num_unfinished == 0
    alone = make_llm()  # scheduling must not change what greedy decoding produces
    for (prompt, params), ev in zip(jobs[:4], results, strict=False):
        assert alone.generate([prompt], params)[0].token_ids == ev[-1].token_ids


def test_drafts_and_preemption_under_slo_keep_greedy_output(make_llm):
    # 24 blocks of 4 tokens for 6 sequences of up to 57 tokens: preemption is certain.
    # max_num_seqs set: auto would fit it to the small pool and avoid the preemption tested here
    llm = make_llm(num_kv_blocks=24, block_size=4, scheduler={"name": "slo", "max_num_seqs": 64},
                   decoder={"name": "ngram", "prompt_lookup_min": 1})
    prompts = ["ab" * 8 + str(i) for i in range(6)]
    params = [SamplingParams(temperature=0, max_tokens=40, ignore_eos=True,
                             **({"slo_class": "interactive"} if i % 2 else {})) for i in range(6)]
    outs = llm.generate(prompts, params)
    assert llm.engine.stats()["preemptions"] > 0
    assert sum(o.metrics.num_draft_tokens for o in outs) > 0
    assert llm.engine.cache.stats().num_used_blocks == 0
    llm.engine.cache.check_integrity()
    ref = make_llm(num_kv_blocks=256).generate(prompts, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    assert [o.token_ids for o in outs] == [o.token_ids for o in ref]


# ---- the bench ----------------------------------------------------------------------------------
def test_bench_slo_report_on_a_tiny_config(tiny_model_dir, tmp_path, monkeypatch):
    import argparse

    from tokenloom.bench import slo as bench
    from tokenloom.bench.plot import plot_slo

    from conftest import tiny_engine_kwargs

    args = argparse.Namespace(config=None, schedulers="continuous,slo", duration=1.5, rate=4.0, ttft_ms=500.0,
                              tpot_ms=None, interactive_prompt_len="4-12", interactive_output_len="2-4",
                              batch_concurrency=1, batch_prompt_len="60-90", batch_output_len="6-10",
                              workload_seed=3)
    opts = bench.slo_options(args)
    assert bench.make_slo_workload(opts, 260) == bench.make_slo_workload(opts, 260)  # seeded
    chats, jobs = bench.make_slo_workload(opts, 260)
    assert chats and all(0 < a.arrival_s <= 1.5 and a.ttft_ms == 500.0 for a in chats)
    assert all(j.slo_class == "batch" and j.ttft_ms is None and 60 <= len(j.prompt_token_ids) <= 90 for j in jobs)
    monkeypatch.setattr(bench, "isolated", lambda fn, *a: fn(*a))  # in this process: no spawn in a test
    report = bench.run_slo(args, tiny_engine_kwargs(tiny_model_dir, num_kv_blocks=64), PluginManager())
    cal = report["calibration"]  # no TPOT target given: measured first, TTFT kept as given
    # the full chunk: the CPU step size (2048) cut to the longest prompt the tiny model's 1024 positions take
    assert (cal["prefill_tokens"], cal["decode_seqs"], cal["decode_context"], cal["chunk_tokens"]) == (8, 3, 60, 1023)
    assert cal["decode_ms"] > 0 and cal["prefill_ms"] > 0 and cal["chunk_ms"] > 0
    # targets round up, never to 0 (a 0 ms target is refused): TPOT to the ms, TTFT to 10 ms
    assert cal["tpot_ms"] == math.ceil(3 * cal["decode_ms"]) and cal["ttft_ms"] == 10 * math.ceil(cal["chunk_ms"] / 10)
    assert cal["tpot_ms"] > 0 and cal["ttft_ms"] > 0
    assert (report["workload"]["ttft_ms"], report["workload"]["tpot_ms"]) == (500.0, cal["tpot_ms"])
    assert [r["scheduler"] for r in report["results"]] == ["continuous", "slo"]
    for r in report["results"]:
        assert set(r["classes"]) == {"batch", "interactive"}
        chat = r["classes"]["interactive"]
        assert chat["finished"] == len(chats)  # every interactive request ran to the end
        assert 0 <= chat["both_met"] <= min(chat["ttft_met"], chat["tpot_met"]) <= 1
        assert r["goodput_req_s"] > 0 and r["output_tok_s"] > 0
    slo_stats = report["results"][1]["scheduler_stats"]
    assert slo_stats["scheduler_slo_interactive_finished"] == len(chats)
    table = bench.format_slo(report)
    assert "| scheduler | goodput req/s | output tok/s | class |" in table and "TPOT = 3 x the decode step" in table
    assert table.count("| interactive |") == 2
    series = plot_slo(report, str(tmp_path / "slo.png"))
    assert series["attainment"] == ["batch", "interactive"]
    assert (tmp_path / "slo.png").read_bytes()[:4] == b"\x89PNG"
