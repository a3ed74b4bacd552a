"""SDPAttention (megatron_paging.mcore.attention) against Megatron-Core's unfused
DotProductAttention, its refusals, its backend pinning; on CUDA, run-to-run bitwise determinism.

Inputs are built the way Megatron's SelfAttention builds them: q/k/v are strided views split
from one fused ``[s, b, groups, (heads/groups + 2) * head_dim]`` projection.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

pytest.importorskip("megatron.core")

from mcore_fixtures import model_parallel  # noqa: E402, F401
from megatron.core import tensor_parallel  # noqa: E402
from megatron.core.transformer.dot_product_attention import DotProductAttention  # noqa: E402
from megatron.core.transformer.enums import AttnMaskType  # noqa: E402
from torch.nn.attention import SDPBackend  # noqa: E402

from megatron_paging.mcore import attention as sdpa_module  # noqa: E402
from megatron_paging.mcore.attention import (  # noqa: E402
    SDPA_BACKENDS,
    SDPAttention,
    select_sdpa_backend,
    strict_deterministic,
    validate_sdpa_backend,
)

# fp32 on CPU: both compute the same matmuls and fp32 softmax; they differ only in where the scale
# is applied (math SDPA scales q and k by sqrt(scale)) and -10000 vs -inf masking. Measured over
# these shapes and s=64/hn=64: at most 1e-5 absolute, under 1e-6 of each tensor's largest entry.
TOL = dict(rtol=1e-5, atol=1e-5)
# Autograd node of each fused backend (math decomposes into plain ops and has none).
SDPA_NODE = {
    SDPBackend.FLASH_ATTENTION: "ScaledDotProductFlashAttention",
    SDPBackend.EFFICIENT_ATTENTION: "ScaledDotProductEfficientAttention",
    SDPBackend.CUDNN_ATTENTION: "ScaledDotProductCudnnAttention",
}


def attention_config(heads=4, groups=4, head_dim=16, **overrides):
    from megatron.core.transformer.transformer_config import TransformerConfig

    fields = dict(
        num_layers=4,
        hidden_size=heads * head_dim,
        num_attention_heads=heads,
        num_query_groups=groups,
        kv_channels=head_dim,
        attention_dropout=0.0,
        use_cpu_initialization=True,
        params_dtype=torch.float32,
    )
    fields.update(overrides)
    return TransformerConfig(**fields)


def build(cls, config, layer_number=1, mask=AttnMaskType.causal, **kwargs):
    return cls(
        config=config,
        layer_number=layer_number,
        attn_mask_type=mask,
        attention_type="self",
        softmax_scale=config.softmax_scale,
        **kwargs,
    )


def fused_qkv(sq, batch, heads, groups, head_dim, seed=0, device="cpu", dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    width = (heads // groups + 2) * head_dim
    mixed = torch.randn(sq, batch, groups, width, generator=gen).to(device, dtype)
    return mixed.requires_grad_()


def split_qkv(mixed, heads, head_dim):
    sq, batch, groups, _ = mixed.shape
    q, k, v = torch.split(mixed, [heads // groups * head_dim, head_dim, head_dim], dim=3)
    return q.reshape(sq, batch, heads, head_dim), k, v


def run(module, mixed, heads, head_dim, grad_seed=1, attention_mask=None):
    """Forward + backward of ``module`` on a fresh leaf copy of ``mixed``: (output, d mixed)."""
    leaf = mixed.detach().clone().requires_grad_()
    out = module(*split_qkv(leaf, heads, head_dim), attention_mask)
    gen = torch.Generator().manual_seed(grad_seed)
    grad = torch.randn(out.shape, generator=gen).to(out.device, out.dtype)
    (out * grad).sum().backward()
    return out, leaf.grad


def sdpa_nodes(tensor):
    """Names of the fused-SDPA autograd nodes behind ``tensor``."""
    seen, stack, names = set(), [tensor.grad_fn], set()
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if node.name().startswith("ScaledDotProduct"):
            names.add(node.name())
        stack.extend(fn for fn, _ in node.next_functions)
    return names


class RecordingTracker:
    """Stands in for Megatron's CUDA RNG tracker (no CUDA here); records each fork."""

    def __init__(self):
        self.forks = []

    @contextlib.contextmanager
    def fork(self, name="model-parallel-rng"):
        self.forks.append(name)
        yield


@pytest.fixture
def tracker(monkeypatch):
    recording = RecordingTracker()
    monkeypatch.setattr(tensor_parallel, "get_cuda_rng_tracker", lambda *a, **k: recording)
    return recording


class CPUMemoryBuffer:
    """DotProductAttention's score buffer, on the CPU (Megatron's allocates on the current GPU)."""

    def get_tensor(self, shape, dtype, name, mem_alloc_context=None):
        return torch.empty(shape, dtype=dtype)


@pytest.fixture
def reference_on_cpu(model_parallel, tracker, monkeypatch):  # noqa: F811
    """DotProductAttention runnable on the CPU; it forks the tracker even without dropout."""
    from megatron.core import parallel_state

    monkeypatch.setattr(parallel_state, "get_global_memory_buffer", CPUMemoryBuffer)
    return tracker


@pytest.fixture
def recorded_kernels(monkeypatch):
    """Every backend list SDPAttention pins through ``torch.nn.attention.sdpa_kernel``."""
    calls, real = [], torch.nn.attention.sdpa_kernel

    def recording(backends, set_priority=False):
        calls.append(list(backends))
        return real(backends, set_priority)

    monkeypatch.setattr(torch.nn.attention, "sdpa_kernel", recording)
    return calls


@contextlib.contextmanager
def deterministic_algorithms(warn_only=False):
    before = (
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
    )
    torch.use_deterministic_algorithms(True, warn_only=warn_only)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before[0], warn_only=before[1])


def causal_mask(sq):
    """The mask GPT's dataloader makes (True = masked): DotProductAttention applies it."""
    return torch.triu(torch.ones(sq, sq, dtype=torch.bool), diagonal=1)[None, None]


@pytest.mark.parametrize(
    "sq, batch, heads, groups, head_dim",
    [(8, 2, 4, 4, 16), (16, 1, 4, 2, 8), (5, 3, 6, 1, 32), (1, 2, 4, 2, 16)],
    ids=["mha", "gqa", "mqa", "one-token"],
)
@pytest.mark.parametrize("scaling", ["default", "softmax_scale", "layer_scaling"])
def test_matches_dot_product_attention(
    reference_on_cpu, recorded_kernels, sq, batch, heads, groups, head_dim, scaling
):
    overrides = {
        "softmax_scale": dict(softmax_scale=0.37),
        "layer_scaling": dict(apply_query_key_layer_scaling=True, attention_softmax_in_fp32=True),
    }.get(scaling, {})
    config = attention_config(heads, groups, head_dim, **overrides)
    layer = 3  # layer scaling divides by 3 and multiplies back: same product
    ours, reference = build(SDPAttention, config, layer), build(DotProductAttention, config, layer)
    mixed = fused_qkv(sq, batch, heads, groups, head_dim)
    mask = causal_mask(sq) if sq > 1 else None  # ours ignores it: causal either way
    out, grad = run(ours, mixed, heads, head_dim, attention_mask=mask)
    assert reference_on_cpu.forks == []  # no dropout: no random numbers, no fork
    ref_out, ref_grad = run(reference, mixed, heads, head_dim, attention_mask=mask)

    assert out.shape == ref_out.shape == (sq, batch, heads * head_dim)
    torch.testing.assert_close(out, ref_out, **TOL)
    for name, got, want in zip(
        "qkv", *(split_qkv(g, heads, head_dim) for g in (grad, ref_grad)), strict=True
    ):
        torch.testing.assert_close(got, want, **TOL, msg=lambda m, n=name: f"d{n}: {m}")
    assert recorded_kernels == [[SDPBackend.MATH]]  # CPU: math pinned
    assert sdpa_nodes(out) == set()  # ... and math ran (not the CPU flash kernel)


def test_dropout_in_training_only_inside_tracker_fork(reference_on_cpu):
    forks = reference_on_cpu.forks
    config = attention_config(attention_dropout=0.5)
    module, reference = build(SDPAttention, config), build(DotProductAttention, config)
    mixed = fused_qkv(8, 2, 4, 4, 16)
    torch.manual_seed(3)
    dropped, _ = run(module, mixed, 4, 16)
    assert forks == ["model-parallel-rng"]
    torch.manual_seed(3)
    assert torch.equal(run(module, mixed, 4, 16)[0], dropped)  # same stream, same masks
    module.eval(), reference.eval()
    kept, _ = run(module, mixed, 4, 16)
    assert forks == ["model-parallel-rng"] * 2  # eval: no dropout, no fork
    reference_out, _ = run(reference, mixed, 4, 16, attention_mask=causal_mask(8))
    torch.testing.assert_close(kept, reference_out, **TOL)
    assert not torch.allclose(kept, dropped)
    override = build(SDPAttention, config, attention_dropout=0.0)
    assert override.attention_dropout == 0.0  # the constructor argument wins, as in Megatron


@pytest.mark.parametrize(
    "overrides, field",
    [
        (dict(context_parallel_size=2), "context_parallel_size"),
        (dict(softmax_type="off-by-one"), "softmax_type"),
        (dict(window_size=(4, 0)), "window_size"),
        (dict(qk_clip=True, qk_clip_threshold=100.0), "qk_clip"),
    ],
)
@pytest.mark.usefixtures("model_parallel")
def test_config_refusals(overrides, field):
    config = attention_config()
    for name, value in overrides.items():  # set after validation: some need other features
        setattr(config, name, value)
    with pytest.raises(ValueError, match=field) as error:
        build(SDPAttention, config)
    assert "\n" not in str(error.value)


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(sdpa_backend="fast"), "sdpa_backend"),
        (dict(attention_dropout=1.0), "attention_dropout"),
    ],
)
@pytest.mark.usefixtures("model_parallel")
def test_constructor_refusals(kwargs, field):
    with pytest.raises(ValueError, match=field) as error:
        build(SDPAttention, attention_config(), **kwargs)
    assert "\n" not in str(error.value)


@pytest.mark.parametrize(
    "mask_type, mask, call_kwargs, sk, field",
    [
        (AttnMaskType.causal, None, dict(packed_seq_params=object()), 8, "packed_seq_params"),
        (AttnMaskType.causal, None, dict(attention_bias=torch.zeros(1)), 8, "attention_bias"),
        (AttnMaskType.padding, causal_mask(8), {}, 8, "attn_mask_type=padding with"),
        (AttnMaskType.padding_causal, None, {}, 8, "attn_mask_type=padding_causal"),
        (AttnMaskType.causal_bottom_right, None, {}, 8, "attn_mask_type=causal_bottom_right"),
        (AttnMaskType.causal, None, {}, 12, "sq == sk"),
        (AttnMaskType.no_mask, None, dict(attn_mask_type=AttnMaskType.arbitrary), 8, None),
    ],
)
@pytest.mark.usefixtures("model_parallel")
def test_forward_refusals(mask_type, mask, call_kwargs, sk, field):
    module = build(SDPAttention, attention_config(), mask=mask_type)
    q = torch.randn(8, 2, 4, 16)
    kv = torch.randn(sk, 2, 4, 16)
    if field is None:  # the forward's attn_mask_type wins; arbitrary without a tensor: no mask
        assert module(q, kv, kv, mask, **call_kwargs).shape == (8, 2, 64)
        return
    with pytest.raises(ValueError, match=field) as error:
        module(q, kv, kv, mask, **call_kwargs)
    assert "\n" not in str(error.value)


@pytest.mark.usefixtures("model_parallel")
def test_deterministic_mode_needs_torch_deterministic_algorithms():
    module = build(SDPAttention, attention_config(deterministic_mode=True))
    q = torch.randn(8, 2, 4, 16)
    with pytest.raises(ValueError, match="deterministic_mode") as error:
        module(q, q, q, None)
    assert "\n" not in str(error.value)
    with deterministic_algorithms(warn_only=True), pytest.raises(ValueError, match="warn_only"):
        module(q, q, q, None)
    with deterministic_algorithms():
        assert module(q, q, q, None).shape == (8, 2, 64)


def test_unmasked_types_attend_to_every_key(reference_on_cpu):
    config = attention_config()
    mixed = fused_qkv(8, 2, 4, 4, 16)
    reference, _ = run(build(DotProductAttention, config, mask=AttnMaskType.padding), mixed, 4, 16)
    for mask_type in (AttnMaskType.no_mask, AttnMaskType.padding, AttnMaskType.arbitrary):
        out, _ = run(build(SDPAttention, config, mask=mask_type), mixed, 4, 16)
        torch.testing.assert_close(out, reference, **TOL)


CUDA, CPU = "cuda", "cpu"
BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32


@pytest.mark.parametrize(
    "name, device, dtype, deterministic, expected",
    [
        ("auto", CUDA, BF16, True, SDPBackend.FLASH_ATTENTION),
        ("auto", CUDA, BF16, False, SDPBackend.FLASH_ATTENTION),
        ("auto", CUDA, FP16, True, SDPBackend.FLASH_ATTENTION),
        ("auto", CUDA, FP32, True, SDPBackend.EFFICIENT_ATTENTION),
        ("auto", CPU, FP32, True, SDPBackend.MATH),
        ("auto", CPU, BF16, False, SDPBackend.MATH),
        ("flash", CUDA, BF16, True, SDPBackend.FLASH_ATTENTION),
        ("efficient", CUDA, BF16, True, SDPBackend.EFFICIENT_ATTENTION),
        ("cudnn", CUDA, BF16, False, SDPBackend.CUDNN_ATTENTION),
        ("math", CUDA, BF16, True, SDPBackend.MATH),
        ("flash", CPU, FP32, False, SDPBackend.FLASH_ATTENTION),
        ("cudnn", CUDA, BF16, True, "not deterministic"),
        ("cudnn", CPU, BF16, False, "needs CUDA"),
        ("efficient", CPU, FP32, False, "needs CUDA"),
        ("fast", CUDA, BF16, False, "sdpa_backend must be one of"),
    ],
)
def test_backend_selection(name, device, dtype, deterministic, expected):
    if isinstance(expected, str):
        with pytest.raises(ValueError, match=expected) as error:
            select_sdpa_backend(name, device, dtype, deterministic)
        assert "\n" not in str(error.value)
    else:
        assert select_sdpa_backend(name, device, dtype, deterministic) == expected
    assert all(validate_sdpa_backend(n) == n for n in SDPA_BACKENDS)


def test_strict_deterministic_reads_torch_mode():
    assert not strict_deterministic()
    with deterministic_algorithms():
        assert strict_deterministic()
    with deterministic_algorithms(warn_only=True):  # flash/efficient backward would only warn
        assert not strict_deterministic()


@pytest.mark.usefixtures("model_parallel")
def test_forward_pins_the_selected_backend(recorded_kernels, monkeypatch):
    """The CUDA branch of the selection, faked on CPU (bf16: the CPU flash kernel runs), plus
    the deterministic flag the forward hands to the selection."""
    seen, real_select = [], select_sdpa_backend

    def as_if_cuda(name, device_type, dtype, deterministic, same_head_dim=True):
        seen.append((name, device_type, dtype, deterministic, same_head_dim))
        return real_select(name, CUDA, dtype, deterministic, same_head_dim=same_head_dim)

    monkeypatch.setattr(sdpa_module, "select_sdpa_backend", as_if_cuda)
    module = build(SDPAttention, attention_config(groups=2))
    mixed = fused_qkv(8, 2, 4, 2, 16, dtype=BF16)
    with deterministic_algorithms():
        out, _ = run(module, mixed, 4, 16)
    assert seen == [("auto", CPU, BF16, True, True)]
    assert recorded_kernels == [[SDPBackend.FLASH_ATTENTION]]
    assert sdpa_nodes(out) == {"ScaledDotProductFlashAttentionForCpuBackward0"}


# --------------------------------------------------------------------------------------------
# CUDA (run on an H200 elsewhere): deterministic mode is bitwise reproducible run to run.
# --------------------------------------------------------------------------------------------
requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def cuda_run(module, mixed, heads, head_dim, seed=1234):
    # Reseed the tracker: both runs must draw the same dropout masks from the same stream.
    tensor_parallel.model_parallel_cuda_manual_seed(seed)
    return run(module, mixed, heads, head_dim)


def expected_nodes(pinned):
    return {SDPA_NODE[pinned] + "Backward0"} if pinned in SDPA_NODE else set()


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("dropout", [0.0, 0.1])
@pytest.mark.parametrize("groups", [8, 2], ids=["mha", "gqa"])
@pytest.mark.parametrize("backend", ["auto", "efficient", "math"])
@pytest.mark.usefixtures("model_parallel")
def test_cuda_deterministic_bitwise_run_to_run(monkeypatch, backend, groups, dropout):
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # the math backend's matmuls
    heads, head_dim = 8, 64
    config = attention_config(
        heads, groups, head_dim, attention_dropout=dropout, deterministic_mode=True
    )
    module = build(SDPAttention, config, sdpa_backend=backend).cuda()
    mixed = fused_qkv(256, 2, heads, groups, head_dim, device=CUDA, dtype=BF16)
    with deterministic_algorithms():  # what --deterministic-mode sets
        first_out, first_grad = cuda_run(module, mixed, heads, head_dim)
        second_out, second_grad = cuda_run(module, mixed, heads, head_dim)
        module.eval()
        undropped, _ = cuda_run(module, mixed, heads, head_dim)
    assert torch.equal(first_out, second_out)
    assert torch.equal(first_grad, second_grad)
    pinned = select_sdpa_backend(backend, CUDA, BF16, deterministic=True)
    assert sdpa_nodes(first_out) == expected_nodes(pinned)  # the pinned backend is what ran
    assert torch.equal(undropped, first_out) == (dropout == 0.0)  # dropout only when set


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("backend", ["auto", "flash", "efficient", "cudnn", "math"])
@pytest.mark.parametrize("groups", [8, 2], ids=["mha", "gqa"])
@pytest.mark.usefixtures("model_parallel")
def test_cuda_backends_match_fp32_reference(backend, groups):
    if backend == "cudnn" and not torch.backends.cudnn.is_available():
        pytest.skip("cuDNN is not available")
    heads, head_dim = 8, 64
    config = attention_config(heads, groups, head_dim)
    module = build(SDPAttention, config, sdpa_backend=backend).cuda()
    mixed = fused_qkv(128, 2, heads, groups, head_dim, device=CUDA, dtype=BF16)
    out, grad = cuda_run(module, mixed, heads, head_dim)
    ref_out, ref_grad = cuda_run(build(DotProductAttention, config), mixed.float(), heads, head_dim)
    pinned = select_sdpa_backend(backend, CUDA, BF16, deterministic=False)
    assert sdpa_nodes(out) == expected_nodes(pinned)
    bf16_tol = dict(rtol=2e-2, atol=2e-2)  # bf16 inputs; the reference computes them in fp32
    torch.testing.assert_close(out.float(), ref_out, **bf16_tol)
    torch.testing.assert_close(grad.float(), ref_grad, **bf16_tol)
