"""tools/checkpoint/convert.py --model-type T5: TP2xPP2(split 1) -> TP1 -> TP2xPP2(split 1) ->
TP1xPP4(split 2), and a converted checkpoint resumes pretrain_t5.py with the original's losses.

The source is trained by pretrain_t5.py at TP2 x PP2 with --pipeline-model-parallel-split-rank 1
(encoder on stage 0, decoder and a second embedding copy on stage 1, a tied LM head with a bias)
for 4 iterations, saving at iteration 2. Stateless SGD (no momentum) at a constant learning rate
makes the weights, the consumed samples and the iteration the whole training state, so a
converted iteration-2 checkpoint loaded with --no-load-optim --no-load-rng must continue with the
uninterrupted run's losses at iterations 3 and 4: bit for bit at the source's own layout, within
float32 reduction-order noise at TP1 and at PP4 (split 2, where the last stage keeps its own copy
of the tied word table). An untied variant (its own head weight, no head bias) makes the same
round trip and trains on at TP1 and TP2xPP2 with equal losses. Bad target splits, models other
than T5, a mixed-layout or partial source are refused in one line before any work.
"""

import os
import shutil
import sys

import pytest
import torch

from tests.functional_tests import convert_utils as cu
from tests.functional_tests.t5_utils import run_pretrain_t5
from tests.unit_tests.dist_utils import run_distributed

sys.path.insert(0, os.path.join(cu.REPO, 'tools', 'checkpoint'))
import convert  # noqa: E402

RTOL = 1e-5
TRAIN = [
    '--micro-batch-size', '2', '--global-batch-size', '4', '--eval-iters', '1',
    '--optimizer', 'sgd', '--sgd-momentum', '0', '--lr-decay-style', 'constant',
    '--lr-warmup-iters', '0',
]  # fmt: skip
SOURCE_LAYOUT = [
    '--tensor-model-parallel-size', '2', '--pipeline-model-parallel-size', '2',
    '--pipeline-model-parallel-split-rank', '1',
]  # fmt: skip
T5 = ['--model-type', 'T5', '--loader', 'mcore', '--saver', 'mcore']


def _train(extra):
    result = run_pretrain_t5(TRAIN + list(extra))
    return {int(k): float(v['lm loss']) for k, v in result['train_losses'].items()}


def _layout(tp, pp, split=None):
    flags = ['--tensor-model-parallel-size', str(tp), '--pipeline-model-parallel-size', str(pp)]
    return flags + (['--pipeline-model-parallel-split-rank', str(split)] if split else [])


@pytest.fixture(scope='module')
def checkpoints(tmp_path_factory, t5_data_prefix):
    root = tmp_path_factory.mktemp('convert_t5')
    data = ['--data-path', t5_data_prefix, '--data-cache-path', str(root / 'cache')]
    run_dir, src, tp1, back, pp4 = (str(root / n) for n in ('run', 'src', 'tp1', 'back', 'pp4'))
    run = ['--train-iters', '4', '--save', run_dir, '--save-interval', '2']
    outs = run_distributed(
        _train,
        world_size=4,
        tp=2,
        pp=2,
        split_rank=1,
        args=(SOURCE_LAYOUT + run + data,),
        timeout=600,
    )
    # The iteration-2 checkpoint of the uninterrupted run, as its own checkpoint directory.
    shutil.copytree(os.path.join(run_dir, 'iter_0000002'), os.path.join(src, 'iter_0000002'))
    with open(os.path.join(src, 'latest_checkpointed_iteration.txt'), 'w') as f:
        f.write('2')
    target = ['--target-tensor-parallel-size', '1', '--target-pipeline-parallel-size', '1']
    log = cu.convert(*T5, '--load-dir', src, '--save-dir', tp1, *target, model_type=None).stdout
    target = ['--target-tensor-parallel-size', '2', '--target-pipeline-parallel-size', '2']
    split = ['--target-pipeline-parallel-split-rank', '1']
    cu.convert(*T5, '--load-dir', tp1, '--save-dir', back, *target, *split, model_type=None)
    # Written over an older checkpoint of another layout (TP1): only the new layout remains.
    shutil.copytree(tp1, pp4)
    target = ['--target-tensor-parallel-size', '1', '--target-pipeline-parallel-size', '4']
    split = ['--target-pipeline-parallel-split-rank', '2', '--overwrite']
    cu.convert(*T5, '--load-dir', back, '--save-dir', pp4, *target, *split, model_type=None)
    return dict(
        src=src, tp1=tp1, back=back, pp4=pp4, log=log, losses=outs[-1], data=data, root=root
    )


def _full_t5(ckpt_dir):
    """{global name: full tensor} of a T5 checkpoint (stage copies of the embedding and of the
    LM head's second name left out), with its reader."""
    from megatron.training.checkpoint import checkpoint_conversion_t5 as t5
    from megatron.training.checkpoint.checkpoint_conversion import CheckpointReader

    reader = CheckpointReader(ckpt_dir)
    assert reader.model_type == 'T5'
    encoder, decoder = t5.t5_depths(reader.args)
    split = reader.args.pipeline_model_parallel_split_rank
    full = {}
    for pp_rank in range(reader.pp):
        ((_, chunk),), _ = reader.load_stage(pp_rank)
        stage = t5.t5_stage(encoder, decoder, reader.pp, split, pp_rank)
        enc, dec, rest = t5.split_t5_chunk(chunk, stage)
        for block, layers in (('encoder', enc), ('decoder', dec)):
            for index, layer in layers.items():
                for name, tensor in layer.items():
                    if tensor is not None:
                        full[f'{block}.layers.{index}.{name}'] = tensor
        for name, tensor in rest.items():
            copy = (pp_rank > 0 and name.startswith('embedding.')) or name.startswith('lm_head.')
            if tensor is not None and not copy and name != 'output_layer.weight':
                full[name] = tensor
    return full, reader


def test_round_trip_is_bitwise_exact(checkpoints):
    source, src_reader = _full_t5(checkpoints['src'])
    assert (src_reader.tp, src_reader.pp) == (2, 2)
    names = sorted(source)
    # Embeddings, 2 x 12 encoder and 2 x 20 decoder layer tensors, 2 final norms, the head bias.
    assert len(names) == 2 + 2 * 12 + 2 * 20 + 2 * 2 + 1
    for key, layout in (('tp1', (1, 1, None)), ('back', (2, 2, 1)), ('pp4', (1, 4, 2))):
        converted, reader = _full_t5(checkpoints[key])
        args = reader.args
        assert (reader.tp, reader.pp, args.pipeline_model_parallel_split_rank) == layout, key
        assert sorted(converted) == names, key
        for name in names:
            assert torch.equal(converted[name], source[name]), f'{key}: {name} differs'
        assert reader.iteration == 2 and args.consumed_train_samples == 8
    sent = [
        line[len('sending ') :]
        for line in checkpoints['log'].splitlines()
        if line.startswith('sending ')
    ]
    assert sent == (
        ['embeddings', 'encoder layer 0', 'encoder layer 1', 'encoder final norm']
        + ['decoder layer 0', 'decoder layer 1', 'decoder final norm', 'lm head']
    )
    assert 'saver: decoder layer 4/4' in checkpoints['log']  # the progress lines


def test_back_files_equal_the_source_files(checkpoints):
    """Literal: every rank file of TP2xPP2 -> TP1 -> TP2xPP2 holds the source's model entries
    (the split-rank stage's embedding copy and both names of the LM head included)."""
    for tp_rank in range(2):
        for pp_rank in range(2):
            src = cu.read_rank_file(checkpoints['src'], tp_rank, pp_rank, pp=2)['model']
            back = cu.read_rank_file(checkpoints['back'], tp_rank, pp_rank, pp=2)['model']
            assert sorted(back) == sorted(src)
            for name, tensor in src.items():
                if tensor is None:
                    assert back[name] is None, name
                else:
                    assert torch.equal(back[name], tensor), (tp_rank, pp_rank, name)


def test_overwrite_leaves_only_the_new_layout(checkpoints):
    iteration_dir = os.path.join(checkpoints['pp4'], 'iter_0000002')
    assert sorted(os.listdir(iteration_dir)) == [f'mp_rank_00_{p:03d}' for p in range(4)]
    # Stage 3 (decoder, no embedding) keeps its own copy of the tied word table.
    last = cu.read_rank_file(checkpoints['pp4'], 0, 3, pp=4)['model']
    first = cu.read_rank_file(checkpoints['pp4'], 0, 0, pp=4)['model']
    word = first['embedding.word_embeddings.weight']
    assert torch.equal(last['output_layer.weight'], word)
    assert torch.equal(last['lm_head.output_layer.weight'], word)
    assert not any(name.startswith('embedding.') for name in last)


def _resume(load_dir, layout, data):
    flags = ['--load', load_dir, '--no-load-optim', '--no-load-rng', '--train-iters', '4']
    return _train(layout + flags + data)


def test_converted_checkpoints_resume_with_the_original_losses(checkpoints):
    expected = checkpoints['losses']
    assert sorted(expected) == [1, 2, 3, 4]
    data = checkpoints['data']
    (tp1,) = run_distributed(
        _resume, world_size=1, args=(checkpoints['tp1'], _layout(1, 1), data), timeout=600
    )
    assert sorted(tp1) == [3, 4]
    for it in (3, 4):
        assert tp1[it] == pytest.approx(expected[it], rel=RTOL), it
    pp4 = run_distributed(
        _resume,
        world_size=4,
        pp=4,
        split_rank=2,
        args=(checkpoints['pp4'], _layout(1, 4, 2), data),
        timeout=600,
    )[-1]
    assert sorted(pp4) == [3, 4]
    for it in (3, 4):
        assert pp4[it] == pytest.approx(expected[it], rel=RTOL), it


@pytest.fixture(scope='module')
def untied(checkpoints):
    """An untied T5 (its own output weight, no head bias) at TP1, made from the TP1 conversion,
    converted to TP2xPP2(split 1) and back."""
    from megatron.training.checkpoint.checkpoint_conversion import CheckpointReader

    root = checkpoints['root']
    src, tp2pp2, back = (str(root / n) for n in ('untied', 'untied_tp2pp2', 'untied_back'))
    shutil.copytree(checkpoints['tp1'], src)
    path = CheckpointReader(src).rank_file(0, 0)
    state = cu.read_rank_file(src, 0, 0, pp=1)
    model = state['model']
    head = model['embedding.word_embeddings.weight'].flip(0).clone()  # not the word table
    for prefix in ('output_layer.', 'lm_head.output_layer.'):
        del model[prefix + 'bias']
        model[prefix + 'weight'] = head
    state['args'].untie_embeddings_and_output_weights = True
    torch.save(state, path)
    target = ['--target-tensor-parallel-size', '2', '--target-pipeline-parallel-size', '2']
    split = ['--target-pipeline-parallel-split-rank', '1']
    cu.convert(*T5, '--load-dir', src, '--save-dir', tp2pp2, *target, *split, model_type=None)
    target = ['--target-tensor-parallel-size', '1', '--target-pipeline-parallel-size', '1']
    log = cu.convert(*T5, '--load-dir', tp2pp2, '--save-dir', back, *target, model_type=None)
    return dict(src=src, tp2pp2=tp2pp2, back=back, head=head, log=log.stdout)


def test_untied_head_round_trip(untied, checkpoints):
    source = cu.read_rank_file(untied['src'], 0, 0, pp=1)['model']
    back = cu.read_rank_file(untied['back'], 0, 0, pp=1)['model']
    assert sorted(back) == sorted(source)
    for name, tensor in source.items():
        if tensor is None:
            assert back[name] is None, name
        else:
            assert torch.equal(back[name], tensor), name
    assert 'sending output layer' in untied['log'] and 'sending lm head' not in untied['log']
    # TP2 x PP2: the head's vocabulary shards on the last stage, no bias anywhere.
    for tp_rank in range(2):
        last = cu.read_rank_file(untied['tp2pp2'], tp_rank, 1, pp=2)['model']
        shard = untied['head'].chunk(2, dim=0)[tp_rank]
        assert torch.equal(last['output_layer.weight'], shard)
        assert torch.equal(last['lm_head.output_layer.weight'], shard)
        assert 'output_layer.bias' not in last and 'lm_head.output_layer.bias' not in last
    # Both layouts load strictly into pretrain_t5.py's model and give the same next loss.
    data, untie = checkpoints['data'], ['--untie-embeddings-and-output-weights']
    flags = ['--no-load-optim', '--no-load-rng', '--train-iters', '3'] + untie + data
    (tp1,) = run_distributed(
        _train, world_size=1, args=(_layout(1, 1) + ['--load', untied['src']] + flags,)
    )
    tp2pp2 = run_distributed(
        _train,
        world_size=4,
        tp=2,
        pp=2,
        split_rank=1,
        args=(_layout(2, 2, 1) + ['--load', untied['tp2pp2']] + flags,),
    )[-1]
    assert sorted(tp1) == sorted(tp2pp2) == [3]
    assert tp2pp2[3] == pytest.approx(tp1[3], rel=RTOL)
    assert tp1[3] != pytest.approx(checkpoints['losses'][3], rel=1e-3)  # the head is its own


def _error(capsys, *flags):
    code = convert.main([*T5, *flags])
    out, err = capsys.readouterr()
    assert code == 2, out + err
    assert 'Starting saver' not in out
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    return lines[0]


def test_target_split_rank_errors(capsys, checkpoints, tmp_path):
    save = ['--load-dir', checkpoints['src'], '--save-dir', str(tmp_path / 'out')]

    def target(pp, split=None):
        flags = ['--target-pipeline-parallel-size', str(pp)]
        return flags + (['--target-pipeline-parallel-split-rank', str(split)] if split else [])

    assert _error(capsys, *save, *target(2, 2)) == (
        'error: --target-pipeline-parallel-split-rank 2 does not fit '
        '--target-pipeline-parallel-size 2: it must be at least 1 and less than 2 (stages 0 .. '
        'split-1 hold the encoder, the others the decoder)'
    )
    assert _error(capsys, *save, *target(4)) == (
        'error: --target-pipeline-parallel-split-rank is required for a T5 at '
        '--target-pipeline-parallel-size 4 (the source is PP2, split rank 1)'
    )
    assert _error(capsys, *save, *target(1, 1)) == (
        'error: --target-pipeline-parallel-split-rank 1 needs --target-pipeline-parallel-size > 1 '
        '(got 1)'
    )
    assert _error(capsys, *save, *target(4, 1)) == (
        'error: --target-pipeline-parallel-split-rank 1 with --target-pipeline-parallel-size 4: '
        'the 2 decoder layers do not divide into 3 decoder stages'
    )
    assert _error(capsys, *save, *target(4, 3)) == (
        'error: --target-pipeline-parallel-split-rank 3: the 2 encoder layers do not divide into '
        '3 encoder stages'
    )
    code = convert.main(['--model-type', 'T5', '--loader', 'mcore', '--saver', 'hf', *save])
    assert code == 2
    assert capsys.readouterr().err.strip() == (
        'error: --saver hf exports GPT models (GPT-2 and Llama families), not --model-type T5'
    )
    code = convert.main(['--model-type', 'BERT', *T5[2:], *save])
    assert code == 2
    assert capsys.readouterr().err.strip() == (
        f'error: --model-type BERT, but {checkpoints["src"]} holds a T5 model'
    )
    assert not os.path.exists(tmp_path / 'out')


def test_split_rank_flag_is_refused_for_other_models(checkpoints, tmp_path):
    import loader_mcore
    import saver_mcore

    parser = convert.build_parser()
    loader_mcore.add_arguments(parser)
    saver_mcore.add_arguments(parser)
    args = parser.parse_args(
        [*T5, '--load-dir', checkpoints['src'], '--save-dir', str(tmp_path / 'out')]
        + ['--target-pipeline-parallel-size', '2', '--target-pipeline-parallel-split-rank', '1']
    )
    md = loader_mcore.check_arguments(args)
    saver_mcore.check_arguments(args, md)  # a T5: accepted
    md.model_type = 'GPT'
    with pytest.raises(ValueError) as info:
        saver_mcore.check_arguments(args, md)
    assert str(info.value) == (
        '--target-pipeline-parallel-split-rank is for --model-type T5 (encoder-decoder models), '
        'not GPT'
    )


def test_mixed_layout_and_partial_sources_are_refused(capsys, checkpoints, tmp_path):
    mixed = str(tmp_path / 'mixed')
    shutil.copytree(checkpoints['back'], mixed)
    shutil.copytree(
        os.path.join(checkpoints['tp1'], 'iter_0000002', 'mp_rank_00'),
        os.path.join(mixed, 'iter_0000002', 'mp_rank_00'),
    )
    save = ['--save-dir', str(tmp_path / 'out')]
    assert _error(capsys, '--load-dir', mixed, *save).startswith(
        f'error: checkpoint directory {mixed}/iter_0000002 holds rank folders of more than one '
        f'parallel layout (mp_rank_00, mp_rank_00_000, mp_rank_00_001, mp_rank_01_000, '
        f'mp_rank_01_001)'
    )
    partial = str(tmp_path / 'partial')
    shutil.copytree(checkpoints['back'], partial)
    os.remove(os.path.join(partial, 'iter_0000002', 'mp_rank_01_001', 'model_optim_rng.pt'))
    assert _error(capsys, '--load-dir', partial, *save) == (
        f'error: --load-dir {partial}: partial checkpoint, 1 of 4 rank files of its TP2 x PP2 '
        f'layout are missing: iter_0000002/mp_rank_01_001/model_optim_rng.pt'
    )


def test_checkpoint_args_carry_the_split_rank(checkpoints):
    """--use-checkpoint-args takes the split rank with the pipeline size, and the decoder's depth
    and length; a run at another split is refused by name before any tensor is read."""
    from megatron.training import checkpointing
    from megatron.training.arguments import parse_args
    from megatron.training.checkpoint.checkpoint_conversion import CheckpointReader
    from megatron.training.global_vars import destroy_global_vars, set_args

    args = parse_args(args_list=['--use-checkpoint-args', '--load', checkpoints['pp4']])
    args, _ = checkpointing.load_args_from_checkpoint(args)
    assert (args.pipeline_model_parallel_size, args.pipeline_model_parallel_split_rank) == (4, 2)
    assert (args.num_layers, args.decoder_num_layers, args.decoder_seq_length) == (2, 2, 16)
    args.pipeline_model_parallel_split_rank = 1
    destroy_global_vars()
    set_args(args)
    try:
        message = checkpointing._layout_mismatch_message(
            CheckpointReader(checkpoints['pp4']).args, 'ckpt'
        )
    finally:
        destroy_global_vars()
    assert message == (
        'checkpoint ckpt does not match this run:\n  pipeline_model_parallel_split_rank value '
        'from checkpoint (2) is not equal to the input argument value (1).'
    )
