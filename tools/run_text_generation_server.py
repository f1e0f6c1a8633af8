"""Serve a GPT or hybrid Mamba checkpoint over HTTP: Megatron's `PUT /api`, OpenAI-style
`/v1/completions` and `/v1/chat/completions`, `/v1/models` and `/health`, on the dynamic-batching
inference engine.

Start it with the model-parallel flags of the checkpoint, e.g. (see examples/inference/):

    torchrun --nproc-per-node 1 tools/run_text_generation_server.py --load CKPT \\
        --num-layers 12 --hidden-size 768 --num-attention-heads 12 --seq-length 1024 \\
        --max-position-embeddings 1024 --micro-batch-size 1 --tokenizer-type GPT2BPETokenizer \\
        --vocab-file data/gpt2/gpt2-vocab.json --merge-file data/gpt2/gpt2-merges.txt

A hybrid Mamba checkpoint (written by pretrain_mamba.py or convert.py --model-type mamba) is
recognised from its args with --use-checkpoint-args (or pass --is-hybrid-model and its Mamba
flags): the engine keeps the attention layers' KV cache and, per request, each Mamba layer's conv
and SSM state. tools/run_mamba_text_generation_server.py (Megatron core_r0.8.0's name) is this
script with --is-hybrid-model set.

A LLaVA checkpoint (pretrain_vlm.py, convert.py --model-type LLAVA; recognised with
--use-checkpoint-args) is served with images: `PUT /api` takes "images" (base64 PNG / JPEG) for
the prompts' <image> markers and /v1/chat/completions OpenAI image_url parts (data URLs only);
its requests run one at a time on every rank (megatron/inference/vlm_generation.py), not on the
engine.

Global rank 0 serves on --host:--port and drives the engine; every other rank follows its
broadcasts (megatron/inference/worker_loop.py). Concurrent requests are batched: at most
--max-batch-size run at once, --max-waiting-requests more may wait (beyond that: HTTP 503), and the
KV cache holds --inference-dynamic-batching-buffer-size-gb GiB per rank.
"""

import errno
import os
import socket
import sys

sys.path.append(os.path.abspath(os.path.join(os.path.dirname(__file__), os.path.pardir)))

from typing import Union

import torch

from megatron.core.models.gpt import GPTModel
from megatron.core.models.mamba import MambaModel
from megatron.core.utils import get_current_device
from megatron.inference.inference_engine import get_dynamic_inference_engine
from megatron.inference.serving import Serving
from megatron.inference.text_generation_server import (
    MAX_PROMPTS,
    MAX_REQUEST_BYTES,
    MegatronServer,
    run_generation_worker_loop,
)
from megatron.inference.worker_loop import ServingLoop
from megatron.training.checkpointing import load_checkpoint
from megatron.training.global_vars import get_args, get_tokenizer
from megatron.training.gpt_builder import (
    gpt_config_from_args,
    gpt_layer_spec_from_args,
    gpt_model_kwargs,
)
from megatron.training.initialize import initialize_megatron
from megatron.training.mamba_builder import mamba_model_from_args
from megatron.training.run_control.errors import run_main
from megatron.training.training import get_model
from megatron.training.utils import print_rank_0
from megatron.training.validation.argument_validation_mamba import is_mamba_run
from megatron.training.validation.context_parallel_checks import refuse_context_parallel


def model_provider(pre_process=True, post_process=True) -> Union[GPTModel, MambaModel]:
    """The GPT (or hybrid Mamba) model of this stage, with full-vocabulary logits on every TP
    rank (parallel_output=False) so that each rank can sample. Built as pretrain_gpt.py /
    pretrain_mamba.py build it (megatron/training/gpt_builder.py, mamba_builder.py): Megatron's
    server builds its layer spec without q/k layernorm, which would serve a Qwen3 checkpoint
    without its q/k norms; here --qk-layernorm, MLA, the dense / MoE layer mix and the rope
    flags are honoured."""
    args = get_args()
    if is_mamba_run(args):
        print_rank_0('building Mamba model ...')
        return mamba_model_from_args(args, pre_process, post_process, parallel_output=False)
    print_rank_0('building GPT model ...')
    config = gpt_config_from_args(args)
    return GPTModel(
        config=config,
        transformer_layer_spec=gpt_layer_spec_from_args(args, config),
        pre_process=pre_process,
        post_process=post_process,
        parallel_output=False,
        **gpt_model_kwargs(args),
    )


def add_text_generate_args(parser):
    """Server flags: Megatron's --port, plus where to bind and the request limits."""
    group = parser.add_argument_group(title='text generation')
    group.add_argument('--port', type=int, default=5000, help='TCP port the server listens on.')
    group.add_argument(
        '--host',
        type=str,
        default='127.0.0.1',
        help='Address the server binds to (Megatron binds 0.0.0.0, every '
        'interface; pass --host 0.0.0.0 to serve other machines).',
    )
    group.add_argument(
        '--max-prompts', type=int, default=MAX_PROMPTS, help='Most prompts in one request.'
    )
    group.add_argument(
        '--max-request-bytes',
        type=int,
        default=MAX_REQUEST_BYTES,
        help='Largest request body accepted, in bytes (larger: HTTP 400).',
    )
    group.add_argument(
        '--random-weights',
        action='store_true',
        help='Serve randomly initialized weights when no --load is given (a smoke test); '
        'without it the server refuses to start without a checkpoint.',
    )
    group.add_argument(
        '--max-batch-size',
        type=int,
        default=None,
        help='Most requests (prompts) the engine runs at once (default: '
        '--inference-dynamic-batching-max-requests, else as many as the KV cache holds, at most '
        '256).',
    )
    group.add_argument(
        '--max-waiting-requests',
        type=int,
        default=1024,
        help='Most requests (prompts) that may wait for a free row; a request beyond that is '
        'answered HTTP 503. At least --max-prompts.',
    )
    group.add_argument(
        '--use-legacy-static-engine',
        action='store_true',
        help="Serve every request through Megatron's generate() loop, one at a time (the "
        'server before the dynamic engine), instead of batching them.',
    )
    group.add_argument(
        '--served-model-name',
        type=str,
        default=None,
        help='Model name reported by GET /v1/models (default: the --load directory name).',
    )
    return parser


def _bind_error(host, port):
    """The errno of binding host:port here (0: it can be served)."""
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        with socket.socket(family, socket.SOCK_STREAM) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((host, port))
    except socket.gaierror:
        return errno.EADDRNOTAVAIL
    except OSError as exc:
        return exc.errno or errno.EADDRNOTAVAIL
    return 0


def check_address(host, port):
    """Rank 0 can listen on host:port, checked before the model is built (a port in use or a host
    that is not this machine's is one line, not werkzeug's exit after all the work). Every rank
    learns the verdict and refuses together, so no rank is left in a collective."""
    code = _bind_error(host, port) if torch.distributed.get_rank() == 0 else 0
    verdict = torch.tensor([code], dtype=torch.long, device=get_current_device())
    torch.distributed.broadcast(verdict, 0)
    if verdict.item():
        raise ValueError(
            f'--host {host} --port {port}: cannot serve there ({os.strerror(verdict.item())})'
        )


def check_serving_flags(args):
    """The server's limits, before any work (ValueError naming the flag)."""
    for flag, value in (
        ('--max-prompts', args.max_prompts),
        ('--max-request-bytes', args.max_request_bytes),
        ('--max-batch-size', 1 if args.max_batch_size is None else args.max_batch_size),
        ('--max-waiting-requests', args.max_waiting_requests),
    ):
        if value < 1:
            raise ValueError(f'{flag} must be at least 1, got {value}')
    if args.max_waiting_requests < args.max_prompts:
        raise ValueError(
            f'--max-waiting-requests ({args.max_waiting_requests}) must be at least '
            f'--max-prompts ({args.max_prompts}): a request of that many prompts must fit the queue'
        )
    given = args.inference_dynamic_batching_max_requests
    if args.max_batch_size is not None and given is not None and given != args.max_batch_size:
        raise ValueError(
            f'--max-batch-size ({args.max_batch_size}) and '
            f'--inference-dynamic-batching-max-requests ({given}) disagree; give one of them'
        )


def check_one_replica(args):
    """Every rank follows global rank 0's broadcasts, so the world is one model replica: TP x PP,
    times EP for an MoE model (the expert-parallel ranks hold different experts of the same
    replica and run the same requests; their dispatch exchanges the tokens)."""
    ep = getattr(args, 'expert_model_parallel_size', 1) or 1
    if args.data_parallel_size != ep:
        tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
        raise ValueError(
            f'text generation runs one model replica: world size ({args.world_size}) must equal '
            f'--tensor-model-parallel-size ({tp}) x --pipeline-model-parallel-size ({pp}) x '
            f'--expert-model-parallel-size ({ep}) = {tp * pp * ep}'
        )


#: Script defaults for flags left unset. Generation batches prompts itself, so the training
#: micro-batch size only needs a value: a checkpoint converted with --use-checkpoint-args then
#: starts with the tokenizer flags alone.
ARGS_DEFAULTS = {
    'tokenizer_type': 'GPT2BPETokenizer',
    'no_load_rng': True,
    'no_load_optim': True,
    'micro_batch_size': 1,
}


def is_vision_language_checkpoint(args) -> bool:
    """A pretrain_vlm.py (LLaVA) checkpoint restored by --use-checkpoint-args: its args record
    drop_vision_class_token."""
    return getattr(args, 'drop_vision_class_token', None) is not None


def vision_language_model(args):
    """The LLaVAModel of a pretrain_vlm.py checkpoint, built by pretrain_vlm.py's own model
    provider (its flags not recorded in the checkpoint, e.g. the freezing ones, take their
    defaults), loaded and in eval mode."""
    import argparse

    import pretrain_vlm
    from megatron.core.enums import ModelType

    defaults = pretrain_vlm.add_vlm_extra_args(argparse.ArgumentParser()).parse_args([])
    for name, value in vars(defaults).items():
        if not hasattr(args, name):
            setattr(args, name, value)
    if args.pipeline_model_parallel_size > 1:
        raise ValueError(
            f'--pipeline-model-parallel-size {args.pipeline_model_parallel_size}: a '
            f'vision-language (LLaVA) model is served on one pipeline stage (TP only)'
        )
    model = get_model(pretrain_vlm.model_provider, ModelType.encoder_or_decoder, False)
    if args.load is not None:
        _ = load_checkpoint(model, None, None)
    model = model[0]
    model.eval()
    return model


def serve_vision_language(args):
    """Serve a LLaVA checkpoint: every request (with or without images) runs on every rank as
    one vision-language generation, one request at a time (megatron/inference/vlm_generation.py)."""
    from megatron.inference.serving import VLMServing
    from megatron.inference.vlm_generation import VLMLoop

    model = vision_language_model(args)
    tokenizer = get_tokenizer()
    if args.rank == 0:
        name = args.served_model_name or os.path.basename(os.path.normpath(args.load or 'megatron'))
        loop = VLMLoop(model, tokenizer.vocab_size).start()
        server = MegatronServer(
            VLMServing(loop, tokenizer, model),
            max_position_embeddings=args.max_position_embeddings,
            max_prompts=args.max_prompts,
            max_request_bytes=args.max_request_bytes,
            model_name=name,
        )
        print_rank_0(
            f'vision-language model: {model.img_seq_len} tokens per '
            f'{args.img_h}x{args.img_w} image, at most {model.language_max_sequence_length} '
            f'positions; requests run one at a time'
        )
        print_rank_0(f'text generation server listening on http://{args.host}:{args.port}')
        server.run(args.host, port=args.port)
    run_generation_worker_loop(model)


def main(args_list=None, args_defaults=None):
    """Start the server (`args_defaults` add script defaults to ARGS_DEFAULTS)."""
    initialize_megatron(
        extra_args_provider=add_text_generate_args,
        args_defaults={**ARGS_DEFAULTS, **(args_defaults or {})},
        args_list=args_list,
    )
    args = get_args()
    refuse_context_parallel(args, 'text generation')
    if args.num_layers_per_virtual_pipeline_stage is not None:
        print("Interleaved pipeline schedule is not yet supported for text generation.")
        sys.exit(1)
    check_serving_flags(args)
    check_one_replica(args)
    if args.load is None and not args.random_weights:
        # A server without weights answers with the words of a random model.
        raise ValueError(
            'the text generation server needs --load (the checkpoint to serve); pass '
            '--random-weights to serve randomly initialized weights'
        )
    check_address(args.host, args.port)
    print_rank_0("WARNING: Forcing exit_on_missing_checkpoint to True for text generation.")
    args.exit_on_missing_checkpoint = True
    if is_vision_language_checkpoint(args):
        return serve_vision_language(args)

    model = get_model(model_provider, wrap_with_ddp=False)
    if args.load is not None:
        _ = load_checkpoint(model, None, None)
    assert len(model) == 1, "Above condition should have caught this"
    model = model[0]

    # Every rank holds the engine; rank 0's requests reach the others at each step.
    engine = get_dynamic_inference_engine(
        args,
        model,
        request_source_rank=0 if args.world_size > 1 else None,
        max_requests=args.max_batch_size,
        max_waiting_requests=args.max_waiting_requests,
        isolate_failures=True,
    )
    # Global rank 0 serves (the first stage's tensor rank 0 of expert-parallel rank 0); every
    # other rank, expert-parallel ones included, follows its broadcasts.
    if args.rank == 0:
        name = args.served_model_name or os.path.basename(os.path.normpath(args.load or 'megatron'))
        serving = Serving(
            ServingLoop(engine, model).start(),
            get_tokenizer(),
            legacy=args.use_legacy_static_engine,
            max_waiting_requests=args.max_waiting_requests,
        )
        server = MegatronServer(
            serving,
            max_position_embeddings=args.max_position_embeddings,
            max_prompts=args.max_prompts,
            max_request_bytes=args.max_request_bytes,
            model_name=name,
        )
        ctx = engine.context
        print_rank_0(
            f'inference engine: at most {ctx.max_requests} requests at once (+ '
            f'{args.max_waiting_requests} waiting), {ctx.num_blocks} KV blocks of '
            f'{ctx.block_size_tokens} tokens, {ctx.max_tokens} tokens per step'
            + (' (--use-legacy-static-engine: requests run one at a time)'
               if args.use_legacy_static_engine else '')
        )  # fmt: skip
        print_rank_0(f'text generation server listening on http://{args.host}:{args.port}')
        server.run(args.host, port=args.port)
    run_generation_worker_loop(model, engine)


if __name__ == "__main__":
    run_main(main)
