"""The decoder conformance kit's constrained cases (``tokenloom.testing.check_decoder``): a
decoder whose verification ignores the grammar fails them (and passes the unconstrained
ones), the exact masked law is a law, and the cases are skipped, with a warning that says
why, without xgrammar or on a vocabulary that cannot spell them. The built-in decoders run
the whole kit in tests/test_speculative.py."""

from __future__ import annotations

import sys

import pytest
import torch

from tokenloom.core.hookspecs import hookimpl
from tokenloom.core.interfaces import SequenceOutput
from tokenloom.core.sampling_params import Constraint, SamplingParams
from tokenloom.plugins.decoders.ngram import NgramDecoder, NgramOptions
from tokenloom.testing import (
    KIT_CONSTRAINTS,
    KIT_PROMPT,
    ConformanceError,
    ConformanceSkipped,
    check_decoder,
    exact_marginals,
    make_tiny_model,
)

pytestmark = pytest.mark.usefixtures("one_thread")

pytest.importorskip("xgrammar")


@pytest.fixture(scope="module")
def kit_model(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("kit") / "tiny")


class GrammarBlindPlugin:
    """Prompt-lookup drafts verified exactly (accept with the target probability, else draw
    from the rest), but against the target *without* the grammar's mask: exact when
    unconstrained, wrong under a constraint (a draft the grammar forbids can be kept)."""

    @hookimpl
    def register_decoders(self, register):
        class GrammarBlindDecoder(NgramDecoder):
            name = "grammar-blind"

            def verify_drafts(self, forward, drafts, draft_probs, draft_parents=None):
                from tokenloom.core.sampler import SamplingRow
                from tokenloom.plugins.decoders.verify import row_contexts, target_probs

                outs, at = [], 0
                for seq, k, d in zip(forward.seqs, forward.num_rows, drafts, strict=True):
                    rows = [r._replace(grammar=None) for r in row_contexts(seq, d)]
                    p = target_probs(self.runner.sampler, forward.logits[at:at + k], rows)
                    at += k
                    gen = self.runner.sampler.generator_for(SamplingRow.of(seq))
                    greedy = seq.params.greedy
                    toks: list[int] = []
                    for i, tok in enumerate(d):
                        keep = int(p[i].argmax()) == tok if greedy else float(torch.rand((), generator=gen)) < float(p[i, tok])
                        if not keep:
                            break
                        toks.append(tok)
                    row = p[len(toks)].clone()
                    if len(toks) < len(d) and not greedy:
                        row[d[len(toks)]] = 0
                        row /= row.sum()
                    nxt = int(row.argmax()) if greedy else int(torch.multinomial(row, 1, generator=gen))
                    outs.append(SequenceOutput(toks + [nxt], num_accepted=len(toks), num_drafted=len(d)))
                return outs

        register("grammar-blind", GrammarBlindDecoder, options=NgramOptions,
                 description="verification without the grammar's mask (tests)")


def test_a_decoder_blind_to_the_grammar_fails_only_the_constrained_cases(kit_model):
    options = {"prompt_lookup_min": 1}
    # exact without a constraint: the unconstrained checks pass ...
    report = check_decoder("grammar-blind", model_dir=kit_model, plugins=[GrammarBlindPlugin()],
                           decoder_options=options, draws=600, depth=2, sampling=[{"temperature": 1.0}],
                           constraints=())
    assert min(report["sampling_0"]) > 1e-5 and not any(k.startswith("constrained") for k in report)
    # ... and the constrained cases catch it
    with pytest.raises(ConformanceError, match="under the (json_schema|regex) constraint"):
        check_decoder("grammar-blind", model_dir=kit_model, plugins=[GrammarBlindPlugin()],
                      decoder_options=options, draws=600, depth=2, sampling=[{"temperature": 1.0}])


def test_the_masked_law_sums_to_one_and_ends_where_the_grammar_does(kit_model):
    from tokenloom import LLM

    flags = {"model": str(kit_model), "dtype": "float32", "device": "cpu", "num_kv_blocks": 256, "block_size": 16}
    with LLM(flags=flags) as llm:
        schema = Constraint(**KIT_CONSTRAINTS[0])
        laws = exact_marginals(llm, KIT_PROMPT, SamplingParams(temperature=1.0, constraint=schema), 3)
        vocab = llm.engine.model_config.vocab_size
        assert [law.numel() for law in laws] == [vocab + 1] * 3
        assert all(float(law.sum()) == pytest.approx(1.0) for law in laws)
        assert float(laws[0][0]) == pytest.approx(1.0)  # "{" is the only way to start an object
        allowed = {i for i, p in enumerate(laws[1].tolist()) if p > 0}
        assert allowed == {1, 2, 3}  # "}", "\"a\"", "\"b\"": optional keys
        # "{}" must be followed by EOS (id vocab - 1), which completes the grammar: "ended" from token 4
        assert float(laws[2][vocab - 1]) == pytest.approx(float(laws[1][1])) and float(laws[2][vocab]) == 0.0
        fourth = exact_marginals(llm, KIT_PROMPT, SamplingParams(temperature=1.0, constraint=schema), 4)[3]
        assert float(fourth[vocab]) == pytest.approx(float(laws[1][1]))  # the answers that were "{}"
        plain = exact_marginals(llm, KIT_PROMPT, SamplingParams(temperature=1.0), 2)
        assert [law.numel() for law in plain] == [vocab] * 2


def test_the_constrained_cases_are_skipped_with_a_reason(kit_model, monkeypatch):
    small = {"draws": 200, "depth": 1, "sampling": [{"temperature": 1.0}]}
    with pytest.warns(ConformanceSkipped, match="cannot spell the kit's regex constraint"):
        report = check_decoder("standard", model_dir=kit_model, constraints=[{"kind": "regex", "value": "x+"}],
                               **small)
    assert "sampling_0" in report and not any(k.startswith("constrained") for k in report)
    monkeypatch.setitem(sys.modules, "xgrammar", None)  # as if it were not installed
    with pytest.warns(ConformanceSkipped, match="need the xgrammar package"):
        report = check_decoder("standard", model_dir=kit_model, **small)
    assert "sampling_0" in report and not any(k.startswith("constrained") for k in report)
