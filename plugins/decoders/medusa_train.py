"""Training Medusa heads by self-distillation (`tokenloom train-medusa`).

1. **Data**: the model answers prompts, greedily, through the engine itself: half built
   from the calibration part of CPython's ``pydoc_data.topics`` (the text quantizers
   calibrate on; evaluation text stays unseen), half general chat from fixed templates
   over a list of everyday subjects. Its own outputs are the labels, so the heads learn
   what *this* model would say next (Medusa paper, section 3.3: self-distillation, with
   hard labels here).
2. **Features**: one prefill per answered conversation gives the final hidden state at
   every position; the heads read its RMSNorm (what the output head reads). Only
   positions inside the generated answer are used.
3. **Training**: head ``i`` at position ``t`` is trained to predict token ``t + i + 2``
   (the base head predicts ``t + 1``), cross-entropy through the model's frozen output
   head, Adam, all heads at once. A tenth of the conversations is held out; the report
   gives each head's top-1 accuracy there, which bounds the acceptance a chain can reach.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass

import torch

from tokenloom.plugins.decoders.medusa import MedusaHeads, normalise

#: general subjects for the chat half of the data (none of them is a `bench spec` prompt)
SUBJECTS = ("photosynthesis", "the Roman Empire", "volcanoes", "recursion", "compound interest", "the water cycle",
            "jazz music", "electric cars", "sleep", "gardening", "chess", "the moon", "bicycles", "coffee",
            "rainforests", "vaccines", "the internet", "saving money", "baking bread", "public speaking",
            "climate change", "the human heart", "learning a language", "earthquakes", "machine learning",
            "the French Revolution", "healthy breakfasts", "time management", "black holes", "honey bees",
            "job interviews", "solar panels", "the stock market", "friendship", "ancient Egypt", "running",
            "databases", "music theory", "recycling", "the ocean")
CHAT_TEMPLATES = ("Explain {s} to a beginner.", "List three facts about {s}.", "Write a short paragraph about {s}.",
                  "What are the pros and cons of {s}?", "Give me some advice about {s}.", "Why is {s} important?",
                  "Describe {s} in a few sentences.", "How would you teach a child about {s}?")
PROMPT_TEMPLATES = (
    "Explain the following documentation in simple words:\n\n{text}",
    "Summarise this text:\n\n{text}",
    "What is the main point of the following?\n\n{text}",
    "Continue this text:\n\n{text}",
)


def distillation_prompts(n: int, chars: int = 400, seed: int = 0) -> list[list[dict]]:
    """``n`` chat conversations: pydoc calibration topics and general subjects, alternating."""
    from tokenloom.core.evaluation import split_corpus

    calibration, _ = split_corpus()
    texts = [t.strip()[:chars] for _, t in calibration if len(t.strip()) > 80]
    rng = random.Random(seed)
    rng.shuffle(texts)
    chats = [t.format(s=subject) for subject in SUBJECTS for t in CHAT_TEMPLATES]
    rng.shuffle(chats)
    out = []
    for i in range(n):  # alternate: documentation questions, general chat
        if i % 2 == 0:
            j = i // 2
            out.append(PROMPT_TEMPLATES[j % len(PROMPT_TEMPLATES)].format(text=texts[j % len(texts)]))
        else:
            out.append(chats[(i // 2) % len(chats)])
    return [[{"role": "user", "content": c}] for c in out]


@dataclass(slots=True)
class Features:
    x: torch.Tensor  # [N, d] normalised hidden states at answer positions
    labels: torch.Tensor  # [N, H] token i + 2 places ahead for head i (-100 past the end)
    group: torch.Tensor  # [N] which conversation each position came from


def collect_features(llm, conversations: list[list[int]], prompt_lens: list[int], num_heads: int,
                     progress: Callable[[int, int], None] | None = None) -> Features:
    """Hidden states of every answer position, and each head's label there."""
    from tokenloom.core.sampling_params import SamplingParams
    from tokenloom.core.sequence import Sequence

    engine = llm.engine
    model = engine.runner.model
    xs, labels, groups = [], [], []
    for c, (ids, p) in enumerate(zip(conversations, prompt_lens, strict=True)):
        seq = Sequence("medusa", list(ids), SamplingParams(max_tokens=1))
        if not engine.cache.allocate(seq, len(ids)):
            raise ValueError(f"a {len(ids)}-token conversation does not fit the KV cache")
        try:
            h = engine.call_in_step_thread(engine.runner.prefill_hidden, ids, engine.cache.block_table(seq))
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
        labels.append(lab)
        groups.append(torch.full((len(t),), c))
        if progress is not None:
            progress(c + 1, len(conversations))
    return Features(torch.cat(xs).float(), torch.cat(labels), torch.cat(groups))


def train_heads(feats: Features, head_weight: torch.Tensor, num_heads: int, *, epochs: int = 2, lr: float = 1e-3,
                batch_size: int = 256, holdout: float = 0.1, seed: int = 0,
                progress: Callable[[int, int], None] | None = None) -> tuple[MedusaHeads, dict]:
    """Train ``num_heads`` heads on ``feats`` through the frozen ``head_weight [V, d]``;
    returns the heads and a report (loss, held-out top-1 accuracy per head)."""
    g = torch.Generator().manual_seed(seed)
    n_groups = int(feats.group.max()) + 1
    held = set(torch.randperm(n_groups, generator=g)[: max(1, int(n_groups * holdout))].tolist())
    is_held = torch.tensor([int(c) in held for c in feats.group])
    train_idx, test_idx = torch.nonzero(~is_held).flatten(), torch.nonzero(is_held).flatten()
    heads = MedusaHeads(num_heads, feats.x.shape[1])
    opt = torch.optim.Adam(heads.parameters(), lr=lr)
    W = head_weight.detach().float()
    steps = epochs * -(-len(train_idx) // batch_size)
    done, losses = 0, []
    for _ in range(epochs):
        order = train_idx[torch.randperm(len(train_idx), generator=g)]
        for b in order.split(batch_size):
            logits = heads(feats.x[b]) @ W.T  # [H, B, V]
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
    acc = []
    with torch.no_grad():
        correct = torch.zeros(num_heads)
        total = torch.zeros(num_heads)
        base = torch.zeros(num_heads)
        for b in test_idx.split(1024):
            pred = (heads(feats.x[b]) @ W.T).argmax(-1)  # [H, B]
            untrained = (feats.x[b] @ W.T).argmax(-1)  # what a zero head (the base guess) predicts
            lab = feats.labels[b].T
            valid = lab != -100
            correct += ((pred == lab) & valid).sum(1).float()
            base += ((untrained[None] == lab) & valid).sum(1).float()
            total += valid.sum(1).float()
        acc = (correct / total.clamp_min(1)).tolist()
        base_acc = (base / total.clamp_min(1)).tolist()
    return heads, {"train_positions": len(train_idx), "heldout_positions": len(test_idx), "steps": done,
                   "first_loss": losses[0] if losses else None, "last_loss": sum(losses[-10:]) / max(len(losses[-10:]), 1),
                   "heldout_top1": acc, "heldout_top1_untrained": base_acc}
