"""Shared pieces of the checkpoint-conversion tests: tiny source checkpoints made with
pretrain_gpt.py on mock data, the convert.py command, whole-model reads, and forward passes of
a converted checkpoint built from its saved args alone (--use-checkpoint-args).
"""

import os
import subprocess
import sys

import torch

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CONVERT = os.path.join(REPO, 'tools', 'checkpoint', 'convert.py')
CHECKPOINT_UTIL = os.path.join(REPO, 'tools', 'checkpoint_util.py')

#: Tiny models on mock data (NullTokenizer: 4096 ids, eod = 4095).
COMMON_ARGS = [
    '--seq-length',
    '16',
    '--max-position-embeddings',
    '16',
    '--attention-dropout',
    '0.0',
    '--hidden-dropout',
    '0.0',
    '--micro-batch-size',
    '1',
    '--global-batch-size',
    '4',
    '--lr',
    '1e-2',
    '--min-lr',
    '1e-3',
    '--lr-decay-style',
    'cosine',
    '--lr-warmup-iters',
    '1',
    '--weight-decay',
    '0.01',
    '--clip-grad',
    '1.0',
    '--seed',
    '1234',
    '--mock-data',
    '--tokenizer-type',
    'NullTokenizer',
    '--vocab-size',
    '4095',
    '--split',
    '98,2,0',
    '--num-workers',
    '0',
    '--log-interval',
    '1',
    '--eval-interval',
    '1000',
    '--eval-iters',
    '1',
    '--distributed-backend',
    'gloo',
]
GPT_ARCH = ['--num-layers', '4', '--hidden-size', '32', '--num-attention-heads', '4']
LLAMA_ARCH = [
    '--num-layers',
    '4',
    '--hidden-size',
    '64',
    '--num-attention-heads',
    '8',
    '--group-query-attention',
    '--num-query-groups',
    '2',
    '--ffn-hidden-size',
    '96',
    '--normalization',
    'RMSNorm',
    '--norm-epsilon',
    '1e-6',
    '--swiglu',
    '--position-embedding-type',
    'rope',
    '--rotary-base',
    '5000',
    '--disable-bias-linear',
    '--untie-embeddings-and-output-weights',
]


def run_pretrain(extra_args):
    """pretrain() of pretrain_gpt.py on this rank; {iteration: lm loss} on the last stage."""
    if REPO not in sys.path:
        sys.path.insert(0, REPO)
    import pretrain_gpt
    from megatron.core.enums import ModelType
    from megatron.training.global_vars import destroy_global_vars
    from megatron.training.training import pretrain

    destroy_global_vars()
    try:
        result = pretrain(
            pretrain_gpt.train_valid_test_datasets_provider,
            pretrain_gpt.model_provider,
            ModelType.encoder_or_decoder,
            pretrain_gpt.forward_step,
            args_list=COMMON_ARGS + list(extra_args),
        )
    finally:
        destroy_global_vars()
    return {int(k): float(v['lm loss']) for k, v in result['train_losses'].items()}


def make_source_checkpoint(save_dir, arch_args, layout_args, world_size, tp, pp, iters=3):
    """Train `iters` iterations at a layout and save at the end (optimizer state included)."""
    from tests.unit_tests.dist_utils import run_distributed

    extra = (
        list(arch_args)
        + list(layout_args)
        + [
            '--train-iters',
            str(iters),
            '--save',
            save_dir,
            '--save-interval',
            str(iters),
        ]
    )
    run_distributed(run_pretrain, world_size=world_size, tp=tp, pp=pp, args=(extra,), timeout=600)


def _run_script_in_child(script, argv, out_path, err_path):
    """Body of the forked child: run `script` as `python script argv...` would, output to files.

    Never returns: the child leaves with os._exit so that none of pytest's exit handlers run in
    it.
    """
    import runpy
    import traceback

    code = 1
    try:
        out = open(out_path, 'w')
        err = open(err_path, 'w')
        # C-level writes (and any grandchild the script forks, such as convert.py's saver) go
        # to the same files as Python's prints.
        os.dup2(out.fileno(), 1)
        os.dup2(err.fileno(), 2)
        sys.stdout, sys.stderr = out, err
        sys.argv = [script, *argv]
        sys.path.insert(0, os.path.dirname(script))
        try:
            runpy.run_path(script, run_name='__main__')
            code = 0
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
            if exc.code is not None and not isinstance(exc.code, int):
                print(exc.code, file=sys.stderr)
        except BaseException:
            traceback.print_exc()
            code = 1
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os._exit(code)


def _prime_imports():
    """Import what the conversion plugins import, once in this process, so that forked runs
    start with it loaded (a fresh interpreter spends seconds importing torch and transformers)."""
    import megatron.training.checkpoint.checkpoint_conversion  # noqa: F401

    try:
        import transformers  # noqa: F401
    except ImportError:
        pass


def convert(*flags, check=True, model_type='GPT', script=CONVERT, timeout=600):
    """Run tools/checkpoint/convert.py (or `script`) as its command line would; the
    CompletedProcess (returncode, stdout, stderr).

    The script runs in a child forked from this process rather than in a new interpreter: the
    same code path from `sys.argv` through `if __name__ == '__main__'`, without paying torch's
    import again. The child has its own globals, so nothing the loader sets leaks into the
    tests, and the saver it starts is forked from it as on the command line.
    """
    import multiprocessing
    import tempfile

    _prime_imports()
    model_flags = ['--model-type', model_type] if model_type else []
    argv = [*model_flags, *flags]
    with tempfile.TemporaryDirectory() as tmp:
        out_path, err_path = os.path.join(tmp, 'out'), os.path.join(tmp, 'err')
        sys.stdout.flush()
        sys.stderr.flush()
        child = multiprocessing.get_context('fork').Process(
            target=_run_script_in_child, args=(script, argv, out_path, err_path)
        )
        child.start()
        child.join(timeout)
        if child.is_alive():
            child.kill()
            child.join(10)
            raise subprocess.TimeoutExpired([script, *argv], timeout)
        stdout, stderr = open(out_path).read(), open(err_path).read()
    proc = subprocess.CompletedProcess([script, *argv], child.exitcode, stdout, stderr)
    if check:
        assert proc.returncode == 0, f'convert.py {flags} failed:\n{proc.stdout}\n{proc.stderr}'
    return proc


def read_rank_file(ckpt_dir, tp_rank, pp_rank, pp):
    from megatron.training.checkpoint.checkpoint_conversion import (
        CheckpointReader,
        torch_load_weights_only,
    )

    reader = CheckpointReader(ckpt_dir)
    assert reader.pp == pp
    return torch_load_weights_only(reader.rank_file(tp_rank, pp_rank), mmap=False)


def full_model(ckpt_dir):
    """{global name: full tensor} of a checkpoint, with its reader (layout, args, iteration).

    The last stage's copy of a tied embedding is returned as 'output_layer.weight (copy)'.
    """
    from megatron.training.checkpoint.checkpoint_conversion import split_chunk_by_layer
    from megatron.training.checkpoint.checkpoint_conversion_moe import MoECheckpointReader

    reader = MoECheckpointReader(ckpt_dir)  # any TP x PP (x EP) layout
    block = 'encoder' if reader.model_type == 'BERT' else 'decoder'
    full = {}
    for pp_rank in range(reader.pp):
        chunks, _ = reader.load_stage(pp_rank)
        for offset, chunk in chunks:
            layers, rest = split_chunk_by_layer(chunk, offset)
            for index, layer in layers.items():
                for name, tensor in layer.items():
                    if tensor is not None:
                        full[f'{block}.layers.{index}.{name}'] = tensor
            for name, tensor in rest.items():
                if tensor is None:
                    continue
                tied_copy = (
                    name == 'output_layer.weight'
                    and not reader.args.untie_embeddings_and_output_weights
                )
                full[name + (' (copy)' if tied_copy else '')] = tensor
    return full, reader


def logits_from_checkpoint(load_dir, tokens, extra_args=(), also=None):
    """Full-vocabulary logits [b, s, v] of a checkpoint at its own layout (harness rank).

    The model is built by pretrain_gpt.model_provider from the checkpoint's saved args only
    (--use-checkpoint-args), the rank's file loaded with strict=True, and activations passed
    between pipeline stages by hand. With `also`, the last stage returns (logits,
    also(model, tokens)).
    """
    if REPO not in sys.path:
        sys.path.insert(0, REPO)
    import pretrain_gpt
    from megatron.core import parallel_state as ps
    from megatron.training.arguments import parse_args
    from megatron.training.checkpoint.checkpoint_conversion import torch_load_weights_only
    from megatron.training.checkpoint.checkpoint_conversion_moe import MoECheckpointReader
    from megatron.training.checkpointing import load_args_from_checkpoint
    from megatron.training.global_vars import destroy_global_vars, set_args
    from megatron.training.validation.argument_validation import validate_args
    from tests.unit_tests.models.gpt_test_utils import gather_logits

    destroy_global_vars()
    args = parse_args(
        args_list=[
            '--load',
            load_dir,
            '--use-checkpoint-args',
            '--micro-batch-size',
            '1',
            '--mock-data',
            '--tokenizer-type',
            'NullTokenizer',
            '--vocab-size',
            '1',
            *extra_args,
        ]
    )
    load_args_from_checkpoint(args)
    args.world_size, args.rank = torch.distributed.get_world_size(), torch.distributed.get_rank()
    validate_args(args)
    set_args(args)
    try:
        first, last = ps.is_pipeline_first_stage(), ps.is_pipeline_last_stage()
        model = pretrain_gpt.model_provider(pre_process=first, post_process=last)
        reader = MoECheckpointReader(load_dir)
        state = torch_load_weights_only(
            reader.rank_file(
                ps.get_tensor_model_parallel_rank(),
                ps.get_pipeline_model_parallel_rank(),
                ps.get_expert_model_parallel_rank(),
            ),
            mmap=False,
        )
        model.load_state_dict(state['model'], strict=True)
        model.eval()
        b, s = tokens.shape
        position_ids = torch.arange(s).unsqueeze(0).expand(b, -1)
        with torch.no_grad():
            if not first:
                hidden = torch.empty(s, b, args.hidden_size)
                torch.distributed.recv(hidden, ps.get_pipeline_model_parallel_prev_rank())
                model.set_input_tensor(hidden)
            out = model(tokens if first else None, position_ids, None)
            if not last:
                torch.distributed.send(out.contiguous(), ps.get_pipeline_model_parallel_next_rank())
                return None
            if also is not None:
                return gather_logits(out), also(model, tokens)
            return gather_logits(out)
    finally:
        destroy_global_vars()
