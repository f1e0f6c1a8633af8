"""Process-group fallbacks: a group passed in, else the global one of `parallel_state`.

Core modules take their process groups as arguments; a caller that passes None gets the group
that `parallel_state.initialize_model_parallel()` created. Each `get_*_if_none` below resolves
one such argument, so the global lookup happens in one place and a module that is handed its
groups never touches the globals. Later Megatron imports such helpers from
`megatron.core.utils`, which re-exports these.
"""

from megatron.core import parallel_state


def get_tensor_model_parallel_group_if_none(group=None, check_initialized: bool = True):
    """`group` if given, else the global tensor model parallel group."""
    return (
        group
        if group is not None
        else parallel_state.get_tensor_model_parallel_group(check_initialized)
    )


def get_pipeline_model_parallel_group_if_none(group=None, check_initialized: bool = True):
    """`group` if given, else the global pipeline model parallel group."""
    return (
        group
        if group is not None
        else parallel_state.get_pipeline_model_parallel_group(check_initialized)
    )


def get_data_parallel_group_if_none(
    group=None, with_context_parallel: bool = False, check_initialized: bool = True
):
    """`group` if given, else the global data parallel group (optionally with context parallel)."""
    if group is not None:
        return group
    return parallel_state.get_data_parallel_group(with_context_parallel, check_initialized)


def get_data_parallel_group_gloo_if_none(group=None, with_context_parallel: bool = False):
    """`group` if given, else the gloo copy of the global data parallel group."""
    return (
        group
        if group is not None
        else parallel_state.get_data_parallel_group_gloo(with_context_parallel)
    )


def get_context_parallel_group_if_none(group=None, check_initialized: bool = True):
    """`group` if given, else the global context parallel group."""
    return (
        group if group is not None else parallel_state.get_context_parallel_group(check_initialized)
    )


def get_hierarchical_context_parallel_groups_if_none(groups=None, check_initialized: bool = True):
    """`groups` if given, else the global hierarchical context parallel groups."""
    if groups is not None:
        return groups
    return parallel_state.get_hierarchical_context_parallel_groups(check_initialized)


def get_data_parallel_group_with_cp_if_none(group=None, check_initialized: bool = True):
    """`group` if given, else the global data parallel group including context parallel ranks."""
    if group is not None:
        return group
    return parallel_state.get_data_parallel_group(
        with_context_parallel=True, check_initialized=check_initialized
    )


def get_model_parallel_group_if_none(group=None, check_initialized: bool = True):
    """`group` if given, else the global model parallel group."""
    if group is not None:
        return group
    return parallel_state.get_model_parallel_group(check_initialized=check_initialized)


def get_embedding_group_if_none(group=None, check_initialized: bool = True):
    """`group` if given, else the global embedding group (None when not a member)."""
    return group if group is not None else parallel_state.get_embedding_group(check_initialized)


def get_position_embedding_group_if_none(group=None, check_initialized: bool = True):
    """`group` if given, else the global position embedding group (None when not a member)."""
    return (
        group
        if group is not None
        else parallel_state.get_position_embedding_group(check_initialized)
    )


def get_tensor_and_data_parallel_group_if_none(group=None, with_context_parallel: bool = False):
    """`group` if given, else the global tensor + data parallel group."""
    return (
        group
        if group is not None
        else parallel_state.get_tensor_and_data_parallel_group(with_context_parallel)
    )


def get_expert_model_parallel_group_if_none(group=None, check_initialized: bool = True):
    """`group` if given, else the global expert model parallel group."""
    return (
        group
        if group is not None
        else parallel_state.get_expert_model_parallel_group(check_initialized)
    )


def get_tensor_and_expert_parallel_group_if_none(group=None, check_initialized: bool = True):
    """`group` if given, else the global tensor + expert parallel group."""
    return (
        group
        if group is not None
        else parallel_state.get_tensor_and_expert_parallel_group(check_initialized)
    )


def get_tensor_and_context_parallel_group_if_none(group=None, check_initialized: bool = True):
    """`group` if given, else the global tensor + context parallel group."""
    return (
        group
        if group is not None
        else parallel_state.get_tensor_and_context_parallel_group(check_initialized)
    )


def get_data_modulo_expert_parallel_group_if_none(
    group=None, with_context_parallel: bool = True, check_initialized: bool = True
):
    """`group` if given, else the global data-modulo-expert parallel group (the data parallel
    group of expert parameters, with context parallel by default)."""
    if group is not None:
        return group
    return parallel_state.get_data_modulo_expert_parallel_group(
        with_context_parallel, check_initialized
    )
