"""DDP's gradient accumulators on the training stream (megatron_paging/mcore/ddp_stream.py).

CPU: the installer's rebinding of Megatron's ``wrap_model_chunks_with_ddp`` (on by default, off
on request, undone by uninstall), the cases that keep Megatron's side stream. GPU: an
accumulator made under Megatron's side stream makes autograd record that stream on the weight
gradient, so its memory cannot be reused after the drop until the GPU passes it; made through
the wrapper, the next allocation gets it at once and nothing warns.
"""

from __future__ import annotations

import types
import warnings

import pytest
import torch

pytest.importorskip("megatron.core")

from megatron.training import training  # noqa: E402

from megatron_paging.mcore import ddp_stream  # noqa: E402
from megatron_paging.mcore import installer as install_mod  # noqa: E402

ORIGINAL_WRAP = training.wrap_model_chunks_with_ddp
MISMATCH = "AccumulateGrad node's stream does not match"


@pytest.fixture
def installer():
    inst = install_mod.PagingInstaller()
    yield inst
    inst.uninstall()


def test_install_wraps_megatrons_ddp_builder_and_uninstall_restores_it(installer):
    installer.install()
    wrapped = training.wrap_model_chunks_with_ddp
    assert wrapped is not ORIGINAL_WRAP and wrapped.megatron_paging_ddp_stream
    assert wrapped.__wrapped__ is ORIGINAL_WRAP
    installer.uninstall()
    assert training.wrap_model_chunks_with_ddp is ORIGINAL_WRAP


def test_the_baseline_install_wraps_it_too(installer):
    # Megatron-Core's own manager arm trains through the same wrapper (a fair comparison)
    installer.install(replace_paged_stash=False)
    assert getattr(training.wrap_model_chunks_with_ddp, "megatron_paging_ddp_stream", False)


def test_cases_that_keep_megatrons_stream():
    config = types.SimpleNamespace(fp8=None, cuda_graph_impl="none")
    assert ddp_stream.keeps_side_stream(config) is None
    assert ddp_stream.keeps_side_stream(types.SimpleNamespace()) is None
    config.cuda_graph_impl = "local"
    assert ddp_stream.keeps_side_stream(config) is None
    config.cuda_graph_impl = "full_iteration"
    assert "--cuda-graph-impl full_iteration" in ddp_stream.keeps_side_stream(config)
    config.cuda_graph_impl = "transformer_engine"
    assert "transformer_engine" in ddp_stream.keeps_side_stream(config)
    config = types.SimpleNamespace(fp8="hybrid", cuda_graph_impl="none")
    assert "fp8" in ddp_stream.keeps_side_stream(config)


def test_the_wrapper_passes_arguments_and_result_through():
    calls = []

    def wrap(model, config, *args, **kwargs):
        calls.append((model, config, args, kwargs))
        return ["wrapped"]

    config = types.SimpleNamespace(fp8="e4m3", cuda_graph_impl="none")  # kept: no stream work
    out = ddp_stream.on_training_stream(wrap)(["m"], config, 1, DP="ddp")
    assert out == ["wrapped"] and calls == [(["m"], config, (1,), {"DP": "ddp"})]


def _grad_after_backward(make_accumulator):
    """Make the weight's accumulator under Megatron's side stream through
    ``make_accumulator``; run forward-backward on the default stream with a DDP-like hook that
    drops the gradient while the GPU is still busy; return (whether autograd warned, whether a
    new tensor of the gradient's size got the dropped gradient's memory at once)."""
    weight = torch.nn.Parameter(torch.randn(4096, 4096, device="cuda"))
    keep, grad_ptrs = [], []

    def drop(*_):
        grad_ptrs.append(weight.grad.data_ptr())
        weight.grad = None  # what Megatron's DDP hook does once main_grad has it

    def register(model, config):
        acc = weight.expand_as(weight).grad_fn.next_functions[0][0]
        acc.register_hook(drop)
        keep.append(acc)
        return model

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        make_accumulator(register)(
            [weight], types.SimpleNamespace(fp8=None, cuda_graph_impl="none")
        )
    torch.cuda.current_stream().wait_stream(side)
    x = torch.randn(8192, 4096, device="cuda")
    torch.cuda.synchronize()
    torch.cuda._sleep(200_000_000)  # the host runs ahead of the GPU, as in training
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        (x @ weight).sum().backward()
    # The allocator hands a freed block to the next request of its stream at once, unless
    # another stream's recorded use still has to complete (the side stream waits for the GPU).
    probe = torch.empty_like(weight)
    reused = probe.data_ptr() == grad_ptrs[0]
    torch.cuda.synchronize()
    warned = any(MISMATCH in str(w.message) for w in caught)
    return warned, reused


@pytest.mark.gpu
def test_an_accumulator_made_on_the_side_stream_holds_gradients_made_through_us_does_not():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    warned, reused = _grad_after_backward(lambda f: f)
    print(
        f"\nMegatron's side stream: warned={warned} (PyTorch may warn once per process), "
        f"dropped gradient's memory reused at once: {reused}"
    )
    assert not reused  # the 64 MiB gradient waits for the side stream
    warned, reused = _grad_after_backward(ddp_stream.on_training_stream)
    print(f"training stream: warned={warned} reused at once: {reused}")
    assert not warned and reused
