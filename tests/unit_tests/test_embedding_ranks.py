"""Embedding-group hooks: Megatron's default (position) embedding ranks, custom callables in
`generate_model_parallel_groups`, and `initialize_megatron(get_embedding_ranks=...)` (what
`pretrain()` passes on) creating the groups from them."""

import torch

from megatron.core import parallel_state as ps
from tests.unit_tests.dist_utils import run_distributed


def test_default_ranks_match_megatron():
    # One stage: it holds both embeddings.
    assert ps.default_embedding_ranks([5]) == [5]
    assert ps.default_position_embedding_ranks([5]) == [5]
    # First and last stage; position embeddings only on the first.
    assert ps.default_embedding_ranks([0, 2, 4, 6]) == [0, 6]
    assert ps.default_position_embedding_ranks([0, 2, 4, 6]) == [0]
    # The encoder/decoder split stage joins both groups, unless it is already in them.
    assert ps.default_embedding_ranks([0, 2, 4, 6], split_rank=2) == [0, 4, 6]
    assert ps.default_position_embedding_ranks([0, 2, 4, 6], split_rank=2) == [0, 4]
    assert ps.default_embedding_ranks([0, 2, 4, 6], split_rank=0) == [0, 6]
    assert ps.default_position_embedding_ranks([0, 2, 4, 6], split_rank=0) == [0]


def _last_only(pp_ranks):
    return [pp_ranks[-1]]


def _every_stage(pp_ranks):
    return list(pp_ranks)


def test_custom_callables_in_layout():
    g = ps.generate_model_parallel_groups(
        8,
        tensor_model_parallel_size=2,
        pipeline_model_parallel_size=2,
        get_embedding_ranks=_last_only,
        get_position_embedding_ranks=_every_stage,
    )
    assert g["pp"] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert g["embedding"] == [[4], [5], [6], [7]]
    assert g["position_embedding"] == g["pp"]


def _initialize_with_hooks():
    from megatron.training.initialize import initialize_megatron

    # The harness built default groups for this job; initialize_megatron must build its own.
    ps.destroy_model_parallel()
    initialize_megatron(
        args_list=(
            "--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 "
            "--max-position-embeddings 16 --micro-batch-size 1 --pipeline-model-parallel-size 2 "
            "--tokenizer-type NullTokenizer --vocab-size 64 --distributed-backend gloo"
        ).split(),
        get_embedding_ranks=_last_only,
        get_position_embedding_ranks=_every_stage,
    )
    emb = ps.get_embedding_group()
    pos = ps.get_position_embedding_group()
    return {
        "rank": torch.distributed.get_rank(),
        "embedding": None if emb is None else torch.distributed.get_process_group_ranks(emb),
        "position": None if pos is None else torch.distributed.get_process_group_ranks(pos),
    }


def test_initialize_megatron_uses_the_hooks():
    outs = run_distributed(_initialize_with_hooks, world_size=2, pp=2)
    assert outs[0] == {"rank": 0, "embedding": None, "position": [0, 1]}
    assert outs[1] == {"rank": 1, "embedding": [1], "position": [0, 1]}
