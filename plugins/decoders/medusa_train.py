"""Training Medusa heads by self-distillation (`tokenloom train-medusa`).

1. **Prompts**: most are written by the model itself. An instruction-tuned model given
   only its chat template up to where a user's message begins writes a user's message
   (Xu et al. 2024, "Magpie: Alignment Data Synthesis from Scratch by Prompting Aligned
   LLMs with Nothing", arXiv:2406.08464); sampled at temperature 1 these cover far more
   ground than any fixed list, and they are the kind of question a chat user asks. The
   rest (``grounded_share``) ask about passages from the calibration part of CPython's
   ``pydoc_data.topics`` (the text quantizers calibrate on; evaluation text stays unseen),
   so the heads also learn to copy. Answers are the model's own, greedy, through the
   engine; they are the labels, so the heads learn what *this* model says next (Medusa
   paper, section 3.3: self-distillation, hard labels here).
2. **Features**: one prefill per answered conversation gives the final hidden state at
   every position; the heads read its RMSNorm (what the output head reads). Only
   positions inside the generated answer are used.
3. **Training**: head ``i`` at position ``t`` is trained to predict token ``t + i + 2``
   (the base head predicts ``t + 1``), cross-entropy through the model's frozen output
   head, Adam, all heads at once. A tenth of the conversations is held out; the report
   gives each head's top-k accuracy there (``heldout_topk``), from which the decoder
   builds its candidate tree (:func:`tokenloom.plugins.decoders.medusa.best_tree`).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass

import torch

from tokenloom.plugins.decoders.medusa import MedusaHeads, normalise, token_features

PROMPT_TEMPLATES = (
    "Explain the following documentation in simple words:\n\n{text}",
    "Summarise this text:\n\n{text}",
    "What is the main point of the following?\n\n{text}",
    "Continue this text:\n\n{text}",
)


def user_turn_prefix(tokenizer) -> list[int]:
    """Token ids of the chat template up to where the first user message's text begins
    (system prompt included): Magpie's "pre-query template"."""
    sentinel = "\x00tokenloom-user-message\x00"
    text = tokenizer.apply_chat_template([{"role": "user", "content": sentinel}], add_generation_prompt=False)
    if sentinel not in text:
        raise ValueError("the chat template does not render a user message's text as given")
    return tokenizer.encode(text[: text.index(sentinel)])


def self_written_prompts(llm, n: int, *, max_tokens: int = 96, seed: int = 0) -> list[str]:
    """``n`` distinct user messages the model writes itself (temperature 1, top-p 0.95);
    only messages it ended (its end-of-turn token, not the length limit) are kept."""
    from tokenloom.core.sampling_params import SamplingParams

    prefix = user_turn_prefix(llm.tokenizer)
    out: list[str] = []
    seen: set[str] = set()
    attempt = 0
    while len(out) < n and attempt < 4:
        want = int((n - len(out)) * 1.5) + 4
        params = [SamplingParams(temperature=1.0, top_p=0.95, max_tokens=max_tokens, seed=seed + attempt * 1_000_003 + i)
                  for i in range(want)]
        for o in llm.generate([prefix] * want, params):
            text = o.text.strip()
            if o.finish_reason == "stop" and len(text) >= 12 and text not in seen:
                seen.add(text)
                out.append(text)
        attempt += 1
    return out[:n]


def distillation_prompts(n: int, llm=None, *, grounded_share: float = 0.25, chars: int = 400,
                         seed: int = 0) -> list[list[dict]]:
    """``n`` single-turn conversations: ``grounded_share`` of them ask about a pydoc
    calibration passage, the rest are user messages the model (``llm``) wrote itself.
    Without ``llm`` every conversation is a passage question."""
    from tokenloom.core.evaluation import split_corpus

    if not 0.0 <= grounded_share <= 1.0:
        raise ValueError(f"grounded_share must be in [0, 1], got {grounded_share}")
    n_grounded = n if llm is None else round(n * grounded_share)
    calibration, _ = split_corpus()
    texts = [t.strip()[:chars] for _, t in calibration if len(t.strip()) > 80]
    rng = random.Random(seed)
    rng.shuffle(texts)
    grounded = [PROMPT_TEMPLATES[j % len(PROMPT_TEMPLATES)].format(text=texts[j % len(texts)]) for j in range(n_grounded)]
    written = self_written_prompts(llm, n - n_grounded, seed=seed) if n > n_grounded else []
    prompts = grounded + written
    rng.shuffle(prompts)
    return [[{"role": "user", "content": c}] for c in prompts]


def frequent_tokens(tokens: torch.Tensor, k: int) -> torch.Tensor:
    """The draft vocabulary: the ``k`` token ids most frequent in ``tokens`` (the answers),
    most frequent first (ties: lower id first); fewer if fewer distinct ids occur."""
    if k < 0:
        raise ValueError(f"draft_vocab must be >= 0, got {k}")
    ids, counts = torch.unique(tokens, return_counts=True)
    order = sorted(range(len(ids)), key=lambda i: (-int(counts[i]), int(ids[i])))[:k]
    return ids[torch.tensor(order, dtype=torch.long)].to(torch.int64)


#: held-out accuracy is measured for each head's best TOPK_RANKS guesses (the tree's widest choice)
TOPK_RANKS = 10


@dataclass(slots=True)
class Features:
    x: torch.Tensor  # [N, d] normalised hidden states at answer positions
    tokens: torch.Tensor  # [N] the token each of those states produced (the next one)
    labels: torch.Tensor  # [N, H] token i + 2 places ahead for head i (-100 past the end)
    group: torch.Tensor  # [N] which conversation each position came from


def collect_features(llm, conversations: list[list[int]], prompt_lens: list[int], num_heads: int,
                     progress: Callable[[int, int], None] | None = None) -> Features:
    """Hidden states of every answer position, and each head's label there."""
    from tokenloom.core.sampling_params import SamplingParams
    from tokenloom.core.sequence import Sequence

    engine = llm.engine
    model = engine.runner.model
    xs, tokens, labels, groups = [], [], [], []
    for c, (ids, p) in enumerate(zip(conversations, prompt_lens, strict=True)):
        seq = Sequence("medusa", list(ids), SamplingParams(max_tokens=1))
        if not engine.cache.allocate(seq, len(ids)):
            raise ValueError(f"a {len(ids)}-token conversation does not fit the KV cache")
        try:
            h = engine.call_in_step_thread(engine.executor.prefill_hidden, ids, engine.cache.block_table(seq))
            x = engine.call_in_step_thread(normalise, model, h)
        finally:
            engine.cache.free(seq)
        t = torch.arange(p - 1, len(ids) - 2)  # positions whose next-next token is in the answer
        ids_t = torch.tensor(ids)
        lab = torch.full((len(t), num_heads), -100, dtype=torch.long)
        for i in range(num_heads):
            ok = t + i + 2 < len(ids)
            lab[ok, i] = ids_t[t[ok] + i + 2]
        xs.append(x[t].clone())
        tokens.append(ids_t[t + 1])
        labels.append(lab)
        groups.append(torch.full((len(t),), c))
        if progress is not None:
            progress(c + 1, len(conversations))
    return Features(torch.cat(xs).float(), torch.cat(tokens), torch.cat(labels), torch.cat(groups))


def train_heads(feats: Features, head_weight: torch.Tensor, num_heads: int, *, embedding: torch.Tensor | None = None,
                epochs: int = 2, lr: float = 1e-3, batch_size: int = 256, holdout: float = 0.1, seed: int = 0,
                compute_dtype: torch.dtype = torch.float32, draft_vocab: int = 8192, sequential: bool = False,
                progress: Callable[[int, int], None] | None = None) -> tuple[MedusaHeads, dict]:
    """Train ``num_heads`` heads on ``feats`` through the frozen ``head_weight [V, d]``;
    with the input ``embedding [V, d]`` they also read the token each state produced
    (``token_input``; without, the hidden state alone), and ``sequential`` heads the true
    tokens before their own (teacher forcing: their held-out accuracy is conditional on a
    right branch, as the tree uses them). Returns the heads and a report
    (loss, held-out accuracy per head and rank); the heads keep the ``draft_vocab`` tokens
    most frequent in the answers (:func:`frequent_tokens`; 0: none). The output-head matmul, most of the work,
    runs in ``compute_dtype`` (the model's dtype: bf16 where the CPU has it); the heads and
    the optimiser stay fp32."""
    g = torch.Generator().manual_seed(seed)
    n_groups = int(feats.group.max()) + 1
    held = set(torch.randperm(n_groups, generator=g)[: max(1, int(n_groups * holdout))].tolist())
    is_held = torch.tensor([int(c) in held for c in feats.group])
    train_idx, test_idx = torch.nonzero(~is_held).flatten(), torch.nonzero(is_held).flatten()
    heads = MedusaHeads(num_heads, feats.x.shape[1], token_input=embedding is not None, sequential=sequential)
    E = embedding.detach().float() if embedding is not None else None

    def head_states(b: torch.Tensor) -> torch.Tensor:
        if E is None:
            return heads(feats.x[b], None)
        if not sequential:
            return heads(feats.x[b], token_features(E[feats.tokens[b]]))
        # teacher forcing: head i reads the token produced and the i true tokens after it
        # (past a conversation's end: zeros; that head's label is ignored there anyway)
        toks = torch.cat([feats.tokens[b, None], feats.labels[b, :num_heads - 1]], dim=1)  # [B, H]
        return heads(feats.x[b], token_features(E[toks.clamp_min(0)]) * (toks >= 0)[..., None])

    opt = torch.optim.Adam(heads.parameters(), lr=lr)
    W = head_weight.detach().float()
    Wc = W.to(compute_dtype)
    steps = epochs * -(-len(train_idx) // batch_size)
    done, losses = 0, []
    for _ in range(epochs):
        order = train_idx[torch.randperm(len(train_idx), generator=g)]
        for b in order.split(batch_size):
            logits = (head_states(b).to(compute_dtype) @ Wc.T).float()  # [H, B, V]
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, W.shape[0]), feats.labels[b].T.reshape(-1),
                                                     ignore_index=-100)
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(float(loss.detach()))
            done += 1
            if progress is not None:
                progress(done, steps)
    heads.eval()
    heads.vocab = frequent_tokens(feats.tokens, draft_vocab) if draft_vocab else None
    with torch.no_grad():
        ranks = torch.zeros(num_heads, TOPK_RANKS)  # [H, R]: label was the head's r-th best guess
        total = torch.zeros(num_heads)
        base = torch.zeros(num_heads)
        for b in test_idx.split(1024):
            top = (head_states(b) @ W.T).topk(TOPK_RANKS, dim=-1).indices  # [H, B, R]
            untrained = (feats.x[b] @ W.T).argmax(-1)  # what a zero head (the base guess) predicts
            lab = feats.labels[b].T
            valid = lab != -100
            ranks += ((top == lab[..., None]) & valid[..., None]).sum(1).float()
            base += ((untrained[None] == lab) & valid).sum(1).float()
            total += valid.sum(1).float()
        rank_acc = ranks / total.clamp_min(1)[:, None]
    return heads, {"train_positions": len(train_idx), "heldout_positions": len(test_idx), "steps": done,
                   "first_loss": losses[0] if losses else None, "last_loss": sum(losses[-10:]) / max(len(losses[-10:]), 1),
                   "heldout_top1": rank_acc[:, 0].tolist(),
                   "heldout_top1_untrained": (base / total.clamp_min(1)).tolist(),
                   "heldout_rank_accuracy": [[round(float(v), 5) for v in row] for row in rank_acc]}
