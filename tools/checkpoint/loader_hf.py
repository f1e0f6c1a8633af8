"""Loader plugin: a Hugging Face model directory (GPT-2 or Llama family; Mixtral / Qwen2-MoE /
Qwen3-MoE; DeepSeek-V3).

`--load-dir` holds config.json and model.safetensors (or an index and its shards). The model is
sent as a TP = PP = 1 model at iteration 1 with our args for its architecture, so that the saved
checkpoint starts pretrain_gpt.py with --use-checkpoint-args.
"""

import os
import types

import loader_mcore
import mamba_checkpoint
import mcore_llava
import mcore_vision
import torch
import utils

utils.add_megatron_path()

from megatron.training.checkpoint import checkpoint_conversion as cc  # noqa: E402
from megatron.training.checkpoint import checkpoint_conversion_moe as cc_moe  # noqa: E402
from megatron.training.checkpoint import hf_checkpoint as hfc  # noqa: E402
from megatron.training.checkpoint import hf_checkpoint_deepseek as hfc_ds  # noqa: E402
from megatron.training.checkpoint import hf_checkpoint_moe as hfc_moe  # noqa: E402


def add_arguments(parser):
    group = parser.add_argument_group(title='Hugging Face loader')
    group.add_argument(
        '--megatron-path',
        type=str,
        default=None,
        help='Repository root to import megatron from (default: this checkout).',
    )
    group.add_argument(
        '--hf-tokenizer-type',
        type=str,
        default=None,
        help='tokenizer type recorded in the checkpoint args (default: '
        'GPT2BPETokenizer for GPT-2, HuggingFaceTokenizer for Llama)',
    )
    group.add_argument(
        '--seq-length',
        type=int,
        default=None,
        help='sequence length recorded in the checkpoint args (default: '
        'the position limit, at most 4096)',
    )


#: Files that make a directory loadable by transformers' AutoTokenizer.
HF_TOKENIZER_FILES = ('tokenizer.json', 'tokenizer_config.json', 'tokenizer.model')
GPT2_BPE_FILES = ('vocab.json', 'merges.txt')


def _present(hf_dir, names):
    return [n for n in names if os.path.isfile(os.path.join(hf_dir, n))]


def default_tokenizer_type(family):
    return 'GPT2BPETokenizer' if family == 'gpt2' else 'HuggingFaceTokenizer'


def tokenizer_args(hf_dir, family, requested=None):
    """(tokenizer type, {tokenizer file args}) that the checkpoint records, from the tokenizer
    files the Hugging Face directory holds, so that a checkpoint started with
    --use-checkpoint-args finds a tokenizer that exists.

    - --hf-tokenizer-type given: that type, with the directory's files when it has them;
    - else tokenizer.json / tokenizer_config.json / tokenizer.model: HuggingFaceTokenizer;
    - else vocab.json + merges.txt: GPT2BPETokenizer with those files;
    - else a GPT-2: GPT2BPETokenizer (give --vocab-file / --merge-file at run time);
    - else refused, naming the flag to pass.
    """
    hf_files = _present(hf_dir, HF_TOKENIZER_FILES)
    has_bpe = len(_present(hf_dir, GPT2_BPE_FILES)) == 2
    bpe = {
        'vocab_file': os.path.join(os.path.abspath(hf_dir), 'vocab.json'),
        'merge_file': os.path.join(os.path.abspath(hf_dir), 'merges.txt'),
    }
    kind = requested
    if kind is None:
        if hf_files:
            kind = 'HuggingFaceTokenizer'
        elif has_bpe or family == 'gpt2':
            kind = 'GPT2BPETokenizer'
        else:
            raise ValueError(
                f'--load-dir {hf_dir} holds no tokenizer files ({", ".join(HF_TOKENIZER_FILES)}, '
                f'or vocab.json + merges.txt): copy the model\'s tokenizer files there, or pass '
                f'--hf-tokenizer-type (e.g. --hf-tokenizer-type GPT2BPETokenizer, then give '
                f'--vocab-file and --merge-file when you start from the checkpoint)'
            )
    if kind == 'HuggingFaceTokenizer':
        if not hf_files:
            raise ValueError(
                f'--hf-tokenizer-type HuggingFaceTokenizer: --load-dir {hf_dir} holds none of '
                f'{", ".join(HF_TOKENIZER_FILES)}; copy them there or pass another '
                f'--hf-tokenizer-type'
            )
        return kind, {'tokenizer_model': os.path.abspath(hf_dir)}
    if kind == 'GPT2BPETokenizer' and has_bpe:
        return kind, bpe
    return kind, {}


def metadata(args, config, margs, dtype):
    """The metadata namespace of an imported Hugging Face model."""
    return types.SimpleNamespace(
        model_type=args.model_type,
        num_layers=margs.num_layers,
        hidden_size=margs.hidden_size,
        seq_length=margs.seq_length,
        num_attention_heads=margs.num_attention_heads,
        max_position_embeddings=margs.max_position_embeddings,
        tokenizer_type=margs.tokenizer_type,
        iteration=1,
        params_dtype=dtype,
        bert_binary_head=False,
        output_layer=margs.untie_embeddings_and_output_weights,
        position_embedding_type=margs.position_embedding_type,
        linear_bias=margs.add_bias_linear,
        norm_has_bias=margs.normalization == 'LayerNorm',
        swiglu=margs.swiglu,
        previous_tensor_parallel_size=1,
        previous_pipeline_parallel_size=1,
        true_vocab_size=_hf_vocab_size(config),
        make_vocab_size_divisible_by=margs.make_vocab_size_divisible_by,
        checkpoint_args=margs,
        consumed_train_samples=0,
        consumed_valid_samples=0,
        num_experts=getattr(margs, 'num_experts', None),
    )


def _hf_vocab_size(config):
    if hfc_ds.is_deepseek_hf_config(config):
        return hfc_ds.deepseek_config_namespace(config).vocab_size
    if hfc_moe.is_moe_hf_config(config):
        return hfc_moe.hf_moe_config_namespace(config).vocab_size
    return hfc.hf_config_namespace(config).vocab_size


def _config_dtype(config):
    return {'float16': torch.float16, 'bfloat16': torch.bfloat16}.get(
        config.get('torch_dtype') or config.get('dtype'), torch.float32
    )


def build_metadata(args, tokenizer_type=None):
    """(config, metadata); every check of the source (files, shapes against config.json, the
    tokenizer to record) runs here, reading only the safetensors headers."""
    if args.model_type != 'GPT':
        raise ValueError(f'--model-type {args.model_type}: Hugging Face imports are GPT models')
    config = hfc.read_hf_config(args.load_dir)
    if hfc_ds.is_deepseek_hf_config(config):
        return _deepseek_metadata(args, config, tokenizer_type)
    moe = hfc_moe.is_moe_hf_config(config)
    family = 'moe' if moe else hfc.hf_family(config)
    hfc.check_hf_files(args.load_dir)
    if moe:
        hfc_moe.check_moe_hf_tensors(args.load_dir, config)
    else:
        hfc.check_hf_shapes(args.load_dir, config)
    kind, files = tokenizer_args(args.load_dir, family, tokenizer_type or args.hf_tokenizer_type)
    to_args = hfc_moe.megatron_args_from_hf_moe if moe else hfc.megatron_args_from_hf
    margs = to_args(config, kind, seq_length=args.seq_length, **files)
    margs.params_dtype = _config_dtype(config)
    return config, metadata(args, config, margs, margs.params_dtype)


def _deepseek_metadata(args, config, tokenizer_type):
    hfc.check_hf_files(args.load_dir)
    mtp = hfc_ds.check_deepseek_hf_shapes(args.load_dir, config)
    kind, files = tokenizer_args(args.load_dir, 'moe', tokenizer_type or args.hf_tokenizer_type)
    margs = hfc_ds.megatron_args_from_hf_deepseek(
        config, kind, seq_length=args.seq_length, mtp_layers=mtp, **files
    )
    margs.params_dtype = _config_dtype(config)
    return config, metadata(args, config, margs, margs.params_dtype)


def check_arguments(args):
    if mamba_checkpoint.is_mamba(args):
        return mamba_checkpoint.hf_metadata(args)[1]
    if args.model_type == 'VISION':
        return mcore_vision.hf_metadata(args)
    if args.model_type == 'LLAVA':
        return mcore_llava.hf_metadata(args, tokenizer_args)
    return build_metadata(args)[1]


def send_full_model(queue, md, full):
    """Stream a full (TP = PP = 1) megatron-core state dict as the protocol's messages."""
    queue.put(md)
    layers, rest = cc.split_chunk_by_layer(full, 0)
    utils.queue_put(queue, 'embeddings', loader_mcore.embeddings_message(md, rest))
    for index, layer in layers.items():
        message = cc_moe.moe_layer_to_message(layer, md.swiglu, getattr(md, 'num_experts', None))
        utils.queue_put(queue, f'transformer layer {index}', message)
    loader_mcore.send_tail(queue, md, rest)


def _load(queue, args):
    config, md = build_metadata(args)
    print(f'reading {os.path.join(args.load_dir, hfc.SAFETENSORS_NAME)}', flush=True)
    hf_state_dict = hfc.load_hf_state_dict(args.load_dir)
    if hfc_ds.is_deepseek_hf_config(config):
        mtp = md.checkpoint_args.mtp_num_layers or 0
        full = hfc_ds.full_state_dict_from_hf_deepseek(config, hf_state_dict, mtp)
    elif hfc_moe.is_moe_hf_config(config):
        full = hfc_moe.full_state_dict_from_hf_moe(config, hf_state_dict)
    else:
        full = hfc.full_state_dict_from_hf(config, hf_state_dict)
    send_full_model(queue, md, full)


def load_checkpoint(queue, args):
    utils.add_megatron_path(args.megatron_path)
    if mamba_checkpoint.is_mamba(args):
        body = mamba_checkpoint.load_hf
    elif args.model_type == 'VISION':
        body = mcore_vision.load_hf
    elif args.model_type == 'LLAVA':
        utils.run_loader(queue, lambda q, a: mcore_llava.load_hf(q, a, tokenizer_args), args)
        return
    else:
        body = _load
    utils.run_loader(queue, body, args)
