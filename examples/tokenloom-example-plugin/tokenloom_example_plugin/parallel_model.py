"""An example model family: the parallel block (GPT-J, PaLM), registered by a third party.

In a parallel block attention and the MLP read the same normed input and both add to the
residual stream at once: ``h + attention(norm(h)) + mlp(norm(h))``, one norm per layer
instead of two. tokenloom's shared decoder does everything else (RoPE, the KV cache,
grouped-query attention, quantizers, tensor parallelism): the family only rewires the
layer (``forward`` and ``norms``) and claims its checkpoints' architecture name.

A checkpoint is a Hugging Face directory whose config.json says
``"architectures": ["ExampleParallelForCausalLM"]``, with LLaMA's tensor names minus
``post_attention_layernorm``.
"""

from __future__ import annotations

from tokenloom.plugins.models.decoder import DecoderLayer, DecoderModel
from tokenloom.plugins.models.families import Family


class ParallelLayer(DecoderLayer):
    def norms(self) -> list[str]:
        return ["input_norm"] + (["q_norm", "k_norm"] if self.cfg.qk_norm else [])

    def forward(self, h, delta, cos, sin, k_cache, v_cache, meta, backend):
        x, h = backend.add_rms_norm(h, delta, self.input_norm, self.cfg.rms_norm_eps, self.dtype)
        attn = self.attend(x, cos, sin, k_cache, v_cache, meta, backend)
        return h, attn + self.tp.all_reduce(self.mlp(x, backend))  # the next layer adds both to the stream


class ParallelFamily(Family):
    """Parallel attention and MLP blocks (example plugin)."""

    name = "example-parallel"
    hf_architectures = ("ExampleParallelForCausalLM",)
    hf_model_types = ("example_parallel",)
    gguf_architectures = ()

    def build(self, cfg, dtype, backend, max_len, tp):
        return DecoderModel(cfg, dtype, backend, max_len, tp, layer=ParallelLayer)
