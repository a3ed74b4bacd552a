"""TinyMoE: a tiny, deterministic, sync-free MoE language model in plain PyTorch.

Each layer is ``x + mixer(norm(x))`` then ``x + moe(norm(x))``:

* the token mixer is attention-free: a small MLP over each token and its predecessor (causal);
* the MoE block routes every token to its top-k experts and *dispatches* it into a static
  capacity buffer ``[num_experts * capacity, hidden]``: expert ``e`` owns the padded segment
  ``[e * capacity, (e + 1) * capacity)``, of which only a live prefix (``live_rows[e]``, an int64
  device tensor) holds tokens. Assignments past an expert's capacity are dropped. Everything is
  computed on the device with static shapes: no host read of a routing decision.

Why paged runs are bitwise identical to unpaged ones
----------------------------------------------------
Paging keeps only the live rows of a saved capacity buffer; a reload writes them back into a
fresh tensor whose other rows hold whatever that allocation held (``torch.empty``; tests fill
them with NaN). Parity therefore needs one property of the model: **no result depends on a
non-live row of a saved capacity buffer**. Plain autograd cannot promise that (the weight
gradient of ``x @ w`` reads every row of ``x``, and ``NaN * 0`` is ``NaN``), so the three ops that
touch capacity buffers are custom autograd functions whose backward passes first select the
live rows with ``torch.where(row_live, saved, 0)``. ``torch.where`` never propagates the
unselected value, so the masked tensors, and everything computed from them, are the same bytes
whatever the non-live rows held. The control run goes through the very same ``torch.where``
calls, so both runs execute identical kernels on identical bytes.

The same functions keep the backward free of atomics (gradients are gathered, never
scattered with accumulation), so the result is also reproducible on CUDA.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

# Per-expert capacity is rounded up to this many rows: torch._grouped_mm wants 16-byte aligned
# group offsets for bf16, and it keeps the padded segments page-friendly.
CAPACITY_ALIGN = 16
GROUPED_MM_CHOICES = ("auto", "loop", "grouped_mm")


@dataclass(frozen=True)
class TinyMoEConfig:
    vocab: int = 256
    hidden: int = 64
    ffn: int = 128
    layers: int = 4
    experts: int = 8
    topk: int = 2
    capacity_factor: float = 1.5
    # "loop": one mm per expert segment; "grouped_mm": torch._grouped_mm (CUDA needs bf16);
    # "auto": grouped_mm for CUDA bf16 tensors when torch has it, else loop.
    grouped_mm: str = "auto"

    def __post_init__(self):
        for name in ("vocab", "hidden", "ffn", "layers", "experts", "topk"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.topk > self.experts:
            raise ValueError(f"topk ({self.topk}) must not exceed experts ({self.experts})")
        if not self.capacity_factor > 0:
            raise ValueError(f"capacity_factor must be > 0, got {self.capacity_factor!r}")
        if self.grouped_mm not in GROUPED_MM_CHOICES:
            raise ValueError(
                f"grouped_mm must be one of {GROUPED_MM_CHOICES}, got {self.grouped_mm!r}"
            )

    def expert_capacity(self, tokens: int) -> int:
        """Static rows per expert for ``tokens`` tokens (a multiple of CAPACITY_ALIGN)."""
        rows = math.ceil(tokens * self.topk * self.capacity_factor / self.experts)
        return -(-rows // CAPACITY_ALIGN) * CAPACITY_ALIGN


@dataclass
class Routing:
    """Where each (token, choice) went, all on the device. ``C`` = experts * capacity rows."""

    capacity: int  # rows per expert
    segments: tuple[tuple[int, int], ...]  # (start_row, rows) per expert, static
    slot: torch.Tensor  # int64 [T, K]: capacity row of each assignment (0 when dropped)
    keep: torch.Tensor  # bool [T, K]: assignment fits its expert's capacity
    row_token: torch.Tensor  # int64 [C]: token held by each row (0 for non-live rows)
    row_choice: torch.Tensor  # int64 [C]: which of the token's k choices the row holds
    row_live: torch.Tensor  # bool [C]
    live_rows: torch.Tensor  # int64 [E]: live prefix of each expert segment


def route(expert_ids: torch.Tensor, num_experts: int, capacity: int) -> Routing:
    """Assign ``expert_ids [T, K]`` to capacity rows; first choices of all tokens go first."""
    tokens, topk = expert_ids.shape
    device = expert_ids.device
    flat = expert_ids.t().reshape(-1)  # choice-major: every token's first choice has priority
    one_hot = F.one_hot(flat, num_experts)
    position = (one_hot.cumsum(0).gather(1, flat[:, None]) - 1).squeeze(1)
    keep = position < capacity
    slot = flat * capacity + position
    total_rows = num_experts * capacity
    # Dropped assignments write to a scratch row past the end, sliced off below.
    dest = torch.where(keep, slot, total_rows)
    row_assignment = torch.zeros(total_rows + 1, dtype=torch.int64, device=device)
    row_assignment.scatter_(0, dest, torch.arange(flat.numel(), device=device))
    row_assignment = row_assignment[:total_rows]
    live_rows = one_hot.sum(0).clamp(max=capacity).to(torch.int64)
    in_segment = torch.arange(capacity, device=device)
    row_live = (in_segment[None, :] < live_rows[:, None]).reshape(total_rows)
    return Routing(
        capacity=capacity,
        segments=tuple((e * capacity, capacity) for e in range(num_experts)),
        slot=torch.where(keep, slot, 0).view(topk, tokens).t(),
        keep=keep.view(topk, tokens).t(),
        row_token=row_assignment % tokens,
        row_choice=row_assignment // tokens,
        row_live=row_live,
        live_rows=live_rows,
    )


def _live(rows: torch.Tensor, row_live: torch.Tensor) -> torch.Tensor:
    """``rows`` with every non-live row replaced by zeros; never reads those rows' values."""
    return torch.where(row_live[:, None], rows, 0)


def _use_grouped_mm(mode: str, x: torch.Tensor, w: torch.Tensor) -> bool:
    if mode == "auto":
        # _grouped_mm needs bf16 on CUDA and 16-byte aligned rows.
        aligned = x.shape[-1] % 8 == 0 and w.shape[-1] % 8 == 0
        return x.is_cuda and x.dtype == torch.bfloat16 and aligned and hasattr(torch, "_grouped_mm")
    return mode == "grouped_mm"


def _group_ends(segments, device) -> torch.Tensor:
    # Built on the device from static ints (no host-to-device copy in the step).
    rows = segments[0][1]
    if all(s == e * rows and n == rows for e, (s, n) in enumerate(segments)):
        return torch.arange(1, len(segments) + 1, dtype=torch.int32, device=device) * rows
    ends = torch.empty(len(segments), dtype=torch.int32, device=device)
    for e, (start, rows) in enumerate(segments):
        ends[e] = start + rows
    return ends


def grouped_mm(x: torch.Tensor, w: torch.Tensor, segments, mode: str) -> torch.Tensor:
    """``out[seg_e] = x[seg_e] @ w[e]`` for ``x [C, K]``, ``w [E, K, N]`` (``w`` may be a view).

    Segments must tile ``x``'s rows in order when ``torch._grouped_mm`` is used.
    """
    if _use_grouped_mm(mode, x, w):
        return torch._grouped_mm(x, w, offs=_group_ends(segments, x.device))
    out = x.new_empty(x.shape[0], w.shape[-1])
    for e, (start, rows) in enumerate(segments):
        torch.mm(x[start : start + rows], w[e], out=out[start : start + rows])
    return out


def grouped_weight_grad(x: torch.Tensor, grad: torch.Tensor, segments, mode: str) -> torch.Tensor:
    """``out[e] = x[seg_e].T @ grad[seg_e]``: the gradient of ``w`` in :func:`grouped_mm`."""
    if _use_grouped_mm(mode, x, grad):
        return torch._grouped_mm(x.t(), grad, offs=_group_ends(segments, x.device))
    return torch.stack([x[s : s + n].t() @ grad[s : s + n] for s, n in segments])


def _mark(paging, tensor: torch.Tensor, routing: Routing) -> None:
    if paging is not None:
        paging.mark(tensor, routing.live_rows, routing.segments)


class Dispatch(torch.autograd.Function):
    """``x [T, H]`` -> capacity buffer ``[C, H]``; non-live rows are zero."""

    @staticmethod
    def forward(ctx, x, slot, keep, row_token, row_live):
        ctx.save_for_backward(slot, keep)
        return _live(x[row_token], row_live)

    @staticmethod
    def backward(ctx, grad_rows):
        slot, keep = ctx.saved_tensors
        tokens, topk = slot.shape
        # Each token gathers its k rows (no scatter-add: deterministic on every device).
        picked = grad_rows[slot.reshape(-1)].view(tokens, topk, -1)
        grad_x = torch.where(keep[..., None], picked, 0).sum(1)
        return grad_x, None, None, None, None


class ExpertMLP(torch.autograd.Function):
    """``gelu(x @ w1[e]) @ w2[e]`` on each expert's segment of a capacity buffer.

    Saves its three capacity-sized activations (input, fc1 output, activation) and marks them
    for paging; backward reads only their live rows.
    """

    @staticmethod
    def forward(ctx, x, w1, w2, routing: Routing, mode: str, paging):
        fc1 = grouped_mm(x, w1, routing.segments, mode)
        act = F.gelu(fc1)
        out = grouped_mm(act, w2, routing.segments, mode)
        for t in (x, fc1, act):
            _mark(paging, t, routing)
        ctx.save_for_backward(x, fc1, act, w1, w2, routing.row_live)
        ctx.segments, ctx.mode = routing.segments, mode
        return out

    @staticmethod
    def backward(ctx, grad_out):
        x, fc1, act, w1, w2, row_live = ctx.saved_tensors
        segments, mode = ctx.segments, ctx.mode
        grad_out = _live(grad_out, row_live)
        grad_w2 = grouped_weight_grad(_live(act, row_live), grad_out, segments, mode)
        grad_act = grouped_mm(grad_out, w2.transpose(-2, -1), segments, mode)
        grad_fc1 = torch.ops.aten.gelu_backward(grad_act, _live(fc1, row_live))
        grad_fc1 = _live(grad_fc1, row_live)
        grad_w1 = grouped_weight_grad(_live(x, row_live), grad_fc1, segments, mode)
        grad_x = grouped_mm(grad_fc1, w1.transpose(-2, -1), segments, mode)
        return grad_x, grad_w1, grad_w2, None, None, None


class Combine(torch.autograd.Function):
    """Capacity buffer ``y [C, H]`` -> ``out[t] = sum_k probs[t, k] * y[slot[t, k]]`` (kept only).

    Saves ``y`` (marked for paging); backward reads only its live rows.
    """

    @staticmethod
    def forward(ctx, y, probs, routing: Routing, paging):
        tokens, topk = routing.slot.shape
        picked = y[routing.slot.reshape(-1)].view(tokens, topk, -1)
        out = torch.where(routing.keep[..., None], picked * probs[..., None], 0).sum(1)
        _mark(paging, y, routing)
        ctx.save_for_backward(
            y, probs, routing.slot, routing.keep, routing.row_token, routing.row_choice,
            routing.row_live,
        )
        return out

    @staticmethod
    def backward(ctx, grad_out):
        y, probs, slot, keep, row_token, row_choice, row_live = ctx.saved_tensors
        tokens, topk = slot.shape
        # A live row holds exactly one (token, choice): its gradient is a gather.
        row_prob = probs[row_token, row_choice]
        grad_y = _live(grad_out[row_token] * row_prob[:, None], row_live)
        picked = y[slot.reshape(-1)].view(tokens, topk, -1)
        grad_probs = torch.where(keep, (picked * grad_out[:, None, :]).sum(-1), 0)
        return grad_y, grad_probs, None, None


class MoEBlock(nn.Module):
    def __init__(self, cfg: TinyMoEConfig):
        super().__init__()
        self.cfg = cfg
        self.router = nn.Parameter(torch.empty(cfg.hidden, cfg.experts))
        self.w1 = nn.Parameter(torch.empty(cfg.experts, cfg.hidden, cfg.ffn))
        self.w2 = nn.Parameter(torch.empty(cfg.experts, cfg.ffn, cfg.hidden))

    def forward(self, x: torch.Tensor, paging=None) -> torch.Tensor:
        cfg = self.cfg
        probs = torch.softmax((x @ self.router).float(), dim=-1)
        top_probs, expert_ids = torch.topk(probs, cfg.topk, dim=-1)
        top_probs = (top_probs / top_probs.sum(-1, keepdim=True)).to(x.dtype)
        routing = route(expert_ids, cfg.experts, cfg.expert_capacity(x.shape[0]))
        rows = Dispatch.apply(x, routing.slot, routing.keep, routing.row_token, routing.row_live)
        rows = ExpertMLP.apply(rows, self.w1, self.w2, routing, cfg.grouped_mm, paging)
        return Combine.apply(rows, top_probs, routing, paging)


class ShiftMixer(nn.Module):
    """Attention-free causal token mixer: an MLP over each token and its predecessor."""

    def __init__(self, hidden: int):
        super().__init__()
        self.fc_in = nn.Linear(2 * hidden, hidden, bias=False)
        self.fc_out = nn.Linear(hidden, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x [B, S, H]
        previous = F.pad(x, (0, 0, 1, 0))[:, :-1]
        return self.fc_out(F.gelu(self.fc_in(torch.cat([x, previous], dim=-1))))


class TinyMoELayer(nn.Module):
    def __init__(self, cfg: TinyMoEConfig):
        super().__init__()
        self.mixer_norm = nn.RMSNorm(cfg.hidden)
        self.mixer = ShiftMixer(cfg.hidden)
        self.moe_norm = nn.RMSNorm(cfg.hidden)
        self.moe = MoEBlock(cfg)

    def forward(self, x: torch.Tensor, paging=None) -> torch.Tensor:
        x = x + self.mixer(self.mixer_norm(x))
        batch, seq, hidden = x.shape
        moe_out = self.moe(self.moe_norm(x).reshape(batch * seq, hidden), paging)
        return x + moe_out.view(batch, seq, hidden)


@torch.no_grad()
def init_parameters(module: nn.Module, seed: int) -> None:
    """Initialize from ``seed`` alone (CPU generator), so equal seeds give equal weights.

    Norm weights are 1, the embedding N(0, 1), every other weight N(0, 1 / fan_in).
    """
    generator = torch.Generator().manual_seed(seed)
    for name, param in module.named_parameters():
        if name.endswith("norm.weight"):
            param.fill_(1.0)
            continue
        fan_in = param.shape[-2] if param.dim() == 3 else param.shape[-1]
        std = 1.0 if name == "embed.weight" else fan_in**-0.5
        values = torch.randn(param.shape, generator=generator) * std
        param.copy_(values.to(param.dtype))


class StageChunk(nn.Module):
    """``cfg.layers`` TinyMoE layers of one pipeline stage, with the embedding on the first
    stage (``num_stages`` stages) and the final norm, LM head and loss on the last.

    Weights are seeded by ``seed`` and the stage index only, so every run builds the same stage.
    """

    def __init__(self, cfg: TinyMoEConfig, stage: int, num_stages: int, seed: int = 0):
        super().__init__()
        self.cfg = cfg
        self.stage, self.first, self.last = stage, stage == 0, stage == num_stages - 1
        self.embed = nn.Embedding(cfg.vocab, cfg.hidden) if self.first else None
        self.layers = nn.ModuleList(TinyMoELayer(cfg) for _ in range(cfg.layers))
        self.norm = nn.RMSNorm(cfg.hidden) if self.last else None
        self.head = nn.Linear(cfg.hidden, cfg.vocab, bias=False) if self.last else None
        init_parameters(self, seed * 1000 + stage)

    def loss(self, x: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = self.head(self.norm(x))
        return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


class TinyMoE(nn.Module):
    """Embedding, ``layers`` x [mixer, MoE], final norm, LM head; ``forward`` returns the CE loss.

    ``paging`` (optional) is any object with ``mark(tensor, live_rows, segments)``: the model
    calls it for every capacity-sized tensor it saves for backward.
    """

    def __init__(self, cfg: TinyMoEConfig, seed: int = 0):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab, cfg.hidden)
        self.layers = nn.ModuleList(TinyMoELayer(cfg) for _ in range(cfg.layers))
        self.norm = nn.RMSNorm(cfg.hidden)
        self.head = nn.Linear(cfg.hidden, cfg.vocab, bias=False)
        self.reset_parameters(seed)

    def reset_parameters(self, seed: int) -> None:
        init_parameters(self, seed)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor, paging=None) -> torch.Tensor:
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x, paging)
        logits = self.head(self.norm(x))
        return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


def synthetic_batches(
    vocab: int, batch: int, seq: int, steps: int, seed: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``steps`` (tokens, targets) pairs on the CPU: a noisy affine chain, so loss can fall.

    Each next token is ``(5 * token + 3) % vocab`` with probability 0.9, else uniform.
    """
    generator = torch.Generator().manual_seed(seed)
    batches = []
    for _ in range(steps):
        seqs = torch.empty(batch, seq + 1, dtype=torch.int64)
        seqs[:, 0] = torch.randint(vocab, (batch,), generator=generator)
        noise = torch.randint(vocab, (batch, seq), generator=generator)
        jump = torch.rand(batch, seq, generator=generator) < 0.1
        for i in range(seq):
            follow = (5 * seqs[:, i] + 3) % vocab
            seqs[:, i + 1] = torch.where(jump[:, i], noise[:, i], follow)
        batches.append((seqs[:, :-1].contiguous(), seqs[:, 1:].contiguous()))
    return batches
