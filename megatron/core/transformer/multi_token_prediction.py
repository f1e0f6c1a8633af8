"""Multi-token prediction (MTP, DeepSeek-V3; later Megatron's `multi_token_prediction.py`).

Depth k = 1 .. D predicts the token k + 1 places ahead. With h_0 the decoder output after the
final norm, [s, b, h]:

    ids_k, labels_k, mask_k = each rolled left once more (the tail zero-filled)
    x_k = eh_proj([enorm(embedding(ids_k)) ; hnorm(h_{k-1})])     eh_proj [h, 2h], embedding first
    h_k = final_layernorm(layer_k(x_k))                             layer_k: the last layer's spec
    L_k = sum(mask_k * CE(output_layer(h_k), labels_k)) / sum(mask_k)

The output layer and the embedding are the main model's. L_k is not part of "lm loss": it is
logged as "mtp_{k} loss", and (mtp_loss_scaling_factor / D) * L_k is injected into the backward
pass through the main hidden state (`MoEAuxLossAutoScaler`, whose gradient scale the schedule sets
to loss scale / micro-batches, as for the main loss). Layer_k uses the main rotary angles: a
uniform position shift leaves RoPE attention unchanged.

Tensor parallelism: eh_proj is a ColumnParallelLinear (split along h over TP, backward: the
input gradient is all-reduced) whose output is all-gathered over TP (backward: split); the inner
layer is split as every layer.
Under sequence parallelism the embedding and h_{k-1} arrive as [s/tp, b, h] slices: eh_proj
all-gathers its input along s (backward: reduce-scatter), and its gathered [s, b, h] output is
split back to this rank's slice (backward: all-gather) for the inner layer, whose MoE router then
balances over the same tp slices as the decoder's; the norms carry `sequence_parallel`, so their
gradients are summed over tp. Pipeline and context parallelism are refused (mtp_config_checks.py).
"""

from typing import Callable, Dict, List, Optional

import torch
from torch import Tensor

from megatron.core import tensor_parallel
from megatron.core.process_groups_config import resolve_process_groups
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler
from megatron.core.transformer.spec_utils import ModuleSpec, build_module
from megatron.core.transformer.torch_norm import WrappedTorchNorm

#: {depth k: summed detached L_k of this iteration's micro-batches} (training only).
_MTP_LOSS_TRACKER: Dict[int, Tensor] = {}


def mtp_loss_tracker() -> Dict[int, Tensor]:
    """The MTP losses recorded since the last `clear_mtp_loss_tracker`."""
    return _MTP_LOSS_TRACKER


def clear_mtp_loss_tracker() -> None:
    _MTP_LOSS_TRACKER.clear()


def roll_left(tensor: Tensor, dim: int = -1, segment_offsets: Optional[Tensor] = None) -> Tensor:
    """Shift `tensor` one place towards index 0 along `dim`; the freed last place holds 0.

    With `segment_offsets` (packed sequences: where each segment starts in the batch-major
    b * s stream of a [b, s] tensor, then the stream's end) every segment shifts on its own: its
    last place holds 0 instead of the next segment's first token, so no prediction crosses a
    document boundary.
    """
    if segment_offsets is None:
        rolled = torch.roll(tensor, shifts=-1, dims=dim)
        rolled.narrow(dim, tensor.size(dim) - 1, 1).zero_()
        return rolled
    flat = torch.roll(tensor.reshape(-1), shifts=-1)  # [b * s]
    ends = segment_offsets[1:].to(device=flat.device, dtype=torch.long) - 1
    flat[ends] = 0
    flat[-1] = 0
    return flat.view_as(tensor)


class MultiTokenPredictionLayer(MegatronModule):
    """One MTP depth: enorm, hnorm, eh_proj, the inner transformer layer, final_layernorm.

    Args:
        config (TransformerConfig): the model config.
        layer_spec (ModuleSpec): spec of the inner layer (the last decoder layer's).
        depth (int): k (1-based).
        pg_collection (ProcessGroupCollection, optional): its `tp` group splits eh_proj and the
            inner layer.
    """

    def __init__(self, config, layer_spec: ModuleSpec, depth: int, pg_collection=None):
        super().__init__(config=config)
        self.pg_collection = resolve_process_groups(pg_collection, ("tp",))
        h, eps = config.hidden_size, config.layernorm_epsilon
        self.enorm = WrappedTorchNorm(config=config, hidden_size=h, eps=eps)
        self.hnorm = WrappedTorchNorm(config=config, hidden_size=h, eps=eps)
        self.eh_proj = tensor_parallel.ColumnParallelLinear(
            2 * h,
            h,
            config=config,
            init_method=config.init_method,
            bias=False,
            gather_output=False,  # gathered in forward: ColumnParallelLinear refuses it with SP
            skip_bias_add=False,
            tp_group=self.pg_collection.tp,
        )
        self.transformer_layer = build_module(
            layer_spec,
            config=config,
            layer_number=config.num_layers + depth,
            pg_collection=pg_collection,
        )
        self.final_layernorm = WrappedTorchNorm(config=config, hidden_size=h, eps=eps)

    def forward(
        self,
        embedded: Tensor,
        hidden: Tensor,
        attention_mask,
        rotary_pos_emb,
        packed_seq_params=None,
    ) -> Tensor:
        """embedded (of the rolled ids) and hidden (h_{k-1}) [s, b, h] -> h_k [s, b, h]
        ([s/tp, b, h] each under sequence parallelism)."""
        x = torch.cat((self.enorm(embedded), self.hnorm(hidden)), dim=-1)  # [s, b, 2h]
        x, _ = self.eh_proj(x)  # [s, b, h/tp] (all-gathered along s with SP)
        # [s, b, h/tp] -> [s, b, h]; backward: this rank's slice of the gradient.
        x = tensor_parallel.gather_from_tensor_model_parallel_region(x, group=self.pg_collection.tp)
        if self.eh_proj.sequence_parallel:
            # [s, b, h] -> [s/tp, b, h]; backward: all-gather along s.
            x = tensor_parallel.scatter_to_sequence_parallel_region(x, group=self.pg_collection.tp)
        x, _ = self.transformer_layer(
            x,
            attention_mask=attention_mask,
            rotary_pos_emb=rotary_pos_emb,
            packed_seq_params=packed_seq_params,
        )
        return self.final_layernorm(x)


class MultiTokenPredictionBlock(MegatronModule):
    """The D MTP layers (`mtp.layers.{k-1}.*`) and their losses.

    Args:
        config (TransformerConfig): reads mtp_num_layers and mtp_loss_scaling_factor.
        layer_spec (ModuleSpec): the inner layers' spec.
        pg_collection (ProcessGroupCollection, optional): the model's groups.
    """

    def __init__(self, config, layer_spec: ModuleSpec, pg_collection=None):
        super().__init__(config=config)
        self.layers = torch.nn.ModuleList(
            MultiTokenPredictionLayer(config, layer_spec, k + 1, pg_collection)
            for k in range(config.mtp_num_layers)
        )

    def sharded_state_dict(self, prefix: str = '', sharded_offsets: tuple = (), metadata=None):
        """Distributed checkpoint: each depth's own split (eh_proj over TP along its output, the
        inner layer as a decoder layer); the layer list itself holds no state. Without this the
        ModuleList would be saved as replicated tensors, which no other TP size can load."""
        sharded = {}
        for depth, layer in enumerate(self.layers):
            sharded.update(
                layer.sharded_state_dict(f'{prefix}layers.{depth}.', sharded_offsets, metadata)
            )
        return sharded

    def losses(
        self,
        hidden: Tensor,
        input_ids: Tensor,
        position_ids: Optional[Tensor],
        labels: Tensor,
        loss_mask: Optional[Tensor],
        embedding: Callable,
        token_losses: Callable,
        attention_mask=None,
        rotary_pos_emb=None,
        packed_seq_params=None,
    ) -> List[Tensor]:
        """[L_1 .. L_D] (fp32 scalars with their graphs) for the main hidden state h_0 [s, b, h].

        Args:
            input_ids, labels, loss_mask, position_ids: [b, s] of the main model.
            embedding: (ids, position_ids) -> [s, b, h], the main embedding.
            token_losses: (h [s, b, h], labels [b, s]) -> per-token CE [b, s] through the main
                output layer.
        """
        if loss_mask is None:
            loss_mask = torch.ones_like(labels, dtype=torch.float32)
        loss_mask = loss_mask.float()
        result = []
        offsets = None if packed_seq_params is None else packed_seq_params.segment_offsets()
        for layer in self.layers:
            input_ids, labels, loss_mask = (
                roll_left(t, segment_offsets=offsets) for t in (input_ids, labels, loss_mask)
            )
            if position_ids is not None:
                position_ids = roll_left(position_ids, segment_offsets=offsets)
            embedded = embedding(input_ids=input_ids, position_ids=position_ids)
            hidden = layer(embedded, hidden, attention_mask, rotary_pos_emb, packed_seq_params)
            ce = token_losses(hidden, labels)  # [b, s]
            result.append((ce * loss_mask).sum() / loss_mask.sum().clamp(min=1.0))
        return result

    def forward(self, hidden: Tensor, **kwargs) -> Tensor:
        """Inject (factor / D) * L_k of every depth into h_0's backward; returns h_0 [s, b, h]
        (unchanged values). Records the detached L_k in training."""
        losses = self.losses(hidden, **kwargs)
        scale = self.config.mtp_loss_scaling_factor / len(self.layers)
        for depth, loss in enumerate(losses, start=1):
            if self.training:
                detached = loss.detach().float()
                _MTP_LOSS_TRACKER[depth] = _MTP_LOSS_TRACKER.get(depth, 0.0) + detached
            hidden = MoEAuxLossAutoScaler.apply(hidden, scale * loss)
        return hidden
