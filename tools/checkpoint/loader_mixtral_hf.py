"""Loader plugin with Megatron's loader_mixtral_hf command line: a Hugging Face Mixtral directory.

The model is imported as loader_hf does, with Megatron's choices for Mixtral: iteration 1,
sequence length 4096, tokenizer type Llama2Tokenizer with --tokenizer-model recorded, and
parameters in bf16 as Megatron's loader sets them. Unlike Megatron's loader:

- the RoPE base (`rope_theta`, 1e6 for Mixtral) is carried into the checkpoint args as
  --rotary-base, so the converted model needs no --rotary-base at run time;
- transformers 5.x is supported (Megatron's version check refuses it);
- every expert weight is checked: a missing or mis-shaped one stops with one line instead of
  saving random experts.
"""

import loader_hf
import torch
import utils

utils.add_megatron_path()

from megatron.training.checkpoint import hf_checkpoint as hfc  # noqa: E402
from megatron.training.checkpoint import hf_checkpoint_moe as hfc_moe  # noqa: E402


def add_arguments(parser):
    group = parser.add_argument_group(title='Mixtral HF loader.')
    group.add_argument(
        '--true-vocab-size',
        type=int,
        default=None,
        help='Vocabulary size before padding: the embedding rows past it are dropped.',
    )
    group.add_argument(
        '--vocab-file',
        type=str,
        default=None,
        help='Path to the vocab file (accepted and ignored, as in Megatron)',
    )
    group.add_argument(
        '--tokenizer-model', required=True, help='SentencePiece model file of the tokenizer.'
    )
    group.add_argument(
        '--megatron-path',
        type=str,
        default=None,
        help='Repository root to import megatron from (default: this checkout).',
    )


def _build(args):
    if args.model_type != 'GPT':
        raise ValueError('Mixtral is a GPT model (--model-type GPT).')
    config = hfc.read_hf_config(args.load_dir)
    if config.get('model_type') != 'mixtral':
        raise ValueError(
            f'{args.load_dir} holds a {config.get("model_type")!r} model, not Mixtral (use '
            '--loader hf for other Hugging Face models)'
        )
    hfc.check_hf_files(args.load_dir)
    hfc_moe.check_moe_hf_tensors(args.load_dir, config)
    margs = hfc_moe.megatron_args_from_hf_moe(
        config, 'Llama2Tokenizer', seq_length=4096, tokenizer_model=args.tokenizer_model
    )
    vocab = hfc_moe.hf_moe_config_namespace(config).vocab_size
    if args.true_vocab_size is not None and args.true_vocab_size != vocab:
        raise ValueError(
            f'--true-vocab-size {args.true_vocab_size} differs from the model\'s vocab_size {vocab}'
        )
    margs.params_dtype = torch.bfloat16
    margs.bf16 = True
    md = loader_hf.metadata(args, config, margs, margs.params_dtype)
    return config, md


def check_arguments(args):
    return _build(args)[1]


def _load(queue, args):
    config, md = _build(args)
    hf_state_dict = {
        k: v.to(md.params_dtype) for k, v in hfc.load_hf_state_dict(args.load_dir).items()
    }
    full = hfc_moe.full_state_dict_from_hf_moe(config, hf_state_dict)
    loader_hf.send_full_model(queue, md, full)


def load_checkpoint(queue, args):
    utils.add_megatron_path(args.megatron_path)
    utils.run_loader(queue, _load, args)
