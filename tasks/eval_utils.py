"""Accuracy of a fine-tuned model per validation file, as in Megatron's tasks/eval_utils.py."""

import time

import torch

from megatron.core import parallel_state as mpu
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.utils import get_current_device
from megatron.training.global_vars import get_args
from megatron.training.utils import print_rank_last
from tasks.finetune_utils import build_data_loader, process_batch


def accuracy_func_provider(single_dataset_provider):
    """Callback(model, epoch) printing the accuracy on every --valid-data path and overall.

    Returns:
        the callback; it returns {name: (correct, total)} plus 'overall' on the last stage.
    """
    args = get_args()
    dataloaders = []
    for datapath in args.valid_data:
        dataset = single_dataset_provider(datapath)
        dataloader = build_data_loader(
            dataset,
            args.orig_micro_batch_size,
            args.num_workers,
            drop_last=(mpu.get_data_parallel_world_size() > 1),
        )
        dataloaders.append((dataset.dataset_name, dataloader))

    def metrics_func(model, epoch):
        print_rank_last('calculating metrics ...')
        correct = 0
        total = 0
        results = {}
        for name, dataloader in dataloaders:
            start_time = time.time()
            correct_ans, total_count = calculate_correct_answers(model, dataloader, epoch)
            correct += correct_ans
            total += total_count
            results[name] = (correct_ans, total_count)
            if total_count:
                percent = float(correct_ans) * 100.0 / float(total_count)
                print_rank_last(
                    ' > |epoch: {}| metrics for {}: correct / total = {} / {} = '
                    '{:.4f} %, elapsed time (sec): {:.3f}'.format(
                        epoch, name, correct_ans, total_count, percent, time.time() - start_time
                    )
                )
        if total:
            percent = float(correct) * 100.0 / float(total)
            print_rank_last(
                ' >> |epoch: {}| overall: correct / total = {} / {} = {:.4f} %'.format(
                    epoch, correct, total, percent
                )
            )
        results['overall'] = (correct, total)
        return results

    return metrics_func


def _correct_loss_func(labels, output_tensor):
    """Counts of argmax-correct predictions and labels of the batch."""
    predicted = torch.argmax(output_tensor, dim=-1)
    corrects = (predicted == labels).sum()
    return torch.zeros(()), {'correct': corrects, 'total': labels.new_tensor(labels.numel())}


def calculate_correct_answers(model, dataloader, epoch):
    """(correct, total) over the dataloader, summed over the data-parallel group."""
    from functools import partial

    args = get_args()
    for m in model:
        m.eval()
    saved = (args.micro_batch_size, args.global_batch_size)
    multiplier = getattr(dataloader.dataset, 'sample_multiplier', 1)
    counts = torch.zeros(2, dtype=torch.long, device=get_current_device())

    def forward_step(batch, data_iterator, model):
        tokens, types, labels, padding_mask = process_batch(batch)
        return model(tokens, padding_mask, tokentype_ids=types), partial(_correct_loss_func, labels)

    with torch.no_grad():
        for batch in dataloader:
            actual = len(batch['label'])
            args.micro_batch_size = actual * multiplier
            args.global_batch_size = args.micro_batch_size * mpu.get_data_parallel_world_size()
            losses = get_forward_backward_func()(
                forward_step_func=partial(forward_step, batch),
                data_iterator=None,
                model=model,
                num_microbatches=1,
                seq_length=args.seq_length,
                micro_batch_size=args.micro_batch_size,
                forward_only=True,
            )
            if mpu.is_pipeline_last_stage():
                counts[0] += losses[0]['correct']
                counts[1] += losses[0]['total']
    for m in model:
        m.train()
    args.micro_batch_size, args.global_batch_size = saved
    if mpu.is_pipeline_last_stage():
        torch.distributed.all_reduce(counts, group=mpu.get_data_parallel_group())
    return int(counts[0]), int(counts[1])
