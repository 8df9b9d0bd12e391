"""ModelRunner: a Batch in, logits out. Owns the model, the KV tensors and the sampler."""

from __future__ import annotations

from collections.abc import Callable

import torch

from tokenloom.core.attention import AttentionInputs, PrefillSpan
from tokenloom.core.loader import LoadedCheckpoint
from tokenloom.core.models.llama import LlamaModel
from tokenloom.core.sampler import Sampler
from tokenloom.core.sequence import Batch, Sequence

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
KV_SCALE_BYTES = 2  # a quantised KV pool's bfloat16 scale per token per head (backends/torch_backend.py)


def pick_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """``auto``: bfloat16 where the hardware computes it natively (CUDA, or a CPU with
    AVX512-BF16/AMX), else float32 -- on an AVX2-only CPU bf16 matmuls are emulated and
    2-4x slower than fp32 at batch sizes above one."""
    if dtype != "auto":
        return DTYPES[dtype]
    if device.type == "cuda":
        return torch.bfloat16
    native = getattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)() or \
        getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)()
    return torch.bfloat16 if native else torch.float32


def pick_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


class ModelRunner:
    def __init__(self, checkpoint: LoadedCheckpoint, *, backend, quantizer, dtype: torch.dtype,
                 device: torch.device, block_size: int, max_model_len: int, seed: int = 0):
        """Build the model on ``device`` and load it (each matmul through ``quantizer``,
        packed by ``backend``). The KV pool comes after: :meth:`allocate_kv_cache`."""
        self.cfg = checkpoint.config
        self.backend, self.dtype, self.device = backend, dtype, device
        self.block_size, self.max_model_len = block_size, max_model_len
        self.model = LlamaModel(self.cfg, dtype, backend, max_model_len).to(device)
        self.model.load_weights(checkpoint.weights, quantizer, checkpoint.quant_config)  # takes (empties) the checkpoint's tensors
        self.num_blocks = 0
        self.kv_caches: list = []
        self.sampler = Sampler(seed, device)

    def allocate_kv_cache(self, num_blocks: int, kv_cache_dtype: str = "auto") -> None:
        """``kv_cache_dtype``: ``auto`` (the model dtype) or an 8-bit storage, ``fp8`` or ``int8``."""
        self.num_blocks = num_blocks
        self.kv_caches = self.backend.allocate_kv_cache(self.cfg.num_layers, num_blocks, self.block_size,
                                                        self.cfg.num_kv_heads, self.cfg.head_dim, self.dtype,
                                                        kv_cache_dtype)

    @staticmethod
    def kv_bytes_per_token(cfg, dtype: torch.dtype, kv_cache_dtype: str = "auto") -> int:
        """KV pool bytes one token takes over all layers. fp8/int8: one byte per element plus
        one bfloat16 scale per token per kv head, for K and for V (the torch backend's layout)."""
        if kv_cache_dtype == "auto":
            return cfg.kv_bytes_per_token(torch.finfo(dtype).bits // 8)
        return cfg.kv_bytes_per_token(1) + 2 * cfg.num_layers * cfg.num_kv_heads * KV_SCALE_BYTES

    @staticmethod
    def num_blocks_for(cfg, dtype: torch.dtype, block_size: int, memory_mb: int, kv_cache_dtype: str = "auto") -> int:
        per_block = ModelRunner.kv_bytes_per_token(cfg, dtype, kv_cache_dtype) * block_size
        return max(1, (memory_mb << 20) // per_block)

    def prepare(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor, AttentionInputs, list[int], list[Sequence]]:
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        attn = AttentionInputs(slot_mapping=None, block_size=bs)  # type: ignore[arg-type]
        sample_rows: list[int] = []
        sample_seqs: list[Sequence] = []
        for seq, n, table in zip(batch.seqs, batch.num_scheduled_tokens, batch.block_tables, strict=True):
            start, row = seq.num_computed_tokens, len(input_ids)
            end = start + n
            input_ids.extend(seq.token_ids[start:end])
            positions.extend(range(start, end))
            slots.extend(table[p // bs] * bs + p % bs for p in range(start, end))
            if n == 1 and start > 0:
                attn.decode_rows.append(row)
                attn.decode_context_lens.append(end)
                attn.decode_block_tables.append(table)
            else:
                attn.prefills.append(PrefillSpan(row, row + n, end, table))
            if end == seq.num_tokens:  # reached the end: this sequence samples a token
                sample_rows.append(row + n - 1)
                sample_seqs.append(seq)
        dev = self.device
        attn.slot_mapping = torch.tensor(slots, dtype=torch.long, device=dev)
        return (torch.tensor(input_ids, dtype=torch.long, device=dev),
                torch.tensor(positions, dtype=torch.long, device=dev), attn, sample_rows, sample_seqs)

    @torch.inference_mode()
    def forward(self, batch: Batch) -> tuple[torch.Tensor | None, list[Sequence]]:
        """Run the batch; return logits [S, V] for the S sequences that sample this step."""
        if batch.copies:
            self.backend.copy_blocks(self.kv_caches, batch.copies)
        input_ids, positions, attn, rows, seqs = self.prepare(batch)
        meta = self.backend.prepare(attn)
        hidden = self.model(input_ids, positions, self.kv_caches, meta)
        if not rows:
            return None, []
        return self.model.compute_logits(hidden[torch.tensor(rows, device=self.device)]), seqs

    @torch.inference_mode()
    def prefill_logits(self, token_ids: list[int], block_table: list[int]) -> torch.Tensor:
        """Logits for every position of one prompt (tests and scoring)."""
        seq = Sequence("score", list(token_ids), params=None)  # type: ignore[arg-type]
        batch = Batch([seq], [len(token_ids)], [block_table])
        input_ids, positions, attn, _, _ = self.prepare(batch)
        hidden = self.model(input_ids, positions, self.kv_caches, self.backend.prepare(attn))
        return self.model.compute_logits(hidden)


def load_checkpoint(path, registry_formats: dict[str, Callable], dtype: torch.dtype, progress=None) -> LoadedCheckpoint:
    for factory in registry_formats.values():
        fmt = factory()
        if fmt.claims(path):
            return fmt.load(path, dtype, progress)
    from tokenloom.core.errors import ConfigError

    raise ConfigError(f"no model format claims {str(path)!r}; known formats: {', '.join(registry_formats)}")
