"""Model architectures and GPU specifications for first-order throughput arithmetic.

`ModelArch` holds the few numbers of a dense decoder-only transformer's configuration that
set its parameter count and its KV cache size; `GpuSpec` holds the published figures of an
accelerator that bound decode (memory bandwidth) and training (dense bf16 FLOP/s).
`MODELS` and `GPUS` are presets from public configuration files and data sheets.

Pure arithmetic: no I/O, no numpy needed. `rlfeed.sched.throughput` builds the roofline
estimates on top of these.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(kw_only=True, frozen=True)
class ModelArch:
    """A dense decoder-only transformer (Llama/Qwen family: GQA attention, SwiGLU MLP,
    RMSNorm, no biases), as far as parameter count and KV cache size are concerned."""

    name: str  # preset key or free label, e.g. "qwen3-8b"; no default
    num_layers: int  # transformer blocks (config `num_hidden_layers`); no default
    hidden_size: int  # residual stream width D (config `hidden_size`); no default
    num_attention_heads: int  # query heads (config `num_attention_heads`); no default
    num_kv_heads: int  # key/value heads, < query heads under GQA (`num_key_value_heads`)
    head_dim: int  # per-head width; Qwen3 sets it independently of hidden/heads; no default
    intermediate_size: int  # SwiGLU inner width (three D x I matrices per block); no default
    vocab_size: int  # rows of the embedding and of the LM head; no default
    tie_word_embeddings: bool  # True: the LM head reuses the embedding matrix; no default
    qk_norm: bool = False  # Qwen3: RMSNorm weights (head_dim each) on q and k; default False
    kv_bytes_per_element: int = 2  # bytes per cached key/value number; default 2 (bf16)
    weight_bytes_per_param: int = 2  # bytes per weight read per decode step; default 2 (bf16)

    def __post_init__(self) -> None:
        for field_name in (
            "num_layers",
            "hidden_size",
            "num_attention_heads",
            "num_kv_heads",
            "head_dim",
            "intermediate_size",
            "vocab_size",
            "kv_bytes_per_element",
            "weight_bytes_per_param",
        ):
            value = getattr(self, field_name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"ModelArch {self.name!r}: {field_name} must be a positive int")
        if self.num_attention_heads % self.num_kv_heads != 0:
            raise ValueError(
                f"ModelArch {self.name!r}: num_attention_heads ({self.num_attention_heads}) "
                f"must be a multiple of num_kv_heads ({self.num_kv_heads})"
            )


def kv_bytes_per_token(arch: ModelArch) -> int:
    """Bytes of KV cache one token of context occupies: keys and values (2) for every layer
    and KV head. Qwen3-8B: 2 x 36 x 8 x 128 x 2 B = 147,456 B."""
    return 2 * arch.num_layers * arch.num_kv_heads * arch.head_dim * arch.kv_bytes_per_element


def param_count(arch: ModelArch) -> int:
    """Parameters N, counted from the architecture: token embeddings, per block the
    attention projections q/k/v/o (q and o are D x heads*head_dim, k and v D x
    kv_heads*head_dim), the three SwiGLU matrices, two RMSNorms (plus q/k norms when
    `qk_norm`), the final RMSNorm, and an untied LM head. Tied embeddings count once."""
    d, hd = arch.hidden_size, arch.head_dim
    attention = 2 * d * arch.num_attention_heads * hd + 2 * d * arch.num_kv_heads * hd
    mlp = 3 * d * arch.intermediate_size
    norms = 2 * d + (2 * hd if arch.qk_norm else 0)
    embeddings = arch.vocab_size * d * (1 if arch.tie_word_embeddings else 2)
    return arch.num_layers * (attention + mlp + norms) + embeddings + d


def _qwen3(name: str, **shape: int | bool) -> ModelArch:
    return ModelArch(name=name, qk_norm=True, vocab_size=151_936, head_dim=128, **shape)


def _llama3(name: str, **shape: int | bool) -> ModelArch:
    return ModelArch(
        name=name, vocab_size=128_256, head_dim=128, tie_word_embeddings=False, **shape
    )


# From each model's config.json on the Hugging Face Hub (Qwen/Qwen3-*, meta-llama/Meta-Llama-3-*).
# Published totals, which tests hold param_count to: 0.6B (0.596B counting the tied embedding
# once), 8.19B, 32.8B, 8.03B, 70.6B.
MODELS: dict[str, ModelArch] = {
    arch.name: arch
    for arch in (
        _qwen3(
            "qwen3-0.6b",
            num_layers=28,
            hidden_size=1024,
            num_attention_heads=16,
            num_kv_heads=8,
            intermediate_size=3072,
            tie_word_embeddings=True,
        ),
        _qwen3(
            "qwen3-8b",
            num_layers=36,
            hidden_size=4096,
            num_attention_heads=32,
            num_kv_heads=8,
            intermediate_size=12_288,
            tie_word_embeddings=False,
        ),
        _qwen3(
            "qwen3-32b",
            num_layers=64,
            hidden_size=5120,
            num_attention_heads=64,
            num_kv_heads=8,
            intermediate_size=25_600,
            tie_word_embeddings=False,
        ),
        _llama3(
            "llama3-8b",
            num_layers=32,
            hidden_size=4096,
            num_attention_heads=32,
            num_kv_heads=8,
            intermediate_size=14_336,
        ),
        _llama3(
            "llama3-70b",
            num_layers=80,
            hidden_size=8192,
            num_attention_heads=64,
            num_kv_heads=8,
            intermediate_size=28_672,
        ),
    )
}


@dataclass(kw_only=True, frozen=True)
class GpuSpec:
    """The published figures of one accelerator that bound decode and training speed."""

    name: str  # preset key or free label, e.g. "h200"; no default
    memory_bandwidth_bytes_per_s: float  # HBM bandwidth, bytes/s; bounds decode; no default
    dense_bf16_flops_per_s: float  # dense (not 2:4 sparse) bf16 FLOP/s; bounds training
    memory_bytes: float | None = None  # HBM capacity, bytes; None = unknown; default None

    def __post_init__(self) -> None:
        for field_name in ("memory_bandwidth_bytes_per_s", "dense_bf16_flops_per_s"):
            if not getattr(self, field_name) > 0:
                raise ValueError(f"GpuSpec {self.name!r}: {field_name} must be > 0")
        if self.memory_bytes is not None and not self.memory_bytes > 0:
            raise ValueError(f"GpuSpec {self.name!r}: memory_bytes must be > 0 or None")


GPUS: dict[str, GpuSpec] = {
    # NVIDIA H100 SXM5 data sheet: 3.35 TB/s HBM3, 989 TFLOP/s dense bf16
    # (1,979 listed with sparsity), 80 GB.
    "h100": GpuSpec(
        name="h100",
        memory_bandwidth_bytes_per_s=3.35e12,
        dense_bf16_flops_per_s=989e12,
        memory_bytes=80e9,
    ),
    # NVIDIA H200 SXM data sheet: 4.8 TB/s HBM3e, 989 TFLOP/s dense bf16, 141 GB; the
    # figures the chapter's Section 14.6 uses.
    "h200": GpuSpec(
        name="h200",
        memory_bandwidth_bytes_per_s=4.8e12,
        dense_bf16_flops_per_s=989e12,
        memory_bytes=141e9,
    ),
    # NVIDIA A100 80GB SXM data sheet: 2,039 GB/s HBM2e, 312 TFLOP/s dense bf16
    # (624 listed with sparsity), 80 GB.
    "a100": GpuSpec(
        name="a100",
        memory_bandwidth_bytes_per_s=2.039e12,
        dense_bf16_flops_per_s=312e12,
        memory_bytes=80e9,
    ),
}
