"""Batch inference with megatron.core.inference (Megatron core_r0.8.0's example, same flags and
output lines).

    torchrun --nproc-per-node 1 examples/inference/gpt/simple_gpt_batch_inference.py \\
        --load CKPT --use-checkpoint-args --tokenizer-type GPT2BPETokenizer \\
        --vocab-file data/gpt2/gpt2-vocab.json --merge-file data/gpt2/gpt2-merges.txt \\
        --num-tokens-to-generate 20 --max-batch-size 4 --prompts "Hello, my name is" "The sky"

Defaults are greedy (--top_k 1). Static batches of --max-batch-size prompts run one after the
other; with --inference-dynamic-batching the prompts go through the dynamic engine instead
(continuous batching over a paged KV cache, see docs/inference_engine.md). Global rank 0 prints
one result per prompt.
"""

import os
import sys

sys.path.append(os.path.abspath(os.path.join(os.path.dirname(__file__), *[os.path.pardir] * 3)))

import torch  # noqa: E402

from megatron.core.inference.common_inference_params import CommonInferenceParams  # noqa: E402
from megatron.inference.inference_engine import get_inference_engine  # noqa: E402
from megatron.training.checkpointing import load_checkpoint  # noqa: E402
from megatron.training.global_vars import get_args  # noqa: E402
from megatron.training.initialize import initialize_megatron  # noqa: E402
from megatron.training.run_control.errors import run_main  # noqa: E402
from megatron.training.training import get_model  # noqa: E402
from pretrain_gpt import model_provider  # noqa: E402


def add_text_generate_args(parser):
    """The example's flags (core_r0.8.0's names and defaults, underscores included)."""
    group = parser.add_argument_group(title='text generation')
    group.add_argument("--temperature", type=float, default=1.0, help='Sampling temperature.')
    group.add_argument("--top_k", type=int, default=1, help='Top k sampling.')
    group.add_argument("--top_p", type=float, default=0.0, help='Top p sampling.')
    group.add_argument(
        "--return-log-probs",
        action='store_true',
        default=False,
        help='Return the log probabilities of the final output tokens',
    )
    group.add_argument(
        "--num-tokens-to-generate",
        type=int,
        default=30,
        help='Number of tokens to generate for each prompt',
    )
    group.add_argument(
        "--prompts",
        metavar='N',
        type=str,
        nargs='+',
        help='Input prompts with each prompt within quotes and seperated by space',
    )
    group.add_argument(
        "--max-batch-size", type=int, default=1, help='Max number of prompts to process at once'
    )
    return parser


def main(args_list=None):
    initialize_megatron(
        extra_args_provider=add_text_generate_args,
        args_defaults={
            'no_load_rng': True,
            'no_load_optim': True,
            'micro_batch_size': 1,
            'exit_on_missing_checkpoint': True,
        },
        args_list=args_list,
    )
    args = get_args()
    if not args.prompts:
        raise ValueError("--prompts: give at least one prompt")
    if args.max_batch_size < 1:
        raise ValueError(f"--max-batch-size must be at least 1, got {args.max_batch_size}")

    model = get_model(model_provider, wrap_with_ddp=False)
    load_checkpoint(model, None, None)
    model = model[0]

    inference_engine = get_inference_engine(args, model, max_batch_size=args.max_batch_size)
    common_inference_params = CommonInferenceParams(
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        return_log_probs=args.return_log_probs,
        num_tokens_to_generate=args.num_tokens_to_generate,
    )
    results = inference_engine.generate(args.prompts, common_inference_params)

    if torch.distributed.get_rank() == 0:
        for idx, result in enumerate(results):
            print(f' \n------------- RESULT FOR PROMPT {idx} --------------- ')
            result = {
                'id': result.request_id,
                'input_prompt': result.prompt,
                'generated_text': result.generated_text,
                'generated_tokens': result.generated_tokens,
            }
            print(result)
    return results


if __name__ == "__main__":
    run_main(main)
