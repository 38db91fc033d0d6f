"""A small LLaMA-style decoder-only language model for demos and tests.

Shape legend used in the comments below:
    B  = batch size
    T  = tokens per sequence (<= max_seq_len)
    D  = model dim
    H  = attention heads
    Dh = head dim (D // H)
    F  = feed-forward hidden dim
    V  = vocabulary size
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from fp8train.activations import float8_swiglu
from fp8train.config import Role


@dataclass(frozen=True)
class ModelArgs:
    vocab_size: int = 256
    dim: int = 128
    n_layers: int = 2
    n_heads: int = 4
    ffn_dim: int = 352
    max_seq_len: int = 128
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    float8_swiglu: bool = False
    """Keep SwiGLU's two inputs for backward in float8 (fp8train.activations)."""
    float8_swiglu_exact_forward: bool = False
    """With float8_swiglu: SwiGLU's output from its high-precision inputs, not the copies."""

    def __post_init__(self) -> None:
        if self.dim % self.n_heads:
            raise ValueError(f"dim={self.dim} is not divisible by n_heads={self.n_heads}")
        if (self.dim // self.n_heads) % 2:
            raise ValueError("the head dim must be even: rotary embeddings rotate pairs")


def llama_ffn_dim(dim: int, multiple_of: int = 16) -> int:
    """SwiGLU hidden size: 2/3 of 4*dim (same parameter count as a 4x GELU MLP), rounded up so
    that float8 gemms, which need multiples of 16, accept it. Gives 352 for dim=128."""
    hidden = int(2 * 4 * dim / 3)
    return multiple_of * -(-hidden // multiple_of)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalize in float32: the mean of squares loses too many bits in bf16/fp16.
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return xf.type_as(x) * self.weight


def rotary_cos_sin(
    seq_len: int, head_dim: int, theta: float, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """(T, Dh/2) cos and sin tables, computed in float32 on every forward instead of stored as
    buffers so that `model.to(torch.bfloat16)` cannot round the angles."""
    pair = torch.arange(0, head_dim, 2, device=device, dtype=torch.float32)
    inv_freq = theta ** (-pair / head_dim)
    angles = torch.outer(torch.arange(seq_len, device=device, dtype=torch.float32), inv_freq)
    return angles.cos(), angles.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate (B, T, H, Dh) by position; the two halves of Dh form the (real, imag) pairs."""
    x1, x2 = x.float().chunk(2, dim=-1)
    cos, sin = cos[:, None, :], sin[:, None, :]  # (T, 1, Dh/2): broadcast over heads
    return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).type_as(x)


class Attention(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.n_heads = args.n_heads
        self.head_dim = args.dim // args.n_heads
        self.wq = nn.Linear(args.dim, args.dim, bias=False)
        self.wk = nn.Linear(args.dim, args.dim, bias=False)
        self.wv = nn.Linear(args.dim, args.dim, bias=False)
        self.wo = nn.Linear(args.dim, args.dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        # -1 heads: under tensor parallelism each rank holds n_heads / tp of them.
        q = self.wq(x).view(B, T, -1, self.head_dim)
        k = self.wk(x).view(B, T, -1, self.head_dim)
        v = self.wv(x).view(B, T, -1, self.head_dim)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        # SDPA wants (B, H, T, Dh).
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )
        return self.wo(out.transpose(1, 2).reshape(B, T, -1))


class FeedForward(nn.Module):
    """SwiGLU: silu(x W1) * (x W3), projected back by W2. With `float8_swiglu` (an attribute,
    from ModelArgs) the two halves are kept for backward in float8 (fp8train.activations),
    and with `float8_swiglu_exact_forward` the output is computed from the halves themselves."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.w1 = nn.Linear(args.dim, args.ffn_dim, bias=False)
        self.w3 = nn.Linear(args.dim, args.ffn_dim, bias=False)
        self.w2 = nn.Linear(args.ffn_dim, args.dim, bias=False)
        self.float8_swiglu = args.float8_swiglu
        self.float8_swiglu_exact_forward = args.float8_swiglu_exact_forward

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.w1(x), self.w3(x)
        if self.float8_swiglu:
            hidden = float8_swiglu(gate, up, exact_forward=self.float8_swiglu_exact_forward)
        else:
            hidden = F.silu(gate) * up
        return self.w2(hidden)


def use_float8_swiglu(model: nn.Module, exact_forward: bool = False) -> nn.Module:
    """Turn on `float8_swiglu` (with `exact_forward`) in every FeedForward of `model`;
    `model`."""
    for module in model.modules():
        if isinstance(module, FeedForward):
            module.float8_swiglu = True
            module.float8_swiglu_exact_forward = exact_forward
    return model


def tie_shared_delayed_inputs(model: nn.Module) -> nn.Module:
    """Tie the delayed input scales (fp8train.tie_delayed_input_scales) of the layers that
    read one input in every block of `model`: wq, wk and wv; w1 and w3. Groups with a layer
    that is not float8 or not delayed are left alone. Returns `model`."""
    from fp8train.delayed import delayed_roles, tie_delayed_input_scales
    from fp8train.linear import Float8Linear

    def delayed_input(layer: nn.Module) -> bool:
        return isinstance(layer, Float8Linear) and Role.INPUT in delayed_roles(layer.config)

    for module in model.modules():
        if isinstance(module, Attention):
            group = [module.wq, module.wk, module.wv]
        elif isinstance(module, FeedForward):
            group = [module.w1, module.w3]
        else:
            continue
        if all(delayed_input(layer) for layer in group):
            tie_delayed_input_scales(group)
    return model


class TransformerBlock(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)
        self.attention = Attention(args)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)
        self.feed_forward = FeedForward(args)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), cos, sin)
        return x + self.feed_forward(self.ffn_norm(x))


class Transformer(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleList(TransformerBlock(args) for _ in range(args.n_layers))
        self.norm = RMSNorm(args.dim, args.norm_eps)
        self.lm_head = nn.Linear(args.dim, args.vocab_size, bias=False)
        self._init_weights()

    def _init_weights(self) -> None:
        # GPT-2 style: small normal init, with the projections that write into the residual
        # stream scaled down by depth so the residual variance does not grow with n_layers.
        residual_std = 0.02 / (2 * self.args.n_layers) ** 0.5
        for name, module in self.named_modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                std = residual_std if name.endswith(("wo", "w2")) else 0.02
                nn.init.normal_(module.weight, mean=0.0, std=std)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens: (B, T) long -> logits: (B, T, V)."""
        T = tokens.shape[1]
        if T > self.args.max_seq_len:
            raise ValueError(f"sequence length {T} exceeds max_seq_len={self.args.max_seq_len}")
        cos, sin = rotary_cos_sin(
            T, self.args.dim // self.args.n_heads, self.args.rope_theta, tokens.device
        )
        x = self.tok_embeddings(tokens)  # (B, T, D)
        for layer in self.layers:
            x = layer(x, cos, sin)
        return self.lm_head(self.norm(x))  # (B, T, V)
