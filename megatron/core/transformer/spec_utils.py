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


def get_module(spec_or_module: Union[ModuleSpec, type], **additional_kwargs):
    """The class or function a spec names (without building it)."""
    if isinstance(spec_or_module, (type, types.FunctionType)):
        return spec_or_module
    if isinstance(spec_or_module.module, (type, types.FunctionType)):
        return spec_or_module.module
    return import_module(spec_or_module.module)


def build_module(spec_or_module: Union[ModuleSpec, type], *args, **kwargs):
    """Build the module a spec describes.

    A function in the spec (e.g. `get_bias_dropout_add`) is returned as is, not called. A class is
    instantiated with `*args`, `spec.params`, `submodules=spec.submodules` (if set) and `**kwargs`.
    """
    # A bare function given as the spec itself is returned unchanged.
    if isinstance(spec_or_module, types.FunctionType):
        return spec_or_module

    if isinstance(spec_or_module, ModuleSpec) and isinstance(
        spec_or_module.module, types.FunctionType
    ):
        return spec_or_module.module

    if isinstance(spec_or_module, type):
        module = spec_or_module
    elif hasattr(spec_or_module, "module") and isinstance(spec_or_module.module, type):
        module = spec_or_module.module
    else:
        module = import_module(spec_or_module.module)

    # A class that is itself a function factory (e.g. IdentityFuncOp) is still instantiated.
    if isinstance(module, types.FunctionType):
        return module

    if hasattr(spec_or_module, "submodules") and spec_or_module.submodules is not None:
        kwargs["submodules"] = spec_or_module.submodules

    params = getattr(spec_or_module, "params", {}) or {}
    try:
        return module(*args, **params, **kwargs)
    except TypeError as exc:
        raise TypeError(f"{exc} when instantiating {module.__name__}").with_traceback(
            exc.__traceback__
        ) from None
