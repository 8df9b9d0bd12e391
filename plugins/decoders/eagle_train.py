"""Training an EAGLE draft by self-distillation (`tokenloom train-eagle`).

1. **Conversations**: the same as `train-medusa`'s (plugins/decoders/medusa_train.py):
   user messages the model writes itself (Magpie) and questions about documentation
   passages, answered greedily by the model through the engine.
2. **Features**: one prefill per conversation gives the target's feature ``f_p`` (final
   hidden state after the last norm) at every position, and the target's own greedy choice
   there, ``y_p = argmax head(f_p)``: the labels are what *this* model would say.
3. **Training** (:func:`train_draft`): the draft reads the pairs ``(f_p, x_{p+1})`` and
   predicts ``f_{p+1}`` (smooth-L1, EAGLE's feature regression) and ``y_{p+1}`` through the
   frozen output head restricted to the draft vocabulary (cross-entropy). Training-time
   test (as EAGLE-3 and HASS do): the draft is also unrolled on its own predicted
   features, ``unroll`` steps deep, each step seeing exactly what a tree node of that depth
   sees at inference (:meth:`EagleDraft.unrolled`), so deep drafts are trained as used.
   Losses are counted on answer positions only; a share of the conversations is held out,
   and the report gives the draft's top-1 agreement with the target there, per depth.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tokenloom.plugins.decoders.eagle import DraftShape, EagleDraft
from tokenloom.plugins.decoders.medusa import normalise
from tokenloom.plugins.decoders.medusa_train import frequent_tokens


@dataclass(slots=True)
class Conversation:
    feats: torch.Tensor  # [L, d] the target's features (bfloat16)
    tokens: torch.Tensor  # [L] token ids
    greedy: torch.Tensor  # [L] the target's argmax at each position
    prompt_len: int


def _trim() -> None:
    """Give freed heap pages back to the system (glibc): the features kept between large
    temporary logits otherwise leave RSS growing by megabytes a conversation."""
    import ctypes

    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def collect(llm, conversations: list[list[int]], prompt_lens: list[int],
            progress: Callable[[int, int], None] | None = None) -> list[Conversation]:
    """Features and greedy choices at every position of each conversation."""
    from tokenloom.core.sampling_params import SamplingParams
    from tokenloom.core.sequence import Sequence

    engine = llm.engine
    model = engine.runner.model

    def features(ids: list[int], table: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        h = engine.executor.prefill_hidden(ids, table)
        f = normalise(model, h)
        greedy = torch.cat([model.lm_logits(f[i:i + 128].to(model.dtype)).argmax(-1) for i in range(0, len(ids), 128)])
        return f.to(torch.bfloat16), greedy

    out = []
    for c, (ids, p) in enumerate(zip(conversations, prompt_lens, strict=True)):
        seq = Sequence("eagle", list(ids), SamplingParams(max_tokens=1))
        if not engine.cache.allocate(seq, len(ids)):
            raise ValueError(f"a {len(ids)}-token conversation does not fit the KV cache")
        try:
            f, greedy = engine.call_in_step_thread(features, ids, engine.cache.block_table(seq))
        finally:
            engine.cache.free(seq)
        # copies made here, on this thread: tensors kept from the step thread's allocations
        # pinned its malloc arena between the big temporaries (RSS grew ~12 MB a conversation)
        out.append(Conversation(f.cpu().clone(), torch.tensor(ids), greedy.cpu().clone(), p))
        del f, greedy
        if c % 64 == 63:
            _trim()
        if progress is not None:
            progress(c + 1, len(conversations))
    return out


def train_draft(convs: list[Conversation], shape: DraftShape, head_weight: torch.Tensor, embedding: torch.Tensor,
                final_norm: torch.Tensor, *, epochs: int = 3, lr: float = 1e-3, unroll: int = 3,
                accumulate: int = 4, holdout: float = 0.05, draft_vocab: int = 8192, reg_weight: float = 1.0,
                cls_weight: float = 0.3, seed: int = 0, compute_dtype: torch.dtype = torch.float32,
                progress: Callable[[int, int], None] | None = None) -> tuple[EagleDraft, dict]:
    """Train a draft on ``convs`` through the frozen ``head_weight [V, d]`` and input
    ``embedding [V, d]``; returns it and a report (losses, held-out top-1 per depth)."""
    g = torch.Generator().manual_seed(seed)
    order = torch.randperm(len(convs), generator=g).tolist()
    n_held = max(1, int(len(convs) * holdout))
    held, train = [convs[i] for i in order[:n_held]], [convs[i] for i in order[n_held:]]
    answers = torch.cat([c.tokens[c.prompt_len:] for c in train])
    vocab = frequent_tokens(answers, draft_vocab) if draft_vocab else torch.arange(head_weight.shape[0])
    slot = torch.full((head_weight.shape[0],), -100, dtype=torch.long)
    slot[vocab] = torch.arange(len(vocab))
    head = head_weight[vocab].float()
    E = embedding.float()

    torch.manual_seed(seed)
    draft = EagleDraft(shape)
    with torch.no_grad():
        draft.out_norm.copy_(final_norm.float())
    draft.train()
    opt = torch.optim.AdamW(draft.parameters(), lr=lr, weight_decay=0.0)
    total = epochs * -(-len(train) // accumulate)
    warmup = max(1, min(50, total // 10))
    sched = torch.optim.lr_scheduler.LambdaLR(  # linear warm-up, then a cosine down to a tenth
        opt, lambda s: min(1.0, (s + 1) / warmup) * (0.1 + 0.45 * (1 + math.cos(math.pi * min(s / total, 1.0)))))
    weights = [0.8 ** j for j in range(unroll)]

    def losses(c: Conversation, depth: int) -> tuple[torch.Tensor, list[tuple[int, int]]]:
        L = len(c.tokens)
        feats = c.feats.float()
        emb = E[torch.cat([c.tokens[1:], c.tokens[-1:]])]  # row p: the token after p
        with torch.autocast("cpu", dtype=compute_dtype, enabled=compute_dtype != torch.float32):
            outs = draft.unrolled(feats, emb, depth)
        # row p predicts f_{p+1} and the target's choice there; answer positions only
        p = torch.arange(max(c.prompt_len - 2, 0), L - 1)
        target_f = feats[p + 1]
        label = slot[c.greedy[p + 1]]
        loss = torch.zeros(())
        hits = []
        for j, out in enumerate(outs):
            ok = p >= j  # pass j + 1 needs a root j rows back
            if not ok.any():
                hits.append((0, 0))
                continue
            o = out[p[ok]].float()
            logits = o @ head.T
            reg = F.smooth_l1_loss(o, target_f[ok])
            lab = label[ok]
            cls = F.cross_entropy(logits, lab, ignore_index=-100) if (lab >= 0).any() else torch.zeros(())
            loss = loss + weights[j] * (reg_weight * reg + cls_weight * cls)
            hits.append((int((logits.argmax(-1) == lab).sum()), int(ok.sum())))
        return loss, hits

    steps, done, history = 0, 0, []
    for _ in range(epochs):
        perm = torch.randperm(len(train), generator=g).tolist()
        for start in range(0, len(perm), accumulate):
            opt.zero_grad()
            batch = [train[i] for i in perm[start:start + accumulate]]
            total_loss = 0.0
            for c in batch:
                loss, _ = losses(c, unroll)
                (loss / len(batch)).backward()
                total_loss += float(loss.detach()) / len(batch)
            torch.nn.utils.clip_grad_norm_(draft.parameters(), 1.0)
            opt.step()
            sched.step()
            history.append(total_loss)
            steps += 1
            done += 1
            if progress is not None:
                progress(done, total)
    draft.eval()
    with torch.no_grad():
        right = [0] * unroll
        seen = [0] * unroll
        for c in held:
            _, hits = losses(c, unroll)
            for j, (r, n) in enumerate(hits):
                right[j] += r
                seen[j] += n
    draft.vocab = vocab.to(torch.int64)
    report = {"train_conversations": len(train), "heldout_conversations": len(held), "steps": steps,
              "first_loss": history[0] if history else None,
              "last_loss": sum(history[-20:]) / max(1, len(history[-20:])),
              "heldout_top1_by_depth": [round(r / max(1, n), 4) for r, n in zip(right, seen, strict=True)],
              "unroll": unroll, "epochs": epochs, "draft_vocab": len(vocab)}
    return draft, report
