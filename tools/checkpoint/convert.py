"""Convert a checkpoint between layouts and formats (Megatron's tools/checkpoint/convert.py).

A loader plugin reads the source and streams the model through a queue to a saver plugin, which
runs in a child process and writes the target:

    python tools/checkpoint/convert.py --model-type GPT --loader mcore --saver mcore \\
        --load-dir ckpt_tp2_pp2 --save-dir ckpt_tp1 \\
        --target-tensor-parallel-size 1 --target-pipeline-parallel-size 1

The queue carries first a metadata namespace, then one dict per message ("embeddings",
"transformer layer N", "final norm", "output layer", BERT heads; a T5's encoder and decoder
messages are listed in mcore_t5.py), each with a "name" key, then the string "done" ("exit" if
the loader failed). Plugins: loader_<name>.py defines
`add_arguments(parser)` and `load_checkpoint(queue, args)`, saver_<name>.py `add_arguments` and
`save_checkpoint(queue, args)`; either may also define `check_arguments(args, source)`, called
before any process starts so that wrong flags fail in one line before any work.
"""

import argparse
import importlib
import os
import sys

import torch.multiprocessing as mp

_HERE = os.path.dirname(os.path.abspath(__file__))
for _path in (_HERE, os.path.dirname(os.path.dirname(_HERE))):
    if _path not in sys.path:
        sys.path.insert(0, _path)

import utils  # noqa: E402  (tools/checkpoint/utils.py)


def load_plugin(plugin_type: str, name: str):
    """Import loader_<name> / saver_<name>, else <name> as a module path."""
    module_name = f'{plugin_type}_{name}'
    try:
        plugin = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        print(exc)
        try:
            module_name = name
            plugin = importlib.import_module(module_name)
        except ModuleNotFoundError as exc2:
            print(exc2)
            sys.exit(f'Unable to load {plugin_type} plugin {name}. Exiting.')
    if not hasattr(plugin, 'add_arguments'):
        sys.exit(f'{module_name} module is not a plugin. Exiting.')
    print(f'Loaded {module_name} as the {plugin_type}.')
    return plugin


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description='Megatron Checkpoint Converter Arguments',
        allow_abbrev=False,
        conflict_handler='resolve',
    )
    parser.add_argument(
        '--model-type',
        type=str,
        required=True,
        choices=['GPT', 'BERT', 'T5', 'mamba', 'VISION', 'LLAVA'],
        help='Type of the model (T5: the mcore / megatron loader and saver; mamba: '
        'pretrain_mamba.py checkpoints and Hugging Face Mamba2 / NemotronH, hf and mcore plugins; '
        'VISION: a CLIP / SigLIP encoder, --loader hf|mcore --saver mcore|hf; '
        'LLAVA: a LlavaForConditionalGeneration / pretrain_vlm.py model, the same plugins)',
    )
    parser.add_argument(
        '--loader',
        type=str,
        default='megatron',
        help='Loader plugin: loader_<name>.py next to convert.py, or an importable module.',
    )
    parser.add_argument(
        '--saver',
        type=str,
        default='megatron',
        help='Saver plugin: saver_<name>.py next to convert.py, or an importable module.',
    )
    parser.add_argument(
        '--load-dir',
        type=str,
        required=True,
        help='Checkpoint (or Hugging Face) directory to read.',
    )
    parser.add_argument(
        '--save-dir',
        type=str,
        required=True,
        help='Directory the converted checkpoint is written to.',
    )
    parser.add_argument(
        '--max-queue-size',
        type=int,
        default=50,
        help='Most messages the loader may send ahead of the saver.',
    )
    parser.add_argument(
        '--no-checking',
        action='store_false',
        dest='checking',
        help='Skip the check that every message names the weights the saver expects, in order.',
    )
    parser.add_argument(
        '--overwrite',
        action='store_true',
        help='Write into a --save-dir that already holds a checkpoint',
    )
    return parser


def main(argv=None) -> int:
    parser = build_parser()
    known_args, _ = parser.parse_known_args(argv)
    loader = load_plugin('loader', known_args.loader)
    saver = load_plugin('saver', known_args.saver)
    loader.add_arguments(parser)
    saver.add_arguments(parser)
    args = parser.parse_args(argv)

    # Every check that can fail on the flags or the source runs here, before any process starts.
    try:
        utils.check_save_dir(args.save_dir)
        source = loader.check_arguments(args) if hasattr(loader, 'check_arguments') else None
        if hasattr(saver, 'check_arguments'):
            saver.check_arguments(args, source)
    except ValueError as exc:
        print(f'error: {exc}', file=sys.stderr)
        return 2

    # The saver (a forked child) shares stdout: both write whole lines, one write each, so that
    # neither cuts the other's lines (unbuffered, print writes a line and its newline apart; block
    # buffers are flushed at any byte).
    if hasattr(sys.stdout, 'reconfigure'):
        sys.stdout.flush()
        sys.stdout.reconfigure(line_buffering=True, write_through=False)
    queue = mp.Queue(maxsize=args.max_queue_size)
    print('Starting saver...')
    utils.set_loader_pid(os.getpid())
    saver_proc = mp.Process(target=saver.save_checkpoint, args=(queue, args))
    saver_proc.start()
    utils.set_saver_process(saver_proc)

    print('Starting loader...')
    loader_failed = False
    try:
        loader.load_checkpoint(queue, args)
    except (utils.SaverExited, ValueError) as exc:
        # One line for the user; the saver was told to exit ("exit" on the queue).
        print(f'error: {exc}', file=sys.stderr)
        loader_failed = True
    finally:
        print('Waiting for saver to complete...')
        saver_proc.join()
    if loader_failed:
        return 1
    if saver_proc.exitcode != 0:
        print(f'error: the saver exited with code {saver_proc.exitcode}', file=sys.stderr)
        return 1
    return 0


if __name__ == '__main__':
    sys.exit(main())
