"""Zero-shot GPT evaluation (WikiText-103 perplexity, LAMBADA cloze accuracy), as in Megatron's
tasks/zeroshot_gpt/evaluate.py, on the megatron-core GPTModel of pretrain_gpt.py.

Any TP/PP layout: every rank reads the (small) dataset itself; the forward-only pipeline schedule
carries activations between stages, and the last stage computes the metric, summed over the
data-parallel group.
"""

import math
import time
from functools import partial

import torch

from megatron.core import parallel_state as mpu
from megatron.core import tensor_parallel
from megatron.core.enums import ModelType
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.utils import get_current_device
from megatron.training.checkpointing import load_checkpoint
from megatron.training.global_vars import get_args, get_tokenizer
from megatron.training.training import get_model
from megatron.training.utils import get_ltor_masks_and_position_ids, print_rank_0, print_rank_last
from tasks.zeroshot_gpt.datasets import build_dataset
from tasks.zeroshot_gpt.sharding import build_eval_data_loader

#: The metric each zero-shot task reports.
TASK_METRIC = {'LAMBADA': 'accuracy', 'WIKITEXT103': 'loss'}


def get_model_provider():
    """pretrain_gpt's model provider (GPT-2 or Llama-style through the usual model flags)."""
    import pretrain_gpt

    return pretrain_gpt.model_provider


def process_batch(batch):
    """(tokens [b, L], labels [b, L], attention_mask, position_ids, loss_mask [b, L], weight [b])
    on device; weight 0 marks a sampler's padding repeat (counted by no metric)."""
    args = get_args()
    tokenizer = get_tokenizer()
    device = get_current_device()
    tokens_ = batch['text'].long().to(device)  # [b, L+1]
    labels = tokens_[:, 1:].contiguous()
    tokens = tokens_[:, :-1].contiguous()
    loss_mask = batch['pad_mask'].long().to(device)
    weight = batch['weight'].float() if 'weight' in batch else torch.ones(tokens_.shape[0])
    weight = weight.to(device)  # [b]
    attention_mask, _, position_ids = get_ltor_masks_and_position_ids(
        tokens,
        tokenizer.eod,
        args.reset_position_ids,
        args.reset_attention_mask,
        args.eod_mask_loss,
    )
    return tokens, labels, attention_mask, position_ids, loss_mask, weight


def _metric_loss(labels, loss_mask, weight, output):
    """Summed (not averaged) masked token NLL of the batch; output = per-token losses [b, L]."""
    counted = loss_mask.float() * weight.view(-1, 1)  # [b, L]; padding repeats count 0
    value = torch.sum(output.float().view(-1) * counted.contiguous().view(-1))
    return value, {'metric': value}


def _metric_accuracy(labels, loss_mask, weight, output):
    """Examples whose every masked target is the argmax (teacher forcing); output = logits
    [b, L, v/p], gathered over the tensor-parallel group first."""
    logits = tensor_parallel.gather_from_tensor_model_parallel_region(output)  # [b, L, v]
    outputs = torch.argmax(logits, -1)
    correct = (outputs == labels).float()
    correct[(1 - loss_mask).bool()] = 1
    correct = correct.prod(-1) * weight  # [b]; padding repeats count 0
    value = correct.sum()
    return value, {'metric': value}


def _forward_step(batch, eval_metric, data_iterator, model):
    """Forward the prepared batch; the loss function returns the batch's metric sum."""
    tokens, labels, attention_mask, position_ids, loss_mask, weight = batch
    if eval_metric == 'loss':
        output = model(tokens, position_ids, attention_mask, labels=labels)
        return output, partial(_metric_loss, labels, loss_mask, weight)
    output = model(tokens, position_ids, attention_mask)
    return output, partial(_metric_accuracy, labels, loss_mask, weight)


def forward_step(batch, model, eval_metric):
    """The batch's metric (summed over the data-parallel group) on the last stage, else None."""
    args = get_args()
    processed = process_batch(batch)
    micro_batch_size = processed[0].shape[0]
    losses = get_forward_backward_func()(
        forward_step_func=partial(_forward_step, processed, eval_metric),
        data_iterator=None,
        model=model,
        num_microbatches=1,
        seq_length=args.seq_length,
        micro_batch_size=micro_batch_size,
        forward_only=True,
    )
    if not mpu.is_pipeline_last_stage():
        return None
    value = losses[0]['metric'].detach().clone().view(1).double()
    torch.distributed.all_reduce(value, group=mpu.get_data_parallel_group())
    return value


def evaluate(data_loader, model, eval_metric):
    """Total of the metric over the dataset (last stage), with progress every --log-interval."""
    args = get_args()
    for model_module in model:
        model_module.eval()
    total_output = 0.0
    with torch.no_grad():
        for iteration, batch in enumerate(data_loader):
            if iteration % args.log_interval == 0:
                print_rank_0('> working on iteration: {}'.format(iteration))
            output = forward_step(batch, model, eval_metric)
            if output is not None:
                total_output += float(output.item())
    return total_output


def compute_results(eval_metric, total_output, dataset):
    """{name: value} of the task's result (the numbers of Megatron's result line)."""
    if eval_metric == 'loss':
        num_tokenized_tokens = dataset.num_tokenized_tokens
        val_loss = total_output / (num_tokenized_tokens - 1)
        token_ratio = (num_tokenized_tokens - 1) / (dataset.num_original_tokens - 1)
        return {
            'avg loss': val_loss,
            'ppl': math.exp(min(20, val_loss)),
            'adjusted ppl': math.exp(min(20, val_loss * token_ratio)),
            'token ratio': token_ratio,
        }
    return {
        'number correct': total_output,
        'total examples': len(dataset),
        'avg accuracy': total_output / len(dataset),
    }


def format_results(task, eval_metric, total_output, dataset):
    """Megatron's result string for the task."""
    string = ' validation results on {} | '.format(task)
    if eval_metric == 'loss':
        num_tokenized_tokens = dataset.num_tokenized_tokens
        num_original_tokens = dataset.num_original_tokens
        val_loss = total_output / (num_tokenized_tokens - 1)
        ppl = math.exp(min(20, val_loss))
        token_ratio = (num_tokenized_tokens - 1) / (num_original_tokens - 1)
        adjusted_ppl = math.exp(min(20, val_loss * token_ratio))
        string += 'avg loss: {:.4E} | '.format(val_loss)
        string += 'ppl: {:.4E} | '.format(ppl)
        string += 'adjusted ppl: {:.4E} | '.format(adjusted_ppl)
        string += 'token ratio: {} |'.format(token_ratio)
        return string
    num_examples = len(dataset)
    acc = total_output / num_examples
    string += 'number correct: {:.4E} | '.format(total_output)
    string += 'total examples: {:.4E} | '.format(num_examples)
    string += 'avg accuracy: {:.4E}'.format(acc)
    return string


def evaluate_and_print_results(task, data_loader, model, eval_metric):
    """Evaluate and print the dashed result block on the last rank.

    Returns:
        {name: value} of the result on the last pipeline stage, None elsewhere.
    """
    total_output = evaluate(data_loader, model, eval_metric)
    string = format_results(task, eval_metric, total_output, data_loader.dataset)
    length = len(string) + 1
    print_rank_last('-' * length)
    print_rank_last(string)
    print_rank_last('-' * length)
    if not mpu.is_pipeline_last_stage():
        return None
    return compute_results(eval_metric, total_output, data_loader.dataset)


def main():
    """Build the model, load --load, evaluate the one --valid-data file and print the result."""
    args = get_args()
    task = args.task
    if task not in TASK_METRIC:
        raise ValueError(f'--task {task}: not a zero-shot task ({sorted(TASK_METRIC)})')
    eval_metric = TASK_METRIC[task]
    if args.num_layers_per_virtual_pipeline_stage is not None:
        raise ValueError(
            '--num-layers-per-virtual-pipeline-stage: the interleaved schedule is '
            'not supported for zero-shot evaluation'
        )
    dataset = build_dataset(task, args, get_tokenizer())

    model = get_model(get_model_provider(), ModelType.encoder_or_decoder, wrap_with_ddp=False)
    if args.load is not None:
        load_checkpoint(model, None, None)
    assert len(model) == 1, 'the interleaved schedule is not supported'

    dataloader = build_eval_data_loader(dataset, args.micro_batch_size, args.num_workers)
    start = time.time()
    result = evaluate_and_print_results(task, dataloader, model, eval_metric)
    print_rank_0('evaluation time (sec): {:.3f}'.format(time.time() - start))
    print_rank_0('done :-)')
    return result
