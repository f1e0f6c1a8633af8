"""Shared pieces of the GPT end-to-end tests: data preparation, the tiny model's flags, and the
worker function that runs `pretrain()` from pretrain_gpt.py (or another pretrain_*.py script, see
bert_utils.py) inside a `run_distributed` rank.
"""

import fcntl
import importlib
import os
import subprocess
import sys
import zlib

import torch

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
VOCAB = os.path.join(REPO, 'data', 'gpt2', 'gpt2-vocab.json')
MERGES = os.path.join(REPO, 'data', 'gpt2', 'gpt2-merges.txt')

#: A tiny GPT on GPT-2 BPE: 2 layers, hidden 64, seq 32. make-vocab-size-divisible-by 64 gives
#: the same padded vocabulary (50304) at TP=1 and TP=2, so layouts are comparable.
TINY_GPT_ARGS = [
    '--num-layers',
    '2',
    '--hidden-size',
    '64',
    '--num-attention-heads',
    '4',
    '--seq-length',
    '32',
    '--max-position-embeddings',
    '32',
    '--attention-dropout',
    '0.0',
    '--hidden-dropout',
    '0.0',
    '--make-vocab-size-divisible-by',
    '64',
    '--lr',
    '3e-3',
    '--min-lr',
    '3e-4',
    '--lr-decay-style',
    'cosine',
    '--lr-warmup-iters',
    '2',
    '--weight-decay',
    '0.01',
    '--clip-grad',
    '1.0',
    '--seed',
    '1234',
    '--vocab-file',
    VOCAB,
    '--merge-file',
    MERGES,
    '--split',
    '98,2,0',
    '--num-workers',
    '0',
    '--log-interval',
    '1',
    '--eval-interval',
    '1000',
]


def preprocess_once(work_dir, output_name, level, preprocess_args):
    """Run tools/preprocess_data.py on data/corpus/mobydick.jsonl once into work_dir.

    Safe to call from several processes: a file lock serialises the build.

    Args:
        work_dir: output folder.
        output_name: --output-prefix name inside work_dir.
        level: 'document' or 'sentence' (the suffix preprocess_data.py gives the files).
        preprocess_args: tokenizer flags and the like.

    Returns:
        the data prefix (work_dir/<output_name>_text_<level>).
    """
    os.makedirs(work_dir, exist_ok=True)
    prefix = os.path.join(work_dir, f'{output_name}_text_{level}')
    with open(os.path.join(work_dir, '.lock'), 'w') as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not os.path.exists(prefix + '.idx'):
            subprocess.run(
                [
                    sys.executable,
                    os.path.join(REPO, 'tools', 'preprocess_data.py'),
                    '--input',
                    os.path.join(REPO, 'data', 'corpus', 'mobydick.jsonl'),
                    '--output-prefix',
                    os.path.join(work_dir, output_name),
                    '--workers',
                    '1',
                ]
                + list(preprocess_args),
                check=True,
                capture_output=True,
                text=True,
            )
        fcntl.flock(lock, fcntl.LOCK_UN)
    return prefix


def prepare_data(work_dir):
    """Preprocess data/corpus/mobydick.jsonl with GPT-2 BPE once into work_dir; returns the
    prefix."""
    return preprocess_once(
        work_dir,
        'mobydick',
        'document',
        [
            '--tokenizer-type',
            'GPT2BPETokenizer',
            '--vocab-file',
            VOCAB,
            '--merge-file',
            MERGES,
            '--append-eod',
        ],
    )


#: Flags of a 4096-id vocabulary (NullTokenizer: ids 0..4094, EOD 4095) for the tests whose
#: subject is not the tokenizer. On a CPU a tiny model's step over GPT-2's 50304 padded ids costs
#: about four times the same step over 4096: at hidden 64 the output layer and its cross-entropy
#: are most of the work.
SMALL_VOCAB_ARGS = ['--tokenizer-type', 'NullTokenizer', '--vocab-size', '4095']
SMALL_VOCAB_EOD = 4095
GPT2_EOD = 50256


def fold_to_small_vocab(src_prefix, work_dir):
    """Write the GPT-2 corpus at `src_prefix` again with its ids folded into the vocabulary of
    SMALL_VOCAB_ARGS (id % 4095; GPT-2's EOD becomes 4095): the same documents, lengths and
    repetitions, so there is as much structure to learn. Built once (a file lock serialises
    concurrent callers); returns the new prefix."""
    import numpy

    from megatron.core.datasets.indexed_dataset import IndexedDataset, IndexedDatasetBuilder

    os.makedirs(work_dir, exist_ok=True)
    prefix = os.path.join(work_dir, 'mobydick_vocab4096_text_document')
    with open(os.path.join(work_dir, '.lock'), 'w') as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not os.path.exists(prefix + '.idx'):
            source = IndexedDataset(src_prefix)
            builder = IndexedDatasetBuilder(prefix + '.bin', dtype=numpy.uint16)
            for doc in range(len(source)):
                ids = source[doc].astype(numpy.int64)
                folded = numpy.where(ids == GPT2_EOD, SMALL_VOCAB_EOD, ids % SMALL_VOCAB_EOD)
                builder.add_document(folded.tolist(), [len(folded)])
            builder.finalize(prefix + '.idx')
        fcntl.flock(lock, fcntl.LOCK_UN)
    return prefix


def write_short_documents(prefix, num_docs=600, eod=SMALL_VOCAB_EOD, seed=0):
    """Write an indexed dataset (`prefix`.bin/.idx) of `num_docs` short documents: 3-39 ids drawn
    skewed from the first 1000 (something to learn), each followed by `eod`. Returns `prefix`.

    Cheap to index in any fresh process, unlike --mock-data, whose ~12M training samples at
    sequence length 16 each new process shuffles anew (seconds)."""
    import numpy

    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    rng = numpy.random.default_rng(seed)
    builder = IndexedDatasetBuilder(prefix + '.bin', dtype=numpy.uint16)
    for _ in range(num_docs):
        ids = (rng.zipf(1.5, rng.integers(3, 40)) % 1000).tolist() + [eod]
        builder.add_document(ids, [len(ids)])
    builder.finalize(prefix + '.idx')
    return prefix


def set_reference_weights(model_chunk, num_layers, layer_offset, qkv_std=0.02):
    """Overwrite every parameter with values that depend only on its *global* name.

    Each full (unsharded) tensor is drawn from a generator seeded by crc32 of the global name and
    this rank's TP slice is taken along `partition_dim` (a gated fc1 per half: [gate_r; up_r]).
    Layer indices are made global with `layer_offset`, MoE expert indices with the expert-parallel
    rank, and a last-stage `output_layer.weight` of a tied model gets the word embedding's
    values, so every TP/PP/EP layout starts from the same model. Grouped experts get the values of
    the equivalent sequential experts. Values are N(0, 0.02) (norm weights 1 + 5 x that), the
    fused QKV weights N(0, qkv_std): a larger qkv_std makes the attention sharp enough for
    positions to matter.
    """
    from megatron.core import parallel_state as mpu

    tp = mpu.get_tensor_model_parallel_world_size()
    tp_rank = mpu.get_tensor_model_parallel_rank()
    gated = getattr(getattr(model_chunk, 'config', None), 'gated_linear_unit', False)
    with torch.no_grad():
        for name, param in model_chunk.named_parameters():
            parts = name.split('.')
            # Decoder layers are numbered per stage; the MTP layers (`mtp.layers.k`) are not.
            if 'layers' in parts and parts[parts.index('layers') - 1] != 'mtp':
                i = parts.index('layers') + 1
                parts[i] = str(int(parts[i]) + layer_offset)
            if 'local_experts' in parts:
                i = parts.index('local_experts') + 1
                nle = _num_local_experts(model_chunk, name)
                parts[i] = str(int(parts[i]) + mpu.get_expert_model_parallel_rank() * nle)
            global_name = '.'.join(parts)
            if global_name == 'output_layer.weight':
                global_name = 'embedding.word_embeddings.weight'
            if parts[-1] in ('weight1', 'weight2') and 'experts' in parts:
                _set_grouped_reference(model_chunk, name, global_name, param, tp, tp_rank, gated)
                continue
            full_shape = list(param.shape)
            partitioned = getattr(param, 'tensor_model_parallel', False)
            if partitioned:
                full_shape[param.partition_dim] *= tp
            full = _reference_tensor(global_name, full_shape, qkv_std)
            if partitioned:
                full = _tp_slice(full, param.partition_dim, tp, tp_rank, gated, global_name)
            param.copy_(full.to(param.dtype))


def _reference_tensor(global_name, full_shape, qkv_std=0.02):
    gen = torch.Generator().manual_seed(zlib.crc32(global_name.encode()))
    std = qkv_std if 'linear_qkv.weight' in global_name else 0.02
    full = torch.randn(full_shape, generator=gen) * std
    if 'norm' in global_name and global_name.endswith('weight'):
        full = 1.0 + 5.0 * full
    return full


def _tp_slice(full, dim, tp, tp_rank, gated, global_name):
    if gated and global_name.endswith('linear_fc1.weight'):
        gate, up = full.chunk(2, dim=0)
        return torch.cat([gate.chunk(tp, dim=0)[tp_rank], up.chunk(tp, dim=0)[tp_rank]], dim=0)
    return torch.chunk(full, tp, dim=dim)[tp_rank]


def _num_local_experts(model_chunk, name):
    module = model_chunk
    for part in name.split('.'):
        module = getattr(module, part)
        if hasattr(module, 'num_local_experts'):
            return module.num_local_experts
    raise ValueError(f'{name}: no experts module on the path')


def _set_grouped_reference(model_chunk, name, global_name, param, tp, tp_rank, gated):
    """GroupedMLP weight1 [h, nle g f / tp] / weight2 [nle f / tp, h]: expert e's block is the
    transposed TP slice of the sequential expert's fc1 / fc2 reference weight."""
    from megatron.core import parallel_state as mpu

    nle = _num_local_experts(model_chunk, name)
    hidden = param.shape[0] if name.endswith('weight1') else param.shape[1]
    prefix = global_name.rsplit('.', 1)[0]  # ...mlp.experts
    first = mpu.get_expert_model_parallel_rank() * nle
    for e in range(nle):
        if name.endswith('weight1'):
            block = param.view(nle, hidden, -1)[e]  # [h, g f / tp]
            fc = f'{prefix}.local_experts.{first + e}.linear_fc1.weight'
            full = _reference_tensor(fc, [block.shape[1] * tp, hidden])
            block.copy_(_tp_slice(full, 0, tp, tp_rank, gated, fc).t())
        else:
            block = param.view(nle, -1, hidden)[e]  # [f / tp, h]
            fc = f'{prefix}.local_experts.{first + e}.linear_fc2.weight'
            full = _reference_tensor(fc, [hidden, block.shape[0] * tp])
            block.copy_(_tp_slice(full, 1, tp, tp_rank, gated, fc).t())


#: The pretrain_*.py module run by `run_pretrain` in this worker.
_SCRIPT = {'name': 'pretrain_gpt'}


def _reference_model_provider(pre_process=True, post_process=True):
    from megatron.core import parallel_state as mpu
    from megatron.training.global_vars import get_args

    args = get_args()
    model = importlib.import_module(_SCRIPT['name']).model_provider(pre_process, post_process)
    pp, pp_rank = args.pipeline_model_parallel_size, mpu.get_pipeline_model_parallel_rank()
    vp = args.virtual_pipeline_model_parallel_size
    first, last = args.decoder_first_pipeline_num_layers, args.decoder_last_pipeline_num_layers
    if vp is None:
        # Written out here rather than read from the model, so a wrong split in the model shows.
        counts = [args.num_layers // pp] * pp
        if first is not None or last is not None:
            fixed = [n for n in (first, last) if n is not None]
            share = (args.num_layers - sum(fixed)) // (pp - len(fixed))
            counts = [share] * pp
            counts[0] = share if first is None else first
            counts[-1] = share if last is None else last
        offset = sum(counts[:pp_rank])
    else:
        # Interleaved: chunk v of stage p holds layers [v * L/vp + p * L/vp/pp, ...).
        vp_rank = mpu.get_virtual_pipeline_model_parallel_rank()
        offset = vp_rank * (args.num_layers // vp) + pp_rank * (args.num_layers // vp // pp)
    set_reference_weights(model, args.num_layers, offset, qkv_std=_REFERENCE['qkv_std'])
    return model


_INJECT_AT = {'iteration': None}
#: The std of the QKV weights of `set_reference_weights` in this worker's run.
_REFERENCE = {'qkv_std': 0.02}


def _forward_step_with_overflow(data_iterator, model):
    """pretrain_gpt.forward_step, but the loss used for backward is inf at one chosen iteration."""
    import pretrain_gpt
    from megatron.training.global_vars import get_args

    output_tensor, loss_func = pretrain_gpt.forward_step(data_iterator, model)
    if get_args().curr_iteration + 1 != _INJECT_AT['iteration']:
        return output_tensor, loss_func

    def overflowing_loss_func(output):
        loss, num_tokens, report = loss_func(output)
        return loss * float('inf'), num_tokens, report

    return output_tensor, overflowing_loss_func


def run_pretrain(
    extra_args,
    reference_weights=False,
    inject_overflow_at=None,
    capture_stdout=False,
    script='pretrain_gpt',
    base_args=None,
    args_defaults=None,
    extra_args_provider=None,
):
    """Run a pretrain script's pretrain() on this rank (called inside a run_distributed worker).

    Args:
        extra_args: flags added to `base_args`.
        reference_weights: start from `set_reference_weights` instead of Megatron's init; a
            float is the std of the QKV weights there (default 0.02).
        inject_overflow_at: iteration whose backward loss is made inf (fp16 skip test, GPT only).
        capture_stdout: return what this rank printed as result['stdout'].
        script: the pretrain_*.py module (its providers and forward_step are used).
        base_args: the model's flags (default TINY_GPT_ARGS).
        args_defaults: the script's args_defaults (default GPT-2 BPE tokenizer).
        extra_args_provider: the script's own flags (callable(parser)), if it has any.

    Returns pretrain()'s result dict (losses are filled on the last rank).
    """
    import contextlib
    import io

    if REPO not in sys.path:
        sys.path.insert(0, REPO)
    from megatron.core.enums import ModelType
    from megatron.training.global_vars import destroy_global_vars
    from megatron.training.training import pretrain

    module = importlib.import_module(script)
    _SCRIPT['name'] = script
    base_args = TINY_GPT_ARGS if base_args is None else base_args
    if args_defaults is None:
        args_defaults = {'tokenizer_type': 'GPT2BPETokenizer'}
    destroy_global_vars()
    _INJECT_AT['iteration'] = inject_overflow_at
    _REFERENCE['qkv_std'] = 0.02 if isinstance(reference_weights, bool) else reference_weights
    forward_step = _forward_step_with_overflow if inject_overflow_at else module.forward_step
    buffer = io.StringIO()
    redirect = contextlib.redirect_stdout(buffer) if capture_stdout else contextlib.nullcontext()
    try:
        with redirect:
            result = pretrain(
                module.train_valid_test_datasets_provider,
                _reference_model_provider if reference_weights else module.model_provider,
                ModelType.encoder_or_decoder,
                forward_step,
                extra_args_provider=extra_args_provider,
                args_defaults=args_defaults,
                args_list=list(base_args) + list(extra_args),
            )
    finally:
        destroy_global_vars()
    if capture_stdout:
        result['stdout'] = buffer.getvalue()
    return result
