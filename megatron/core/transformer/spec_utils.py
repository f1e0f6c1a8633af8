"""Module specs: describe which class builds each submodule, so variants swap classes, not flags.

A `ModuleSpec` names a class (or a function, or a dotted import path given as a
`(module_path, name)` tuple), extra constructor keyword arguments (`params`) and the specs of its
own submodules. `build_module` turns a spec (or a bare class) into an instance.
"""

import types
from dataclasses import dataclass, field
from typing import Tuple, Union


@dataclass
class ModuleSpec:
    """Description of a module to build.

    Args:
        module: the class or function to build, or a `(module_path, name)` tuple to import.
        params: keyword arguments added to the ones the caller passes to `build_module`.
        submodules: a dataclass of the specs of the module's submodules, passed to its constructor
            as `submodules=`.
    """

    module: Union[Tuple, type]
    params: dict = field(default_factory=lambda: {})
    submodules: type = None


def import_module(module_path: Tuple[str]):
    """Import `name` from the dotted path `module_path[0]` (the tuple is `(path, name)`)."""
    base_path, name = module_path
    module = __import__(base_path, globals(), locals(), [name])
    return vars(module)[name]


# What a spec may name directly; anything else in `ModuleSpec.module` is a (path, name) pair.
_DIRECT_KINDS = (type, types.FunctionType)


def get_module(spec_or_module: Union[ModuleSpec, type], **additional_kwargs):
    """The class or function a spec names (without building it)."""
    named = spec_or_module if isinstance(spec_or_module, _DIRECT_KINDS) else spec_or_module.module
    return named if isinstance(named, _DIRECT_KINDS) else import_module(named)


def build_module(spec_or_module: Union[ModuleSpec, type], *args, **kwargs):
    """Build the module a spec describes.

    A function in the spec (e.g. `get_bias_dropout_add`) is returned as is, not called. A class is
    instantiated with `*args`, `spec.params`, `submodules=spec.submodules` (if set) and `**kwargs`.
    """
    target = get_module(spec_or_module)
    # Functions (bias-dropout-add factories and the like) are handed back, not called.
    if isinstance(target, types.FunctionType):
        return target

    submodules = getattr(spec_or_module, "submodules", None)
    if submodules is not None:
        kwargs["submodules"] = submodules
    params = getattr(spec_or_module, "params", {}) or {}
    try:
        return target(*args, **params, **kwargs)
    except TypeError as exc:
        # Name the class: the bare TypeError only names the unexpected argument.
        raise TypeError(f"{exc} when instantiating {target.__name__}").with_traceback(
            exc.__traceback__
        ) from None
