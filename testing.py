"""Conformance kits for plugins, third-party ones included: ``tokenloom.testing``.

A decoder may change how fast tokens come, never which tokens (greedy) or with what
probability (sampled). :func:`check_decoder` runs three checks on an engine:

1. **greedy**: every prompt's greedy output is token-identical to the ``standard`` decoder's;
2. **distribution**: on a tiny-vocabulary model, the decoder's sampled tokens at several
   positions follow the *exact* target distribution, computed from the model's logits with
   the engine's own sampling rules (penalties, temperature, top-k/p, min-p), by a
   chi-square goodness-of-fit test over thousands of draws;
3. **blocks**: when everything has finished, every KV block is back;
4. **constrained** (structured outputs, with a grammar backend installed: ``xgrammar``):
   under each of :data:`KIT_CONSTRAINTS` (a JSON schema and a regex, which the kit
   model's vocabulary spells), greedy output equals ``standard``'s, and sampled output
   follows the exact *masked* target distribution (the same chi-square test; a sequence
   whose grammar completed counts as "ended" at the positions after it). Without
   xgrammar these cases are skipped with a :class:`ConformanceSkipped` warning.

Use it from pytest::

    from tokenloom.testing import check_decoder, make_tiny_model

    def test_my_decoder(tmp_path):
        model = make_tiny_model(tmp_path / "tiny")
        check_decoder("my-decoder", model_dir=model, plugins=[MyPlugin()])

Backends have their own kit, :func:`check_backend` (tokenloom/backends/conformance.py):
every op of the ``Backend`` protocol against the ``torch`` backend at odd shapes::

    from tokenloom.testing import check_backend

    def test_my_backend():
        check_backend("my-backend", plugins=[my_plugin], device="cuda")

Model families (``register_models``) have :func:`check_model`: a checkpoint's logits against
a reference forward, and its greedy ids alone, in a batch and prefilled in chunks behind a
cached prefix::

    from tokenloom.testing import check_model

    def test_my_family(tmp_path):
        check_model(my_checkpoint_dir, plugins=[my_plugin], reference=my_reference_forward)

The tiny model (:func:`make_tiny_model`) is a random LLaMA in the Hugging Face layout with a
vocabulary of a dozen tokens, so a few thousand draws pin the distribution down; the tokens
are pieces of JSON (:data:`KIT_PIECES`), so that a grammar can constrain it. Its prompt
(:data:`KIT_PROMPT`) repeats a pattern, so a prompt-lookup decoder finds drafts to verify.
"""

from __future__ import annotations

import importlib.util
import json
import math
import warnings
from collections.abc import Sequence as Seq
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec
import torch

if TYPE_CHECKING:
    from tokenloom.backends.conformance import (
        KIT_BACKEND_CASES,
        BackendCase,
        check_backend,
    )

__all__ = ["KIT_BACKEND_CASES", "KIT_CONSTRAINTS", "KIT_PIECES", "KIT_PROMPT", "KIT_SAMPLING", "BackendCase",
           "ConformanceError", "ConformanceSkipped", "check_backend", "check_blocks_back", "check_constrained",
           "check_decoder", "check_distribution", "check_greedy_identical", "chi_square", "exact_marginals",
           "make_tiny_model", "MODEL_KIT_PROMPTS", "check_model"]

#: The backend kit lives in tokenloom/backends/conformance.py (its own module: one concept,
#: and ~300 lines); ``from tokenloom.testing import check_backend`` loads it on first use.
_BACKEND_KIT = ("BackendCase", "KIT_BACKEND_CASES", "KIT_WINDOW_CASES", "TOLERANCES", "WindowCase", "check_backend")


def __getattr__(name: str):
    if name in _BACKEND_KIT:
        from tokenloom.backends import conformance

        return getattr(conformance, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

#: every token but EOS, twice: a drafter that copies from the context finds a match after any token
KIT_PROMPT = [*range(11), *range(11), 0, 1, 2]
#: sampling settings the distribution check runs: plain, and every filter and penalty at once
KIT_SAMPLING: tuple[dict[str, Any], ...] = (
    {"temperature": 1.0},
    {"temperature": 0.8, "top_k": 8, "top_p": 0.95, "min_p": 0.02, "repetition_penalty": 1.3,
     "frequency_penalty": 0.2},
)

#: the kit model's tokens (ids 0..10; EOS is the last id): pieces of JSON, so that a JSON
#: schema and a regex can constrain what the model writes (the separators are ``json.dumps``'s,
#: which xgrammar's JSON grammars require)
KIT_PIECES = ("{", "}", '"a"', '"b"', ": ", ", ", "[", "]", "0", "1", "2")
#: constraints the constrained cases decode under, as ``Constraint`` fields: a JSON object
#: (optional keys: the first tokens branch) and a comma list of numbers. Each of them allows
#: several tokens at most positions and EOS (the end of the answer) at some.
KIT_CONSTRAINTS: tuple[dict[str, Any], ...] = (
    {"kind": "json_schema", "value": {
        "type": "object", "properties": {
            "a": {"type": "array", "items": {"type": "integer", "minimum": 0}, "maxItems": 4},
            "b": {"type": "integer", "minimum": 0}},
        "additionalProperties": False}},
    {"kind": "regex", "value": "[12][012]*(, [012]+)*"},
)


class ConformanceError(AssertionError):
    """A decoder changed the output (greedy tokens, a sampled distribution) or leaked blocks."""


class ConformanceSkipped(UserWarning):
    """A part of a kit could not run here (e.g. the constrained cases without xgrammar)."""


def make_tiny_model(path: str | Path, *, vocab_size: int = 12, seed: int = 0, num_layers: int = 2,
                    hidden_size: int = 32, logit_scale: float = 3.0) -> Path:
    """Write a random LLaMA (config.json, model.safetensors, a word-level tokenizer.json of
    ``vocab_size`` tokens: :data:`KIT_PIECES`, then ``t11``..; the last one, ``t{vocab_size - 1}``,
    is EOS) to ``path``; returns the path.
    ``logit_scale`` multiplies the output head so the distributions are far from uniform."""
    from safetensors.torch import save_file
    from tokenizers import Tokenizer, models, pre_tokenizers

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(seed)
    heads, kv_heads, ffn = 4, 2, hidden_size * 2
    head_dim = hidden_size // heads

    def rand(*shape, scale=None):
        return torch.randn(*shape, generator=g) * (scale if scale is not None else shape[-1] ** -0.5)

    sd = {"model.embed_tokens.weight": rand(vocab_size, hidden_size, scale=1.0),
          "model.norm.weight": torch.ones(hidden_size),
          "lm_head.weight": rand(vocab_size, hidden_size) * logit_scale}
    for i in range(num_layers):
        p = f"model.layers.{i}."
        sd.update({p + "input_layernorm.weight": torch.ones(hidden_size),
                   p + "post_attention_layernorm.weight": torch.ones(hidden_size),
                   p + "self_attn.q_proj.weight": rand(heads * head_dim, hidden_size),
                   p + "self_attn.k_proj.weight": rand(kv_heads * head_dim, hidden_size),
                   p + "self_attn.v_proj.weight": rand(kv_heads * head_dim, hidden_size),
                   p + "self_attn.o_proj.weight": rand(hidden_size, heads * head_dim),
                   p + "mlp.gate_proj.weight": rand(ffn, hidden_size),
                   p + "mlp.up_proj.weight": rand(ffn, hidden_size),
                   p + "mlp.down_proj.weight": rand(hidden_size, ffn)})
    save_file({k: v.contiguous() for k, v in sd.items()}, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": vocab_size,
        "hidden_size": hidden_size, "intermediate_size": ffn, "num_hidden_layers": num_layers,
        "num_attention_heads": heads, "num_key_value_heads": kv_heads, "rope_theta": 10000.0,
        "rms_norm_eps": 1e-5, "max_position_embeddings": 256, "tie_word_embeddings": False,
        "bos_token_id": None, "eos_token_id": vocab_size - 1}))
    names = [KIT_PIECES[i] if i < len(KIT_PIECES) else f"t{i}" for i in range(vocab_size - 1)] + [f"t{vocab_size - 1}"]
    vocab = {name: i for i, name in enumerate(names)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=names[0]))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()  # text is the pieces, space-separated
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"eos_token": f"t{vocab_size - 1}"}))
    return path


def chi_square(counts: Seq[int], probs: Seq[float], min_expected: float = 5.0) -> tuple[float, int, float]:
    """Pearson's goodness-of-fit test of ``counts`` against ``probs``: (statistic, degrees of
    freedom, p-value). Cells expected below ``min_expected`` are pooled into one. An observed
    count in a cell of probability 0 gives p-value 0."""
    n = sum(counts)
    if any(c > 0 and p <= 0 for c, p in zip(counts, probs, strict=True)):
        return math.inf, 0, 0.0
    cells, pooled_c, pooled_e = [], 0, 0.0
    for c, p in zip(counts, probs, strict=True):
        if n * p >= min_expected:
            cells.append((c, n * p))
        elif p > 0:
            pooled_c, pooled_e = pooled_c + c, pooled_e + n * p
    if pooled_e > 0:
        cells.append((pooled_c, pooled_e))
    stat = sum((c - e) ** 2 / e for c, e in cells)
    dof = len(cells) - 1
    if dof <= 0:
        return stat, 0, 1.0
    pvalue = float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                           torch.tensor(stat / 2, dtype=torch.float64)))
    return stat, dof, pvalue


def exact_marginals(llm, prompt: list[int], params, depth: int) -> list[torch.Tensor]:
    """The exact law of each of the first ``depth`` generated tokens under ``params`` (the
    engine's own sampling rules, history-dependent penalties included), by enumerating every
    path (``vocab ** (depth - 1)`` prefills: keep the vocabulary tiny).

    With ``params.constraint`` every path's rows are masked by its grammar (a matcher that
    has accepted the path's tokens, as the engine's sampler masks them), and each law has
    one more cell, last: the answer has ended (its grammar completed at an earlier token)."""
    from tokenloom.core.grammar import GrammarState
    from tokenloom.core.sampler import SamplingRow
    from tokenloom.plugins.decoders.verify import target_probs

    engine = llm.engine
    runner, cache = engine.executor, engine.cache
    from tokenloom.core.sampling_params import SamplingParams
    from tokenloom.core.sequence import Sequence

    compiled = None if params.constraint is None else engine.grammar.compile(params.constraint)

    def grammar_after(ids: list[int]) -> GrammarState | None:
        if compiled is None:
            return None
        state = GrammarState(engine.grammar.matcher(compiled), engine.model_config.vocab_size)
        for t in ids[len(prompt):]:
            if not state.accept(t):
                raise RuntimeError(f"the grammar refused token {t} of a path it allowed")
        return state

    def next_probs(ids: list[int], grammar: GrammarState | None) -> torch.Tensor:
        seq = Sequence("exact", list(ids), SamplingParams(max_tokens=1))
        if not cache.allocate(seq, len(ids)):
            raise RuntimeError("the KV cache cannot hold the kit's prompt")
        try:
            logits = engine.call_in_step_thread(runner.prefill_logits, ids, cache.block_table(seq))[-1:]
        finally:
            cache.free(seq)
        row = SamplingRow(params, list(ids), len(prompt), -1, grammar)
        p = target_probs(engine.runner.sampler, logits.float(), [row])[0].double()
        if not bool(torch.isfinite(p).all()) or float(p.sum()) <= 0:
            raise RuntimeError(f"no token may follow {ids[len(prompt):]} under {params.constraint}: the model's "
                               "vocabulary cannot continue the constraint")
        return p

    marginals = []
    frontier: list[tuple[list[int], float, bool]] = [(list(prompt), 1.0, False)]  # (ids, weight, ended)
    for _ in range(depth):
        law = None
        ended = 0.0
        nxt: list[tuple[list[int], float, bool]] = []
        for ids, weight, done in frontier:
            grammar = None if done else grammar_after(ids)
            if done or (grammar is not None and grammar.terminated):
                ended += weight
                nxt.append((ids, weight, True))
                continue
            p = next_probs(ids, grammar)
            law = p * weight if law is None else law + p * weight
            nxt.extend((ids + [t], weight * float(p[t]), False) for t in torch.nonzero(p > 0).flatten().tolist())
        if law is None:  # every path has ended
            law = torch.zeros(engine.model_config.vocab_size, dtype=torch.float64)
        if compiled is not None:
            law = torch.cat([law, law.new_tensor([ended])])
        marginals.append(law)
        frontier = nxt
    return marginals


def check_greedy_identical(llm, decoder: str, prompts: Seq[list[int] | str], max_tokens: int = 32,
                           constraint: Any = None) -> None:
    """Greedy output of ``decoder`` equals ``standard``'s token for token, for every prompt
    (under ``constraint``, a ``Constraint``, when given)."""
    from tokenloom.core.sampling_params import SamplingParams

    base = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, constraint=constraint)
    want = llm.generate(list(prompts), msgspec.structs.replace(base, decoder="standard"))
    got = llm.generate(list(prompts), msgspec.structs.replace(base, decoder=decoder))
    under = "" if constraint is None else f" under the {constraint.kind} constraint"
    for i, (a, b) in enumerate(zip(want, got, strict=True)):
        if a.token_ids != b.token_ids:
            first = next((j for j, (x, y) in enumerate(zip(a.token_ids, b.token_ids, strict=False)) if x != y),
                         min(len(a.token_ids), len(b.token_ids)))
            raise ConformanceError(f"greedy: decoder {decoder!r} differs from standard{under} on prompt {i} at "
                                   f"token {first}: {b.token_ids[first:first + 5]} vs {a.token_ids[first:first + 5]}")


def check_distribution(llm, decoder: str, *, prompt: list[int] = KIT_PROMPT, sampling: dict | None = None,
                       draws: int = 3000, depth: int = 3, alpha: float = 1e-4, constraint: Any = None) -> list[float]:
    """Sample ``draws`` completions of ``depth`` tokens with ``decoder``; each position's
    empirical law must pass a chi-square test against the exact law at level ``alpha``
    (Bonferroni over positions). Returns the p-values. Under ``constraint`` (a
    ``Constraint``) the law is the masked one, and an answer whose grammar completed before
    a position counts in that position's "ended" cell."""
    from tokenloom.core.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=depth, ignore_eos=True, decoder=decoder, constraint=constraint,
                            **(sampling or {"temperature": 1.0}))
    exact = exact_marginals(llm, prompt, params, depth)
    # Generate past ``depth``: a decoder may not draft beyond max_tokens, and the positions
    # checked should be ones it drafted for.
    outs = llm.generate([list(prompt)] * draws, msgspec.structs.replace(params, max_tokens=depth + 8))
    cells = exact[0].numel()
    ended = llm.engine.model_config.vocab_size  # the "ended" cell of a constrained law
    under = "" if constraint is None else f", under the {constraint.kind} constraint"
    pvalues = []
    for pos in range(depth):
        seen = [o.token_ids[pos] if pos < len(o.token_ids) else ended for o in outs]
        if max(seen) >= cells:
            raise ConformanceError(f"distribution: decoder {decoder!r}{under}: an answer ended at "
                                   f"{min(len(o.token_ids) for o in outs)} tokens, before token {pos + 1}")
        counts = torch.bincount(torch.tensor(seen), minlength=cells).tolist()
        stat, dof, pvalue = chi_square(counts, exact[pos].tolist())
        pvalues.append(pvalue)
        if pvalue < alpha / depth:
            raise ConformanceError(
                f"distribution: decoder {decoder!r}, token {pos + 1}, sampling {sampling or 'temperature 1'}{under}: "
                f"chi-square {stat:.1f} on {dof} dof, p = {pvalue:.2e} over {draws} draws; "
                f"observed {counts}, expected {[round(float(p) * draws, 1) for p in exact[pos]]}")
    return pvalues


def constrained_skip_reason(llm, constraints: Seq[Any], prompt: list[int] = KIT_PROMPT) -> str | None:
    """Why the constrained cases cannot run on ``llm`` (None: they can): no xgrammar, or a
    vocabulary that cannot start the constraints' answers (not the kit model's pieces)."""
    if llm.engine.grammar.name == "xgrammar" and importlib.util.find_spec("xgrammar") is None:
        return "the constrained cases need the xgrammar package: pip install 'tokenloom[structured]'"
    from tokenloom.core.grammar import GrammarState

    for c in constraints:
        state = GrammarState(llm.engine.grammar.matcher(llm.engine.grammar.compile(c)),
                             llm.engine.model_config.vocab_size)
        allowed = state.allowed()
        if allowed is None or not bool(allowed.any()):
            return (f"the model's vocabulary cannot spell the kit's {c.kind} constraint (the kit model, "
                    f"make_tiny_model, has the tokens {KIT_PIECES})")
    return None


def check_constrained(llm, decoder: str, prompts: Seq[list[int]], constraints: Seq[Any],
                      sampling: Seq[dict[str, Any]] = KIT_SAMPLING, draws: int = 2000,
                      depth: int = 3) -> dict[str, Any]:
    """The constrained cases: for each constraint (a ``Constraint``), greedy identical to
    ``standard`` on every prompt, then the masked distribution at ``sampling[i % len]``,
    and every block back. Returns the p-values per constraint; a
    :class:`ConformanceSkipped` warning and an empty report when they cannot run here."""
    reason = constrained_skip_reason(llm, constraints)
    if reason is not None:
        warnings.warn(f"check_decoder({decoder!r}): constrained cases skipped: {reason}", ConformanceSkipped,
                      stacklevel=3)
        return {}
    report: dict[str, Any] = {}
    for i, c in enumerate(constraints):
        check_greedy_identical(llm, decoder, prompts, constraint=c)
        report[f"constrained_{i}"] = check_distribution(llm, decoder, sampling=sampling[i % len(sampling)],
                                                        draws=draws, depth=depth, constraint=c)
        check_blocks_back(llm)
    return report


def check_blocks_back(llm) -> None:
    stats = llm.engine.cache.stats()
    if stats.num_used_blocks:
        raise ConformanceError(f"blocks: {stats.num_used_blocks} KV blocks still used after every request ended")
    llm.engine.cache.check_integrity()


def check_decoder(decoder: str, *, model_dir: str | Path, plugins: Seq[Any] = (), decoder_options: dict | None = None,
                  greedy_prompts: Seq[list[int]] | None = None, draws: int = 2000, depth: int = 3,
                  sampling: Seq[dict[str, Any]] = KIT_SAMPLING,
                  constraints: Seq[dict[str, Any]] = KIT_CONSTRAINTS,
                  constrained_draws: int | None = None) -> dict[str, Any]:
    """All four checks for ``decoder`` on the model at ``model_dir`` (e.g. from
    :func:`make_tiny_model`), with ``plugins`` registered (the decoder's own package, for a
    third party). ``decoder_options`` configure it (``[decoder]`` keys). ``constraints``
    (``Constraint`` fields; ``()``: none) are the constrained cases, the i-th sampled at
    ``sampling[i % len(sampling)]`` with ``constrained_draws`` draws (default half of ``draws``:
    a masked law has few cells); they are skipped with a :class:`ConformanceSkipped`
    warning without xgrammar, or on a model whose vocabulary cannot spell them. Raises
    :class:`ConformanceError`; returns the distribution p-values per sampling setting
    (``sampling_i``) and per constraint (``constrained_i``, absent when skipped)."""
    from tokenloom import LLM
    from tokenloom.core.plugins import PluginManager
    from tokenloom.core.sampling_params import Constraint

    pm = PluginManager(load_entry_points=False, extra=list(plugins))
    flags = {"model": str(model_dir), "dtype": "float32", "device": "cpu", "num_kv_blocks": 512, "block_size": 16,
             "decoder": {"name": decoder, **(decoder_options or {})}, "scheduler": {"max_num_seqs": 8}}
    prompts = greedy_prompts or [KIT_PROMPT, KIT_PROMPT[:7], [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5], [7] * 9]
    report: dict[str, Any] = {}
    with LLM(flags=flags, plugin_manager=pm) as llm:
        check_greedy_identical(llm, decoder, prompts)
        check_blocks_back(llm)
        for i, s in enumerate(sampling):
            report[f"sampling_{i}"] = check_distribution(llm, decoder, sampling=s, draws=draws, depth=depth)
            check_blocks_back(llm)
        if constraints:
            report.update(check_constrained(llm, decoder, prompts, [Constraint(**c) for c in constraints],
                                            sampling=sampling, depth=depth,
                                            draws=draws // 2 if constrained_draws is None else constrained_draws))
        report["stats"] = {k: v for k, v in llm.engine.stats().items() if k.startswith("decoder_")}
    return report


# ---- the model kit ------------------------------------------------------------------------------
#: prompts of mixed lengths (token ids below 12: any vocabulary holds them)
MODEL_KIT_PROMPTS = ([*range(1, 11)] * 4, [3, 1, 4, 1, 5, 9, 2, 6], [*range(11)] * 2 + [5] * 7)


def check_model(model_dir: str | Path, *, plugins: Seq[Any] = (), reference: Any = None,
                prompts: Seq[list[int]] = MODEL_KIT_PROMPTS, max_tokens: int = 24, rtol: float = 1e-4,
                flags: dict[str, Any] | None = None) -> dict[str, Any]:
    """The conformance kit for a model family (``register_models``; see core/hookspecs.py):
    the checkpoint at ``model_dir``, served with ``plugins`` registered (the family's own
    package, for a third party), in float32:

    1. **logits**: with ``reference(ids) -> [len(ids), vocab]`` (e.g. transformers' model, or
       your own plain-torch forward), the prefill logits of each prompt within ``rtol``
       relative (max abs difference over max abs value);
    2. **batching**: the greedy ids of the prompts decoded together (mixed lengths) equal
       each prompt's alone;
    3. **chunking and prefix cache**: a prompt prefilled in 8-token chunks behind a prefix an
       earlier request left in the cache gives the ids it gives in one piece;
    4. **blocks**: every KV block is back at the end.

    Raises :class:`ConformanceError`; returns the worst relative logit difference."""
    from tokenloom import LLM
    from tokenloom.core.plugins import PluginManager
    from tokenloom.core.sampling_params import SamplingParams

    def engine(**extra: Any) -> Any:
        pm = PluginManager(load_entry_points=False, extra=list(plugins))
        base = {"model": str(model_dir), "dtype": "float32", "device": "cpu", "num_kv_blocks": 256, "block_size": 8}
        return LLM(flags={**base, **(flags or {}), **extra}, plugin_manager=pm)

    greedy = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    report: dict[str, Any] = {"max_rel_logit_diff": None}
    with engine(scheduler={"max_num_seqs": 8}) as llm:
        if reference is not None:
            worst = 0.0
            for i, ids in enumerate(prompts):
                blocks = list(range(-(-len(ids) // 8)))
                ours = llm.engine.runner.prefill_logits(list(ids), block_table=blocks)
                with torch.no_grad():
                    theirs = torch.as_tensor(reference(list(ids))).float()
                rel = ((ours - theirs).abs().max() / theirs.abs().max()).item()
                worst = max(worst, rel)
                if not rel <= rtol:
                    raise ConformanceError(f"logits: prompt {i} differs from the reference by {rel:.2e} relative "
                                           f"(allowed {rtol:.0e})")
            report["max_rel_logit_diff"] = worst
        alone = [llm.generate([list(p)], greedy)[0].token_ids for p in prompts]
        together = [o.token_ids for o in llm.generate([list(p) for p in prompts], greedy)]
        for i, (a, b) in enumerate(zip(alone, together, strict=True)):
            if a != b:
                raise ConformanceError(f"batching: prompt {i} decodes {b[:8]}... in a batch, {a[:8]}... alone")
        check_blocks_back(llm)
    longest = max(prompts, key=len)
    with engine(scheduler={"max_num_seqs": 8, "max_num_batched_tokens": 8}) as llm:
        llm.generate([list(longest[:16])], SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
        chunked = llm.generate([list(longest)], greedy)[0].token_ids
        if chunked != alone[list(prompts).index(longest)]:
            raise ConformanceError(f"chunking: the longest prompt decodes {chunked[:8]}... prefilled in chunks behind "
                                   f"a cached prefix, {alone[list(prompts).index(longest)][:8]}... in one piece")
        check_blocks_back(llm)
    return report
