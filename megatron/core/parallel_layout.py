"""Megatron's rank layout as a pure function: every process group's rank lists, no processes.

`generate_model_parallel_groups(world_size, ...)` returns the tensor, pipeline, data, context,
model, embedding, position-embedding, tensor-and-data and expert groups that
`parallel_state.initialize_model_parallel()` creates. A rank's coordinates follow `order`
(default "tp-cp-ep-dp-pp", first = fastest varying); see `parallel_state`'s docstring for the
16-rank example.
"""

from functools import partial
from typing import Callable, Dict, List, Optional, Sequence


class ParallelLayoutError(ValueError, RuntimeError):
    """Sizes or an order that do not describe a layout of the world.

    A ValueError (a user error, one line with the numbers); also a RuntimeError, which Megatron
    r0.8 raises for these and library code (its unit tests among it) catches.
    """


class ModelParallelInitError(RuntimeError, AssertionError):
    """initialize_model_parallel cannot run: no torch.distributed, or groups already exist.

    Megatron r0.8 asserts both, so this is also an AssertionError for library code catching it.
    """


def _prefix_product(sizes: Sequence[int]) -> List[int]:
    out = [1]
    for size in sizes:
        out.append(out[-1] * size)
    return out


def generate_masked_orthogonal_rank_groups(
    world_size: int, parallel_size: Sequence[int], mask: Sequence[bool]
) -> List[List[int]]:
    """Rank groups spanning the masked dimensions of a multi-dimensional rank grid.

    The world is viewed as a grid of shape `parallel_size` (first dimension fastest varying), so
    rank = sum(coord[i] * stride[i]) with stride[i] = prod(parallel_size[:i]). A group holds every
    rank that shares the coordinates of the unmasked dimensions; within a group, ranks are listed
    with the first masked dimension fastest. Example: sizes [tp=2, dp=3, pp=4] with mask
    [True, False, False] gives the tensor parallel groups [0, 1], [2, 3], ...

    Args:
        world_size: product of `parallel_size`.
        parallel_size: size of each dimension, fastest first.
        mask: which dimensions the groups span.

    Returns:
        world_size / prod(masked sizes) groups of global ranks.
    """
    assert len(parallel_size) == len(mask)
    strides = _prefix_product(parallel_size)
    assert strides[-1] == world_size, f"{parallel_size} does not multiply to {world_size}"
    masked = [(size, strides[i]) for i, (size, m) in enumerate(zip(parallel_size, mask)) if m]
    unmasked = [(size, strides[i]) for i, (size, m) in enumerate(zip(parallel_size, mask)) if not m]

    def offsets(dims):
        # Every combination of coordinates of `dims`, first dimension fastest, as rank offsets.
        result = [0]
        for size, stride in dims:
            result = [base + c * stride for c in range(size) for base in result]
        return result

    in_group = offsets(masked)
    return [[base + off for off in in_group] for base in offsets(unmasked)]


class RankGenerator:
    """Rank groups of a tp/cp/ep/dp/pp grid laid out in a given `order` (first = fastest).

    Expert parallelism subdivides data parallelism: the grid without ep has dimensions
    (tp, cp, dp, pp) in `order`, the grid with ep replaces dp by (ep, dp / ep).

    Args:
        tp, ep, dp, pp, cp: tensor, expert, data, pipeline and context parallel sizes
            (dp counts all data parallel ranks, including the expert parallel ones).
        order: dash-separated dimension names, e.g. "tp-cp-ep-dp-pp".
    """

    def __init__(self, tp: int, ep: int, dp: int, pp: int, cp: int, order: str):
        self.tp, self.ep, self.dp, self.pp, self.cp = tp, ep, dp, pp, cp
        self.world_size = tp * dp * pp * cp
        sizes = {"tp": tp, "pp": pp, "dp": dp, "ep": ep, "cp": cp}
        tokens = order.lower().split("-")
        for token in tokens:
            if token not in sizes:
                raise ParallelLayoutError(
                    f"order {order!r}: unknown dimension {token!r} (expected tp/cp/ep/dp/pp)"
                )
        if len(set(tokens)) != len(tokens):
            raise ParallelLayoutError(f"order {order!r} repeats a dimension")
        if "ep" in tokens and "ep-dp" not in order and "dp-ep" not in order:
            raise ParallelLayoutError(f"order {order!r}: ep and dp must be adjacent")
        for name, size in sizes.items():
            if name not in tokens:
                if size != 1:
                    raise ParallelLayoutError(
                        f"order {order!r} lacks {name!r} but its size is {size}, not 1"
                    )
                tokens.append(name)
        self.order_w_ep = "-".join(tokens)
        self.order_wo_ep = "-".join(t for t in tokens if t != "ep")
        self.ordered_size_w_ep = []
        self.ordered_size_wo_ep = []
        for token in tokens:
            if token == "dp":
                self.ordered_size_w_ep.append(dp // ep)
                self.ordered_size_wo_ep.append(dp)
            elif token == "ep":
                self.ordered_size_w_ep.append(ep)
            else:
                self.ordered_size_w_ep.append(sizes[token])
                self.ordered_size_wo_ep.append(sizes[token])

    @staticmethod
    def get_mask(order: str, token: str) -> List[bool]:
        """Which dimensions of `order` the dash-separated `token` names."""
        dims = order.split("-")
        mask = [False] * len(dims)
        for t in token.split("-"):
            mask[dims.index(t)] = True
        return mask

    def get_ranks(self, token: str, independent_ep: bool = False) -> List[List[int]]:
        """Groups spanning the dimensions in `token` (e.g. "tp-pp" = model parallel groups).

        Args:
            token: dash-separated dimension names.
            independent_ep: use the grid where ep is its own dimension (dp then means dp / ep).
        """
        if independent_ep:
            order, sizes = self.order_w_ep, self.ordered_size_w_ep
        else:
            order, sizes = self.order_wo_ep, self.ordered_size_wo_ep
        return generate_masked_orthogonal_rank_groups(
            self.world_size, sizes, self.get_mask(order, token)
        )


def _check_sizes(
    world_size: int,
    tensor_model_parallel_size: int,
    pipeline_model_parallel_size: int,
    context_parallel_size: int,
    expert_model_parallel_size: int,
    virtual_pipeline_model_parallel_size: Optional[int],
    pipeline_model_parallel_split_rank: Optional[int],
) -> int:
    """Validate the sizes; returns the data parallel size."""
    sizes = {
        "world_size": world_size,
        "tensor_model_parallel_size": tensor_model_parallel_size,
        "pipeline_model_parallel_size": pipeline_model_parallel_size,
        "context_parallel_size": context_parallel_size,
        "expert_model_parallel_size": expert_model_parallel_size,
    }
    for name, value in sizes.items():
        if not isinstance(value, int) or value < 1:
            raise ParallelLayoutError(f"{name} must be a positive integer, got {value!r}")
    model_size = tensor_model_parallel_size * pipeline_model_parallel_size * context_parallel_size
    if world_size % model_size != 0:
        raise ParallelLayoutError(
            f"world_size ({world_size}) is not divisible by tensor_model_parallel_size "
            f"({tensor_model_parallel_size}) x pipeline_model_parallel_size "
            f"({pipeline_model_parallel_size}) x context_parallel_size ({context_parallel_size}) "
            f"= {model_size}"
        )
    data_parallel_size = world_size // model_size
    if data_parallel_size % expert_model_parallel_size != 0:
        # Expert parallelism splits the data-parallel ranks only (Megatron core_r0.8's
        # initialize_model_parallel): dp x cp divisible by ep is not enough.
        raise ParallelLayoutError(
            f"data parallel size ({data_parallel_size} = world size {world_size} / (TP "
            f"{tensor_model_parallel_size} x PP {pipeline_model_parallel_size} x CP "
            f"{context_parallel_size})) is not divisible by expert_model_parallel_size "
            f"({expert_model_parallel_size}); expert parallelism splits the data-parallel "
            "ranks, not the context-parallel ones"
        )
    if virtual_pipeline_model_parallel_size is not None:
        if pipeline_model_parallel_size <= 1:
            raise ParallelLayoutError(
                f"virtual_pipeline_model_parallel_size ({virtual_pipeline_model_parallel_size}) "
                f"needs pipeline_model_parallel_size > 1, got {pipeline_model_parallel_size}"
            )
        if virtual_pipeline_model_parallel_size < 1:
            raise ParallelLayoutError(
                "virtual_pipeline_model_parallel_size must be >= 1, got "
                f"{virtual_pipeline_model_parallel_size}"
            )
    if pipeline_model_parallel_split_rank is not None and not (
        0 <= pipeline_model_parallel_split_rank < pipeline_model_parallel_size
    ):
        raise ParallelLayoutError(
            f"pipeline_model_parallel_split_rank ({pipeline_model_parallel_split_rank}) must be in "
            f"[0, pipeline_model_parallel_size ({pipeline_model_parallel_size}))"
        )
    return data_parallel_size


def hierarchical_context_parallel_groups(
    cp_groups: List[List[int]], hierarchical_sizes: Sequence[int]
) -> List[List[List[int]]]:
    """The groups of each level of hierarchical context parallelism, inside every CP group.

    Level 0 takes contiguous runs of `hierarchical_sizes[0]` ranks of a CP group; level l takes
    ranks strided by the product of the lower levels' sizes (as Megatron's
    `create_hierarchical_groups`). Example: CP group [0, 2, 4, 6] with sizes [2, 2] gives level 0
    [0, 2] [4, 6] and level 1 [0, 4] [2, 6].

    Returns:
        one list of groups (each a list of global ranks) per level.
    """
    sizes = list(hierarchical_sizes)
    levels = [[] for _ in sizes]
    for ranks in cp_groups:
        product = 1
        for size in sizes:
            product *= size
        if product != len(ranks):
            raise ParallelLayoutError(
                f"hierarchical context parallel sizes {sizes} multiply to {product}, not to the "
                f"context parallel size {len(ranks)}"
            )
        below = 1
        for level, size in enumerate(sizes):
            span = below * size
            for start in range(0, len(ranks), span):
                for offset in range(below):
                    levels[level].append([ranks[start + offset + i * below] for i in range(size)])
            below = span
    return levels


def default_embedding_ranks(pp_ranks: List[int], split_rank: Optional[int] = None) -> List[int]:
    """Ranks of one pipeline group holding the word embeddings: the first and last stage (the
    only stage when there is one), plus the encoder/decoder split stage when given. As in
    Megatron's megatron/core/parallel_state.py."""
    if len(pp_ranks) == 1:
        return [pp_ranks[0]]
    if split_rank is not None and pp_ranks[split_rank] not in (pp_ranks[0], pp_ranks[-1]):
        return [pp_ranks[0], pp_ranks[split_rank], pp_ranks[-1]]
    return [pp_ranks[0], pp_ranks[-1]]


def default_position_embedding_ranks(
    pp_ranks: List[int], split_rank: Optional[int] = None
) -> List[int]:
    """Ranks of one pipeline group holding the position embeddings: the first stage, plus the
    encoder/decoder split stage when given. As in Megatron's megatron/core/parallel_state.py."""
    if split_rank is not None and pp_ranks[0] != pp_ranks[split_rank]:
        return [pp_ranks[0], pp_ranks[split_rank]]
    return [pp_ranks[0]]


def generate_model_parallel_groups(
    world_size: int,
    tensor_model_parallel_size: int = 1,
    pipeline_model_parallel_size: int = 1,
    context_parallel_size: int = 1,
    expert_model_parallel_size: int = 1,
    order: str = "tp-cp-ep-dp-pp",
    pipeline_model_parallel_split_rank: Optional[int] = None,
    virtual_pipeline_model_parallel_size: Optional[int] = None,
    get_embedding_ranks: Optional[Callable[[List[int]], List[int]]] = None,
    get_position_embedding_ranks: Optional[Callable[[List[int]], List[int]]] = None,
    hierarchical_context_parallel_sizes: Optional[Sequence[int]] = None,
) -> Dict[str, List[List[int]]]:
    """Every group's rank lists of Megatron's layout, computed without processes.

    Args:
        world_size: total number of ranks.
        tensor_model_parallel_size, pipeline_model_parallel_size, context_parallel_size,
            expert_model_parallel_size: parallel sizes (data parallel size is what remains).
        order: rank layout, first dimension fastest varying.
        pipeline_model_parallel_split_rank: encoder/decoder split stage (adds the split rank
            to the embedding and position-embedding groups).
        virtual_pipeline_model_parallel_size: only validated here.
        get_embedding_ranks, get_position_embedding_ranks: callables mapping one pipeline
            group's ranks to the ranks of its (position) embedding group; default
            `default_embedding_ranks` / `default_position_embedding_ranks` with the split rank.
        hierarchical_context_parallel_sizes: sizes of the levels of hierarchical context
            parallelism (product = context_parallel_size); adds "hcp-0", "hcp-1", ...

    Returns:
        A dict from group kind to the list of groups (each a list of global ranks):
        "tp", "pp", "dp", "dp-cp" (data parallel with context parallel), "cp", "mp" (tensor +
        pipeline), "embedding", "position_embedding", "tp-dp", "tp-dp-cp", "tp-cp", "tp-ep",
        "mp-ep" (tensor + expert + pipeline), "ep", "dp-modulo-ep", "dp-modulo-ep-cp".
        Expert parallelism subdivides data parallelism (not context parallelism), as in
        Megatron core_r0.8: with CP, an expert group holds ranks of one CP rank and different
        DP ranks, and expert gradients reduce over "dp-modulo-ep-cp".

    Raises:
        ValueError: sizes that do not divide the world size, or an invalid order / split rank.
    """
    dp = _check_sizes(
        world_size,
        tensor_model_parallel_size,
        pipeline_model_parallel_size,
        context_parallel_size,
        expert_model_parallel_size,
        virtual_pipeline_model_parallel_size,
        pipeline_model_parallel_split_rank,
    )
    gen = RankGenerator(
        tp=tensor_model_parallel_size,
        ep=expert_model_parallel_size,
        dp=dp,
        pp=pipeline_model_parallel_size,
        cp=context_parallel_size,
        order=order,
    )
    groups = {
        "dp": gen.get_ranks("dp"),
        "dp-cp": gen.get_ranks("dp-cp"),
        "cp": gen.get_ranks("cp"),
        "mp": gen.get_ranks("tp-pp"),
        "tp": gen.get_ranks("tp"),
        "pp": gen.get_ranks("pp"),
        "tp-dp-cp": gen.get_ranks("tp-dp-cp"),
        "tp-dp": gen.get_ranks("tp-dp"),
        "tp-cp": gen.get_ranks("tp-cp"),
        "tp-ep": gen.get_ranks("tp-ep", independent_ep=True),
        "mp-ep": gen.get_ranks("tp-ep-pp", independent_ep=True),
        "ep": gen.get_ranks("ep", independent_ep=True),
        "dp-modulo-ep": gen.get_ranks("dp", independent_ep=True),
        "dp-modulo-ep-cp": gen.get_ranks("dp-cp", independent_ep=True),
    }
    if get_embedding_ranks is None:
        get_embedding_ranks = partial(
            default_embedding_ranks, split_rank=pipeline_model_parallel_split_rank
        )
    if get_position_embedding_ranks is None:
        get_position_embedding_ranks = partial(
            default_position_embedding_ranks, split_rank=pipeline_model_parallel_split_rank
        )
    if hierarchical_context_parallel_sizes is not None:
        levels = hierarchical_context_parallel_groups(
            groups["cp"], hierarchical_context_parallel_sizes
        )
        for level, level_groups in enumerate(levels):
            groups[f"hcp-{level}"] = level_groups
    groups["embedding"] = [list(get_embedding_ranks(ranks)) for ranks in groups["pp"]]
    groups["position_embedding"] = [
        list(get_position_embedding_ranks(ranks)) for ranks in groups["pp"]
    ]
    return groups
