"""How the decoder's layers are dealt to the pipeline stages when the split is uneven.

By default every stage holds num_layers / pp consecutive layers. Later Megatron-core versions let
the first and/or the last stage hold a chosen number of layers instead
(`TransformerConfig.first_pipeline_num_layers` / `last_pipeline_num_layers`, set from
`--decoder-first-pipeline-num-layers` / `--decoder-last-pipeline-num-layers`); the layers left
over are spread evenly over the other stages. r0.8's `--standalone-embedding-stage` is the case
first = 0: stage 0 holds the input embedding and no transformer layer.

Pure arithmetic, no process groups: the model asks with its own pipeline rank and size, and the
checkpoint converters ask for every stage of a layout they do not run.
"""

from typing import List, Optional


def uneven_split_requested(first: Optional[int], last: Optional[int]) -> bool:
    """Whether a first- or last-stage layer count overrides the even split."""
    return first is not None or last is not None


def check_pipeline_layer_split(
    num_layers: int, pp_size: int, first: Optional[int], last: Optional[int]
) -> None:
    """Raise ValueError when the first/last counts cannot split `num_layers` over `pp_size` stages.

    Args:
        num_layers: decoder layers of the whole model.
        pp_size: pipeline-parallel stages.
        first: layers on stage 0, or None for the even share.
        last: layers on the last stage, or None for the even share.
    """
    if not uneven_split_requested(first, last):
        return
    for name, value in (('first', first), ('last', last)):
        if value is not None and value < 0:
            raise ValueError(f"{name}_pipeline_num_layers must be >= 0, got {value}")
    fixed = [value for value in (first, last) if value is not None]
    if pp_size < 1 + len(fixed):
        raise ValueError(
            f"an uneven pipeline split (first_pipeline_num_layers={first}, "
            f"last_pipeline_num_layers={last}) needs pipeline_model_parallel_size > "
            f"{len(fixed)}, got {pp_size}"
        )
    rest = num_layers - sum(fixed)
    others = pp_size - len(fixed)
    if rest < 0 or rest % others != 0:
        raise ValueError(
            f"num_layers ({num_layers}) minus the fixed stages' layers ({sum(fixed)}) must "
            f"split evenly over the other {others} pipeline stages, got {rest}"
        )


def pipeline_stage_layer_counts(
    num_layers: int, pp_size: int, first: Optional[int] = None, last: Optional[int] = None
) -> List[int]:
    """Layers held by each pipeline stage, stage 0 first.

    Example: 6 layers, 3 stages, first=0 (a standalone embedding stage) -> [0, 3, 3].
    """
    check_pipeline_layer_split(num_layers, pp_size, first, last)
    if not uneven_split_requested(first, last):
        return [num_layers // pp_size] * pp_size
    fixed = [value for value in (first, last) if value is not None]
    share = (num_layers - sum(fixed)) // (pp_size - len(fixed))
    counts = [share] * pp_size
    if first is not None:
        counts[0] = first
    if last is not None:
        counts[-1] = last
    return counts


def pipeline_stage_layer_offset(
    num_layers: int, pp_size: int, pp_rank: int, first: Optional[int], last: Optional[int]
) -> int:
    """Global index of the first layer on stage `pp_rank` (its predecessors' layers summed)."""
    return sum(pipeline_stage_layer_counts(num_layers, pp_size, first, last)[:pp_rank])
