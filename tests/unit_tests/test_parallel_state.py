"""parallel_state: the pure rank layout, the live groups on gloo ranks, accessors and teardown."""

import itertools

import pytest
import torch

from megatron.core import group_fallbacks
from megatron.core import parallel_state as ps
from tests.unit_tests.dist_utils import run_distributed

# --------------------------------------------------------------------------------------------
# Pure layout
# --------------------------------------------------------------------------------------------


def test_documented_16_rank_example():
    # The example of Megatron's initialize_model_parallel docstring (tp=2, pp=4, dp=2).
    groups = ps.generate_model_parallel_groups(
        16, tensor_model_parallel_size=2, pipeline_model_parallel_size=4
    )
    assert groups["dp"] == [[0, 2], [1, 3], [4, 6], [5, 7], [8, 10], [9, 11], [12, 14], [13, 15]]
    assert groups["tp"] == [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9], [10, 11], [12, 13], [14, 15]]
    assert groups["pp"] == [[0, 4, 8, 12], [1, 5, 9, 13], [2, 6, 10, 14], [3, 7, 11, 15]]
    assert groups["embedding"] == [[0, 12], [1, 13], [2, 14], [3, 15]]
    assert groups["position_embedding"] == [[0], [1], [2], [3]]
    # Model parallel groups: one member of every tp group of one pipeline.
    assert groups["mp"] == [[0, 1, 4, 5, 8, 9, 12, 13], [2, 3, 6, 7, 10, 11, 14, 15]]
    assert groups["dp-cp"] == groups["dp"] and groups["cp"] == [[r] for r in range(16)]


def _assert_partition(groups, world_size, group_size, kind):
    assert all(len(g) == group_size for g in groups), (
        f"{kind}: sizes {sorted({len(g) for g in groups})}"
    )
    flat = sorted(itertools.chain.from_iterable(groups))
    assert flat == list(range(world_size)), f"{kind}: not every rank exactly once"


def _coords(rank, tp, cp, dp):
    # rank = tp_rank + tp * (cp_rank + cp * (dp_rank + dp * pp_rank))
    return rank % tp, rank // tp % cp, rank // (tp * cp) % dp, rank // (tp * cp * dp)


@pytest.mark.parametrize(
    "world,tp,pp,cp,ep",
    [(1024, 8, 8, 2, 1), (64, 2, 4, 1, 4), (24, 2, 3, 2, 1)],
)
def test_large_world_invariants(world, tp, pp, cp, ep):
    g = ps.generate_model_parallel_groups(
        world,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        context_parallel_size=cp,
        expert_model_parallel_size=ep,
    )
    dp = world // (tp * pp * cp)
    sizes = {
        "tp": tp,
        "pp": pp,
        "dp": dp,
        "cp": cp,
        "dp-cp": dp * cp,
        "mp": tp * pp,
        "tp-dp": tp * dp,
        "tp-dp-cp": tp * dp * cp,
        "tp-cp": tp * cp,
        "ep": ep,
        "tp-ep": tp * ep,
        "dp-modulo-ep": dp // ep,
        "dp-modulo-ep-cp": dp // ep * cp,
    }
    for kind, size in sizes.items():
        _assert_partition(g[kind], world, size, kind)
    # Each kind of group varies exactly its own coordinates and fixes all the others.
    varying = {
        "tp": {0},
        "cp": {1},
        "dp": {2},
        "pp": {3},
        "dp-cp": {1, 2},
        "mp": {0, 3},
        "tp-dp": {0, 2},
    }
    for kind, dims in varying.items():
        for group in g[kind]:
            coords = [_coords(r, tp, cp, dp) for r in group]
            for d, dim_size in enumerate((tp, cp, dp, pp)):
                values = {c[d] for c in coords}
                assert len(values) == (dim_size if d in dims else 1), (kind, group, d)
    # Data parallel groups are orthogonal to tensor and pipeline groups: a dp group meets each
    # tp group and each pp group in at most one rank.
    tp_of = {r: i for i, grp in enumerate(g["tp"]) for r in grp}
    pp_of = {r: i for i, grp in enumerate(g["pp"]) for r in grp}
    for group in g["dp"]:
        assert len({tp_of[r] for r in group}) == len(group)
        assert len({pp_of[r] for r in group}) == len(group)
    # Embedding groups: first and last stage of each pipeline.
    assert g["embedding"] == [[grp[0], grp[-1]] for grp in g["pp"]]
    # Expert groups split the data parallel dimension: an ep group is inside one dp group.
    dp_of = {r: i for i, grp in enumerate(g["dp"]) for r in grp}
    for group in g["ep"]:
        assert len({dp_of[r] for r in group}) == 1


def test_split_rank_adds_to_embedding_groups():
    g = ps.generate_model_parallel_groups(
        8,
        pipeline_model_parallel_size=4,
        tensor_model_parallel_size=2,
        pipeline_model_parallel_split_rank=2,
    )
    assert g["pp"][0] == [0, 2, 4, 6]
    assert g["embedding"][0] == [0, 4, 6] and g["position_embedding"][0] == [0, 4]
    # Split rank 0 is already the first stage: nothing added.
    g = ps.generate_model_parallel_groups(
        4, pipeline_model_parallel_size=4, pipeline_model_parallel_split_rank=0
    )
    assert g["embedding"] == [[0, 3]] and g["position_embedding"] == [[0]]


def test_tp_pp_dp_order():
    g = ps.generate_model_parallel_groups(
        8, tensor_model_parallel_size=2, pipeline_model_parallel_size=2, order="tp-pp-dp"
    )
    assert g["tp"] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert g["pp"] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert g["dp"] == [[0, 4], [1, 5], [2, 6], [3, 7]]


@pytest.mark.parametrize(
    "kwargs,pattern",
    [
        (dict(world_size=12, tensor_model_parallel_size=5), r"world_size \(12\).*\(5\).*= 5"),
        (
            dict(world_size=16, tensor_model_parallel_size=2, pipeline_model_parallel_size=3),
            r"world_size \(16\).*tensor_model_parallel_size \(2\).*pipeline_model_parallel_size "
            r"\(3\)",
        ),
        (dict(world_size=8, context_parallel_size=3), r"context_parallel_size \(3\)"),
        (
            dict(world_size=8, tensor_model_parallel_size=2, expert_model_parallel_size=3),
            r"data parallel size \(4 = world size 8 / \(TP 2 x PP 1 x CP 1\)\).*"
            r"expert_model_parallel_size \(3\)",
        ),
        (
            dict(
                world_size=8, pipeline_model_parallel_size=1, virtual_pipeline_model_parallel_size=2
            ),
            r"virtual_pipeline_model_parallel_size \(2\).*got 1",
        ),
        (
            dict(
                world_size=8, pipeline_model_parallel_size=2, pipeline_model_parallel_split_rank=2
            ),
            r"split_rank \(2\)",
        ),
        (dict(world_size=8, tensor_model_parallel_size=0), r"tensor_model_parallel_size.*0"),
        (dict(world_size=8, order="tp-cp-ep-xx-pp"), r"unknown dimension 'xx'"),
        (dict(world_size=8, order="tp-ep-cp-dp-pp"), r"ep and dp must be adjacent"),
    ],
)
def test_bad_sizes_raise_value_error_with_numbers(kwargs, pattern):
    with pytest.raises(ValueError, match=pattern):
        ps.generate_model_parallel_groups(**kwargs)


@pytest.mark.parametrize(
    "accessor",
    [
        ps.get_tensor_model_parallel_group,
        ps.get_pipeline_model_parallel_group,
        ps.get_data_parallel_group,
        ps.get_data_parallel_group_gloo,
        ps.get_context_parallel_group,
        ps.get_model_parallel_group,
        ps.get_embedding_group,
        ps.get_pipeline_model_parallel_first_rank,
        ps.get_data_parallel_src_rank,
        group_fallbacks.get_tensor_model_parallel_group_if_none,
    ],
)
def test_accessor_before_init_names_initialize(accessor):
    ps.destroy_model_parallel()
    with pytest.raises(RuntimeError, match=r"initialize_model_parallel\(\)"):
        accessor()


def test_if_none_helpers_pass_given_group_through():
    sentinel = object()
    assert group_fallbacks.get_tensor_model_parallel_group_if_none(sentinel) is sentinel
    assert (
        group_fallbacks.get_data_parallel_group_if_none(sentinel, with_context_parallel=True)
        is sentinel
    )
    assert group_fallbacks.get_pipeline_model_parallel_group_if_none(sentinel) is sentinel


# --------------------------------------------------------------------------------------------
# Live groups on gloo ranks
# --------------------------------------------------------------------------------------------

_GETTERS = {
    "tp": ps.get_tensor_model_parallel_group,
    "pp": ps.get_pipeline_model_parallel_group,
    "dp": ps.get_data_parallel_group,
    "dp-cp": lambda: ps.get_data_parallel_group(with_context_parallel=True),
    "cp": ps.get_context_parallel_group,
    "mp": ps.get_model_parallel_group,
    "tp-dp": ps.get_tensor_and_data_parallel_group,
    "tp-dp-cp": lambda: ps.get_tensor_and_data_parallel_group(with_context_parallel=True),
    "tp-cp": ps.get_tensor_and_context_parallel_group,
    "ep": ps.get_expert_model_parallel_group,
    "tp-ep": ps.get_tensor_and_expert_parallel_group,
    "dp-modulo-ep": ps.get_data_modulo_expert_parallel_group,
}


def _check_live_groups(expected, tp, pp, cp, ep, vpp=None):
    rank = torch.distributed.get_rank()
    world = torch.distributed.get_world_size()
    assert ps.model_parallel_is_initialized()
    mine = {
        kind: next(g for g in groups if rank in g)
        for kind, groups in expected.items()
        if kind in _GETTERS
    }
    for kind, getter in _GETTERS.items():
        got = torch.distributed.get_process_group_ranks(getter())
        assert got == mine[kind], f"{kind}: {got} != {mine[kind]}"
    # gloo copies of the data parallel group, with and without context parallel.
    for with_cp, kind in ((False, "dp"), (True, "dp-cp")):
        gloo = ps.get_data_parallel_group_gloo(with_context_parallel=with_cp)
        assert torch.distributed.get_backend(gloo) == "gloo"
        assert torch.distributed.get_process_group_ranks(gloo) == mine[kind]
        assert gloo is not ps.get_data_parallel_group(with_context_parallel=with_cp)
        assert ps.get_data_parallel_world_size(with_context_parallel=with_cp) == len(mine[kind])
        assert ps.get_data_parallel_rank(with_context_parallel=with_cp) == mine[kind].index(rank)
        assert ps.get_data_parallel_src_rank(with_context_parallel=with_cp) == mine[kind][0]
    tp_rank, cp_rank, dp_rank, pp_rank = _coords(rank, tp, cp, world // (tp * pp * cp))
    assert ps.get_tensor_model_parallel_world_size() == tp
    assert ps.get_tensor_model_parallel_rank() == tp_rank
    assert ps.get_tensor_model_parallel_src_rank() == rank - tp_rank
    assert ps.get_pipeline_model_parallel_world_size() == pp
    assert ps.get_pipeline_model_parallel_rank() == pp_rank
    assert ps.get_context_parallel_world_size() == cp and ps.get_context_parallel_rank() == cp_rank
    assert ps.get_expert_model_parallel_world_size() == ep
    assert ps.get_expert_model_parallel_rank() == mine["ep"].index(rank)
    pipe = mine["pp"]
    assert ps.get_pipeline_model_parallel_first_rank() == pipe[0]
    assert ps.get_pipeline_model_parallel_last_rank() == pipe[-1]
    assert ps.get_pipeline_model_parallel_next_rank() == pipe[(pp_rank + 1) % pp]
    assert ps.get_pipeline_model_parallel_prev_rank() == pipe[(pp_rank - 1) % pp]
    emb = next(g for g in expected["embedding"] if rank in g or g[0] in pipe)
    assert ps.is_rank_in_embedding_group(ignore_virtual=True) == (rank in emb)
    if rank in emb:
        assert torch.distributed.get_process_group_ranks(ps.get_embedding_group()) == emb
    else:
        assert ps.get_embedding_group() is None
    pos = next(g for g in expected["position_embedding"] if g[0] == pipe[0])
    assert ps.is_rank_in_position_embedding_group() == (rank in pos)
    assert ps.get_virtual_pipeline_model_parallel_world_size() == vpp
    if vpp is None:
        assert ps.is_pipeline_first_stage() == (pp_rank == 0)
        assert ps.is_pipeline_last_stage() == (pp_rank == pp - 1)
        assert ps.is_rank_in_embedding_group() == (rank in emb)
    else:
        # Chunk 0 of stage 0 is the first stage, chunk vpp-1 of the last stage the last one.
        assert ps.get_virtual_pipeline_model_parallel_rank() == 0
        for chunk in range(vpp):
            ps.set_virtual_pipeline_model_parallel_rank(chunk)
            assert ps.is_pipeline_first_stage() == (pp_rank == 0 and chunk == 0)
            assert ps.is_pipeline_first_stage(ignore_virtual=True) == (pp_rank == 0)
            assert ps.is_pipeline_last_stage() == (pp_rank == pp - 1 and chunk == vpp - 1)
            assert ps.is_pipeline_last_stage(ignore_virtual=True) == (pp_rank == pp - 1)
            if rank == emb[0]:
                assert ps.is_rank_in_embedding_group() == (chunk == 0)
            elif rank == emb[-1]:
                assert ps.is_rank_in_embedding_group() == (chunk == vpp - 1)
    buf = ps.get_global_memory_buffer().get_tensor((3, 4), torch.float32, "mpu")
    assert (
        buf.shape == (3, 4)
        and ps.get_global_memory_buffer().get_tensor((2,), torch.float32, "mpu").data_ptr()
        == buf.data_ptr()
    )
    # The groups really communicate: a tp all-reduce sums over tp ranks only.
    t = torch.tensor([float(rank)])
    torch.distributed.all_reduce(t, group=ps.get_tensor_model_parallel_group())
    assert t.item() == sum(mine["tp"])
    return rank


@pytest.mark.parametrize(
    "tp,pp,cp,ep,vpp",
    [
        (2, 2, 1, 1, None),
        (1, 2, 1, 1, 2),
        (1, 1, 2, 1, None),
        (2, 1, 1, 2, None),
        (1, 4, 1, 1, None),
    ],
)
def test_live_groups_match_pure_layout_4_ranks(tp, pp, cp, ep, vpp):
    expected = ps.generate_model_parallel_groups(
        4,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        context_parallel_size=cp,
        expert_model_parallel_size=ep,
    )
    out = run_distributed(
        _check_live_groups,
        4,
        tp=tp,
        pp=pp,
        cp=cp,
        ep=ep,
        vpp=vpp,
        args=(expected, tp, pp, cp, ep, vpp),
    )
    assert out == [0, 1, 2, 3]


def test_live_groups_match_pure_layout_8_ranks():
    tp, pp, cp = 2, 2, 2
    expected = ps.generate_model_parallel_groups(
        8, tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, context_parallel_size=cp
    )
    out = run_distributed(
        _check_live_groups, 8, tp=tp, pp=pp, cp=cp, args=(expected, tp, pp, cp, 1)
    )
    assert out == list(range(8))


def _split_rank_checks():
    rank = torch.distributed.get_rank()
    assert ps.get_pipeline_model_parallel_split_rank() == 2
    assert ps.is_pipeline_stage_before_split() == (rank < 2)
    assert ps.is_pipeline_stage_after_split() == (rank >= 2)
    assert ps.is_pipeline_stage_at_split() == (rank == 1)
    emb = ps.get_embedding_group()
    if rank in (0, 2, 3):
        assert torch.distributed.get_process_group_ranks(emb) == [0, 2, 3]
        assert ps.is_rank_in_embedding_group()
    else:
        assert emb is None and not ps.is_rank_in_embedding_group()
    assert ps.is_rank_in_position_embedding_group() == (rank in (0, 2))
    return True


def test_split_rank_groups_live():
    assert all(run_distributed(_split_rank_checks, 4, pp=4, split_rank=2))


def _destroy_resets_everything():
    ps.set_tensor_model_parallel_world_size(7)
    ps.set_pipeline_model_parallel_rank(3)
    ps.set_virtual_pipeline_model_parallel_rank(1)
    ps.destroy_model_parallel()
    leftovers = [name for name in ps._RESET_TO_NONE if getattr(ps, name) is not None]
    assert not leftovers, leftovers
    assert not ps._CREATED_GROUPS
    assert not ps.model_parallel_is_initialized()
    for getter in _GETTERS.values():
        try:
            getter()
        except RuntimeError as exc:
            assert "initialize_model_parallel()" in str(exc)
        else:
            raise AssertionError(f"{getter} did not raise after destroy_model_parallel()")
    # Every module-level global that holds state is covered by the reset list.
    state_globals = {
        n for n in vars(ps) if n.startswith("_") and n.isupper() and n.lstrip("_")[:1].isalpha()
    }
    assert state_globals - set(ps._RESET_TO_NONE) <= {
        "_CREATED_GROUPS",
        "_INIT_HINT",
        "_RESET_TO_NONE",
    }
    # And the state can be built again.
    ps.initialize_model_parallel(tensor_model_parallel_size=2)
    assert ps.get_tensor_model_parallel_world_size() == 2
    with_error = None
    try:
        ps.initialize_model_parallel(tensor_model_parallel_size=2)
    except RuntimeError as exc:
        with_error = str(exc)
    assert with_error and "destroy_model_parallel" in with_error
    return True


def test_destroy_resets_every_global():
    assert all(run_distributed(_destroy_resets_everything, 2, tp=2, pp=1))


def _init_with_bad_sizes():
    ps.destroy_model_parallel()
    try:
        ps.initialize_model_parallel(tensor_model_parallel_size=3)
    except ValueError as exc:
        return str(exc)
    return None


def test_initialize_rejects_non_dividing_sizes():
    messages = run_distributed(_init_with_bad_sizes, 2)
    assert all(m is not None and "world_size (2)" in m and "(3)" in m for m in messages)


def _partial_data_parallel_groups():
    ps.destroy_model_parallel()
    refused = None
    try:
        ps.initialize_model_parallel(num_distributed_optimizer_instances=3)
    except ValueError as exc:
        refused = str(exc)
    refused = (refused, ps.model_parallel_is_initialized())
    ps.initialize_model_parallel(num_distributed_optimizer_instances=2)
    ranks = torch.distributed.get_process_group_ranks
    intra = ranks(
        ps.get_data_parallel_group(with_context_parallel=True, partial_data_parallel=True)
    )
    inter = ranks(ps.get_inter_partial_data_parallel_group())
    ps.destroy_model_parallel()
    ps.initialize_model_parallel()
    single = (
        ps.get_inter_partial_data_parallel_group(),
        ps.get_data_parallel_group(with_context_parallel=True, partial_data_parallel=True)
        is ps.get_data_parallel_group(with_context_parallel=True),
    )
    return refused, intra, inter, single


def test_partial_data_parallel_groups_split_dp_into_instances():
    outs = run_distributed(_partial_data_parallel_groups, 4)
    for rank, (refused, intra, inter, single) in enumerate(outs):
        message, initialized = refused
        # Refused before any group is made (nothing to destroy).
        assert "num_distributed_optimizer_instances (3)" in message and "(4)" in message
        assert not initialized
        # Instances of consecutive data-parallel ranks; the replicas of a rank across them.
        assert intra == ([0, 1] if rank < 2 else [2, 3])
        assert inter == [rank % 2, rank % 2 + 2]
        assert single == (None, True)
