"""EAGLE drafts and the `auto` decoder: the draft's unrolled training pass is the tree's
inference, the decoder passes the conformance kit (greedy identity, sampled distribution,
blocks back), a mixed batch gives each request its solo tokens, drafts for another model are
refused, training lowers the loss, and `auto` picks n-gram or EAGLE and says so."""

from __future__ import annotations

import pytest
import torch

from tokenloom.core.errors import ConfigError
from tokenloom.core.sampling_params import SamplingParams
from tokenloom.plugins.decoders.eagle import DraftShape, EagleDraft, model_fingerprint
from tokenloom.testing import check_decoder, make_tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def kit_model(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("kit") / "tiny")


def _kit_flags(model_dir, **extra):
    return {"model": str(model_dir), "dtype": "float32", "device": "cpu", "num_kv_blocks": 256, "block_size": 16,
            **extra}


def random_draft(model_dir, path, seed: int = 0, scale: float = 1.0):
    """A random-weight draft carrying ``model_dir``'s fingerprint (exactness needs no training)."""
    from tokenloom import LLM

    with LLM(flags=_kit_flags(model_dir)) as llm:
        model = llm.engine.runner.model
        fp, shape = model_fingerprint(model), DraftShape.of(model.cfg)
    torch.manual_seed(seed)
    draft = EagleDraft(shape)
    with torch.no_grad():
        for p in draft.parameters():
            p.mul_(scale)
    draft.save(path, "tiny", fp)
    return path


def test_unrolled_training_pass_is_what_tree_nodes_compute():
    torch.manual_seed(0)
    draft = EagleDraft(DraftShape(64, 4, 2, 16, 128, 10000.0, 1e-5)).double()
    L, p = 12, 7
    f, e = torch.randn(L, 64).double(), torch.randn(L, 64).double()
    outs = draft.unrolled(f, e, 3)
    empty = torch.zeros(0, 2, 16).double()
    ctx, k, v = draft.step(f[:p], e[:p], torch.arange(p), empty, empty, None)  # the committed pairs
    assert torch.allclose(ctx, outs[0][:p], atol=1e-12)
    # a depth-1 node at pair p reads the root's predicted feature and its own token
    o2, k2, v2 = draft.step(ctx[p - 1:p], e[p:p + 1], torch.tensor([p]), k, v, torch.ones(1, p + 1, dtype=torch.bool))
    assert torch.allclose(o2[0], outs[1][p], atol=1e-6)
    # its child at pair p + 1 attends to the context, its parent and itself
    o3, _, _ = draft.step(o2, e[p + 1:p + 2], torch.tensor([p + 1]), torch.cat([k, k2]), torch.cat([v, v2]),
                          torch.ones(1, p + 2, dtype=torch.bool))
    assert torch.allclose(o3[0], outs[2][p + 1], atol=1e-6)


def test_eagle_passes_the_conformance_kit(kit_model, tmp_path):
    draft = random_draft(kit_model, tmp_path / "draft.safetensors")
    report = check_decoder("eagle", model_dir=kit_model, decoder_options={"draft": str(draft), "max_batch": 8})
    stats = report["stats"]
    assert stats["decoder_eagle_drafted"] > 1_000 and stats["decoder_eagle_accepted"] > 100
    assert stats["decoder_eagle_mean_tree_nodes"] > 1


def test_mixed_batch_gives_each_request_its_solo_tokens(kit_model, tmp_path):
    from tokenloom import LLM

    draft = random_draft(kit_model, tmp_path / "draft.safetensors")
    prompts = [[1, 2, 3, 4, 5, 1, 2, 3], [3, 1, 4, 1, 5, 9 % 11, 2, 6], [7] * 9, [2, 4, 6, 8, 10, 2, 4]]
    params = [SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, decoder="eagle"),
              SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, decoder="ngram"),
              SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, decoder="standard"),
              SamplingParams(temperature=0.8, seed=5, max_tokens=24, ignore_eos=True, decoder="eagle")]
    flags = _kit_flags(kit_model, decoder={"name": "eagle", "draft": str(draft), "max_batch": 8})
    with LLM(flags=flags) as llm:
        solo = [llm.generate([p], q)[0].token_ids for p, q in zip(prompts, params, strict=True)]
        together = [o.token_ids for o in llm.generate(prompts, params)]
        assert together == solo
        assert llm.engine.stats()["decoder_eagle_accepted"] > 0
        assert llm.engine.cache.stats().num_used_blocks == 0


def test_a_draft_for_another_model_is_refused_naming_both(kit_model, tmp_path):
    from tokenloom import LLM

    other = make_tiny_model(tmp_path / "other", seed=1)
    draft = random_draft(other, tmp_path / "other.safetensors")
    with pytest.raises(ConfigError, match="trained for 'tiny'.*fingerprint.*not for this model"):
        LLM(flags=_kit_flags(kit_model, decoder={"name": "eagle", "draft": str(draft)}))
    with pytest.raises(ConfigError, match="train-eagle"):  # no draft anywhere for the kit model
        LLM(flags=_kit_flags(kit_model, decoder={"name": "eagle"}))


def test_fingerprint_is_the_same_in_float32_and_bfloat16(kit_model):
    from tokenloom import LLM

    prints = []
    for dtype in ("float32", "bfloat16"):
        with LLM(flags={**_kit_flags(kit_model), "dtype": dtype}) as llm:
            prints.append(model_fingerprint(llm.engine.runner.model))
    assert prints[0] == prints[1]


def test_training_a_draft_raises_its_agreement_with_the_target(make_llm, tiny_model_dir):
    from safetensors.torch import load_file

    from tokenloom.plugins.decoders.eagle_train import collect, train_draft

    llm = make_llm()
    prompts = [[(7 * i + j) % 200 + 30 for j in range(12)] for i in range(16)]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    ids = [p + o.token_ids for p, o in zip(prompts, outs, strict=True)]
    convs = collect(llm, ids, [len(p) for p in prompts])
    model = llm.engine.runner.model
    assert convs[0].feats.shape == (36, model.cfg.hidden_size)
    # greedy decoding: the target's choice at the last prompt position is the first answer token
    assert int(convs[0].greedy[11]) == ids[0][12]
    weights = load_file(tiny_model_dir / "model.safetensors")
    head, emb = weights["lm_head.weight"].float(), weights["model.embed_tokens.weight"].float()
    shape, norm = DraftShape.of(model.cfg), model.norm.detach().float()
    _, untrained = train_draft(convs, shape, head, emb, norm, epochs=1, lr=1e-9, unroll=2, holdout=0.25,
                               draft_vocab=0)
    draft, report = train_draft(convs, shape, head, emb, norm, epochs=12, lr=3e-3, unroll=2, holdout=0.25,
                                draft_vocab=0)
    assert report["last_loss"] < 0.5 * report["first_loss"]
    assert report["heldout_top1_by_depth"][0] > untrained["heldout_top1_by_depth"][0] + 0.1


def test_auto_chooses_ngram_where_text_repeats_and_says_so(kit_model, tmp_path, monkeypatch):
    from tokenloom import LLM

    draft = random_draft(kit_model, tmp_path / "draft.safetensors")
    flags = _kit_flags(kit_model, decoder={"name": "auto", "speculative": False}, enable_decoders=[])
    # no draft for the kit model where auto looks: auto goes on with n-gram alone
    with LLM(flags=flags) as llm:
        assert llm.engine.decoder.eagle is None
        out = llm.generate([[1, 2, 3, 1, 2, 3, 1, 2, 3]], SamplingParams(temperature=0, max_tokens=24,
                                                                          ignore_eos=True))[0]
        want = llm.generate([[1, 2, 3, 1, 2, 3, 1, 2, 3]], SamplingParams(temperature=0, max_tokens=24,
                                                                           ignore_eos=True, decoder="standard"))[0]
        assert out.token_ids == want.token_ids
        assert set(out.metrics.drafted_by) <= {"ngram"}
    # with a draft where train-eagle writes it, auto drafts with EAGLE where n-gram finds nothing
    monkeypatch.setattr("tokenloom.plugins.decoders.eagle.default_draft_path", lambda name: draft)
    with LLM(flags=flags) as llm:
        assert llm.engine.decoder.eagle is not None
        prompts = [[1, 2, 3, 1, 2, 3, 1, 2, 3], [3, 1, 4, 1, 5, 9, 2, 6, 5]]
        got = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True))
        want = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, decoder="standard"))
        assert [o.token_ids for o in got] == [o.token_ids for o in want]
        assert "eagle" in set().union(*(o.metrics.drafted_by for o in got))
        assert llm.engine.stats()["decoder_auto_chose_eagle"] > 0
        # a seeded request's choices depend on it alone, not on timings other requests left
        seeded = SamplingParams(temperature=1.0, seed=3, max_tokens=32, ignore_eos=True)
        first = llm.generate([prompts[0]], seeded)[0]
        llm.generate(prompts * 3, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
        assert llm.generate([prompts[0]], seeded)[0].token_ids == first.token_ids
        assert "eagle" not in first.metrics.drafted_by
        assert llm.engine.cache.stats().num_used_blocks == 0


def test_auto_drafts_with_the_model_in_four_bits_where_the_target_is_not(kit_model):
    """A float32 target: auto loads the engine's model through the 4-bit kernel as a second
    model draft, measures it, and its drafts (greedy and sampled) keep the target's output; a
    target that already runs the 4-bit kernel gets no such draft."""
    from tokenloom import LLM

    prompts = [[3, 1, 4, 1, 5, 9, 2, 6, 5], [7, 7, 2, 9, 10, 11]]
    with LLM(flags=_kit_flags(kit_model, decoder={"name": "auto", "eagle": False, "probe_steps": 2})) as llm:
        auto = llm.engine.decoder
        assert auto.speculative is not None and list(auto.drafters) == ["speculative"]
        got = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
        want = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, decoder="standard"))
        assert [o.token_ids for o in got] == [o.token_ids for o in want]
        assert "speculative" in set().union(*(o.metrics.drafted_by for o in got))
        assert llm.engine.stats()["decoder_auto_chose_speculative"] > 0
        assert llm.engine.cache.stats().num_used_blocks == 0
        assert auto.speculative.draft.cache.stats().num_used_blocks == 0
    # the decoder kit (greedy, sampled chi-square, blocks back) with auto measuring its modes
    # again after every step, so that the speculative draft proposes throughout (its sampled
    # drafts' distributions are what verification must be given)
    report = check_decoder("auto", model_dir=kit_model, decoder_options={
        "eagle": False, "probe_steps": 2, "reprobe_steps": 1, "max_batch": 8})
    assert report["stats"]["decoder_auto_chose_speculative"] > 100
    with LLM(flags=_kit_flags(kit_model, quantizer="rtn", decoder={"name": "auto", "eagle": False})) as llm:
        assert llm.engine.decoder.speculative is None and not llm.engine.decoder.drafters


def test_the_draft_cache_holds_the_true_pairs_after_decoding(kit_model, tmp_path, monkeypatch):
    """After decoding with trees (features from prompt rows, decode rows and accepted tree
    nodes), the draft's committed KV equals one pass of the draft over the sequence's true
    pairs (f_p, x_{p+1}) from a single prefill: features and tokens line up."""
    from tokenloom import LLM
    from tokenloom.core.sequence import Sequence
    from tokenloom.plugins.decoders.medusa import normalise

    draft = random_draft(kit_model, tmp_path / "draft.safetensors")
    with LLM(flags=_kit_flags(kit_model, decoder={"name": "eagle", "draft": str(draft)})) as llm:
        eagle, engine = llm.engine.decoder, llm.engine
        kept = {}
        release = eagle.release_state

        def grab(seq):
            st = eagle._states.get(seq.seq_id)
            if st is not None:
                kept["st"], kept["tokens"] = st, list(seq.token_ids)
            release(seq)

        monkeypatch.setattr(eagle, "release_state", grab)
        out = llm.generate([[1, 2, 3, 4, 5, 1, 2, 3]], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))[0]
        assert out.metrics.num_accepted_tokens > 0  # trees were verified and partly kept
        st, tokens = kept["st"], kept["tokens"]
        n = st.committed
        assert st.base == 0 and n >= len(tokens) - 8
        seq = Sequence("ref", tokens, SamplingParams(max_tokens=1))
        assert engine.cache.allocate(seq, len(tokens))
        try:
            h = engine.call_in_step_thread(engine.executor.prefill_hidden, tokens, engine.cache.block_table(seq))
        finally:
            engine.cache.free(seq)
        f = normalise(engine.runner.model, h).to(eagle.dtype)
        empty = st.k[:0]
        _, k_ref, v_ref = eagle.draft.step(f[:n], eagle._emb(tokens[1:n + 1]), torch.arange(n), empty, empty, None)
        assert torch.allclose(st.k[:n], k_ref, atol=1e-4) and torch.allclose(st.v[:n], v_ref, atol=1e-4)
