"""Every hook tokenloom defines. Plugins implement them with ``@hookimpl``.

Two kinds of hook exist, each with its own verb:

* ``register_*(register)`` collects: called once at start-up for each plugin that
  implements it; the plugin calls ``register(name, factory, options=..., requires=...,
  conflicts=...)`` for each strategy it provides. The hot loop never goes through pluggy.
* event hooks (``engine_started``, ``step_finished``, ``request_finished``) notify
  observers; the engine skips them when nothing implements them.

There is no ``firstresult`` ("who claims this?") hook: where something must be claimed,
the registered objects answer themselves (a model format's ``claims(path)``, tried in
registration order).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any, Protocol

import msgspec
import pluggy

if TYPE_CHECKING:  # annotations only: these modules import this one (through the plugin manager)
    from tokenloom.core.config import EngineConfig
    from tokenloom.core.engine import AsyncEngine
    from tokenloom.core.metrics import StepStats
    from tokenloom.core.outputs import Finished

PROJECT = "tokenloom"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


class Register(Protocol):
    """The ``register`` callable every ``register_*`` hook receives."""

    def __call__(self, name: str, factory: Callable[..., Any], *, options: type[msgspec.Struct] | None = None,
                 requires: Mapping[str, Iterable[str]] | None = None,
                 conflicts: Mapping[str, Iterable[str]] | None = None, description: str = "",
                 loads_model: bool = False) -> None:
        """``factory``'s arguments depend on the role (see each hook); Any: it returns the
        role's object, checked against the role's Protocol at start-up. ``loads_model``
        (decoders): the strategy loads a second model, so it is built only when it is the
        engine's decoder or listed in ``enable_decoders``."""


@hookspec
def register_schedulers(register: Register) -> None:
    """Register scheduler factories.

    Called once per plugin manager, at start-up, before any engine is built.

    :param register: ``register(name, factory, *, options=None, requires=None,
        conflicts=None, description="")``. ``factory(options, cache_manager, engine_config)``
        must return an object satisfying :class:`tokenloom.core.interfaces.Scheduler`.
        Every factory's result is checked against its role's Protocol at start-up (a
        frontend's when the server mounts it; core/contracts.py): a missing method fails
        there, naming it.
        ``options`` is a msgspec Struct type; the config section of this strategy is
        converted to it, so an unknown key fails naming the key.
    :returns: nothing; results are ignored.
    """


@hookspec
def register_cache_managers(register: Register) -> None:
    """Register KV-cache manager factories.

    Called once per plugin manager, at start-up.

    :param register: as for :func:`register_schedulers`; ``factory(options, num_blocks,
        block_size)`` returns a :class:`tokenloom.core.interfaces.CacheManager`.
    :returns: nothing; results are ignored.
    """


@hookspec
def register_quantizers(register: Register) -> None:
    """Register weight quantizers.

    Called once per plugin manager, at start-up.

    :param register: as for :func:`register_schedulers`; ``factory(options)`` returns a
        :class:`tokenloom.core.interfaces.Quantizer`. It is called while the model loads,
        before anything is packed or moved to the device: for each matmul slot (q/k/v and
        gate/up fused) it turns the checkpoint's raw tensors (quantised ones untouched) into
        a weight spec, which the backend packs for its kernels; the KV pool is sized after.
        The method comes from the checkpoint's metadata unless ``[quantizer]`` names one.
    :returns: nothing; results are ignored.
    """


@hookspec
def register_decoders(register: Register) -> None:
    """Register decoder strategies (standard, speculative, ...).

    Called once per plugin manager, at start-up.

    :param register: as for :func:`register_schedulers`; ``factory(options, context)``, with
        a frozen :class:`tokenloom.core.interfaces.DecoderContext` (engine config, plugin
        manager, model config, cache manager, model runner, ``load_model`` for a second
        checkpoint with its own KV pool, the model's name), returns a
        :class:`tokenloom.core.interfaces.Decoder`. A decoder that subclasses
        ``tokenloom.plugins.decoders.base.SharedStepDecoder`` only proposes drafts (the shared
        step verifies them exactly) and can be chosen per request (``params.decoder``): the
        engine's decoder builds every such decoder at start-up (``DecoderContext.
        per_request_decoders``), never inside a step. Register one that loads a second model
        with ``loads_model=True``: it is built only where ``enable_decoders`` lists it.
        ``tokenloom.testing.check_decoder`` is the conformance kit for it.
    :returns: nothing; results are ignored.
    """


@hookspec
def register_backends(register: Register) -> None:
    """Register compute backends.

    Called once per plugin manager, at start-up.

    :param register: as for :func:`register_schedulers`; ``factory(options, device)``
        returns a :class:`tokenloom.core.interfaces.Backend`.
    :returns: nothing; results are ignored.
    """


@hookspec
def register_model_formats(register: Register) -> None:
    """Register model checkpoint formats (GGUF, Hugging Face directories, ...).

    Called once per plugin manager, at start-up.

    :param register: as for :func:`register_schedulers`; ``factory()`` returns a
        :class:`tokenloom.core.interfaces.ModelFormat`: ``claims(path) -> bool`` and
        ``load(path, dtype, progress) -> LoadedCheckpoint``. Every format is built and
        checked at start-up; the first whose ``claims`` is true loads the checkpoint.
    :returns: nothing; results are ignored.
    """


@hookspec
def register_models(register: Register) -> None:
    """Register model architectures (LLaMA, Qwen, Gemma, ... or a family of your own).

    Called once per plugin manager, at start-up.

    :param register: as for :func:`register_schedulers`; ``factory()`` returns a
        :class:`tokenloom.core.interfaces.ModelArchitecture`: the HF ``architectures`` and
        GGUF ``general.architecture`` names it claims, its config parser (refusing, by name,
        a key it does not implement), its GGUF tensor names and ``build(cfg, dtype, backend,
        max_len, tp)``, which returns the module (a
        :class:`tokenloom.core.interfaces.CausalLM`). The model formats ask the registered
        architectures which one claims a checkpoint; the runner builds the model through
        it. ``tokenloom.testing.check_model`` is the conformance kit for a new family.
    :returns: nothing; results are ignored.
    """


@hookspec
def register_frontends(register: Register) -> None:
    """Register frontends: the ways in to a served engine (WebSocket, OpenAI HTTP, ...).

    Called once per plugin manager, at start-up. ``tokenloom serve`` mounts every frontend
    that ``[frontends] enabled`` names, all over one engine, each on its own port.

    :param register: as for :func:`register_schedulers`; ``factory(options, context)``, with
        ``options`` this frontend's ``[frontends.<name>]`` table converted to its options
        Struct and a :class:`tokenloom.core.interfaces.FrontendContext` (the engine, the bind
        address, and the gateway every frontend shares: API key, Origin rules, queue limit,
        rate limits, metrics, draining), returns a
        :class:`tokenloom.core.interfaces.Frontend`. Import heavy dependencies (an HTTP
        framework) inside the factory, not at module import.
    :returns: nothing; results are ignored.
    """


@hookspec
def register_grammars(register: Register) -> None:
    """Register grammar backends: structured outputs (``SamplingParams.constraint``).

    Called once per plugin manager, at start-up. The engine builds the one that
    ``engine.grammar_backend`` names (built in: ``xgrammar``, the default, and ``llguidance``).

    :param register: as for :func:`register_schedulers`; ``factory(options, tokenizer,
        vocab_size)``, with the engine's :class:`tokenloom.core.tokenizer.Tokenizer` and the
        model's vocabulary size (the width of its logits, which may exceed the tokenizer's),
        returns a :class:`tokenloom.core.interfaces.GrammarBackend`: ``compile(constraint)``
        turns a :class:`tokenloom.core.sampling_params.Constraint` into a compiled grammar
        (raising :class:`tokenloom.core.errors.ClientError` naming the request parameter when
        it cannot), ``matcher(compiled)`` gives one sequence's
        :class:`tokenloom.core.interfaces.GrammarMatcher`. The engine calls ``compile`` on a
        worker thread of its own (never the event loop, never the step thread) and caches
        the result by constraint; a factory should not import a heavy dependency before the
        first ``compile``.
    :returns: nothing; results are ignored.
    """


@hookspec
def register_tool_parsers(register: Register) -> None:
    """Register tool-call parsers: how one model family writes function calls.

    Called once per plugin manager, at start-up. The engine builds the one that
    ``engine.tool_call_parser`` names; ``auto`` (the default) picks by the chat template
    (``<tool_call>``: ``hermes``; ``[TOOL_CALLS]``: ``mistral``; ``<|python_tag|>``:
    ``llama3_json``; any other: ``hermes``, whose system prompt then shows the tools).

    :param register: as for :func:`register_schedulers`; ``factory(options)`` returns a
        :class:`tokenloom.core.interfaces.ToolParser`: ``scan(text, final)`` reads the
        calls out of an answer (whole or as it grows), ``constraint(...)`` forces the format
        for ``tool_choice`` ``required`` and a named function, ``render_calls`` /
        ``render_result`` / ``system_prompt`` write history and tools for a template that
        does not. :mod:`tokenloom.core.tools` does the rest (OpenAI's fields, streaming).
    :returns: nothing; results are ignored.
    """


@hookspec
def register_adapters(register: Register) -> None:
    """Register adapter kinds: low-rank updates over the base model's matmuls, many loaded
    at once, each request naming its own (``SamplingParams.adapter``; the OpenAI ``model``
    field), mixed in one step with the base.

    Called once per plugin manager, at start-up. None is built unless the config selects
    one (``[adapter] name = "lora"``, the ``[lora]`` table, ``--lora NAME=PATH`` or
    ``--enable-lora``). Each rank builds its own over its share of the model.

    :param register: as for :func:`register_schedulers`; ``factory(options)`` returns a
        :class:`tokenloom.core.interfaces.AdapterManager`: ``attach(model, tp)`` wraps the
        model's matmuls (``CausalLM.linear_sites`` / ``set_linear``), ``load`` / ``unload``
        manage adapters by name, ``begin_step(rows, n)`` / ``end_step()`` bracket each step
        with the rows each adapter covers. The built-in ``lora`` reads PEFT adapters.
    :returns: nothing; results are ignored.
    """


@hookspec
def engine_started(config: EngineConfig, engine: AsyncEngine) -> None:
    """The engine has loaded its model and built its strategies.

    Called once per engine, on the event loop, before the first step.

    :param config: the effective :class:`tokenloom.core.config.EngineConfig`.
    :param engine: the :class:`tokenloom.core.engine.AsyncEngine`.
    :returns: nothing; results are ignored.
    """


@hookspec
def step_finished(stats: StepStats) -> None:
    """One engine step has finished. Skipped entirely when no plugin implements it.

    Called once per step, on the event loop, after outputs were pushed to streams.

    :param stats: a :class:`tokenloom.core.metrics.StepStats`.
    :returns: nothing; results are ignored.
    """


@hookspec
def request_finished(request_id: str, output: Finished) -> None:
    """A request has finished (stop, length, abort or error).

    Called exactly once per accepted request, on the event loop.

    :param request_id: the request's id.
    :param output: the final :class:`tokenloom.core.outputs.RequestOutput`.
    :returns: nothing; results are ignored.
    """
