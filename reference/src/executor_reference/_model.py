"""The reference transformer's layers, tensor-parallel, and one pipeline stage of it."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from executor_core.torch import ParallelState, mapped_zeros

from ._config import ModelConfig, stage_layers

__all__ = ["KVCache", "StageModel"]


class RMSNorm(nn.Module):
    """Root-mean-square norm with a learned scale (replicated on every TP rank)."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(size), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
        return (x.float() * scale).to(x.dtype) * self.weight


class ColumnParallelLinear(nn.Module):
    """``y = x W^T`` with W's output features split across TP ranks: each rank computes its
    slice of ``y``; no communication."""

    def __init__(self, in_features: int, out_features: int, tp_size: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(
            torch.empty(out_features // tp_size, in_features), requires_grad=False
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


class RowParallelLinear(nn.Module):
    """``y = x W^T`` with W's input features split across TP ranks: each rank multiplies its
    slice of ``x`` and the partial sums are all-reduced."""

    def __init__(self, in_features: int, out_features: int, state: ParallelState) -> None:
        super().__init__()
        self.weight = nn.Parameter(
            torch.empty(out_features, in_features // state.tp_size), requires_grad=False
        )
        self.state = state

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.state.tp_all_reduce(F.linear(x, self.weight))


class VocabParallelEmbedding(nn.Module):
    """Token embedding with the vocabulary split across TP ranks: each rank looks up the ids
    it holds, zeros the others, and the results are all-reduced."""

    def __init__(self, vocab_size: int, hidden_size: int, state: ParallelState) -> None:
        super().__init__()
        per_rank = vocab_size // state.tp_size
        self.start = state.tp_rank * per_rank
        self.stop = self.start + per_rank
        self.weight = nn.Parameter(torch.empty(per_rank, hidden_size), requires_grad=False)
        self.state = state

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.state.tp_size == 1:
            return F.embedding(ids, self.weight)
        foreign = (ids < self.start) | (ids >= self.stop)
        local = (ids - self.start).masked_fill(foreign, 0)
        out = F.embedding(local, self.weight).masked_fill(foreign.unsqueeze(-1), 0.0)
        return self.state.tp_all_reduce(out)


class ParallelLMHead(nn.Module):
    """Vocabulary logits with the vocabulary split across TP ranks, then all-gathered."""

    def __init__(self, vocab_size: int, hidden_size: int, state: ParallelState) -> None:
        super().__init__()
        self.weight = nn.Parameter(
            torch.empty(vocab_size // state.tp_size, hidden_size), requires_grad=False
        )
        self.state = state

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.state.tp_all_gather(F.linear(x, self.weight), dim=-1)


class KVCache:
    """Keys and values of every sequence slot, for this stage's layers and this rank's heads.

    One tensor of shape ``[layers, 2, slots, local_heads, max_seq_len, head_dim]``; the
    driver assigns each sequence a slot.
    """

    def __init__(
        self,
        config: ModelConfig,
        *,
        num_layers: int,
        num_slots: int,
        tp_size: int,
        device: torch.device,
    ) -> None:
        local_heads = config.num_heads // tp_size
        self.num_slots = num_slots
        shape = (num_layers, 2, num_slots, local_heads, config.max_seq_len, config.head_dim)
        dtype = getattr(torch, config.dtype)
        # On the CPU in a mapping of its own, so that sleep gives it back to the OS.
        self.tensor = (
            mapped_zeros(shape, dtype)
            if device.type == "cpu"
            else torch.zeros(shape, dtype=dtype, device=device)
        )

    @property
    def nbytes(self) -> int:
        """Bytes the cache holds."""
        return self.tensor.numel() * self.tensor.element_size()


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)


class Attention(nn.Module):
    """Multi-head causal self-attention with rotary positions and a KV cache; the heads are
    split across TP ranks (column-parallel q/k/v, row-parallel output)."""

    def __init__(self, config: ModelConfig, state: ParallelState) -> None:
        super().__init__()
        h, tp = config.hidden_size, state.tp_size
        self.local_heads = config.num_heads // tp
        self.head_dim = config.head_dim
        self.q_proj = ColumnParallelLinear(h, h, tp)
        self.k_proj = ColumnParallelLinear(h, h, tp)
        self.v_proj = ColumnParallelLinear(h, h, tp)
        self.o_proj = RowParallelLinear(h, h, state)

    def forward(
        self,
        x: torch.Tensor,
        cache: torch.Tensor,
        slots: torch.Tensor,
        start: int,
        cos: torch.Tensor,
        sin: torch.Tensor,
    ) -> torch.Tensor:
        batch, length, _ = x.shape
        stop = start + length

        def heads(t: torch.Tensor) -> torch.Tensor:
            return t.view(batch, length, self.local_heads, self.head_dim).transpose(1, 2)

        q = _rotate(heads(self.q_proj(x)), cos, sin)
        k = _rotate(heads(self.k_proj(x)), cos, sin)
        v = heads(self.v_proj(x))
        # cache: [2, slots, heads, max_seq_len, head_dim]
        cache[0, slots, :, start:stop] = k
        cache[1, slots, :, start:stop] = v
        keys = cache[0, slots, :, :stop]
        values = cache[1, slots, :, :stop]
        if length == 1:
            out = F.scaled_dot_product_attention(q, keys, values)
        elif start == 0:
            out = F.scaled_dot_product_attention(q, keys, values, is_causal=True)
        else:
            positions = torch.arange(stop, device=x.device)
            allowed = positions[None, :] <= (start + torch.arange(length, device=x.device))[:, None]
            out = F.scaled_dot_product_attention(q, keys, values, attn_mask=allowed)
        projected: torch.Tensor = self.o_proj(out.transpose(1, 2).reshape(batch, length, -1))
        return projected


class MLP(nn.Module):
    """SwiGLU MLP: column-parallel gate and up projections, row-parallel down projection."""

    def __init__(self, config: ModelConfig, state: ParallelState) -> None:
        super().__init__()
        h, i = config.hidden_size, config.intermediate_size
        self.gate_proj = ColumnParallelLinear(h, i, state.tp_size)
        self.up_proj = ColumnParallelLinear(h, i, state.tp_size)
        self.down_proj = RowParallelLinear(i, h, state)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        return out


class DecoderLayer(nn.Module):
    """Pre-norm attention and MLP blocks, each with a residual connection."""

    def __init__(self, config: ModelConfig, state: ParallelState) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(config.hidden_size, config.norm_eps)
        self.attn = Attention(config, state)
        self.mlp_norm = RMSNorm(config.hidden_size, config.norm_eps)
        self.mlp = MLP(config, state)

    def forward(
        self,
        x: torch.Tensor,
        cache: torch.Tensor,
        slots: torch.Tensor,
        start: int,
        cos: torch.Tensor,
        sin: torch.Tensor,
    ) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), cache, slots, start, cos, sin)
        out: torch.Tensor = x + self.mlp(self.mlp_norm(x))
        return out


class StageModel(nn.Module):
    """The part of the model one rank runs: its pipeline stage's layers, its TP shard of each.

    Parameter names match the checkpoint's tensor names (``layers.3.mlp.up_proj.weight``), so
    a shard loads with ``load_state_dict(shard, assign=True)``. Built on the meta device: no
    memory is used until the shard is loaded.
    """

    def __init__(self, config: ModelConfig, state: ParallelState) -> None:
        super().__init__()
        self.config = config
        self.state = state
        self.layer_ids = stage_layers(config.num_layers, state.pp_size, state.pp_rank)
        with torch.device("meta"):
            self.embed = (
                VocabParallelEmbedding(config.vocab_size, config.hidden_size, state)
                if state.is_first_stage
                else None
            )
            self.layers = nn.ModuleDict(
                {str(i): DecoderLayer(config, state) for i in self.layer_ids}
            )
            if state.is_last_stage:
                self.norm: RMSNorm | None = RMSNorm(config.hidden_size, config.norm_eps)
                self.lm_head: ParallelLMHead | None = ParallelLMHead(
                    config.vocab_size, config.hidden_size, state
                )
            else:
                self.norm = self.lm_head = None
        head_dim = config.head_dim
        inv_freq = 1.0 / (
            config.rope_theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
        )
        angles = torch.outer(torch.arange(config.max_seq_len, dtype=torch.float32), inv_freq)
        dtype = getattr(torch, config.dtype)
        self._cos = angles.cos().to(device=state.device, dtype=dtype)
        self._sin = angles.sin().to(device=state.device, dtype=dtype)

    def use_state(self, state: ParallelState) -> None:
        """Run on ``state``'s groups from now on: after a rejoin (the same place in the job,
        on the same device, with new groups), every layer that communicates takes the new
        state; the weights stay as they are."""
        if (state.rank, state.tp_size, state.pp_size, state.device) != (
            self.state.rank,
            self.state.tp_size,
            self.state.pp_size,
            self.state.device,
        ):
            raise ValueError(
                f"this stage was built for rank {self.state.rank} (tp={self.state.tp_size}, "
                f"pp={self.state.pp_size}) on {self.state.device}, not rank {state.rank} "
                f"(tp={state.tp_size}, pp={state.pp_size}) on {state.device}"
            )
        for module in self.modules():
            if isinstance(getattr(module, "state", None), ParallelState):
                # setattr: nn.Module's __setattr__ is typed for tensors and modules only.
                setattr(module, "state", state)  # noqa: B010

    def forward(
        self,
        inputs: torch.Tensor,
        kv_cache: KVCache,
        slots: torch.Tensor,
        start: int,
    ) -> torch.Tensor:
        """Token ids ``[B, T]`` (first stage) or hidden states ``[B, T, H]`` (later stages) in;
        hidden states ``[B, T, H]`` out, or the last position's logits ``[B, V]`` on the last
        stage."""
        x = self.embed(inputs) if self.embed is not None else inputs
        length = x.shape[1]
        cos = self._cos[start : start + length]
        sin = self._sin[start : start + length]
        for index, layer in enumerate(self.layers.values()):
            x = layer(x, kv_cache.tensor[index], slots, start, cos, sin)
        if self.norm is None or self.lm_head is None:
            return x
        logits: torch.Tensor = self.lm_head(self.norm(x[:, -1]))
        return logits
