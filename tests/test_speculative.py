"""Speculative decoding end to end: the multi-token step contract (lookahead slots, drafts
in the batch, the engine advancing by accepted tokens), the `ngram` decoder against the
conformance kit, per-request decoders in one batch, and nothing lost on preemption or abort."""

from __future__ import annotations

import asyncio
import json

import numpy as np
import pytest
import torch

from tokenloom.core.errors import ClientError, ConfigError
from tokenloom.core.hookspecs import hookimpl
from tokenloom.core.interfaces import SequenceOutput
from tokenloom.core.sampling_params import SamplingParams
from tokenloom.core.sequence import Sequence
from tokenloom.plugins.decoders.base import SharedStepDecoder
from tokenloom.plugins.decoders.ngram import NgramDecoder, NgramOptions, lookup
from tokenloom.testing import ConformanceError, check_decoder, make_tiny_model

from conftest import tiny_engine_kwargs

# the kits' tiny models run thousands of steps of tiny ops: one torch thread (conftest.one_thread)
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def kit_model(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("kit") / "tiny")


def test_ngram_lookup_takes_the_latest_longest_match():
    t = np.array([5, 1, 2, 3, 9, 1, 2, 3, 7, 8, 4, 1, 2, 3])
    assert lookup(t, 3, 4, 1) == [7, 8, 4]  # "1 2 3" last seen before 7 8 4
    assert lookup(t, 5, 4, 1) == [7, 8, 4, 1, 2]
    assert lookup(np.array([1, 2, 3, 4]), 3, 4, 1) == []  # no token recurs
    assert lookup(np.array([4, 6, 1, 2, 4]), 2, 4, 2) == []  # only a 1-gram recurs, min is 2
    assert lookup(np.array([4, 6, 1, 2, 4]), 2, 4, 1) == [6, 1]


def test_ngram_passes_the_conformance_kit(kit_model):
    report = check_decoder("ngram", model_dir=kit_model, decoder_options={"prompt_lookup_min": 1})
    assert {"constrained_0", "constrained_1"} <= report.keys()  # the kit ran its constrained cases
    stats = report["stats"]
    # Both branches of the rule ran many times: accepted drafts and rejections.
    assert stats["decoder_ngram_drafted"] > 10_000 and 1_000 < stats["decoder_ngram_accepted"] < stats[
        "decoder_ngram_drafted"]


def test_speculative_passes_the_conformance_kit(kit_model):
    # A one-layer draft of the two-layer model: a different distribution, so drafts drawn from
    # q are rejected often and the residual path runs.
    report = check_decoder("speculative", model_dir=kit_model,
                           decoder_options={"draft_num_layers": 1, "draft_quantizer": "none", "max_batch": 8})
    assert {"constrained_0", "constrained_1"} <= report.keys()  # the kit ran its constrained cases
    stats = report["stats"]
    assert stats["decoder_speculative_drafted"] > 5_000
    assert 0.1 < stats["decoder_speculative_acceptance_rate"] < 0.95


class LossyPlugin:
    """A decoder that keeps a draft whenever the target gives it probability > 5%:
    greedy output is unchanged (a one-hot target gives 0 or 1), sampled output is not."""

    @hookimpl
    def register_decoders(self, register):
        class LossyDecoder(NgramDecoder):
            name = "lossy"

            def verify_drafts(self, forward, drafts, draft_probs, draft_parents=None):
                from tokenloom.core.sampler import SamplingRow
                from tokenloom.plugins.decoders.verify import row_contexts, target_probs

                outs, at = [], 0
                for seq, k, d in zip(forward.seqs, forward.num_rows, drafts, strict=True):
                    p = target_probs(self.runner.sampler, forward.logits[at:at + k], row_contexts(seq, d))
                    at += k
                    toks = []
                    for i, tok in enumerate(d):
                        if float(p[i, tok]) <= 0.05:
                            break
                        toks.append(tok)
                    row = p[len(toks)]
                    gen = self.runner.sampler.generator_for(SamplingRow.of(seq))
                    nxt = int(row.argmax()) if seq.params.greedy else int(torch.multinomial(row, 1, generator=gen))
                    outs.append(SequenceOutput(toks + [nxt], num_accepted=len(toks), num_drafted=len(d)))
                return outs

        register("lossy", LossyDecoder, options=NgramOptions, description="verification that keeps likely-enough drafts (tests)")


def test_a_lossy_decoder_fails_the_kit_on_distribution_not_greedy(kit_model):
    with pytest.raises(ConformanceError, match="distribution: decoder 'lossy'"):
        check_decoder("lossy", model_dir=kit_model, plugins=[LossyPlugin()], decoder_options={"prompt_lookup_min": 1})


def test_lookahead_allocation_in_every_cache_manager(make_llm):
    for manager in ("paged", "radix", "contiguous"):
        llm = make_llm(cache_manager=manager, num_kv_blocks=16, block_size=4)
        cache = llm.engine.cache
        seq = Sequence("s", list(range(6)), SamplingParams(max_tokens=20))
        assert cache.allocate(seq, 6)
        seq.num_computed_tokens = 6
        seq.token_ids.append(9)
        assert cache.allocate(seq, 1, num_lookahead=5)  # 6 + 1 + 5 = 12 slots: 3 blocks of 4
        assert len(cache.block_table(seq)) >= 3
        assert cache.stats().num_tokens_stored <= 7  # lookahead slots are reserved, not stored tokens
        cache.free(seq)
        assert cache.stats().num_used_blocks == 0, manager


def test_mixed_batch_gives_each_request_its_tokens_alone(make_llm):
    prompts = ["abcabcabcabc", "hello hello hello", "xyz", "the cat the cat the", "one two one two", "a b c"]
    params = [SamplingParams(temperature=0, max_tokens=24, decoder="ngram", ignore_eos=True),
              SamplingParams(temperature=0.9, top_k=20, seed=7, max_tokens=24, decoder="ngram", ignore_eos=True),
              SamplingParams(temperature=1.0, seed=3, max_tokens=24, ignore_eos=True),
              SamplingParams(temperature=0.7, seed=11, max_tokens=24, decoder="ngram",
                             num_speculative_tokens=3, repetition_penalty=1.2, ignore_eos=True),
              SamplingParams(temperature=0.8, seed=5, max_tokens=24, decoder="speculative", ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=24, decoder="speculative", ignore_eos=True)]
    llm = make_llm(decoder={"name": "standard"}, enable_decoders=["speculative"])
    assert llm.engine.stats()["decoder_speculative_model_bytes"] > 0  # loaded at start-up, counted
    together = llm.generate(prompts, params)
    for prompt, p, out in zip(prompts, params, together, strict=True):
        alone = llm.generate([prompt], p)[0]
        assert alone.token_ids == out.token_ids, prompt
    assert sum(o.metrics.num_draft_tokens for o in together) > 0
    assert llm.engine.cache.stats().num_used_blocks == 0


def test_speculative_mixed_batch_preemption_and_draft_blocks(make_llm):
    """A request-chosen draft-model decoder beside standard and n-gram ones, under preemption:
    the same greedy tokens as a roomy standard engine, and both KV pools empty afterwards."""
    # max_num_seqs set: auto would fit it to the small pool and avoid the preemption tested here
    llm = make_llm(num_kv_blocks=24, block_size=4, decoder={"name": "speculative", "draft_num_layers": 1,
                                                            "draft_quantizer": "none", "draft_num_kv_blocks": 64},
                   scheduler={"max_num_seqs": 64})
    prompts = ["ab" * 8 + str(i) for i in range(6)]
    names = ["speculative", "standard", "ngram", "speculative", "speculative", "standard"]
    params = [SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, decoder=n) for n in names]
    outs = llm.generate(prompts, params)
    assert llm.engine.stats()["preemptions"] > 0
    ref = make_llm(num_kv_blocks=256).generate(prompts, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    assert [o.token_ids for o in outs] == [o.token_ids for o in ref]
    assert sum(o.metrics.num_draft_tokens for o, n in zip(outs, names, strict=True) if n == "speculative") > 0
    assert llm.engine.cache.stats().num_used_blocks == 0
    assert llm.engine.decoder.draft.cache.stats().num_used_blocks == 0
    llm.engine.decoder.draft.cache.check_integrity()


def test_unknown_decoder_is_refused_naming_the_known_ones(make_llm):
    llm = make_llm()
    with pytest.raises(ClientError) as info:
        llm.generate(["hi"], SamplingParams(decoder="medusa-nope"))
    assert info.value.param == "decoder" and "ngram" in str(info.value) and "standard" in str(info.value)
    with pytest.raises(ClientError) as info:
        SamplingParams(num_speculative_tokens=99).validate()
    assert info.value.param == "num_speculative_tokens"


def test_preemption_mid_speculation_loses_nothing(make_llm):
    # 24 blocks of 4 tokens for 6 sequences of up to 60 tokens: preemption is certain.
    # max_num_seqs set: auto would fit it to the small pool and avoid the preemption tested here
    llm = make_llm(num_kv_blocks=24, block_size=4, decoder={"name": "ngram", "prompt_lookup_min": 1},
                   scheduler={"max_num_seqs": 64})
    prompts = ["ab" * 8 + str(i) for i in range(6)]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    outs = llm.generate(prompts, params)
    assert all(len(o.token_ids) == 40 and o.finish_reason == "length" for o in outs)
    assert llm.engine.stats()["preemptions"] > 0
    assert llm.engine.cache.stats().num_used_blocks == 0
    llm.engine.cache.check_integrity()
    ref = make_llm(num_kv_blocks=256)  # same greedy tokens as a roomy, standard engine
    assert [o.token_ids for o in ref.generate(prompts, params)] == [o.token_ids for o in outs]


@pytest.mark.parametrize("decoder", [{"name": "ngram", "prompt_lookup_min": 1},
                                     {"name": "speculative", "draft_num_layers": 1, "draft_quantizer": "none"}])
async def test_abort_mid_speculation_ends_every_stream_once(tiny_model_dir, decoder):
    from tokenloom.core.engine import AsyncEngine
    from tokenloom.core.outputs import Finished

    engine = AsyncEngine.from_options(**tiny_engine_kwargs(tiny_model_dir, decoder=decoder))
    try:
        params = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
        reqs = [engine.submit("ab" * 10 + str(i), params) for i in range(4)]
        finals: dict[str, list] = {r.seq.request_id: [] for r in reqs}

        async def drain(req, abort_after):
            n = 0
            async for item in engine.stream(req):
                if isinstance(item, Finished):
                    finals[req.seq.request_id].append(item)
                else:
                    n += len(item.token_ids)
                    if abort_after and n >= abort_after:
                        engine.abort(req.seq.request_id)

        await asyncio.gather(*(drain(r, 10 if i % 2 else 0) for i, r in enumerate(reqs)))
        assert all(len(f) == 1 for f in finals.values())
        reasons = sorted(f[0].finish_reason for f in finals.values())
        assert reasons == ["aborted", "aborted", "length", "length"]
        assert engine.cache.stats().num_used_blocks == 0
        assert engine.stats()[f"decoder_{decoder['name']}_drafted"] > 0
        if decoder["name"] == "speculative":  # the draft pool too
            assert engine.decoder.draft.cache.stats().num_used_blocks == 0
    finally:
        await engine.shutdown()
        engine.close()


@pytest.mark.slow
def test_speculative_decoders_greedy_identical_on_the_embedded_model(tmp_path):
    from tokenloom import LLM

    passage = ("The river rose in the night, and by morning the lower town was under water. The mayor "
               "opened the school on the hill to anyone who needed a dry floor and a blanket.")
    messages = [[{"role": "user", "content": f"Rewrite this passage in the past perfect tense:\n\n{passage}"}],
                [{"role": "user", "content": f"Summarise in one sentence:\n\n{passage}"}],
                [{"role": "user", "content": "What is the capital of France?"}],
                [{"role": "user", "content": "Write a Python function that reverses a list."}]]
    # fp32, dequantised: a verification forward runs several rows where plain decoding runs
    # one, and with the 4-bit kernel's bfloat16 activations that alone can flip a near-tie.
    heads = _random_heads(tmp_path / "medusa.safetensors", 3, 576, scale=0.3)  # exactness needs no training
    with LLM(dtype="float32", quantizer="none", decoder={"name": "medusa", "heads": str(heads)},
             enable_decoders=["speculative"]) as llm:
        base = SamplingParams(temperature=0, max_tokens=64, decoder="standard")
        want = llm.generate(messages=messages, params=base)
        for name in ("ngram", "speculative", "medusa"):  # speculative: the same model, 4-bit, drafts
            got = llm.generate(messages=messages, params=SamplingParams(temperature=0, max_tokens=64, decoder=name))
            assert [o.token_ids for o in got] == [o.token_ids for o in want], name
            assert sum(o.metrics.num_accepted_tokens for o in got) > (20 if name != "medusa" else 0), name
        assert llm.engine.cache.stats().num_used_blocks == 0


async def test_decoder_is_chosen_per_request_over_the_websocket(make_server):
    from tokenloom.protocols.websocket.client import Client, RequestError

    from conftest import collect

    server, url = await make_server()
    async with Client(url) as client:
        params = {"temperature": 0, "max_tokens": 30, "ignore_eos": True}
        text, done, _ = await collect(client, "abcabcabcabcabc", params=params)
        text2, done2, _ = await collect(client, "abcabcabcabcabc", params={**params, "decoder": "ngram",
                                                                           "num_speculative_tokens": 4})
        assert text2 == text and done2.metrics.num_draft_tokens > 0 and done.metrics.num_draft_tokens == 0
        assert 0 <= done2.metrics.num_accepted_tokens <= done2.metrics.num_draft_tokens
        with pytest.raises(RequestError) as info:
            await collect(client, "x", params={"decoder": "nope"})
        assert info.value.param == "decoder"


def _random_heads(path, num_heads: int, hidden: int, scale: float = 0.5, sequential: bool = False):
    from tokenloom.plugins.decoders.medusa import MedusaHeads

    heads = MedusaHeads(num_heads, hidden, sequential=sequential)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        heads.weight.copy_(torch.randn(heads.weight.shape, generator=g) * scale / hidden ** 0.5)
    heads.save(path, "tiny")
    return path


@pytest.mark.parametrize("sequential", [False, True])
def test_medusa_passes_the_conformance_kit(kit_model, tmp_path, sequential):
    heads = _random_heads(tmp_path / "heads.safetensors", 3, 32, sequential=sequential)
    report = check_decoder("medusa", model_dir=kit_model, decoder_options={"heads": str(heads), "max_batch": 8})
    assert {"constrained_0", "constrained_1"} <= report.keys()  # the kit ran its constrained cases
    stats = report["stats"]
    assert stats["decoder_medusa_drafted"] > 5_000 and stats["decoder_medusa_accepted"] > 100


def test_medusa_without_heads_says_how_to_make_them(make_llm, tmp_path):
    from tokenloom.core.errors import ConfigError

    with pytest.raises(ConfigError, match="train-medusa"):
        make_llm(decoder={"name": "medusa", "heads": str(tmp_path / "none.safetensors")})


def test_training_medusa_heads_lowers_their_loss(make_llm, tiny_model_dir, tmp_path):
    from safetensors.torch import load_file

    from tokenloom.plugins.decoders.medusa import MedusaHeads
    from tokenloom.plugins.decoders.medusa_train import collect_features, train_heads

    llm = make_llm()
    prompts = [[(7 * i + j) % 200 + 30 for j in range(12)] for i in range(12)]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    ids = [p + o.token_ids for p, o in zip(prompts, outs, strict=True)]
    feats = collect_features(llm, ids, [len(p) for p in prompts], num_heads=2)
    assert feats.x.shape == (12 * 23, 64) and feats.labels.shape == (12 * 23, 2)
    assert int(feats.labels[0, 0]) == ids[0][len(prompts[0]) + 1]  # head 0 at the last prompt token: token p + 1
    weight = load_file(tiny_model_dir / "model.safetensors")["lm_head.weight"].float()  # untied in the tiny model
    assert feats.tokens[0] == ids[0][len(prompts[0])]  # the token the last prompt position produced
    embedding = load_file(tiny_model_dir / "model.safetensors")["model.embed_tokens.weight"].float()
    for token_input, sequential in ((False, False), (True, False), (True, True)):
        heads, report = train_heads(feats, weight, 2, embedding=embedding if token_input else None,
                                    epochs=30, lr=3e-3, batch_size=64, sequential=sequential)
        assert heads.token_input is token_input and heads.sequential is sequential
        assert report["last_loss"] < 0.7 * report["first_loss"]
        assert report["heldout_top1"][0] >= report["heldout_top1_untrained"][0]
        heads.save(tmp_path / "h.safetensors", "tiny")
        loaded = MedusaHeads.load(tmp_path / "h.safetensors", 64)  # every kind loads as itself
        assert loaded.token_input is token_input and loaded.sequential is sequential
        torch.testing.assert_close(loaded.weight, heads.weight.detach())
    # a sequential head reads its branch: head 1 sees the true token t + 2 (head 0's target)
    assert heads.weight.shape == (2, 64, 64 * 3)
    assert torch.count_nonzero(heads.weight[0, :, 64 * 2:]) == 0  # head 0 reads [x; e_1] only


def _closed_sets(paths, n):
    """Every ancestor-closed set of ``n`` of ``paths`` (parents listed before children), each
    once, in the order ``combinations(paths, n)`` gives them: each path is taken or left in
    turn, and taken only where its parent was."""
    def grow(i, chosen, members):
        if len(chosen) == n:
            yield tuple(chosen)
            return
        if len(chosen) + len(paths) - i < n:
            return
        p = paths[i]
        if len(p) == 1 or p[:-1] in members:
            members.add(p)
            chosen.append(p)
            yield from grow(i + 1, chosen, members)
            chosen.pop()
            members.discard(p)
        yield from grow(i + 1, chosen, members)

    yield from grow(0, [], set())


def test_best_tree_is_the_best_closed_tree_of_its_size():
    """Against brute force over every ancestor-closed set of paths of the same size."""
    from itertools import combinations, product

    from tokenloom.plugins.decoders.medusa import best_tree, expected_accepted

    acc = [[0.5, 0.2, 0.1], [0.4, 0.15, 0.05], [0.3, 0.1, 0.02]]
    paths = [p for d in (1, 2, 3) for p in product(range(3), repeat=d)]
    for n in (1, 2, 3, 4):  # the enumeration is the filtered combinations (those of 7: 15 M, ~20 s)
        assert list(_closed_sets(paths, n)) == [c for c in combinations(paths, n)
                                                if all(p[:-1] in c for p in c if len(p) > 1)]
    for n in (1, 3, 5, 7):
        tree = best_tree(acc, n)
        assert len(tree) == n and all(p[:-1] in tree for p in tree if len(p) > 1)  # closed under ancestors
        best = max(expected_accepted(acc, list(c)) for c in _closed_sets(paths, n))
        assert expected_accepted(acc, tree) == pytest.approx(best)
    # a head that is never right adds no depth; a second head that is always right doubles the root's worth
    assert all(len(p) == 1 for p in best_tree([[0.6, 0.3], [0.0, 0.0]], 2))
    assert expected_accepted([[0.6, 0.3], [1.0, 0.0]], best_tree([[0.6, 0.3], [1.0, 0.0]], 2)) == pytest.approx(1.2)


def test_medusa_builds_its_tree_from_the_accuracies_saved_with_the_heads(make_llm, tmp_path):
    from tokenloom.plugins.decoders.medusa import DEFAULT_TREE, MedusaHeads, best_tree

    acc = [[0.5, 0.3, 0.1], [0.2, 0.1, 0.05], [0.1, 0.05, 0.0]]
    path = tmp_path / "heads.safetensors"
    MedusaHeads(3, 64).save(path, "tiny", {"heldout_rank_accuracy": acc})
    llm = make_llm(decoder={"name": "medusa", "heads": str(path), "tree_nodes": 5})
    assert llm.engine.decoder.paths == sorted(best_tree(acc, 5), key=lambda q: (len(q), q))
    assert llm.engine.decoder.paths != [q for q in DEFAULT_TREE if len(q) <= 3][:5]
    got = llm.generate(["hello"], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0]
    assert got.metrics.num_draft_tokens > 0  # the tree drafts (zero heads repeat the base guess)
    with pytest.raises(Exception, match="tree_nodes"):
        make_llm(decoder={"name": "medusa", "heads": str(path), "tree_nodes": 0})


def test_the_model_writes_its_own_training_prompts(make_llm):
    """Magpie: the chat template up to a user message's text, sampled, gives user messages
    (the tiny model's are random tokens, but they end and they differ)."""
    from tokenloom.plugins.decoders.medusa_train import (
        PROMPT_TEMPLATES,
        distillation_prompts,
        self_written_prompts,
        user_turn_prefix,
    )

    llm = make_llm()
    prefix = user_turn_prefix(llm.tokenizer)
    rendered = llm.tokenizer.apply_chat_template([{"role": "user", "content": "XYZ"}], add_generation_prompt=False)
    assert llm.tokenizer.decode(prefix, skip_special_tokens=False) + "XYZ" in rendered
    prompts = self_written_prompts(llm, 6, max_tokens=24)
    assert len(prompts) == len(set(prompts)) and all(prompts)
    convs = distillation_prompts(8, llm, grounded_share=0.5)
    heads = tuple(t.split("{")[0] for t in PROMPT_TEMPLATES)
    assert len(convs) == 8 and sum(c[0]["content"].startswith(heads) for c in convs) == 4
    with pytest.raises(ValueError, match="grounded_share"):
        distillation_prompts(4, llm, grounded_share=1.5)


def test_train_medusa_command_writes_heads_the_decoder_loads(tiny_model_dir, tmp_path, capsys):
    from tokenloom import LLM
    from tokenloom.cli.main import main

    out, data = tmp_path / "heads.safetensors", tmp_path / "conversations.jsonl"
    args = ["train-medusa", "--model", str(tiny_model_dir), "--dtype", "float32", "--num-heads", "2",
            "--prompts", "6", "--max-tokens", "12", "--epochs", "1", "--data", str(data)]
    rc = main([*args, "--out", str(out)])
    assert rc == 0 and out.exists()
    assert len(data.read_text().splitlines()) == 6
    capsys.readouterr()
    data.write_text("\n".join(data.read_text().splitlines()[:4]) + "\n")  # a second run reads, not generates
    rc = main([*args, "--out", str(tmp_path / "again.safetensors")])
    assert rc == 0 and json.loads(capsys.readouterr().out)["prompts"] == 4
    with LLM(**tiny_engine_kwargs(tiny_model_dir, decoder={"name": "medusa", "heads": str(out)})) as llm:
        got = llm.generate(["hello"], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))[0]
        assert got.metrics.num_draft_tokens > 0
        assert llm.engine.cache.stats().num_used_blocks == 0


def test_tree_attention_scores_each_node_as_its_own_branch(make_llm):
    """One forward over a draft tree gives every node the logits a chain of its branch gets."""
    from tokenloom.core.sequence import Batch

    llm = make_llm(num_kv_blocks=64, block_size=4)
    runner, cache = llm.engine.runner, llm.engine.cache
    prompt = [5, 9, 33, 70, 12, 8, 90]
    drafts, parents = [40, 41, 42, 50, 51, 60, 70], [-1, -1, -1, 0, 0, 1, 3]
    seq = Sequence("tree", list(prompt), SamplingParams(max_tokens=20))
    assert cache.allocate(seq, len(prompt) - 1)
    runner.forward(Batch([seq], [len(prompt) - 1], [cache.block_table(seq)]))
    seq.num_computed_tokens = len(prompt) - 1
    assert cache.allocate(seq, 1, num_lookahead=len(drafts))
    out = runner.forward(Batch([seq], [1], [cache.block_table(seq)], draft_tokens=[drafts], draft_parents=[parents]))
    assert out.num_rows == [len(drafts) + 1]
    branch = {-1: []}
    for i, p in enumerate(parents):
        branch[i] = branch[p] + [drafts[i]]
    for row, node in enumerate([-1, *range(len(drafts))]):
        ids = prompt + branch[node]
        ref = Sequence("chain", ids, SamplingParams(max_tokens=1))
        assert cache.allocate(ref, len(ids))
        want = runner.prefill_logits(ids, cache.block_table(ref))[-1]
        cache.free(ref)
        torch.testing.assert_close(out.logits[row], want, rtol=1e-4, atol=1e-4)
    cache.free(seq)


@pytest.mark.parametrize("quantizer", ["none", "rtn"])
def test_a_draft_chain_is_verified_as_decode_rows(make_llm, quantizer):
    """A last token and its draft chain go through the step as decode rows sharing the
    sequence's block table (the captured step and the decode attention op take them), and
    each row's logits are those of a plain decode step at that position."""
    from tokenloom.core.sequence import Batch

    llm = make_llm(num_kv_blocks=64, block_size=4, quantizer=quantizer)
    runner, cache = llm.engine.runner, llm.engine.cache
    prompt, drafts = [5, 9, 33, 70, 12, 8, 90], [40, 41, 42, 43, 44]
    seq = Sequence("chain", list(prompt), SamplingParams(max_tokens=20))
    assert cache.allocate(seq, len(prompt) - 1)
    runner.forward(Batch([seq], [len(prompt) - 1], [cache.block_table(seq)]))
    seq.num_computed_tokens = len(prompt) - 1
    assert cache.allocate(seq, 1, num_lookahead=len(drafts))
    batch = Batch([seq], [1], [cache.block_table(seq)], draft_tokens=[drafts])
    plan = runner.plan(batch)[0]
    assert not plan.attn.prefills and plan.attn.decode_rows == list(range(len(drafts) + 1))
    end = len(prompt)
    assert plan.attn.decode_context_lens == list(range(end, end + len(drafts) + 1))
    steps = runner.model.captured.steps if runner.model.captured is not None else None
    out = runner.forward(batch)
    if steps is not None:
        assert runner.model.captured.steps == steps + 1  # the verification ran as the captured step
    assert out.num_rows == [len(drafts) + 1]
    # the same tokens one plain decode step at a time, in a sequence of their own
    ref = Sequence("plain", list(prompt), SamplingParams(max_tokens=20))
    assert cache.allocate(ref, len(prompt) - 1)
    runner.forward(Batch([ref], [len(prompt) - 1], [cache.block_table(ref)]))
    ref.num_computed_tokens = len(prompt) - 1
    for row, token in enumerate([None, *drafts]):
        if token is not None:
            ref.append_token(token)
        assert cache.allocate(ref, 1)
        want = runner.forward(Batch([ref], [1], [cache.block_table(ref)])).logits[0]
        ref.num_computed_tokens += 1
        torch.testing.assert_close(out.logits[row], want, rtol=1e-4, atol=1e-4)
    cache.free(ref)
    cache.free(seq)


@pytest.mark.parametrize("capture", [True, False])
def test_one_sequences_rows_keep_the_quantised_kernel_whatever_its_row_threshold(make_llm, capture):
    """A batch-1 verification step (``AttentionInputs.single_sequence``) keeps every quantised
    matmul on its own kernel, even above the row count where a dense copy takes over
    (``quant_max_rows`` 1 here): each row's logits are bit for bit a plain decode step's, so
    greedy n-gram and draft-model decoding give ``standard``'s tokens on the 4-bit path."""
    from tokenloom.core.sequence import Batch

    llm = make_llm(num_kv_blocks=64, block_size=4, quantizer="rtn", dtype="bfloat16",
                   capture=capture, flags={"backend": {"quant_max_rows": 1}, "enable_decoders": ["ngram", "speculative"]})
    runner, cache = llm.engine.runner, llm.engine.cache
    assert (runner.model.captured is not None) == capture
    captured_before = runner.model.captured.steps if capture else None
    assert "above 1 rows" in runner.model.layers[0].qkv.kernel  # the threshold this test crosses
    prompt, drafts = [5, 9, 33, 70, 12, 8, 90], [40, 41, 42, 43, 44]

    def run():
        seq = Sequence("chain", list(prompt), SamplingParams(max_tokens=20))
        assert cache.allocate(seq, len(prompt) - 1)
        runner.forward(Batch([seq], [len(prompt) - 1], [cache.block_table(seq)]))
        seq.num_computed_tokens = len(prompt) - 1
        assert cache.allocate(seq, 1, num_lookahead=len(drafts))
        batch = Batch([seq], [1], [cache.block_table(seq)], draft_tokens=[drafts])
        assert runner.plan(batch)[0].attn.single_sequence
        out = runner.forward(batch)
        assert runner.backend.step_rows.floor == 1 + len(drafts)
        ref = Sequence("plain", list(prompt), SamplingParams(max_tokens=20))
        assert cache.allocate(ref, len(prompt) - 1)
        runner.forward(Batch([ref], [len(prompt) - 1], [cache.block_table(ref)]))
        ref.num_computed_tokens = len(prompt) - 1
        # two sequences' rows are a batch: the threshold decides again
        two = Batch([seq, ref], [1, 1], [cache.block_table(seq), cache.block_table(ref)])
        assert not runner.plan(two)[0].attn.single_sequence
        runner.backend.prepare(runner.plan(two)[0].attn)
        assert runner.backend.step_rows.floor == 0
        for row, token in enumerate([None, *drafts]):
            if token is not None:
                ref.append_token(token)
            assert cache.allocate(ref, 1)
            want = runner.forward(Batch([ref], [1], [cache.block_table(ref)])).logits[0]
            ref.num_computed_tokens += 1
            assert torch.equal(out.logits[row], want), row
        cache.free(ref)
        cache.free(seq)

    llm.engine.call_in_step_thread(run)
    if capture:  # the decode steps really ran captured
        assert runner.model.captured.steps > captured_before
    want = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))[0].token_ids
    for decoder in ("ngram", "speculative"):
        params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, decoder=decoder)
        assert llm.generate([prompt], params)[0].token_ids == want, decoder


def test_accepted_tree_branch_kv_moves_into_place(make_llm):
    """After a step that accepts a branch of a tree, decoding on gives the tokens (and the
    logits) of plain greedy decoding: the branch's KV sits at the right positions."""
    from tokenloom.core.interfaces import DecoderContext
    from tokenloom.core.sequence import Batch
    from tokenloom.plugins.decoders.standard import StandardDecoder

    llm = make_llm(num_kv_blocks=64, block_size=4)
    engine = llm.engine
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    prompt = [5, 9, 33, 70, 12, 8, 90]
    want = llm.generate([prompt], greedy)[0].token_ids
    runner, cache = engine.runner, engine.cache
    dec = StandardDecoder(None, DecoderContext(engine.config, engine.pm, engine.model_config, cache, runner))
    seq = Sequence("t", list(prompt), greedy)
    assert cache.allocate(seq, len(prompt))
    out = engine.call_in_step_thread(dec.step, Batch([seq], [len(prompt)], [cache.block_table(seq)]))[seq]
    seq.num_computed_tokens = len(prompt)
    seq.token_ids += out.token_ids
    # A tree whose right branch (nodes 2 -> 4) is the greedy continuation, left one wrong.
    drafts, parents = [want[1] + 1, 3, want[1], 4, want[2]], [-1, 0, -1, 0, 2]
    assert cache.allocate(seq, 1, num_lookahead=len(drafts))
    batch = Batch([seq], [1], [cache.block_table(seq)], draft_tokens=[drafts], draft_parents=[parents])
    out = engine.call_in_step_thread(dec.step, batch)[seq]
    assert out.accepted_nodes == [2, 4] and out.token_ids == want[1:4]
    seq.num_computed_tokens += 1 + out.num_accepted
    seq.token_ids += out.token_ids
    while len(seq.token_ids) < len(prompt) + len(want):
        assert cache.allocate(seq, 1)
        out = engine.call_in_step_thread(dec.step, Batch([seq], [1], [cache.block_table(seq)]))[seq]
        seq.num_computed_tokens += 1
        seq.token_ids += out.token_ids
    assert seq.token_ids[len(prompt):] == want
    cache.free(seq)


@pytest.mark.parametrize("cache_manager, scheduler", [("paged", "continuous"), ("radix", "continuous"),
                                                      ("contiguous", "continuous"), ("paged", "static"),
                                                      ("radix", "cache-aware")])
def test_speculation_under_every_cache_manager_and_scheduler(make_llm, cache_manager, scheduler):
    """Drafts through each manager's lookahead and each scheduler: greedy tokens equal a plain
    engine's, prefix caches register only accepted tokens (a second identical batch hits the
    cache and still decodes the same), and every block comes back."""
    llm = make_llm(cache_manager=cache_manager, scheduler=scheduler, num_kv_blocks=96, block_size=4,
                   decoder={"name": "ngram", "prompt_lookup_min": 1})
    prompts = ["abab" * 6, "xyzxyz" * 3 + "x", "hello, hello, hello, "]
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    want = [o.token_ids for o in make_llm(num_kv_blocks=256).generate(prompts, params)]
    for _ in range(2):  # the second round meets whatever the first left in a prefix cache
        outs = llm.generate(prompts, params)
        assert [o.token_ids for o in outs] == want
        assert llm.engine.cache.stats().num_used_blocks == 0
        llm.engine.cache.check_integrity()
    assert llm.engine.stats()["decoder_ngram_accepted"] > 0


class OraclePlugin:
    """A decoder whose drafts are a known continuation (so every draft is accepted)."""

    def __init__(self):
        self.script: list[int] = []

    @hookimpl
    def register_decoders(self, register):
        plugin = self

        class OracleDecoder(SharedStepDecoder):
            name = "oracle"
            default_k = 4

            def propose(self, seqs, outputs, forward):
                for seq in seqs:
                    done = seq.num_output_tokens + len(outputs[seq].token_ids)
                    seq.draft_token_ids = plugin.script[done:done + 4]

        register("oracle", OracleDecoder, description="drafts a scripted continuation (tests)")


@pytest.mark.parametrize("cache_manager", ["radix", "paged"])
def test_a_stop_inside_accepted_drafts_leaves_the_prefix_cache_exact(tiny_model_dir, cache_manager):
    """A stop token among a step's accepted drafts ends the sequence with fewer tokens than
    the step computed KV for: the cache must register only the tokens the sequence has, so a
    request that shares the stopped text and then diverges gets exactly a fresh engine's tokens."""
    from tokenloom import LLM
    from tokenloom.core.plugins import PluginManager

    oracle = OraclePlugin()
    kw = tiny_engine_kwargs(tiny_model_dir, cache_manager=cache_manager, num_kv_blocks=128, block_size=4)
    with LLM(**kw) as plain:
        prompt = [40 + (i * 7) % 50 for i in range(9)]
        greedy = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
        oracle.script = plain.generate([prompt], greedy)[0].token_ids
        # the stop: a draft with accepted drafts after it in its step (steps emit script[1:5]+
        # bonus script[5], then [6:10] + [10], ...), at the token's first occurrence
        j = next(j for j in (2, 3, 6, 7, 8, 11, 12, 13, 16, 17, 18) if oracle.script[j] not in oracle.script[:j])
        branch = prompt + oracle.script[:j + 1] + [3, 5, 8, 13, 21, 34]
        want = plain.generate([branch], greedy)[0].token_ids
    pm = PluginManager(load_entry_points=False, extra=[oracle])
    with LLM(plugin_manager=pm, **{**kw, "decoder": "oracle"}) as llm:
        out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True,
                                                    stop_token_ids=[oracle.script[j]]))[0]
        assert out.token_ids == oracle.script[:j + 1] and out.metrics.num_accepted_tokens >= 4
        llm.engine.cache.check_integrity()
        got = llm.generate([branch], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True,
                                                    decoder="standard"))[0]
        assert got.usage.cached_tokens <= len(prompt) + j + 1
        assert got.token_ids == want
        llm.engine.cache.check_integrity()


def test_static_scheduler_with_a_draft_tree_near_max_tokens(make_llm, tmp_path):
    """A tree's nodes each take a lookahead slot: near the end of a static reservation they
    need blocks beyond it (or go without drafts) instead of indexing past the table."""
    heads = _random_heads(tmp_path / "h.safetensors", 3, 64)
    llm = make_llm(scheduler="static", block_size=4, num_kv_blocks=64, decoder={"name": "medusa", "heads": str(heads)})
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    prompts = [[30 + i for i in range(8)], [60 + i for i in range(5)]]
    want = [o.token_ids for o in make_llm(num_kv_blocks=64).generate(prompts, params)]
    assert [o.token_ids for o in llm.generate(prompts, params)] == want
    assert llm.engine.stats()["decoder_medusa_drafted"] > 0
    assert llm.engine.cache.stats().num_used_blocks == 0


def test_a_decoder_that_cannot_be_built_fails_no_request(make_llm, tmp_path, monkeypatch):
    """Medusa with no heads anywhere: the engine starts (the decoders a request may name are
    built at start-up), requests naming medusa are refused saying why, and the rest run."""
    monkeypatch.setenv("TOKENLOOM_CACHE", str(tmp_path))  # no trained heads here
    llm = make_llm()
    assert "medusa" in llm.engine.decoder.unavailable
    with pytest.raises(ClientError) as info:
        llm.generate(["three"], SamplingParams(decoder="medusa"))
    assert info.value.param == "decoder" and "train-medusa" in str(info.value)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    assert all(o.finish_reason == "length" for o in llm.generate(["one", "two"], params))
    assert llm.engine.cache.stats().num_used_blocks == 0


def test_a_decoder_that_loads_a_model_is_built_only_when_enabled(make_llm):
    """`speculative` loads a draft model: a request cannot make the server load one. Not
    enabled, requests naming it are refused naming the flag; enabled, it is loaded at
    start-up (the step thread never loads a model) and its memory is in the stats."""
    llm = make_llm()
    assert "decoder_speculative_model_bytes" not in llm.engine.stats()
    with pytest.raises(ClientError) as info:
        llm.generate(["one"], SamplingParams(decoder="speculative", max_tokens=4))
    assert info.value.param == "decoder" and "--enable-decoder speculative" in str(info.value)
    with pytest.raises(ConfigError, match="no-such"):
        make_llm(enable_decoders=["no-such"])
    enabled = make_llm(enable_decoders=["speculative"], decoder={"name": "standard"})
    proposer = enabled.engine.decoder._proposers["speculative"]
    assert proposer.draft.runner is not enabled.engine.runner
    out = enabled.generate(["one two"], SamplingParams(decoder="speculative", temperature=0, max_tokens=8,
                                                       ignore_eos=True))[0]
    assert out.metrics.num_draft_tokens > 0


def test_medusa_draft_vocabulary(make_llm, tiny_model_dir, tmp_path, monkeypatch):
    """Heads with a draft vocabulary propose only its tokens, from the output head's own rows,
    and greedy output stays the target's."""
    from safetensors.torch import load_file

    from tokenloom.plugins.decoders.medusa import MedusaDecoder, MedusaHeads, output_head_rows
    from tokenloom.plugins.decoders.medusa_train import frequent_tokens

    assert frequent_tokens(torch.tensor([5, 3, 5, 9, 3, 5, 7]), 3).tolist() == [5, 3, 7]
    assert frequent_tokens(torch.tensor([2, 2]), 10).tolist() == [2]
    path = _random_heads(tmp_path / "v.safetensors", 2, 64, scale=0.3)
    heads = MedusaHeads.load(path, 64)
    heads.vocab = torch.arange(30, 230, 5)  # 40 tokens
    heads.save(path, "tiny")
    assert MedusaHeads.load(path, 64).vocab.tolist() == heads.vocab.tolist()
    proposed: list[int] = []
    real = MedusaDecoder.propose

    def spy(self, seqs, outputs, forward):
        real(self, seqs, outputs, forward)
        for seq in seqs:
            proposed.extend(seq.draft_token_ids)

    monkeypatch.setattr(MedusaDecoder, "propose", spy)
    llm = make_llm(decoder={"name": "medusa", "heads": str(path)})
    dec = llm.engine.decoder
    weight = load_file(tiny_model_dir / "model.safetensors")["lm_head.weight"].float()
    torch.testing.assert_close(dec.vocab_head.float(), weight[heads.vocab], rtol=1e-2, atol=1e-6)
    prompts = ["abcabcabc", "hello hello"]
    got = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    want = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, decoder="standard"))
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert proposed and set(proposed) <= set(heads.vocab.tolist())
    rows = output_head_rows(llm.engine.runner.model, torch.tensor([0, 259]))
    torch.testing.assert_close(rows, weight[[0, 259]], rtol=0, atol=1e-6)


def test_sequential_heads_guess_each_node_from_its_own_branch(make_llm, tmp_path, monkeypatch):
    """With sequential heads a depth-2 node's token is head 1's best given its own parent's
    token (not the best parent's), and greedy output stays the target's."""
    from tokenloom.plugins.decoders.medusa import (
        MedusaDecoder,
        MedusaHeads,
        normalise,
        token_features,
    )

    path = _random_heads(tmp_path / "s.safetensors", 2, 64, scale=0.8, sequential=True)
    tree = [[0], [1], [0, 0], [1, 0]]
    seen = []
    real = MedusaDecoder.propose

    def spy(self, seqs, outputs, forward):
        real(self, seqs, outputs, forward)
        seen.append((list(seqs[0].draft_token_ids), list(seqs[0].draft_parents or []), forward, outputs[seqs[0]]))

    monkeypatch.setattr(MedusaDecoder, "propose", spy)
    llm = make_llm(decoder={"name": "medusa", "heads": str(path), "tree": tree})
    got = llm.generate(["sequential heads"], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0]
    want = llm.generate(["sequential heads"], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True,
                                                             decoder="standard"))[0]
    assert got.token_ids == want.token_ids
    drafts, parents, fwd, out = seen[0]
    assert parents == [-1, -1, 0, 1] and len(drafts) == 4
    model, heads = llm.engine.runner.model, MedusaHeads.load(path, 64)
    row = out.accepted_nodes[-1] + 1 if out.accepted_nodes else out.num_accepted
    x = normalise(model, fwd.hidden[row:row + 1])
    for node, parent in ((2, 0), (3, 1)):  # each child from its own parent's token
        branch = torch.tensor([[out.token_ids[-1], drafts[parent]]])
        h = heads.head(1, x, token_features(model.embed[branch]))
        assert drafts[node] == int(model.lm_head.apply(h).argmax())
