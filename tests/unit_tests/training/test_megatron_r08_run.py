"""A Megatron core_r0.8.0 command line with the r0.8 flags this package wires runs end to end
through pretrain_gpt.py on 2 data-parallel gloo ranks: --mock-data with --eval-iters 0,
--log-straggler, --check-weight-hash-across-dp-replicas-interval, --empty-unused-memory-level,
--use-cpu-initialization, --no-data-sharding."""

import contextlib
import io
import logging
import os
import sys

import torch

from tests.unit_tests.dist_utils import run_distributed

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

R08_ARGS = [
    '--num-layers',
    '2',
    '--hidden-size',
    '32',
    '--num-attention-heads',
    '4',
    '--seq-length',
    '16',
    '--max-position-embeddings',
    '16',
    '--micro-batch-size',
    '1',
    '--global-batch-size',
    '4',
    '--train-iters',
    '4',
    '--lr',
    '1e-3',
    '--mock-data',
    '--tokenizer-type',
    'NullTokenizer',
    '--vocab-size',
    '4095',
    '--eval-iters',
    '0',
    '--log-interval',
    '2',
    '--num-workers',
    '0',
    '--distributed-backend',
    'gloo',
    '--transformer-impl',
    'local',
    '--use-cpu-initialization',
    '--empty-unused-memory-level',
    '2',
    '--check-weight-hash-across-dp-replicas-interval',
    '2',
    '--dataloader-type',
    'cyclic',
    '--no-data-sharding',
    '--log-straggler',
    '--straggler-minmax-count',
    '2',
]


class _Records(logging.Handler):
    def __init__(self):
        super().__init__()
        self.lines = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def _pretrain_worker(extra):
    if REPO not in sys.path:
        sys.path.insert(0, REPO)
    import pretrain_gpt
    from megatron.core.enums import ModelType
    from megatron.training.global_vars import destroy_global_vars
    from megatron.training.training import pretrain

    records = _Records()
    logging.getLogger('megatron.core.utils').addHandler(records)
    destroy_global_vars()
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            result = pretrain(
                pretrain_gpt.train_valid_test_datasets_provider,
                pretrain_gpt.model_provider,
                ModelType.encoder_or_decoder,
                pretrain_gpt.forward_step,
                args_list=R08_ARGS + extra,
            )
    finally:
        destroy_global_vars()
        logging.getLogger('megatron.core.utils').removeHandler(records)
        sys.stdout.write(out.getvalue())
    losses = {it: v['lm loss'] for it, v in result['train_losses'].items()}
    return losses, records.lines, out.getvalue()


def test_r08_flags_run_end_to_end():
    outs = run_distributed(_pretrain_worker, world_size=2, args=([],), timeout=300)
    (losses0, lines0, out), (losses1, lines1, _) = outs
    assert sorted(losses0) == [1, 2, 3, 4] and losses0 == losses1
    assert all(torch.isfinite(torch.tensor(v)) for v in losses0.values())
    # The straggler report: rank 0 logs min/max over both ranks, every --log-interval.
    reports = [line for line in lines0 if 'MnRtt/Rnk' in line]
    assert len(reports) == 2 and not any('MnRtt/Rnk' in line for line in lines1)
    for field in ('MnRtt/Rnk', 'MxRtt/Rnk', 'MnDRtt/Rnk', 'MxDRtt/Rnk', 'MnEtpt/Rnk', 'MxEtpt/Rnk'):
        assert field in reports[0]
    assert any('Bottom 2 Ranks with lowest  Etpt(TF)' in line for line in lines0)
    assert out.count('>>> Weight hashes match after') == 2  # iterations 2 and 4
