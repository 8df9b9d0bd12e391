"""LLM: the synchronous Python API on top of AsyncEngine (vLLM's ``LLM.generate``)."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence as Seq
from typing import Any

from tokenloom.core.engine import AsyncEngine
from tokenloom.core.outputs import Finished
from tokenloom.core.sampling_params import SamplingParams


class LLM:
    """``LLM(model="smollm2-135m").generate(["Hello"], SamplingParams(max_tokens=16))``.

    Keyword arguments are config keys (``dtype="float32"``, ``scheduler="static"``,
    ``scheduler={"name": "continuous", "max_num_seqs": 8}``); they win over ``flags``
    and over the TOML ``config_file``.
    """

    def __init__(self, model: str | None = None, *, config_file=None, flags: dict | None = None,
                 plugin_manager=None, progress=None, **kwargs):
        if model is not None:
            kwargs["model"] = model
        self._loop = asyncio.new_event_loop()
        self.engine = AsyncEngine.from_options(config_file, flags, plugin_manager, progress, **kwargs)

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(self, prompts: str | list[int] | Seq[str | list[int]] | None = None,
                 params: SamplingParams | Seq[SamplingParams] | None = None, *,
                 messages: Seq[list[dict]] | None = None, cache_salt: str | None = None) -> list[Finished]:
        """Run all prompts together (continuous batching does the rest); results in order.
        A prompt whose params ask for ``n > 1`` samples gives n results in a row (its
        ``Finished.index`` 0 .. n-1), its prompt prefilled once."""
        inputs: list[dict[str, Any]]
        if messages is not None:
            inputs = [{"messages": m} for m in messages]
        else:
            if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
                prompts = [prompts]
            inputs = [{"prompt": p} for p in prompts or []]
        for inp in inputs:
            inp["cache_salt"] = cache_salt
        if params is None or isinstance(params, SamplingParams):
            params = [params or SamplingParams()] * len(inputs)
        return self.run(self._run(inputs, list(params)))

    async def _run(self, inputs: list[dict], params: list[SamplingParams]) -> list[Finished]:
        for sp in params:  # constraints compile first (off the event loop): one that fails raises here
            if sp.constraint is not None:
                sp.constraint.validate()
                await self.engine.wait_for_grammar(sp.constraint)
        streams = []
        try:
            for inp, sp in zip(inputs, params, strict=True):
                streams.extend(self.engine.submit(params=sp, **inp).samples)
        except Exception:  # one bad request: the ones already accepted must not run on
            for req in streams:
                self.engine.abort(req.seq.request_id)
            await asyncio.gather(*(self._drain(r) for r in streams))
            raise
        return list(await asyncio.gather(*(self._drain(r) for r in streams)))

    @staticmethod
    async def _drain(req) -> Finished:
        while True:
            item = await req.queue.get()
            if isinstance(item, Finished):
                return item

    def run(self, awaitable):
        """Run a coroutine on this LLM's event loop (the one its engine's step loop lives
        on), e.g. to stream with ``engine.generate`` from synchronous code."""
        return self._loop.run_until_complete(awaitable)

    def close(self) -> None:
        self._loop.run_until_complete(self.engine.shutdown())
        self.engine.close()
        self._loop.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
