"""Evaluation text and perplexity: how much a quantisation method costs in quality.

**Text.** Calibration (GPTQ/AWQ) and evaluation both use the English prose of CPython's own
``pydoc_data.topics`` (the reference-manual sections ``help("FOR")`` etc. print): it ships
with every Python install, needs no download and no data-set licence. It is fixed for a
given Python version, so compare numbers produced under the same interpreter (the report
records ``sys.version``).

**Split** (:func:`split_corpus`, no seed): the topics sorted by key; every 4th one (sorted
index 3, 7, 11, ...) is evaluation, the other three quarters calibration. The two parts share
no topic, and the split is the same on every run.

**Perplexity** (:func:`perplexity`): sliding windows of ``window`` tokens scored with one
prefill each through the engine's own runner (``ModelRunner.prefill_logits``), so the
quantised kernels the engine decodes with are the ones measured. A window starts every
``stride`` tokens (default: ``window``, non-overlapping). Only the tokens no earlier window
scored are scored (the Hugging Face ``transformers`` sliding-window method): with
``stride < window`` each scored token keeps at least ``window - stride`` tokens of context.
A window's first token is context only (nothing predicts it from inside the window), so with
non-overlapping windows one token per window goes unscored. The loss is computed in float64,
natural log; ``ppl = exp(mean NLL)`` over the scored tokens.

Windows are prefills, so a 4-bit method whose backend keeps a dense copy for more than
``backend.quant_max_rows`` rows is scored through that copy (the same dequantised values; set
``backend.quant_max_rows=0`` to score through the 4-bit kernel itself). And ``quantizer=none`` on
a quantised checkpoint (the embedded Q4_1 GGUF) is the dequantised 4-bit model, not the
original full-precision one.
"""

from __future__ import annotations

import math
from collections.abc import Sequence as Seq
from typing import Any

import torch

#: every EVAL_EVERY-th topic (by sorted key) is evaluation text, the rest calibration
EVAL_EVERY = 4
#: what separates two topics when a part is joined into one text
TOPIC_SEPARATOR = "\n\n"


def pydoc_corpus() -> list[tuple[str, str]]:
    """(topic key, text) for every topic of ``pydoc_data.topics``, sorted by key."""
    from pydoc_data.topics import topics

    return sorted((str(k), str(v)) for k, v in topics.items())


def split_corpus(corpus: Seq[tuple[str, str]] | None = None) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """(calibration, evaluation): the topics sorted by key, every ``EVAL_EVERY``-th one
    (index ``EVAL_EVERY - 1``, ``2 * EVAL_EVERY - 1``, ...) to evaluation. Deterministic."""
    items = sorted(corpus if corpus is not None else pydoc_corpus())
    calibration = [t for i, t in enumerate(items) if i % EVAL_EVERY != EVAL_EVERY - 1]
    evaluation = [t for i, t in enumerate(items) if i % EVAL_EVERY == EVAL_EVERY - 1]
    return calibration, evaluation


def calibration_text() -> str:
    """The calibration part as one text (topics in key order, blank line between)."""
    return TOPIC_SEPARATOR.join(text for _, text in split_corpus()[0])


def evaluation_text() -> str:
    """The evaluation part as one text (topics in key order, blank line between)."""
    return TOPIC_SEPARATOR.join(text for _, text in split_corpus()[1])


def encode_text(tokenizer, text: str, *, add_bos: bool | None = False) -> list[int]:
    """Token ids of plain ``text`` with a tokenloom ``Tokenizer`` (special-token strings
    encode as text; ``add_bos=None`` means the tokenizer's default), a ``tokenizers``
    ``Tokenizer`` or a ``transformers`` tokenizer (both without special tokens)."""
    from tokenloom.core.tokenizer import Tokenizer

    if isinstance(tokenizer, Tokenizer):
        return tokenizer.encode(text, add_bos=add_bos, parse_special_tokens=False)
    out = tokenizer.encode(text, add_special_tokens=False)
    return list(getattr(out, "ids", out))


def calibration_texts(n_tokens: int, tokenizer, *, chunk_len: int = 512) -> list[list[int]]:
    """``ceil(n_tokens / chunk_len)`` chunks of exactly ``chunk_len`` token ids, cut one after
    another from the start of the tokenised calibration part (no BOS), for GPTQ/AWQ.
    Raises ``ValueError`` when the calibration part holds fewer tokens than that."""
    if n_tokens < 1 or chunk_len < 1:
        raise ValueError(f"n_tokens and chunk_len must be >= 1, got {n_tokens} and {chunk_len}")
    ids = encode_text(tokenizer, calibration_text())
    n_chunks = -(-n_tokens // chunk_len)
    if n_chunks * chunk_len > len(ids):
        raise ValueError(f"{n_chunks} calibration chunks of {chunk_len} tokens need {n_chunks * chunk_len} tokens; "
                         f"the calibration text has {len(ids)} with this tokenizer")
    return [ids[i * chunk_len:(i + 1) * chunk_len] for i in range(n_chunks)]


def window_spans(n: int, window: int, stride: int) -> list[tuple[int, int, int]]:
    """(begin, end, first scored position) of each window over ``n`` tokens, the
    ``transformers`` sliding-window way: a window starts every ``stride`` tokens and scores
    the positions after the previous window's end (never position ``begin`` itself)."""
    if window < 2 or not 1 <= stride <= window:
        raise ValueError(f"need window >= 2 and 1 <= stride <= window, got window={window}, stride={stride}")
    spans, prev_end = [], 0
    for begin in range(0, max(n - 1, 0), stride):
        end = min(begin + window, n)
        first = max(prev_end, begin + 1)
        if first < end:
            spans.append((begin, end, first))
        prev_end = end
        if end == n:
            break
    return spans


def _token_nll(logits: torch.Tensor, targets: list[int], rows: int = 256) -> float:
    """Sum of -log p(target) in float64; ``logits[i]`` predicts ``targets[i]``."""
    tgt = torch.tensor(targets, dtype=torch.long, device=logits.device)
    total = 0.0
    for s in range(0, len(targets), rows):  # float64 log-softmax of a 49k vocabulary, a slice at a time
        lp = torch.log_softmax(logits[s:s + rows].double(), dim=-1)
        total -= lp.gather(1, tgt[s:s + rows, None]).sum().item()
    return total


def prompt_logprobs(logits: torch.Tensor, ids: Seq[int], top: int = 0, rows: int = 256
                    ) -> list[tuple[float, list[tuple[int, float]]]]:
    """For each prompt token after the first: its log-probability given the tokens before
    it and the ``top`` most likely tokens there (id, logprob), best first. ``logits`` are a
    prefill's, one row per position (row ``i`` predicts ``ids[i + 1]``), as
    :func:`perplexity` scores them: float64 log-softmax, a slice of rows at a time (the
    engine's ``SamplingParams.prompt_logprobs`` and the OpenAI frontend's ``echo``)."""
    out: list[tuple[float, list[tuple[int, float]]]] = []
    tgt = torch.tensor(list(ids[1:]), dtype=torch.long, device=logits.device)
    for s in range(0, len(ids) - 1, rows):
        lp = torch.log_softmax(logits[s:min(s + rows, len(ids) - 1)].double(), dim=-1)
        chosen = lp.gather(1, tgt[s:s + rows, None])[:, 0].tolist()
        if top:
            vals, idx = lp.topk(top, dim=-1)
            tops = [list(zip(i, v, strict=True)) for i, v in zip(idx.tolist(), vals.tolist(), strict=True)]
        else:
            tops = [[] for _ in chosen]
        out.extend(zip(chosen, tops, strict=True))
    return out


def perplexity(engine_or_llm, text_or_ids: str | Seq[int], *, window: int = 512, stride: int | None = None,
               max_tokens: int | None = None) -> dict[str, Any]:
    """Sliding-window perplexity of a text (encoded with the engine's tokenizer, its
    default BOS, special-token strings as text) or of token ids, scored by the engine's own
    runner. ``window`` is capped at the engine's ``max_model_len``; ``stride`` defaults to
    ``window``; ``max_tokens`` keeps the first N tokens.

    The engine must be idle: the window's KV blocks are taken from its cache manager for
    the duration of the call (and all given back, even on error).

    Returns ``{"ppl", "nll" (mean, nats per scored token), "tokens" (scored), "windows",
    "window", "stride", "input_tokens"}``.
    """
    from tokenloom.core.sampling_params import SamplingParams
    from tokenloom.core.sequence import Sequence

    engine = getattr(engine_or_llm, "engine", engine_or_llm)
    if engine.num_unfinished:
        raise RuntimeError("perplexity needs an idle engine (requests are running)")
    if isinstance(text_or_ids, str):
        ids = encode_text(engine.tokenizer, text_or_ids, add_bos=None)
    else:
        ids = [int(t) for t in text_or_ids]
    if max_tokens is not None:
        ids = ids[:max_tokens]
    window = min(window, engine.max_model_len)
    stride = window if stride is None else stride
    spans = window_spans(len(ids), window, stride)
    if not spans:
        raise ValueError(f"perplexity needs at least 2 tokens, got {len(ids)}")
    longest = max(end - begin for begin, end, _ in spans)

    cache, runner, block_size = engine.cache, engine.executor, engine.runner.block_size
    # A scratch sequence owns the window's blocks; num_computed_tokens stays 0, so no prefix
    # cache ever registers them, and freeing returns them as plain free blocks.
    scratch = Sequence("perplexity", list(ids[:longest]), SamplingParams(max_tokens=1))
    if not cache.allocate(scratch, longest):
        raise RuntimeError(f"a {longest}-token window needs {-(-longest // block_size)} free KV blocks; "
                           f"{cache.num_free_blocks} are free")
    try:
        table = list(cache.block_table(scratch))
        total, count = 0.0, 0
        for begin, end, first in spans:
            # row j predicts token begin + j + 1: score positions first .. end - 1. Both the
            # forward and the loss run on the engine's torch thread (see AsyncEngine.__init__).
            total += engine.call_in_step_thread(
                lambda b=begin, e=end, f=first: _token_nll(runner.prefill_logits(ids[b:e], table)[f - b - 1:e - b - 1],
                                                           ids[f:e]))
            count += end - first
    finally:
        cache.free(scratch)
    nll = total / count
    return {"ppl": math.exp(nll), "nll": nll, "tokens": count, "windows": len(spans), "window": window,
            "stride": stride, "input_tokens": len(ids)}
