"""`eagle`: a one-layer draft that predicts the target's next *feature* (Li et al. 2024,
"EAGLE: Speculative Sampling Requires Rethinking Feature Uncertainty", arXiv:2401.15077),
drafting a tree grown from its own confidence (EAGLE-2, Li et al. 2024, arXiv:2406.16858).

**Features and pairs.** The target's feature at position ``p``, ``f_p``, is its final hidden
state after the last norm (what the output head reads). The draft's row ``p`` reads the pair
``(f_p, x_{p+1})`` (the feature and the token sampled from it) and predicts ``f_{p+1}``; the
target's own output head turns that into a distribution over ``x_{p+2}``. Feeding its
predicted feature back with a guessed token drafts further ahead, so guesses stay coherent
several tokens deep (Medusa's independent heads lose that past the first token).

**The draft** (:class:`EagleDraft`): ``h = W_fc [f; e_x]`` (``e_x`` the target's input
embedding of the token), one pre-norm transformer layer of the target's shape (grouped-query
attention with RoPE over the draft's own KV cache, a SwiGLU MLP), a final RMSNorm. Its rows
for committed pairs (true features, true tokens) are kept in a per-sequence KV cache; tree
nodes attend to that cache and to their own ancestors only.

**The tree** (EAGLE-2): the root row (the pair of the last emitted token) gives the first
``topk`` candidates; at each further depth, the ``topk`` candidates with the highest
cumulative draft log-probability are expanded (one draft forward over ``topk`` rows per
depth), each proposing its ``topk`` best children; at the end the ``tree_nodes`` best nodes of
the whole tree by cumulative score are verified. Scores never grow along a path, so that set
is closed under ancestors. Verification is the shared exact core (``accept_tree``):
greedy output equals `standard`'s, sampled output has the target's distribution.

**Adaptive size**: per sequence, the depth follows the accepted length (an average of the
nodes kept per step, plus two, within 2..``depth``), and the tree shrinks with the batch
(``tree_nodes`` divided among the step's drafting sequences, at least ``min_tree_nodes``).

Drafts live in a safetensors file (tensors ``eagle.*``, the draft vocabulary
``eagle.vocab``) whose metadata carries the shape, the training report and the target's
fingerprint (:func:`model_fingerprint`); a draft for another model is refused naming both.
Looked up: ``decoder.draft``, else ``~/.cache/tokenloom/eagle/<model>.safetensors`` (where
`tokenloom train-eagle` writes), else the drafts shipped in ``tokenloom/plugins/decoders/drafts``
whose fingerprint matches.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import msgspec
import torch
import torch.nn.functional as F

from tokenloom.core import env
from tokenloom.core.errors import ConfigError
from tokenloom.core.hookspecs import hookimpl
from tokenloom.core.interfaces import DecoderContext, DecoderOutput
from tokenloom.core.runner import ForwardOutput, pick_dtype
from tokenloom.core.sampling_params import MAX_SPECULATIVE_TOKENS
from tokenloom.core.sequence import Batch, Sequence
from tokenloom.plugins.decoders.base import SharedStepDecoder
from tokenloom.plugins.decoders.medusa import normalise, output_head_rows

#: drafts that ship with the project (found by the target's fingerprint)
SHIPPED_DRAFTS = Path(__file__).parent / "drafts"


def default_draft_path(model_name: str) -> Path:
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in model_name)
    return env.cache_dir() / "eagle" / f"{safe}.safetensors"


@torch.inference_mode()
def model_fingerprint(model) -> str:
    """Which target a draft belongs to: the shape, and the first embedding rows and the final
    norm rounded to bfloat16 (so the same checkpoint in float32 or bfloat16 matches)."""
    cfg = model.cfg
    h = hashlib.sha256(json.dumps([cfg.architecture, cfg.num_layers, cfg.hidden_size, cfg.num_heads,
                                   cfg.num_kv_heads, cfg.vocab_size]).encode())
    for t in (model.embed[:64], model.norm):
        h.update(t.detach().to(torch.bfloat16).view(torch.int16).cpu().numpy().tobytes())
    return h.hexdigest()[:16]


@dataclass(frozen=True, slots=True)
class DraftShape:
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rope_theta: float
    eps: float

    @classmethod
    def of(cls, cfg) -> DraftShape:
        """The target's layer shape."""
        return cls(cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size,
                   float(cfg.rope_theta), float(cfg.rms_norm_eps))


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return F.rms_norm(x, (x.shape[-1],), w.to(x.dtype), eps)


class EagleDraft(torch.nn.Module):
    """``[f; e] -> fc -> one pre-norm decoder layer -> RMSNorm``: the predicted next feature."""

    def __init__(self, shape: DraftShape):
        super().__init__()
        s = self.shape = shape
        d, hd = s.hidden_size, s.head_dim
        lin = torch.nn.Linear
        self.fc = lin(2 * d, d, bias=False)
        self.q, self.k, self.v = lin(d, s.num_heads * hd, bias=False), lin(d, s.num_kv_heads * hd, bias=False), \
            lin(d, s.num_kv_heads * hd, bias=False)
        self.o = lin(s.num_heads * hd, d, bias=False)
        self.gate, self.up = lin(d, s.intermediate_size, bias=False), lin(d, s.intermediate_size, bias=False)
        self.down = lin(s.intermediate_size, d, bias=False)
        self.attn_norm = torch.nn.Parameter(torch.ones(d))
        self.mlp_norm = torch.nn.Parameter(torch.ones(d))
        self.out_norm = torch.nn.Parameter(torch.ones(d))
        inv = 1.0 / (s.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd))
        self.register_buffer("inv_freq", inv, persistent=False)
        self.vocab: torch.Tensor | None = None  # the draft vocabulary (token ids), most frequent first
        self.meta: dict = {}  # metadata: model, fingerprint, the training report
        self._qkv: torch.Tensor | None = None  # fused copies for inference (fuse)
        self._gate_up: torch.Tensor | None = None

    # ---- pieces ---------------------------------------------------------------------
    def rope(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """``x [T, heads, hd]`` rotated by positions ``pos [T]`` (rotate-half convention)."""
        ang = pos.to(torch.float32)[:, None] * self.inv_freq[None]  # [T, hd/2]
        cos, sin = ang.cos()[:, None].to(x.dtype), ang.sin()[:, None].to(x.dtype)
        a, b = x.chunk(2, dim=-1)
        return torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1)

    def fuse(self) -> EagleDraft:
        """For inference: q/k/v and gate/up as one matmul each (fewer small ops per depth)."""
        with torch.no_grad():
            self._qkv = torch.cat([self.q.weight, self.k.weight, self.v.weight])
            self._gate_up = torch.cat([self.gate.weight, self.up.weight])
        return self

    def project(self, f: torch.Tensor, e: torch.Tensor, pos: torch.Tensor):
        """Rows ``[f; e]`` at ``pos``: the residual stream, q, and this row's k and v."""
        s = self.shape
        h = self.fc(torch.cat([f, e], dim=-1))
        x = _rms(h, self.attn_norm, s.eps)
        T = h.shape[0]
        nq, nkv = s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim
        if self._qkv is not None:
            q_, k_, v_ = F.linear(x, self._qkv).split([nq, nkv, nkv], dim=-1)
        else:
            q_, k_, v_ = self.q(x), self.k(x), self.v(x)
        q = self.rope(q_.reshape(T, s.num_heads, s.head_dim), pos)
        k = self.rope(k_.reshape(T, s.num_kv_heads, s.head_dim), pos)
        return h, q, k, v_.reshape(T, s.num_kv_heads, s.head_dim)

    def finish(self, h: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """After attention ``attn [T, heads * hd]``: the output projection, the MLP, the last norm."""
        s = self.shape
        h = h + self.o(attn)
        x = _rms(h, self.mlp_norm, s.eps)
        if self._gate_up is not None:
            gate, up = F.linear(x, self._gate_up).chunk(2, dim=-1)
        else:
            gate, up = self.gate(x), self.up(x)
        h = h + self.down(F.silu(gate) * up)
        return _rms(h, self.out_norm, s.eps)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        """``q [T, H, hd]`` over ``k, v [S, KV, hd]`` with ``mask [T, S]`` (True: attend; None:
        causal with the T queries as the last T keys) -> ``[T, H * hd]``."""
        T, S = q.shape[0], k.shape[0]
        if mask is None:
            mask = torch.ones(T, S, dtype=torch.bool, device=q.device).tril(S - T)
        out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                                             attn_mask=mask[None, None], enable_gqa=True)[0]
        return out.transpose(0, 1).reshape(T, -1)

    # ---- inference --------------------------------------------------------------------
    def step(self, f: torch.Tensor, e: torch.Tensor, pos: torch.Tensor, k_ctx: torch.Tensor, v_ctx: torch.Tensor,
             mask: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Rows ``(f, e)`` at ``pos`` after the context ``k_ctx, v_ctx [L, KV, hd]``: their
        predicted features and their own k, v. ``mask [T, L + T]`` (None: causal)."""
        h, q, k, v = self.project(f, e, pos)
        out = self.finish(h, self.attend(q, torch.cat([k_ctx, k]), torch.cat([v_ctx, v]), mask))
        return out, k, v

    # ---- training (training-time test) -------------------------------------------------------
    def unrolled(self, feats: torch.Tensor, emb: torch.Tensor, depth: int) -> list[torch.Tensor]:
        """One conversation, ``depth`` draft steps deep at every position at once, as the tree
        uses the draft: ``feats [L, d]`` true features, ``emb [L, d]`` embeddings of tokens
        ``x_1 .. x_L`` (row p: the token after position p). Pass 1 reads true pairs (causal);
        pass j reads at row p the feature pass j-1 predicted at row p-1, attends to the true
        rows up to p-j+1 and to its own draft ancestors (pass i's row p-j+i), exactly what a
        depth-j tree node sees. Returns each pass's predicted features ``[L, d]`` (row p
        predicts ``f_{p+1}``; in pass j rows below j-1 have no root and are garbage)."""
        L = feats.shape[0]
        pos = torch.arange(L, device=feats.device)
        h1, q1, k1, v1 = self.project(feats, emb, pos)
        outs = [self.finish(h1, self.attend(q1, k1, v1, None))]
        ks, vs = [k1], [v1]
        s = self.shape
        rep = s.num_heads // s.num_kv_heads
        scale = 1.0 / math.sqrt(s.head_dim)
        K1 = k1.repeat_interleave(rep, dim=1).transpose(0, 1)  # [H, L, hd]
        V1 = v1.repeat_interleave(rep, dim=1).transpose(0, 1)
        for j in range(2, depth + 1):
            prev = torch.cat([outs[-1][:1] * 0, outs[-1][:-1]])  # row p reads pass j-1's row p-1
            h, q, k, v = self.project(prev, emb, pos)
            ks.append(k)
            vs.append(v)
            qq = q.transpose(0, 1)  # [H, L, hd]
            scores = (qq @ K1.transpose(1, 2)) * scale  # [H, L, L] against the true rows
            allowed = torch.ones(L, L, dtype=torch.bool, device=feats.device).tril(-(j - 1))
            scores = scores.masked_fill(~allowed, float("-inf"))
            diag, dv = [], []
            for i in range(2, j + 1):  # pass i's row p - j + i (its ancestors, then itself)
                shift = j - i
                ki = ks[i - 1].repeat_interleave(rep, dim=1).transpose(0, 1)
                vi = vs[i - 1].repeat_interleave(rep, dim=1).transpose(0, 1)
                ki = torch.cat([ki[:, :1].expand(-1, shift, -1), ki[:, :L - shift]], dim=1) if shift else ki
                vi = torch.cat([vi[:, :1].expand(-1, shift, -1), vi[:, :L - shift]], dim=1) if shift else vi
                diag.append((qq * ki).sum(-1, keepdim=True) * scale)  # [H, L, 1]
                dv.append(vi)
            allsc = torch.cat([scores, *diag], dim=-1)  # rows without a root: only -inf on the true part
            w = torch.softmax(allsc.float(), dim=-1).to(qq.dtype)
            o = w[..., :L] @ V1
            for i, vi in enumerate(dv):
                o = o + w[..., L + i:L + i + 1] * vi
            outs.append(self.finish(h, o.transpose(0, 1).reshape(L, -1)))
        return outs

    # ---- files ------------------------------------------------------------------------
    def save(self, path: str | Path, model_name: str, fingerprint: str, meta: dict | None = None) -> None:
        from safetensors.torch import save_file

        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tensors = {f"eagle.{k}": v.detach().to(torch.bfloat16).contiguous() for k, v in self.state_dict().items()}
        if self.vocab is not None:
            tensors["eagle.vocab"] = self.vocab.to(torch.int32).contiguous()
        shape = {k: getattr(self.shape, k) for k in DraftShape.__slots__}
        save_file(tensors, str(path), metadata={"model": model_name, "fingerprint": fingerprint,
                                               "shape": json.dumps(shape), "tokenloom": json.dumps(meta or {})})

    @classmethod
    def load(cls, path: str | Path) -> EagleDraft:
        from safetensors import safe_open

        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
            if "shape" not in meta:
                raise ConfigError(f"{path}: not an EAGLE draft (no shape in its metadata)")
            draft = cls(DraftShape(**json.loads(meta["shape"])))
            state = {k[len("eagle."):]: f.get_tensor(k).float() for k in f.keys() if k != "eagle.vocab"}
            draft.load_state_dict(state)
            if "eagle.vocab" in f.keys():
                draft.vocab = f.get_tensor("eagle.vocab").to(torch.int64)
            try:
                report = json.loads(meta.get("tokenloom", "{}")) or {}
            except ValueError:
                report = {}
            draft.meta = {"model": meta.get("model", "?"), "fingerprint": meta.get("fingerprint", ""), **report}
        return draft.eval().requires_grad_(False)


def find_draft(path: str | None, model_name: str, fingerprint: str) -> Path:
    """The draft file for this target (see the module's docstring), or ConfigError saying
    where it looked."""
    if path:
        if not Path(path).exists():
            raise ConfigError(f"decoder.draft: no file at {path}")
        return Path(path)
    cached = default_draft_path(model_name)
    if cached.exists():
        return cached
    if SHIPPED_DRAFTS.is_dir():
        from safetensors import safe_open

        for p in sorted(SHIPPED_DRAFTS.glob("*.safetensors")):
            with safe_open(str(p), framework="pt") as f:
                if (f.metadata() or {}).get("fingerprint") == fingerprint:
                    return p
    raise ConfigError(f"decoder 'eagle': no draft for this model ({model_name!r}, fingerprint {fingerprint}) at "
                      f"{cached} or among the shipped drafts; train one with `tokenloom train-eagle` or set decoder.draft")


class EagleOptions(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    draft: str | None = None  # safetensors file; default: find_draft
    depth: int = 6  # deepest draft
    topk: int = 6  # candidates per expanded node, and nodes expanded per depth
    tree_nodes: int = 16  # nodes verified per step (batch 1; divided among drafting sequences)
    min_tree_nodes: int = 4
    adaptive: bool = True  # depth follows the accepted length
    # the draft chooses among the draft vocabulary's first N tokens (stored with the draft);
    # None: all it holds; 0: the whole output head
    draft_vocab: int | None = None
    max_batch: int = 4


@dataclass(eq=False, slots=True)
class _State:
    """One sequence's draft: KV rows for its committed pairs, and target features not yet paired."""

    k: torch.Tensor  # [cap, KV, hd]
    v: torch.Tensor
    committed: int = 0  # pairs (f_p, x_{p+1}) whose KV rows are in k, v: base <= p < committed
    base: int = 0  # the first position the draft saw (after a prefix-cache hit, not 0); row p - base
    feats: list[torch.Tensor] = field(default_factory=list)  # features f_p for p >= committed, in order
    known: int = 0  # features known: p < known
    accepted: float = 2.0  # average tree nodes kept per step


class EagleDecoder(SharedStepDecoder):
    name = "eagle"
    needs_hidden = "all"

    def __init__(self, options: EagleOptions | None, context: DecoderContext):
        super().__init__(options, context)
        o = self.opts = options or EagleOptions()
        if self.executor.world_size > 1:
            raise ConfigError(f"decoder 'eagle' reads the whole output head and embedding on one rank; it does not run "
                              f"with tensor_parallel_size {self.executor.world_size}")
        if not 1 <= o.depth <= MAX_SPECULATIVE_TOKENS:
            raise ConfigError(f"decoder.depth must be in 1..{MAX_SPECULATIVE_TOKENS}, got {o.depth}")
        if not 1 <= o.topk <= 32:
            raise ConfigError(f"decoder.topk must be in 1..32, got {o.topk}")
        if not 1 <= o.min_tree_nodes <= o.tree_nodes <= 64:
            raise ConfigError(f"decoder.min_tree_nodes and tree_nodes must satisfy 1 <= min <= tree_nodes <= 64, "
                              f"got {o.min_tree_nodes} and {o.tree_nodes}")
        if o.draft_vocab is not None and o.draft_vocab < 0:
            raise ConfigError(f"decoder.draft_vocab must be >= 0, got {o.draft_vocab}")
        model = self.runner.model
        self.fingerprint = model_fingerprint(model)
        path = find_draft(o.draft, context.model_name, self.fingerprint)
        draft = EagleDraft.load(path)
        if draft.meta.get("fingerprint") != self.fingerprint:
            raise ConfigError(f"decoder 'eagle': the draft at {path} was trained for {draft.meta.get('model')!r} "
                              f"(fingerprint {draft.meta.get('fingerprint')}), not for this model "
                              f"{context.model_name!r} (fingerprint {self.fingerprint})")
        if draft.shape.hidden_size != model.cfg.hidden_size:
            raise ConfigError(f"decoder 'eagle': the draft's hidden size {draft.shape.hidden_size} is not the model's "
                              f"{model.cfg.hidden_size}")
        self.path = path
        # bf16 where the hardware has it: drafts need no more, exactness comes from verification
        self.dtype = pick_dtype("auto", self.runner.device)
        self.draft = draft.to(self.runner.device, self.dtype).fuse()
        self.default_k, self.max_batch = o.depth, o.max_batch
        vocab = draft.vocab if o.draft_vocab != 0 else None
        if vocab is not None and o.draft_vocab:
            vocab = vocab[: o.draft_vocab]
        self.vocab = vocab.to(self.runner.device) if vocab is not None and len(vocab) >= o.topk else None
        ids = self.vocab if self.vocab is not None else torch.arange(model.cfg.vocab_size, device=self.runner.device)
        self.head = output_head_rows(model, ids).to(self.dtype)  # [K, d] rows the draft scores
        self._states: dict[int, _State] = {}
        self._trees = [0, 0, 0]  # trees drafted, their nodes, their depths

    def extra_stats(self) -> dict[str, float]:
        n, nodes, depth = self._trees
        return {"eagle_trees": n, "eagle_mean_tree_nodes": nodes / n, "eagle_mean_depth": depth / n} if n else {}

    def model_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.draft.parameters()) + \
            self.head.numel() * self.head.element_size()

    def release_state(self, seq: Sequence) -> None:
        self._states.pop(seq.seq_id, None)

    def _state(self, seq: Sequence) -> _State:
        st = self._states.get(seq.seq_id)
        if st is None:
            s = self.draft.shape
            z = torch.empty(256, s.num_kv_heads, s.head_dim, dtype=self.dtype, device=self.runner.device)
            st = self._states[seq.seq_id] = _State(z, z.clone())
        return st

    # ---- features ----------------------------------------------------------------------
    def observe(self, batch: Batch, forward: ForwardOutput, result: DecoderOutput, seqs: list[Sequence]) -> None:
        """Keep the target's features of every position this step computed for ``seqs``: the
        scheduled tokens' rows, and the accepted drafts' (a preempted or rolled-back sequence
        starts again from the first position recomputed). In a step too big to draft in
        (``max_batch``), unseeded sequences keep nothing: they will not draft next, and when
        they do again the draft starts over from there."""
        if forward.step_hidden is None:
            return
        big = len(forward.seqs) > self.max_batch
        index = {seq.seq_id: i for i, seq in enumerate(batch.seqs)}
        rows: list[int] = []
        spans: list[tuple[Sequence, int]] = []
        for seq in seqs:
            first = forward.first_row.get(seq.seq_id)
            if first is None or (big and seq.params.seed is None):
                continue
            n = batch.num_scheduled_tokens[index[seq.seq_id]]
            mine = list(range(first, first + n))
            out = result.get(seq)
            if out is not None and out.num_accepted:
                nodes = out.accepted_nodes if out.accepted_nodes else list(range(out.num_accepted))
                mine += [first + n + node for node in nodes]
            rows += mine
            spans.append((seq, len(mine)))
        if not rows:
            return
        h = forward.step_hidden
        feats = normalise(self.runner.model, h[torch.tensor(rows, device=h.device)]).to(self.dtype)
        at = 0
        for seq, n in spans:
            st = self._state(seq)
            start = seq.num_computed_tokens
            if start < st.known:  # recomputed (preemption): forget from there
                self._truncate(st, start)
            if start > st.known:  # positions the draft never saw (a prefix-cache hit, a big batch)
                self._truncate(st, 0)
                st.known = st.committed = st.base = start  # the draft attends only to what it saw from here
            st.feats.append(feats[at:at + n])
            st.known += n
            at += n

    @staticmethod
    def _truncate(st: _State, at: int) -> None:
        if at < st.base:
            st.base = at = 0
        st.committed = min(st.committed, at)
        keep = at - st.committed  # pending features before ``at``
        pending = torch.cat(st.feats) if st.feats else None
        st.feats = [pending[:keep]] if pending is not None and keep > 0 else []
        st.known = min(st.known, at)

    # ---- proposing -------------------------------------------------------------------------
    @torch.inference_mode()
    def propose(self, seqs: list[Sequence], outputs: DecoderOutput, forward: ForwardOutput) -> None:
        shared = max(self.opts.min_tree_nodes, self.opts.tree_nodes // max(1, len(seqs)))
        for seq in seqs:
            seq.draft_token_ids, seq.draft_parents = [], None
            out = outputs[seq]
            st = self._state(seq)
            if out.num_drafted and out.drafted_by in (None, self.name):
                st.accepted += 0.3 * (out.num_accepted - st.accepted)
            tokens = seq.token_ids + out.token_ids
            room = min(self.num_speculative_tokens(seq), seq.max_len - len(tokens) - 1)
            if room <= 0 or st.known != len(tokens) - 1:
                continue  # features missing (should not happen): decode plainly this step
            root = self._catch_up(st, tokens)
            depth = room
            if self.opts.adaptive and seq.params.num_speculative_tokens is None:
                depth = max(2, min(room, round(st.accepted) + 2))
            # a seeded request's tree never depends on the batch (its draws follow the tree)
            budget = self.opts.tree_nodes if seq.params.seed is not None else shared
            drafts, parents = self._grow(st, root, len(tokens) - 1, depth, budget)
            seq.draft_token_ids, seq.draft_parents = drafts, parents
            self._trees[0] += 1
            self._trees[1] += len(drafts)
            self._trees[2] += depth

    def _emb(self, ids) -> torch.Tensor:
        model = self.runner.model
        t = torch.as_tensor(ids, device=model.embed.device)
        return model.embed[t].to(self.dtype)

    def _catch_up(self, st: _State, tokens: list[int]) -> torch.Tensor:
        """Run the draft over the pairs not yet committed (true features, true tokens): their
        KV joins the cache; returns the last one's (the root's) predicted feature."""
        f = torch.cat(st.feats)
        n = f.shape[0]
        start, row = st.committed, st.committed - st.base
        pos = torch.arange(start, start + n, device=f.device)
        out, k, v = self.draft.step(f, self._emb(tokens[start + 1:start + 1 + n]), pos, st.k[:row], st.v[:row], None)
        if row + n > st.k.shape[0]:
            cap = max(2 * st.k.shape[0], row + n + 64)
            for name in ("k", "v"):
                old = getattr(st, name)
                new = old.new_empty(cap, *old.shape[1:])
                new[:row] = old[:row]
                setattr(st, name, new)
        st.k[row:row + n] = k
        st.v[row:row + n] = v
        st.committed, st.feats = start + n, []
        return out[-1:]

    def _top(self, f: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The ``k`` best next tokens of predicted features ``f [m, d]``: (log-probs, token ids)."""
        logp = torch.log_softmax((f @ self.head.T).float(), dim=-1)
        vals, idx = logp.topk(k, dim=-1)
        return vals, (self.vocab[idx] if self.vocab is not None else idx)

    def _grow(self, st: _State, root: torch.Tensor, root_pos: int, depth: int, budget: int
              ) -> tuple[list[int], list[int]]:
        """EAGLE-2's dynamic tree: returns the chosen nodes' tokens and parents, depth by depth."""
        topk = self.opts.topk
        L = st.committed - st.base
        ctx_k, ctx_v = st.k[:L], st.v[:L]
        # every candidate: token, parent candidate (-1: the root), cumulative log-prob, depth
        tok: list[int] = []
        par: list[int] = []
        score: list[float] = []
        dep: list[int] = []
        vals, ids = self._top(root, topk)
        for s_, t in zip(vals[0].tolist(), ids[0].tolist(), strict=True):
            tok.append(t); par.append(-1); score.append(s_); dep.append(1)  # noqa: E702
        frontier = list(range(len(tok)))  # candidates of the deepest level
        feat_of: dict[int, torch.Tensor] = {}  # an expanded candidate's predicted feature
        kv_row: dict[int, int] = {}  # an expanded candidate's row in the tree KV
        tree_k: list[torch.Tensor] = []
        tree_v: list[torch.Tensor] = []
        parent_feat = {-1: root[0]}
        for level in range(1, depth):
            expand = sorted(frontier, key=lambda c: -score[c])[:topk]
            if not expand:
                break
            f = torch.stack([parent_feat[par[c]] if par[c] == -1 else feat_of[par[c]] for c in expand])
            pos = torch.full((len(expand),), root_pos + level, device=f.device)
            n_tree = sum(t.shape[0] for t in tree_k)
            mask = torch.zeros(len(expand), L + n_tree + len(expand), dtype=torch.bool, device=f.device)
            mask[:, :L] = True
            for r, c in enumerate(expand):
                a = par[c]
                while a != -1:
                    mask[r, L + kv_row[a]] = True
                    a = par[a]
                mask[r, L + n_tree + r] = True
            kk = torch.cat([ctx_k, *tree_k]) if tree_k else ctx_k
            vv = torch.cat([ctx_v, *tree_v]) if tree_v else ctx_v
            out, k, v = self.draft.step(f, self._emb([tok[c] for c in expand]), pos, kk, vv, mask)
            for r, c in enumerate(expand):
                feat_of[c] = out[r]
                kv_row[c] = n_tree + r
            tree_k.append(k)
            tree_v.append(v)
            vals, ids = self._top(out, topk)
            frontier = []
            for r, c in enumerate(expand):
                for s_, t in zip(vals[r].tolist(), ids[r].tolist(), strict=True):
                    frontier.append(len(tok))
                    tok.append(t); par.append(c); score.append(score[c] + s_); dep.append(level + 1)  # noqa: E702
        chosen, keep = [], set()
        for c in sorted(range(len(tok)), key=lambda c: (-score[c], dep[c])):
            if par[c] == -1 or par[c] in keep:  # closed under ancestors (ties could break it)
                chosen.append(c)
                keep.add(c)
                if len(chosen) == budget:
                    break
        chosen.sort(key=lambda c: (dep[c], -score[c]))
        where = {c: i for i, c in enumerate(chosen)}
        return [tok[c] for c in chosen], [where[par[c]] if par[c] != -1 else -1 for c in chosen]


@hookimpl
def register_decoders(register):
    register("eagle", EagleDecoder, options=EagleOptions,
             description="an EAGLE draft layer over the target's features grows a tree of drafts, verified exactly "
                         "(`tokenloom train-eagle` makes the draft; one ships for the embedded model)")
