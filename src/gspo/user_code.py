"""The user's own functions, named ``"module:function"`` (reward functions, ``loss.step_credit``): imported with the
folder the command runs in searched too, and with errors that say what actually failed.

Why the current folder: ``python script.py`` and ``python -m`` search it, but the ``gspo`` command's first import
path is its own script's folder (the environment's ``bin/``), so ``my_reward.py`` beside the user's config would not
be found. Standard library only: the reward workers import this module and must start without torch.
"""
from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from types import ModuleType
from typing import Any

from gspo.errors import UserError


def search_current_folder() -> str:
    """Put the current folder on the import path (last, so that a file there never hides an installed module of the
    same name); returns it."""
    cwd = os.getcwd()
    if cwd not in sys.path:
        sys.path.append(cwd)
        importlib.invalidate_caches()  # a folder listing cached before the user's file was written would miss it
    return cwd


def split(path: str, what: str, example: str) -> tuple[str, str]:
    """``(module, attribute)`` of ``"module:function"``; ``what`` names the setting in the error."""
    module_name, sep, attr = path.partition(":")
    if not sep or not module_name or not attr:
        raise UserError(f"{what} is not 'module:function'; write it like {example!r}.")
    return module_name, attr


def not_found(what: str, name: str) -> str:
    """The message for a module that is nowhere on the import path, naming where it was looked for."""
    return (f"{what}: no module named {name!r} in the current folder ({os.getcwd()}) or on the Python path; check the "
            f"name, or add the folder that holds {name.replace('.', os.sep)}.py to PYTHONPATH.")


def exists(module_name: str) -> bool:
    """Whether the top-level package of ``module_name`` can be found, without running any of its code."""
    top = module_name.split(".")[0]
    search_current_folder()
    try:
        return top in sys.modules or importlib.util.find_spec(top) is not None
    except (ImportError, ValueError):
        return False


def locate(path: str, what: str, example: str) -> str:
    """Check ``"module:function"`` as far as it can be without running any of the module's code (which may block, or
    fail): the form, and that the module's top-level package exists on the path or in the current folder. Returns
    ``path``; the import itself happens in a worker process, under its start-up limit."""
    module_name, _ = split(path, what, example)
    if not exists(module_name):
        raise UserError(not_found(what, module_name.split(".")[0]))
    return path


def _origin(module_name: str) -> str:
    """`` (its file)`` when the module's file can be found without importing it, else nothing."""
    try:
        spec = importlib.util.find_spec(module_name)
    except Exception:  # noqa: BLE001 -- a parent package that fails to import: no file to name
        return ""
    return f" ({spec.origin})" if spec is not None and spec.origin else ""


def import_module(module_name: str, what: str) -> ModuleType:
    """Import the user's module, telling a module that is not there from one whose own code failed."""
    search_current_folder()
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name and (module_name + ".").startswith(e.name + "."):
            raise UserError(not_found(what, e.name)) from e
        if e.name:
            raise UserError(f"{what}: {module_name!r}{_origin(module_name)} imports {e.name!r}, which is not installed "
                            "here; install the package that provides it in this Python environment.") from e
        raise UserError(f"{what}: importing {module_name!r}{_origin(module_name)} failed ({e}); fix that module.") from e
    except Exception as e:  # the module's own code can fail in any way (a syntax error, an exception at import)
        raise UserError(f"{what}: importing {module_name!r}{_origin(module_name)} raised {type(e).__name__}: {e}; fix "
                        "that module.") from e


def _shadowed(module: ModuleType, module_name: str) -> str:
    """A hint when a module of the user's name was found somewhere else than the current folder's file of that name
    (``math.py``, ``test.py``: the installed module comes first on the path)."""
    own = os.path.join(os.getcwd(), module_name.replace(".", os.sep) + ".py")
    found = getattr(module, "__file__", None)
    if os.path.isfile(own) and (found is None or os.path.abspath(found) != own):
        return f"; that module is not {own}: an installed one of the same name comes first, so rename your file"
    return ""


def load_function(path: str, what: str, example: str) -> Any:
    """The callable ``"module:function"`` names (``function`` may be dotted, e.g. ``"mod:Class.method"``)."""
    module_name, attr = split(path, what, example)
    module = obj = import_module(module_name, what)
    for part in attr.split("."):
        if not hasattr(obj, part):
            hint = _shadowed(module, module_name) or "; check the function name"
            raise UserError(f"{what}: {module_name!r}{_origin(module_name)} has no attribute {attr!r}{hint}.")
        obj = getattr(obj, part)
    if not callable(obj):
        raise UserError(f"{what} is a {type(obj).__name__}, not a function; point it at a function.")
    return obj
