"""MoE metrics in the training log: `load_balancing_loss` (or `seq_load_balancing_loss`) /
`z_loss` in the log line and TensorBoard, per-layer values with --moe-per-layer-logging,
per-expert token fractions.

Called by `training_log` on every rank every iteration (the reductions are collectives).
"""

from megatron.core import parallel_state as mpu
from megatron.core.num_microbatches_calculator import get_num_microbatches
from megatron.core.transformer.moe.moe_utils import EXPERT_LOAD, track_moe_metrics


def _expected_entries(args):
    """Tracker entries every rank must hold: one value per layer for each loss the router
    records, and per-layer per-expert token counts."""
    names = []
    if args.moe_z_loss_coeff is not None:
        names.append('z_loss')
    balance_names = {'aux_loss': 'load_balancing_loss', 'seq_aux_loss': 'seq_load_balancing_loss'}
    if args.moe_router_load_balancing_type in balance_names and args.moe_aux_loss_coeff:
        names.append(balance_names[args.moe_router_load_balancing_type])
    entries = {name: (args.num_layers,) for name in names}
    entries[EXPERT_LOAD] = (args.num_layers, args.num_experts)
    return entries


def log_moe_metrics(args, iteration, writer, total_loss_dict):
    """Reduce the MoE tracker over pipeline stages, tensor / context and data-parallel ranks,
    write TensorBoard scalars (on the writer's rank) and add the losses to `total_loss_dict`,
    which puts them in the log line. A no-op without --num-experts."""
    if args.num_experts is None:
        return {}
    return track_moe_metrics(
        1.0 / get_num_microbatches(),
        iteration,
        writer,
        total_loss_dict,
        per_layer_logging=args.moe_per_layer_logging,
        expected_entries=_expected_entries(args),
        pp_group=mpu.get_pipeline_model_parallel_group(),
        dp_group=mpu.get_data_parallel_group(),
    )
