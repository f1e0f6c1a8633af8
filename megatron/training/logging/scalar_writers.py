"""Where the training scalars go: TensorBoard (--tensorboard-dir) and Weights & Biases
(--wandb-project), both on the last rank, the one that prints the training log.

`get_scalar_writer()` returns one object with TensorBoard's `add_scalar(name, value, step)` that
writes to both (None when neither is configured), so the log line, the timers and evaluation
write each scalar once. W&B gets the iteration-keyed scalars under TensorBoard's names; the
`... vs samples` series (x = consumed samples) stay TensorBoard-only, because a W&B step must only
grow. Unlike Megatron's, the W&B writer logs without --tensorboard-dir too.

wandb is an optional dependency (`pip install -e .[wandb]`); the flags are checked at start-up
(`observability_args.py`). Set WANDB_MODE=offline to write the run locally only
(`wandb sync <dir>` uploads it later).
"""

import os

from megatron.training.global_vars import get_tensorboard_writer, get_wandb_writer


def _jsonable_config(args) -> dict:
    """vars(args) with values W&B can store (dtypes and other objects become strings)."""
    config = {}
    for key, value in sorted(vars(args).items()):
        if value is None or isinstance(value, (bool, int, float, str)):
            config[key] = value
        elif isinstance(value, (list, tuple)) and all(
            v is None or isinstance(v, (bool, int, float, str)) for v in value
        ):
            config[key] = list(value)
        else:
            config[key] = str(value)
    return config


def build_wandb_writer(args):
    """`wandb` after `wandb.init` on the last rank when --wandb-project is set; else None.

    The run goes to --wandb-save-dir (default <--save>/wandb), is named --wandb-exp-name, and its
    config is the run's arguments.
    """
    if not getattr(args, 'wandb_project', '') or args.rank != args.world_size - 1:
        return None
    import wandb

    save_dir = args.wandb_save_dir or os.path.join(args.save, 'wandb')
    os.makedirs(save_dir, exist_ok=True)
    wandb.init(
        dir=save_dir,
        name=args.wandb_exp_name,
        project=args.wandb_project,
        config=_jsonable_config(args),
    )
    print(f'> logging to wandb project {args.wandb_project}, run {args.wandb_exp_name}', flush=True)
    return wandb


class _ScalarWriter:
    """TensorBoard's `add_scalar` fanned out to TensorBoard and W&B."""

    def __init__(self, tensorboard, wandb):
        self.tensorboard = tensorboard
        self.wandb = wandb

    def add_scalar(self, name, value, step):
        if self.tensorboard is not None:
            self.tensorboard.add_scalar(name, value, step)
        if self.wandb is not None and not name.endswith(' vs samples'):
            self.wandb.log({name: float(value)}, step=int(step))

    def add_text(self, tag, text, step=None):
        if self.tensorboard is not None:
            self.tensorboard.add_text(tag, text, global_step=step)

    def flush(self):
        if self.tensorboard is not None:
            self.tensorboard.flush()


def get_scalar_writer():
    """The writer of this rank's training scalars, or None (not the last rank, or neither
    --tensorboard-dir nor --wandb-project)."""
    tensorboard, wandb = get_tensorboard_writer(), get_wandb_writer()
    if tensorboard is None and wandb is None:
        return None
    return _ScalarWriter(tensorboard, wandb)


def finish_wandb():
    """Close the W&B run (its files are complete afterwards); a no-op without one."""
    wandb = get_wandb_writer()
    if wandb is not None:
        wandb.finish()
