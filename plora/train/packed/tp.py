"""Tensor parallelism for packed jobs: Megatron-style sharding of every decoder block.

A job on `d` GPUs runs as `d` processes (`tune run --nproc_per_node d`), one per GPU, all
in one process group. Inside every decoder block the linears are split the Megatron way,
in DTensor's placement terms:

- column-parallel (q, k, v, gate, up): base weight and bias `Shard(0)` (output features);
  LoRA A replicated, B_kᵀ (stored `[r_k, out]`) `Shard(1)`. The input is replicated, the
  output stays sharded along its last dim (heads, or the MLP's intermediate features).
- row-parallel (o, down): base weight `Shard(1)` (input features), bias replicated (added
  once, after the reduction); LoRA A_k (`[r_k, in]`) `Shard(1)`, B replicated. Each rank
  computes `x_i W_iᵀ + s_k (x_i A_{k,i}ᵀ) B_k` on its input shard and one all-reduce sums
  them: S B is linear in S, so no separate reduction of the low-rank activations is needed.

Embeddings, norms and the output head stay replicated: every rank computes them on the
same values, so the logits, losses and eval decisions are the same on every rank.

The parameters hold their local shards as plain tensors rather than DTensors: the packed
kernels and the flat per-adapter AdamW and norms (`plora.train.packed.bank`) then run on plain
tensors (no DTensor dispatch per LoRA tensor per step), and the optimizer state is sharded
like the parameters with no extra work. The collectives are explicit and
autograd-aware (Megatron's f and g): f (identity forward, all-reduce backward) sits on the
output of each block's two norms, which feed all the column-parallel layers of the block,
so q, k and v share one all-reduce of dx in backward; g (all-reduce forward, identity
backward) ends each row-parallel layer.

Gradients of the replicated LoRA tensors (A of column-parallel layers, B of row-parallel
ones) come out of backward as partial sums (e.g. dA_k = Σ_i dS_{k,i}ᵀ x_k over the output
shards); `reduce_grads` sums them with one bucketed all-reduce per step. When a model has
fewer KV heads than ranks (Qwen2.5-3B: 2 KV heads at TP 4), each KV head is held by
`d / n_kv` ranks (the ones whose query heads use it): those k/v shards are "copies", and
their gradients are summed over the copies in the same all-reduce.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from plora.kernels import packed_lora_linear
from plora.train.packed.inject import PackedModel
from plora.train.packed.layer import PackedLoRALinear

#: torchtune sub-module path inside a decoder block -> style
COLWISE = ("attn.q_proj", "attn.k_proj", "attn.v_proj", "mlp.w1", "mlp.w3")
ROWWISE = ("attn.output_proj", "mlp.w2")
_KV = ("attn.k_proj", "attn.v_proj")


# ------------------------------------------------------------------ collectives (f and g)
class _CopyToTP(torch.autograd.Function):
    """f: identity forward; backward all-reduces the partial input gradients of the shards."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, dy):
        dy = dy.contiguous()
        dist.all_reduce(dy, group=ctx.group)
        return dy, None


class _ReduceFromTP(torch.autograd.Function):
    """g: forward sums the ranks' partial outputs; identity backward (dy is replicated)."""

    @staticmethod
    def forward(ctx, y, group):
        y = y.contiguous()
        dist.all_reduce(y, group=group)
        return y

    @staticmethod
    def backward(ctx, dy):
        return dy, None


def copy_to_tp(x: torch.Tensor, group) -> torch.Tensor:
    return _CopyToTP.apply(x, group)


def reduce_from_tp(y: torch.Tensor, group) -> torch.Tensor:
    return _ReduceFromTP.apply(y, group)


# ------------------------------------------------------------------------ layouts
@dataclass(frozen=True)
class Split:
    """How one linear is cut: this rank's slice [lo, hi) of the split dim, of `full`.

    `copies` ranks hold the same slice (KV heads fewer than ranks); 1 otherwise.
    """

    style: str  # "col" (split output features) | "row" (split input features)
    lo: int
    hi: int
    full: int
    copies: int = 1


def _even(full: int, size: int, rank: int, what: str) -> tuple[int, int]:
    if full % size:
        raise ValueError(f"{what} ({full}) is not divisible by the tensor-parallel degree {size}")
    n = full // size
    return rank * n, (rank + 1) * n


def check_tp_degree(num_heads: int, num_kv_heads: int, size: int) -> None:
    """Attention is split by heads: d | n_heads, and d | n_kv or n_kv | d (KV heads copied)."""
    if num_heads % size:
        raise ValueError(f"{num_heads} attention heads are not divisible by the tensor-parallel degree {size}")
    if num_kv_heads % size and size % num_kv_heads:
        raise ValueError(
            f"{num_kv_heads} KV heads: the tensor-parallel degree {size} must divide them or be a multiple of them"
        )


def _split_for(path: str, out: int, inp: int, attn, size: int, rank: int) -> Split:
    if path in ROWWISE:
        lo, hi = _even(inp, size, rank, f"{path} input features")
        return Split("row", lo, hi, inp)
    if path in _KV and attn.num_kv_heads < size:
        copies = size // attn.num_kv_heads
        head = rank // copies
        hd = attn.head_dim
        return Split("col", head * hd, (head + 1) * hd, out, copies)
    lo, hi = _even(out, size, rank, f"{path} output features")
    return Split("col", lo, hi, out)


class ShardedLinear(nn.Module):
    """A frozen base linear that no adapter targets, split like the packed ones."""

    def __init__(self, base: nn.Linear, split: Split, group):
        super().__init__()
        self.split, self.group = split, group
        w, b = base.weight.detach(), base.bias
        if split.style == "col":
            w = w[split.lo : split.hi]
            b = b.detach()[split.lo : split.hi] if b is not None else None
        else:
            w = w[:, split.lo : split.hi]
            b = b.detach() if b is not None else None
        self.weight = nn.Parameter(w.contiguous().clone(), requires_grad=False)
        self.bias = nn.Parameter(b.contiguous().clone(), requires_grad=False) if b is not None else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.split.style == "col":  # the input is already f-ed at the block's norm
            return F.linear(x, self.weight, self.bias)
        y = reduce_from_tp(F.linear(x, self.weight), self.group)
        return y + self.bias if self.bias is not None else y

    def extra_repr(self) -> str:
        s = self.split
        return f"{s.style}-parallel [{s.lo}:{s.hi}] of {s.full}, copies={s.copies}"


class PackedShard:
    """What a sharded `PackedLoRALinear` needs in forward (installed as `layer.tp`)."""

    def __init__(self, split: Split, group):
        self.split, self.group = split, group

    def forward(self, layer: PackedLoRALinear, x: torch.Tensor) -> torch.Tensor:
        state, split = layer.state, self.split
        row = split.style == "row"
        lead = x.shape[:-1]
        x2 = x.reshape(-1, x.shape[-1])
        weight, bias = layer.base.weight, layer.base.bias
        if not state.active:
            y = F.linear(x2, weight, None if row else bias)
        else:
            # every rank draws the columns it holds of the unsharded layer's mask
            offset = split.lo if row else 0
            lora_x = state.lora_input(x2, layer.dropout_key, offset) if layer.training else None
            y = packed_lora_linear(x2, weight, None if row else bias, layer.a_all, layer.bt_all, state.meta, lora_x=lora_x)
        if row:
            y = reduce_from_tp(y, self.group)
            if bias is not None:
                y = y + bias
        return y.reshape(*lead, y.shape[-1])


# -------------------------------------------------------------------------- driver
class TensorParallel:
    """The TP side of one packed job: shards the model and keeps the ranks consistent."""

    def __init__(self, group=None):
        self.group = group
        self.size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.pm: PackedModel | None = None
        # trainable tensors that are not plain shards: how many ranks hold the same values
        self.copies: dict[nn.Parameter, int] = {}
        self._replicated: list[nn.Parameter] = []
        self._kv_copies: list[tuple[nn.Parameter, Split]] = []  # B_kᵀ shards of copied KV heads
        self._splits: dict[str, Split] = {}

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    # ------------------------------------------------------------------ sharding
    def shard(self, pm: PackedModel) -> PackedModel:
        """Split every decoder block of `pm.model` in place; call before building the optimizer."""
        from torchtune.modules import MultiHeadAttention, TransformerSelfAttentionLayer

        self.pm = pm
        size, rank, group = self.size, self.rank, self.group
        for i, block in enumerate(pm.model.layers):
            if not isinstance(block, TransformerSelfAttentionLayer):
                raise NotImplementedError(f"layers.{i} is {type(block).__name__}; TP supports self-attention decoders")
            attn = block.attn
            if type(attn) is not MultiHeadAttention:  # fused qkv, q/k norms, soft-capping: not sharded
                from plora.models.families.table import tensor_parallel_families

                raise NotImplementedError(
                    f"tensor parallelism supports the {', '.join(tensor_parallel_families())} families; "
                    f"this model's attention (layers.{i}.attn) is {type(attn).__name__}: run it with tp 1"
                )
            check_tp_degree(attn.num_heads, attn.num_kv_heads, size)
            for path in COLWISE + ROWWISE:
                sub, attr = path.split(".")
                parent = getattr(block, sub)
                module = getattr(parent, attr, None)
                if module is None:
                    continue
                base = module.base if isinstance(module, PackedLoRALinear) else module
                split = _split_for(path, base.out_features, base.in_features, attn, size, rank)
                name = f"layers.{i}.{path}"
                self._splits[name] = split
                if isinstance(module, PackedLoRALinear):
                    self._shard_packed(module, split)
                elif isinstance(module, nn.Linear):
                    setattr(parent, attr, ShardedLinear(module, split, group))
                else:
                    raise NotImplementedError(f"{name} is {type(module).__name__}")
            # f once per norm: everything column-parallel in the block reads these two outputs
            block.sa_norm.register_forward_hook(self._f_hook)
            block.mlp_norm.register_forward_hook(self._f_hook)
            attn.num_heads //= size
            attn.num_kv_heads = max(1, attn.num_kv_heads // size)
            attn.embed_dim //= size
        return pm

    def _f_hook(self, module, args, output):
        return copy_to_tp(output, self.group)

    def _shard_packed(self, layer: PackedLoRALinear, split: Split) -> None:
        base = layer.base
        lo, hi = split.lo, split.hi
        with torch.no_grad():
            if split.style == "col":
                w = base.weight[lo:hi]
                b = base.bias[lo:hi] if base.bias is not None else None
                base.out_features = hi - lo
            else:
                w = base.weight[:, lo:hi]
                b = base.bias
                base.in_features = hi - lo
            base.weight = nn.Parameter(w.contiguous().clone(), requires_grad=False)
            if b is not None:
                base.bias = nn.Parameter(b.contiguous().clone(), requires_grad=False)
            a, bt = layer.a_all, layer.bt_all  # every adapter's rows, stacked
            if split.style == "col":  # A replicated, Bᵀ split along out
                bt = nn.Parameter(bt[:, lo:hi].contiguous().clone())
                self.copies[a] = self.size
                self._replicated.append(a)
                self.copies[bt] = split.copies
                if split.copies > 1:
                    self._kv_copies.append((bt, split))
            else:  # A split along in, Bᵀ replicated
                a = nn.Parameter(a[:, lo:hi].contiguous().clone())
                self.copies[bt] = self.size
                self._replicated.append(bt)
                self.copies[a] = 1
            layer.a_all, layer.bt_all = a, bt
        layer.tp = PackedShard(split, self.group)

    # ------------------------------------------------------------------ training
    def reduce_grads(self) -> None:
        """Sum the partial gradients of replicated LoRA tensors (and of copied KV shards)
        over the ranks: one all-reduce for the whole step.

        Every rank has gradients on the same tensors (the active adapters are the same on
        every rank), so the flat buffers line up.
        """
        parts, targets = [], []
        for p in self._replicated:
            if p.grad is not None:
                parts.append(p.grad.reshape(-1))
                targets.append((p, None))
        for p, split in self._kv_copies:
            if p.grad is not None:
                padded = p.grad.new_zeros(p.grad.shape[0], split.full)
                padded[:, split.lo : split.hi] = p.grad
                parts.append(padded.reshape(-1))
                targets.append((p, split))
        if not parts:
            return
        flat = torch.cat(parts)
        dist.all_reduce(flat, group=self.group)
        for (p, split), chunk in zip(targets, flat.split([t.numel() for t in parts])):
            if split is None:
                p.grad.copy_(chunk.view_as(p.grad))
            else:
                p.grad.copy_(chunk.view(p.grad.shape[0], split.full)[:, split.lo : split.hi])

    def take_reduced_grads(self) -> list[torch.Tensor]:
        """The gradients `reduce_grads` sums (replicated tensors, copied KV shards) as they
        are, cleared: where an adapter accumulates its gradient over several steps, what it
        has summed so far is the same on every rank already, so the all-reduce must see only
        this step's partial gradients; `give_back_grads` adds the held ones back after it."""
        held = []
        for p in self._reduced():
            held.append(p.grad.clone())
            p.grad.zero_()
        return held

    def give_back_grads(self, held: list[torch.Tensor]) -> None:
        for p, g in zip(self._reduced(), held):
            p.grad.add_(g)

    def _reduced(self) -> list[nn.Parameter]:
        return [p for p in self._replicated if p.grad is not None] + [p for p, _ in self._kv_copies
                                                                      if p.grad is not None]

    def share(self, p: nn.Parameter) -> float:
        """The weight of a local tensor's squared norm in an adapter's norm over the whole
        unsharded model: 1 / the number of ranks that hold the same values."""
        return 1.0 / self.copies.get(p, 1)

    def reduce_sq_norms(self, sums: torch.Tensor) -> torch.Tensor:
        """Sum the ranks' weighted squared norms: one all-reduce, the same numbers on every
        rank, so every rank takes the same clipping and divergence decisions."""
        dist.all_reduce(sums, group=self.group)
        return sums

    def broadcast_(self, t: torch.Tensor) -> torch.Tensor:
        """Rank 0's values everywhere (losses, prune flags): one decision for all ranks."""
        dist.broadcast(t, src=dist.get_global_rank(self.group, 0) if self.group is not None else 0, group=self.group)
        return t

    # ------------------------------------------------------------------ checkpoints
    def adapter_state_dict(self, k: int) -> dict[str, torch.Tensor]:
        """`PackedModel.adapter_state_dict(k)` with every shard gathered to the full tensor.

        A collective: every rank calls it, in the same order. One all-gather per adapter.
        """
        pm = self.pm
        assert pm is not None, "shard() first"
        local: list[tuple[str, torch.Tensor, Split | None]] = []
        for name, layer in pm.layers.items():
            split = self._splits[name]
            a, bt = layer.lora_a[k].detach(), layer.lora_bt[k].detach()
            if split.style == "col":
                local += [(f"{name}.lora_a.weight", a, None), (f"{name}.lora_b.weight", bt, split)]
            else:
                local += [(f"{name}.lora_a.weight", a, split), (f"{name}.lora_b.weight", bt, None)]
        shards = [t for _, t, s in local if s is not None]
        flat = torch.cat([t.reshape(-1) for t in shards])
        gathered = [torch.empty_like(flat) for _ in range(self.size)]
        dist.all_gather(gathered, flat, group=self.group)
        per_rank = [g.split([t.numel() for t in shards]) for g in gathered]
        out: dict[str, torch.Tensor] = {}
        j = 0
        for key, t, split in local:
            if split is None:
                full = t.clone()
            else:
                # one rank per distinct slice, in order (ranks 0, c, 2c… for copied KV heads)
                pieces = [per_rank[r][j].view_as(t) for r in range(0, self.size, split.copies)]
                full = torch.cat(pieces, dim=1)
                j += 1
            out[key] = full.t() if key.endswith("lora_b.weight") else full
        return out


# ------------------------------------------------------------------------ process group
def tp_degree(cfg_tp: int | None = None) -> int:
    """The job's TP degree: torchrun's WORLD_SIZE; a config `tp` must agree with it."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if cfg_tp is not None and int(cfg_tp) != world:
        raise ValueError(
            f"the job config asks for tp={cfg_tp} but {world} process(es) were launched; "
            f"run it with `tune run --nproc_per_node {cfg_tp} ...`"
        )
    return world


def init_tp(device: torch.device) -> tuple[TensorParallel, torch.device]:
    """Join the job's process group (nccl on CUDA, gloo on CPU); the rank's device."""
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if device.type == "cuda":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        if device.type == "cuda":
            dist.init_process_group("nccl", device_id=device)
        else:
            dist.init_process_group("gloo")
    return TensorParallel(), device


def close_tp() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
