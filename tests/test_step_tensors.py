"""The runner's step inputs: tables and lengths written in place into persistent buffers."""

from __future__ import annotations

import torch

from tokenloom.core.attention import AttentionInputs, PrefillSpan, StepBuffers
from tokenloom.core.sampling_params import SamplingParams
from tokenloom.core.sequence import Batch, Sequence


def _inputs(decodes, spans, block_size=4):
    inp = AttentionInputs(slot_mapping=torch.zeros(0, dtype=torch.long), block_size=block_size)
    for row, (n, table) in enumerate(decodes):
        inp.decode_rows.append(row)
        inp.decode_context_lens.append(n)
        inp.decode_block_tables.append(table)
    inp.prefills = spans
    return inp


def test_tables_are_padded_to_the_widest_context_and_buffers_are_reused():
    buffers = StepBuffers("cpu")
    inp = _inputs([(5, [7, 3, 9]), (9, [1, 2, 4, 8]), (1, [6])],
                  [PrefillSpan(3, 8, 11, [10, 11, 12, 13]), PrefillSpan(8, 9, 1, [5])])
    t = buffers.build(inp)
    assert t.decode_rows.tolist() == [0, 1, 2] and t.decode_context_lens.tolist() == [5, 9, 1]
    # ceil(9 / 4) = 3 blocks wide; blocks past each context are 0, not the table's leftovers
    assert t.decode_block_tables.tolist() == [[7, 3, 0], [1, 2, 4], [6, 0, 0]]
    assert t.prefill_q_starts.tolist() == [3, 8] and t.prefill_q_lens.tolist() == [5, 1]
    assert t.prefill_context_lens.tolist() == [11, 1]
    assert t.prefill_block_tables.tolist() == [[10, 11, 12], [5, 0, 0]]
    assert t.decode_block_tables.is_contiguous() and t.decode_block_tables.dtype == torch.long
    first = t.decode_block_tables.untyped_storage().data_ptr()
    t2 = buffers.build(_inputs([(2, [4])], []))  # a smaller step: the same memory, rewritten
    assert t2.decode_block_tables.untyped_storage().data_ptr() == first
    assert t2.decode_block_tables.tolist() == [[4]] and t2.prefill_q_starts is None
    big = _inputs([(64, list(range(16)))] * 40, [])  # more than the buffer holds: it grows
    assert buffers.build(big).decode_block_tables.shape == (40, 16)


def test_the_runner_hands_the_backend_its_step_tensors(make_llm):
    llm = make_llm(block_size=4)
    runner, cache = llm.engine.runner, llm.engine.cache
    a = Sequence("a", list(range(30, 39)), SamplingParams(max_tokens=4))
    b = Sequence("b", list(range(40, 43)), SamplingParams(max_tokens=4))
    for seq in (a, b):
        assert cache.allocate(seq, seq.num_tokens)
    a.num_computed_tokens = 8  # a decodes its ninth token; b prefills three
    *_, attn, _, _, _ = runner.prepare(Batch([a, b], [1, 3], [cache.block_table(a), cache.block_table(b)]))
    t = attn.step
    assert t is attn.tensors() and t.decode_rows.tolist() == [0]
    assert t.decode_context_lens.tolist() == [9]
    assert t.decode_block_tables.tolist() == [cache.block_table(a)[:3]]
    assert t.prefill_q_starts.tolist() == [1] and t.prefill_context_lens.tolist() == [3]
    for seq in (a, b):
        cache.free(seq)
