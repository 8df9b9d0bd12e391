"""`medusa`: extra decoding heads on the target's last hidden state propose the next tokens
(Cai et al. 2024, "Medusa: Simple LLM Inference Acceleration Framework with Multiple
Decoding Heads", arXiv:2401.10774). No draft model: the heads run on the hidden state the
verification forward already computed.

Head ``i`` (0-based) reads the hidden state of the row that produced a step's last token
``x`` and guesses the token ``i + 1`` places after ``x``: a residual block on the
normalised state, ``h_i = x_n + SiLU(W_i [x_n; e_x] + b_i)`` with ``x_n = RMSNorm(h)``,
then the model's own (frozen) output head. ``e_x`` is the (normalised) embedding of ``x``
itself: the hidden state only says which tokens were likely, while ``x`` is the one
chosen, and every later guess depends on it (the sequential dependence Hydra, Ankner et
al. 2024, arXiv:2402.05109, adds to Medusa; here only the first link of it, so one head
evaluation per sequence still serves the whole tree). ``W_i`` and ``b_i`` start at zero,
so an untrained head repeats the base model's guess; `tokenloom train-medusa` trains them
by self-distillation.

Candidates form a tree (``tree``: paths of per-head top-k ranks, Medusa's "sparse tree";
``tree = []`` proposes a chain of each head's best; by default the ``tree_nodes`` nodes
:func:`best_tree` picks from the held-out accuracies `train-medusa` stores with the heads):
a node's token is head ``d-1``'s
choice at the node's depth ``d``, and siblings differ. The target scores every node in one
forward, each node seeing only its own ancestors (``Batch.draft_parents``), and
``accept_tree`` keeps the longest branch that rejection sampling accepts, so the output
distribution is still exactly the target's. The accepted branch's KV then moves from the
lookahead slots into place (``Backend.move_kv_slots``).

Heads live in a safetensors file (``medusa.{i}.weight``, ``medusa.{i}.bias``) whose
metadata names the model they were trained for; by default
``~/.cache/tokenloom/medusa/<model name>.safetensors``, where `train-medusa` writes.
"""

from __future__ import annotations

import json
from pathlib import Path

import msgspec
import torch

from tokenloom.core import env
from tokenloom.core.errors import ConfigError
from tokenloom.core.hookspecs import hookimpl
from tokenloom.core.interfaces import DecoderContext, DecoderOutput
from tokenloom.core.runner import ForwardOutput, pick_dtype
from tokenloom.core.sampling_params import MAX_SPECULATIVE_TOKENS
from tokenloom.core.sequence import Sequence
from tokenloom.plugins.decoders.base import SharedStepDecoder


def default_heads_path(model_name: str) -> Path:
    root = env.cache_dir()
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in model_name)
    return root / "medusa" / f"{safe}.safetensors"


class MedusaHeads(torch.nn.Module):
    """``num_heads`` residual blocks over the normalised hidden state: ``x + SiLU(W [x; e] + b)``,
    where ``e`` is the normalised embedding of the token that hidden state produced
    (``token_input``; older heads read ``x`` alone). ``sequential`` heads (Hydra's
    sequential dependence) read more: head ``i`` reads ``[x; e_1; ...; e_{i+1}]``, the token
    produced and the i draft tokens before its own guess on the candidate's path, so each
    node of the tree is guessed from its own branch (one head call per depth). Their
    weights are stored padded to the widest head (``[H, d, d (H + 1)]``), head ``i`` using
    the first ``d (i + 2)`` columns."""

    def __init__(self, num_heads: int, hidden_size: int, token_input: bool = True, sequential: bool = False):
        super().__init__()
        if sequential and not token_input:
            raise ValueError("sequential heads read tokens: token_input must be on")
        self.token_input, self.sequential = token_input, sequential
        inputs = hidden_size * ((num_heads + 1) if sequential else (2 if token_input else 1))
        self.weight = torch.nn.Parameter(torch.zeros(num_heads, hidden_size, inputs))
        self.bias = torch.nn.Parameter(torch.zeros(num_heads, hidden_size))
        self.meta: dict = {}  # what train-medusa reported (held-out accuracies, ...)
        # the draft vocabulary: token ids the heads choose among, most frequent first (None: all)
        self.vocab: torch.Tensor | None = None

    @property
    def num_heads(self) -> int:
        return self.weight.shape[0]

    def width(self, i: int) -> int:
        """Input columns head ``i`` reads."""
        d = self.weight.shape[1]
        return d * (i + 2) if self.sequential else self.weight.shape[2]

    def forward(self, x: torch.Tensor, e: torch.Tensor | None = None) -> torch.Tensor:
        """``x [N, d]`` normalised hidden states; ``e`` the token features
        (:func:`token_features`) of what each produced, ``[N, d]`` (``token_input`` heads), or
        for ``sequential`` heads ``[N, H, d]``: that token, then the true next ones (training)
        -> ``[H, N, d]``."""
        if self.sequential:
            return torch.stack([self.head(i, x, e[:, :i + 1]) for i in range(self.num_heads)])
        inp = torch.cat([x, e], dim=-1) if self.token_input else x
        z = torch.einsum("nk,hdk->hnd", inp, self.weight) + self.bias[:, None, :]
        return x[None] + torch.nn.functional.silu(z)

    def head(self, i: int, x: torch.Tensor, e: torch.Tensor | None) -> torch.Tensor:
        """Head ``i`` alone: ``x [N, d]``, ``e [N, k, d]`` (k = i + 1 tokens if sequential, else 1)."""
        inp = x if e is None else torch.cat([x, e.flatten(1)], dim=-1)
        z = inp @ self.weight[i, :, :inp.shape[1]].T + self.bias[i]
        return x + torch.nn.functional.silu(z)

    def save(self, path: str | Path, model_name: str, meta: dict | None = None) -> None:
        from safetensors.torch import save_file

        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tensors = {}
        for i in range(self.num_heads):
            tensors[f"medusa.{i}.weight"] = self.weight[i, :, :self.width(i)].detach().float().contiguous()
            tensors[f"medusa.{i}.bias"] = self.bias[i].detach().float().contiguous()
        if self.vocab is not None:
            tensors["medusa.vocab"] = self.vocab.to(torch.int64).contiguous()
        save_file(tensors, str(path), metadata={"model": model_name, "num_heads": str(self.num_heads),
                                               "hidden_size": str(self.weight.shape[1]),
                                               "token_input": str(int(self.token_input)),
                                               "sequential": str(int(self.sequential)),
                                               "tokenloom": json.dumps(meta or {})})

    @classmethod
    def load(cls, path: str | Path, hidden_size: int) -> MedusaHeads:
        from safetensors import safe_open

        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
            n = int(meta.get("num_heads", 0))
            if n < 1 or int(meta.get("hidden_size", -1)) != hidden_size:
                raise ConfigError(f"{path}: Medusa heads for hidden size {meta.get('hidden_size')} "
                                  f"({n} heads); this model's is {hidden_size}")
            heads = cls(n, hidden_size, token_input=meta.get("token_input", "0") == "1",
                        sequential=meta.get("sequential", "0") == "1")
            try:
                heads.meta = json.loads(meta.get("tokenloom", "{}")) or {}
            except ValueError:
                heads.meta = {}
            with torch.no_grad():
                for i in range(n):
                    heads.weight[i, :, :heads.width(i)].copy_(f.get_tensor(f"medusa.{i}.weight"))
                    heads.bias[i].copy_(f.get_tensor(f"medusa.{i}.bias"))
            if "medusa.vocab" in f.keys():
                heads.vocab = f.get_tensor("medusa.vocab").to(torch.int64)
        return heads.eval().requires_grad_(False)


@torch.inference_mode()
def output_head_rows(model, ids: torch.Tensor) -> torch.Tensor:
    """Rows ``ids`` of the model's output head as dense float32 ``[K, d]``, whatever kind of
    weight packs it (read back by applying it to the identity, in chunks)."""
    d = model.cfg.hidden_size
    eye = torch.eye(d, dtype=model.dtype, device=ids.device)
    cols = [model.lm_logits(eye[i:i + 64])[:, ids] for i in range(0, d, 64)]  # [64, K] each
    return torch.cat(cols).T.contiguous()


def token_features(embedding_rows: torch.Tensor) -> torch.Tensor:
    """What a head reads of a token: its input embedding, RMS-normalised (float32)."""
    e = embedding_rows.float()
    return torch.nn.functional.rms_norm(e, (e.shape[-1],))


def normalise(model, h: torch.Tensor) -> torch.Tensor:
    """What the model's output head sees: the final RMSNorm of hidden states ``h``."""
    return model.backend.rms_norm(h, model.norm, model.cfg.rms_norm_eps).float()


#: the candidate tree for heads that carry no held-out accuracies: each path lists, per
#: depth, which of that head's top tokens to take (0 = best); nodes share their ancestors
DEFAULT_TREE = ((0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (0, 0, 0, 0))


def best_tree(rank_accuracy: list[list[float]], num_nodes: int) -> list[tuple[int, ...]]:
    """The ``num_nodes`` paths that maximise the expected number of accepted drafts
    (Medusa, section 3.1.2 / appendix: the tree from measured accuracies).

    ``rank_accuracy[i][r]`` is how often head ``i``'s ``r``-th best guess was the right
    token on held-out text. Taking the heads as independent, the path ``(r0, r1, ...)``
    is accepted with probability ``prod_i rank_accuracy[i][r_i]``, and a tree accepts in
    expectation the sum of its nodes' probabilities. A node's probability never exceeds
    its parent's, so taking the best nodes one at a time from the frontier gives a tree
    closed under ancestors, and the best one of its size."""
    import heapq

    depth, ranks = len(rank_accuracy), len(rank_accuracy[0]) if rank_accuracy else 0
    frontier = [(-rank_accuracy[0][r], (r,)) for r in range(ranks)] if depth else []
    heapq.heapify(frontier)
    chosen: list[tuple[int, ...]] = []
    while frontier and len(chosen) < num_nodes:
        neg, path = heapq.heappop(frontier)
        chosen.append(path)
        if len(path) < depth:
            for r in range(ranks):
                heapq.heappush(frontier, (neg * rank_accuracy[len(path)][r], path + (r,)))
    return chosen


def expected_accepted(rank_accuracy: list[list[float]], paths: list[tuple[int, ...]]) -> float:
    """Drafts a tree of ``paths`` is expected to get accepted per step (independent heads)."""
    total = 0.0
    for p in paths:
        v = 1.0
        for i, r in enumerate(p):
            v *= rank_accuracy[i][r]
        total += v
    return total


class MedusaOptions(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    heads: str | None = None  # safetensors file; default: default_heads_path(model name)
    num_speculative_tokens: int | None = None  # deepest draft (default: every head)
    tree: list[list[int]] | None = None  # None: best_tree(tree_nodes) from the heads' file; []: a chain
    tree_nodes: int = 8  # size of the tree built from held-out accuracies (tree = None)
    # the heads choose among the draft vocabulary's first N tokens (the most frequent in their
    # training answers, stored with the heads); None: all it holds; 0: the whole vocabulary
    draft_vocab: int | None = None
    max_batch: int = 4


def tree_layout(paths: list[tuple[int, ...]]) -> tuple[list[tuple[int, ...]], list[int]]:
    """Paths ordered depth by depth, and each one's parent index (-1: the last token).
    Every prefix of a path must itself be a path (the tree is closed under ancestors)."""
    order = sorted(set(paths), key=lambda p: (len(p), p))
    index = {p: i for i, p in enumerate(order)}
    parents = []
    for p in order:
        if len(p) > 1 and p[:-1] not in index:
            raise ConfigError(f"decoder.tree: path {list(p)} has no parent {list(p[:-1])} in the tree")
        parents.append(index[p[:-1]] if len(p) > 1 else -1)
    return order, parents


class MedusaDecoder(SharedStepDecoder):
    name = "medusa"
    needs_hidden = True

    def __init__(self, options: MedusaOptions | None, context: DecoderContext):
        super().__init__(options, context)
        o = options or MedusaOptions()
        if self.executor.world_size > 1:
            raise ConfigError(f"decoder 'medusa' reads the whole output head and embedding on one rank; it does not run "
                              f"with tensor_parallel_size {self.executor.world_size}")
        model = self.runner.model
        path = Path(o.heads) if o.heads else default_heads_path(context.model_name)
        if not path.exists():
            raise ConfigError(f"decoder 'medusa': no heads at {path}; train them with `tokenloom train-medusa` "
                              "or set decoder.heads")
        self.heads = MedusaHeads.load(path, model.cfg.hidden_size).to(self.runner.device)
        k = o.num_speculative_tokens if o.num_speculative_tokens is not None else self.heads.num_heads
        if not 0 <= k <= min(self.heads.num_heads, MAX_SPECULATIVE_TOKENS):
            raise ConfigError(f"decoder.num_speculative_tokens must be in 0..{self.heads.num_heads} (the heads), got {k}")
        self.default_k, self.max_batch = k, o.max_batch
        if not 1 <= o.tree_nodes <= 64:
            raise ConfigError(f"decoder.tree_nodes must be in 1..64, got {o.tree_nodes}")
        rank_accuracy = self.heads.meta.get("heldout_rank_accuracy")
        if o.tree is not None:
            paths = [tuple(p) for p in o.tree]
        elif rank_accuracy:
            paths = best_tree(rank_accuracy[: self.heads.num_heads], o.tree_nodes)
        else:
            paths = [q for q in DEFAULT_TREE if len(q) <= self.heads.num_heads]
        if any(not p or min(p) < 0 for p in paths):
            raise ConfigError("decoder.tree: each path is a non-empty list of ranks >= 0")
        if paths and max(map(len, paths)) > self.heads.num_heads:
            raise ConfigError(f"decoder.tree is {max(map(len, paths))} deep; there are {self.heads.num_heads} heads")
        self.paths, self.parents = tree_layout(paths) if paths else ([], [])
        # Draft vocabulary (FR-Spec, Zhao et al. 2025, arXiv:2502.14856): the heads' logits over
        # the most frequent tokens only, a dense [K, d] slice of the output head, instead of
        # the whole head (at 49,152 x 576 it costs a sixth of a decode step). A token outside
        # it is never proposed; what is accepted stays exact.
        self.vocab = self.vocab_head = None
        if o.draft_vocab is not None and o.draft_vocab < 0:
            raise ConfigError(f"decoder.draft_vocab must be >= 0, got {o.draft_vocab}")
        ranks = 1 + max((max(p) for p in self.paths), default=0)  # the widest choice a node makes
        vocab = self.heads.vocab
        if vocab is not None and o.draft_vocab is not None:
            vocab = vocab[: o.draft_vocab]
        if vocab is not None and o.draft_vocab != 0 and len(vocab) >= ranks:
            self.vocab = vocab.to(self.runner.device)
            # bf16 where the hardware has it (a 4-row GEMM in fp32 ran at a third of bf16's
            # speed here): drafts need no more, exactness comes from verification
            self.vocab_head = output_head_rows(model, self.vocab).to(pick_dtype("auto", self.runner.device))

    @torch.inference_mode()
    def propose(self, seqs: list[Sequence], outputs: DecoderOutput, forward: ForwardOutput) -> None:
        """A tree (``tree`` paths deeper than K dropped) or a chain of each head's best."""
        starts, at = {}, 0
        for s, n in zip(forward.seqs, forward.num_rows, strict=True):
            starts[s] = at
            at += n
        want = [(seq, min(self.num_speculative_tokens(seq), self.heads.num_heads,
                          seq.max_len - seq.num_tokens - len(outputs[seq].token_ids) - 1)) for seq in seqs]
        for seq, _ in want:
            seq.draft_token_ids, seq.draft_parents = [], None
        want = [(seq, k) for seq, k in want if k > 0]
        if not want or forward.hidden is None:
            return
        model = self.runner.model
        # the row that produced the step's last token: the last accepted node's (a tree), or
        # the one after the accepted drafts (a chain)
        rows = torch.tensor([starts[seq] + (outputs[seq].accepted_nodes[-1] + 1 if outputs[seq].accepted_nodes
                                            else outputs[seq].num_accepted) for seq, _ in want],
                            device=forward.hidden.device)
        x = normalise(model, forward.hidden[rows])
        last = [outputs[seq].token_ids[-1] for seq, _ in want]  # the token each of those rows produced
        ranks = 1 + max((max(p) for p in self.paths), default=0)
        if self.heads.sequential:
            self._propose_by_depth(want, x, last, ranks)
            return
        e = token_features(model.embed[torch.tensor(last, device=model.embed.device)]) if self.heads.token_input else None
        h = self.heads(x, e)  # [H, S, d]
        top = self._top(h.reshape(-1, h.shape[-1]), ranks).view(self.heads.num_heads, len(want), ranks)
        top = top.transpose(0, 1).tolist()  # [S][H][ranks]
        for (seq, k), guesses in zip(want, top, strict=True):
            if not self.paths:
                seq.draft_token_ids = [guesses[i][0] for i in range(k)]
                continue
            keep = [i for i, p in enumerate(self.paths) if len(p) <= k]  # a prefix: paths go depth by depth
            seq.draft_token_ids = [guesses[len(self.paths[i]) - 1][self.paths[i][-1]] for i in keep]
            seq.draft_parents = [self.parents[i] for i in keep]

    def _top(self, h: torch.Tensor, ranks: int) -> torch.Tensor:
        """The ``ranks`` best token ids for each head state ``h [N, d]`` -> ``[N, ranks]``."""
        if self.vocab_head is not None:  # over the draft vocabulary
            logits = torch.nn.functional.linear(h.to(self.vocab_head.dtype), self.vocab_head)
        else:
            logits = self.runner.model.lm_logits(h)
        top = logits.topk(ranks, dim=-1).indices
        return self.vocab[top] if self.vocab is not None else top

    def _propose_by_depth(self, want: list, x: torch.Tensor, last: list[int], ranks: int) -> None:
        """Sequential heads: depth by depth, each node's children guessed by the next head
        from the node's own branch (the chain: each depth's best)."""
        model = self.runner.model
        paths = self.paths or [(0,) * (d + 1) for d in range(self.heads.num_heads)]
        tokens: list[dict[tuple, int]] = [{} for _ in want]  # per sequence: path -> its token
        for depth in range(1, max(map(len, paths)) + 1):
            # the nodes whose children this depth holds: (sequence, parent path) pairs
            parents = sorted({p[:-1] for p in paths if len(p) == depth})
            rows = [(s, q) for s, (_, k) in enumerate(want) if depth <= k for q in parents]
            if not rows:
                break
            branch = torch.tensor([[last[s], *(tokens[s][q[:j]] for j in range(1, depth))] for s, q in rows],
                                  device=model.embed.device)  # [R, depth] token ids
            h = self.heads.head(depth - 1, x[torch.tensor([s for s, _ in rows], device=x.device)],
                                token_features(model.embed[branch]))
            for (s, q), guesses in zip(rows, self._top(h, ranks).tolist(), strict=True):
                for p in paths:
                    if len(p) == depth and p[:-1] == q:
                        tokens[s][p] = guesses[p[-1]]
        for s, (seq, k) in enumerate(want):
            keep = [i for i, p in enumerate(paths) if len(p) <= k]
            seq.draft_token_ids = [tokens[s][paths[i]] for i in keep]
            seq.draft_parents = [self.parents[i] for i in keep] if self.paths else None


@hookimpl
def register_decoders(register):
    register("medusa", MedusaDecoder, options=MedusaOptions,
             description="Medusa heads on the last hidden state propose a chain, verified exactly "
                         "(`tokenloom train-medusa` makes the heads)")
