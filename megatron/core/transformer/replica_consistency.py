"""Real-time check that parameters meant to be replicated are bit-identical on every replica.

`TransformerConfig.test_mode` (r0.8's `--test-mode`) runs this check in every self-attention
forward on the query/key layernorm parameters, as Megatron does: after each optimizer step all
data-parallel (and context-parallel) replicas and all tensor-parallel ranks must hold the same
values, and a difference means a silent fault (memory corruption, a corrupted transfer, a
checkpoint loaded differently on one rank). Megatron stacks weight and bias (so RMSNorm, which
has no bias, fails there) and compares over the data-parallel group only; here every parameter of
the module is compared over each group given, whatever the norm type.
"""

from typing import Dict, Iterable, Tuple

import torch


class ReplicaMismatchError(RuntimeError):
    """A parameter that should be replicated differs between two ranks of a group."""


def _flat_values(named_params: Iterable[Tuple[str, torch.Tensor]]):
    """Names, sizes and one flat fp32 copy of all values (one collective for all of them)."""
    names, sizes, flats = [], [], []
    for name, param in named_params:
        names.append(name)
        sizes.append(param.numel())
        flats.append(param.detach().reshape(-1).float())
    return names, sizes, torch.cat(flats) if flats else None


def check_replicated_parameters(
    named_params: Iterable[Tuple[str, torch.Tensor]],
    groups: Dict[str, torch.distributed.ProcessGroup],
    where: str = '',
) -> None:
    """All-gather the parameters over each group and compare every rank's copy with this one's.

    Args:
        named_params: (name, tensor) pairs that should hold the same values on every rank of
            each group.
        groups: {label: process group}, e.g. {'tensor-parallel': tp, 'data-parallel': dp}; groups
            of one rank are skipped.
        where: prefix for the error message (the module that owns the parameters).

    Raises:
        ReplicaMismatchError: naming the parameter, the group, both group ranks and the norm of
            the difference.

    Communication: one all-gather per group of size > 1 (forward only; nothing in backward).
    """
    names, sizes, flat = _flat_values(named_params)
    if flat is None:
        return
    # Every group's collective runs before any error is raised: a rank that stopped at its
    # first mismatch would leave the members of its later groups waiting forever.
    mismatches = [
        _first_mismatch(names, sizes, flat, label, group)
        for label, group in groups.items()
        if group is not None and group.size() > 1
    ]
    mismatches = [message for message in mismatches if message is not None]
    if mismatches:
        raise ReplicaMismatchError(
            f"{where}{mismatches[0]}: a replicated parameter has diverged (silent data "
            "corruption or an inconsistent load)"
        )


def _first_mismatch(names, sizes, flat, label, group):
    """All-gather `flat` over `group`; describe the first parameter another rank holds otherwise."""
    gathered = [torch.empty_like(flat) for _ in range(group.size())]
    torch.distributed.all_gather(gathered, flat, group=group)
    mine = group.rank()
    for other, values in enumerate(gathered):
        # Bitwise, so a NaN held identically by every replica is not a mismatch.
        if torch.equal(values.view(torch.int32), flat.view(torch.int32)):
            continue
        for name, mine_part, other_part in zip(names, flat.split(sizes), values.split(sizes)):
            if not torch.equal(mine_part.view(torch.int32), other_part.view(torch.int32)):
                diff = torch.linalg.vector_norm(mine_part - other_part).item()
                return (
                    f"{name} differs between {label} ranks {other} and {mine} "
                    f"(norm of the difference {diff:.3e})"
                )
    return None
