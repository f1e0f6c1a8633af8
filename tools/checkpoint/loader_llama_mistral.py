"""Loader plugin with Megatron's loader_llama_mistral command line, for Llama-2/3, Mistral and
Yi checkpoints in the Hugging Face format (--checkpoint-type hf).

The model is imported as loader_hf does, with Megatron's choices for these models: iteration 1,
sequence length 4096, tokenizer type Llama2Tokenizer (llama2, yi), Llama3Tokenizer or
MistralTokenizer with --tokenizer-model recorded, and parameters in fp32 unless --bf16 / --fp16.
Unlike Megatron's loader, the RoPE base (rope_theta) is carried into the checkpoint args, so a
Llama-3 import needs no --rotary-base at run time.
"""

import loader_hf
import torch
import utils

utils.add_megatron_path()

from megatron.training.checkpoint import hf_checkpoint as hfc  # noqa: E402

MODEL_SIZES = [
    'llama2-7B',
    'llama2-13B',
    'llama2-70B',
    'llama2-7Bf',
    'llama2-13Bf',
    'llama2-70Bf',
    'llama3-8B',
    'llama3-70B',
    'llama3-8Bf',
    'llama3-70Bf',
    'mistral-7B',
    'mistral-7Bf',
    'yi-34B',
]


def add_arguments(parser):
    group = parser.add_argument_group(title='Llama-2/Llama-3/Mistral loader.')
    group.add_argument(
        '--model-size',
        type=str,
        required=True,
        choices=MODEL_SIZES,
        help='Model size can be `llama2-7B`, `llama2-13B`, `llama2-70B`, '
        '`llama3-8B`, `llama3-70B`, `mistral-7B` (for pretrained models), '
        'and `llama2-7Bf`, ... (for chat-finetuned models).',
    )
    group.add_argument(
        '--checkpoint-type',
        type=str,
        required=True,
        help='Checkpoint layout: "hf" (Hugging Face) or "meta" (Meta\'s original files).',
    )
    group.add_argument('--bf16', action='store_true', help='Convert the weights to bf16.')
    group.add_argument('--fp16', action='store_true', help='Convert the weights to fp16.')
    group.add_argument(
        '--true-vocab-size',
        type=int,
        default=None,
        help='original size of vocab (accepted and ignored, as in Megatron)',
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
    group.add_argument(
        '--loader-transformer-impl',
        default='local',
        choices=['local', 'transformer_engine'],
        help='Transformer implementation named in the checkpoint args (one layout here).',
    )


def _tokenizer_type(model_size):
    if model_size.startswith('llama3'):
        return 'Llama3Tokenizer'
    if model_size.startswith('mistral'):
        return 'MistralTokenizer'
    return 'Llama2Tokenizer'


def _dtype(args):
    if args.bf16:
        return torch.bfloat16
    return torch.float16 if args.fp16 else torch.float32


def _build(args):
    if args.model_type != 'GPT':
        raise ValueError('Llama-2, Llama-3 and Mistral are GPT models.')
    if args.checkpoint_type != 'hf':
        raise ValueError(
            f'--checkpoint-type {args.checkpoint_type}: only "hf" is supported here; convert '
            f'Meta weights to the Hugging Face format first (transformers\' '
            f'convert_llama_weights_to_hf.py)'
        )
    if args.bf16 and args.fp16:
        raise ValueError('--bf16 and --fp16 are mutually exclusive')
    config = hfc.read_hf_config(args.load_dir)
    if hfc.hf_family(config) != 'llama':
        raise ValueError(
            f'--model-size {args.model_size}: {args.load_dir} holds a '
            f'{config.get("model_type")!r} model, not Llama or Mistral'
        )
    hfc.check_hf_files(args.load_dir)
    hfc.check_hf_shapes(args.load_dir, config)
    margs = hfc.megatron_args_from_hf(
        config,
        _tokenizer_type(args.model_size),
        seq_length=4096,
        tokenizer_model=args.tokenizer_model,
    )
    margs.params_dtype = _dtype(args)
    margs.bf16, margs.fp16 = args.bf16, args.fp16
    md = loader_hf.metadata(args, config, margs, margs.params_dtype)
    return config, md


def check_arguments(args):
    return _build(args)[1]


def _load(queue, args):
    config, md = _build(args)
    dtype = md.params_dtype
    hf_state_dict = {k: v.to(dtype) for k, v in hfc.load_hf_state_dict(args.load_dir).items()}
    loader_hf.send_full_model(queue, md, hfc.full_state_dict_from_hf(config, hf_state_dict))


def load_checkpoint(queue, args):
    utils.add_megatron_path(args.megatron_path)
    utils.run_loader(queue, _load, args)
