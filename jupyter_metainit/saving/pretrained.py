"""``model.save_pretrained(dir, ...)`` of a model holding deferred tensors: what eager writes.

``saving.hook`` sends such a model here (a model whose tensors are all real takes transformers' own
path). The files are written by ``write_checkpoint`` (what ``save`` writes: the same names, bytes
and config files as eager ``save_pretrained``, in bounded memory, published only when complete),
honouring the installed transformers' arguments. An option that cannot be honoured
(``push_to_hub``, ``distributed_checkpoint``, adapters, quantization, ...) is refused before
anything is written, saying what to do instead.
"""

from __future__ import annotations

import inspect
import os
import re
from collections.abc import Callable
from typing import Any

import torch

from jupyter_metainit.core import is_deferred
from jupyter_metainit.core.errors import MetaInitError
from jupyter_metainit.saving.layout import file_names, state_dict_of
from jupyter_metainit.saving.safetensors_checkpoint import mark_config, write_checkpoint

__all__ = ["holds_deferred", "save_deferred"]

_INSTEAD = (
    "Materialize the model first (jupyter_metainit.materialize(model)) and call save_pretrained "
    "again, or write the safetensors files with jupyter_metainit.save(model, directory)"
)
# Arguments the deferred path honours, or that only matter for a path it refuses (the hub
# token, the adapter key format): any other one must keep its default.
_HONOURED = {
    "self", "save_directory", "is_main_process", "state_dict", "max_shard_size", "variant",
    "token", "save_peft_format", "save_original_format",
}  # fmt: skip
_REASONS = {
    "push_to_hub": "only local files are written: save to a directory, then upload it with "
    "huggingface_hub's upload_folder",
    "distributed_checkpoint": "use jupyter_metainit.save(model, directory, format='dcp')",
    "safe_serialization": "only safetensors files are written for deferred tensors",
    "save_function": "the files are written by jupyter_metainit, not by a save function",
}


def holds_deferred(model: Any, args: tuple, kwargs: dict[str, Any]) -> bool:
    """Whether eager ``save_pretrained`` would meet a deferred tensor: in the model, or in the
    ``state_dict`` given (third positional argument or keyword)."""
    state_dict = kwargs.get("state_dict", args[2] if len(args) > 2 else None)
    if isinstance(state_dict, dict) and any(is_deferred(v) for v in state_dict.values()):
        return True
    return isinstance(model, torch.nn.Module) and is_deferred(model)


def save_deferred(model: Any, original: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
    """Eager ``save_pretrained``'s files, written by ``write_checkpoint``; or a refusal, before
    anything is written."""
    options, extra, defaults = _bind(original, model, args, kwargs)
    _refuse_unsupported(model, options, extra, defaults)
    directory = options["save_directory"]
    if os.path.isfile(directory):  # transformers logs an error and writes nothing
        return original(model, *args, **kwargs)
    if not _saves_on_this_rank(model, options["is_main_process"]):
        mark_config(model, model.dtype)  # what eager does on the other ranks: no file
        os.makedirs(directory, exist_ok=True)
        return None
    state, origin = _state_to_save(model, options["state_dict"])
    names = file_names(options["variant"])
    destination = os.fspath(directory)
    write_checkpoint(
        model,
        state,
        origin,
        destination,
        max_shard_size=options["max_shard_size"],
        dtype=None,
        progress=None,
        names=names,
        original_format=bool(options["save_original_format"]),
        stale=_stale_files(destination, *names),
        code_files=_code_files(model),
    )
    return None


def _bind(
    original: Callable[..., Any], model: Any, args: tuple, kwargs: dict[str, Any]
) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """(argument name -> value, defaults applied, for the installed transformers' signature;
    the extra keyword arguments; argument name -> default)."""
    signature = inspect.signature(original)
    bound = signature.bind(model, *args, **kwargs)
    bound.apply_defaults()
    options = dict(bound.arguments)
    extra: dict[str, Any] = {}
    for name, parameter in signature.parameters.items():
        if parameter.kind is inspect.Parameter.VAR_KEYWORD:
            extra = options.pop(name, {})
        elif parameter.kind is not inspect.Parameter.VAR_POSITIONAL:
            options.setdefault(name, parameter.default)
    options.setdefault("is_main_process", True)
    options.setdefault("state_dict", None)
    options.setdefault("variant", None)
    options.setdefault("save_original_format", True)
    defaults = {n: p.default for n, p in signature.parameters.items()}
    return options, extra, defaults


def _refuse_unsupported(
    model: Any, options: dict[str, Any], extra: dict[str, Any], defaults: dict[str, Any]
) -> None:
    """Raise, naming the argument or the model's feature, for what the deferred path cannot
    write as eager ``save_pretrained`` would."""
    for name, value in options.items():
        if name not in _HONOURED and not _same(value, defaults.get(name)):
            _refuse(f"{name}={value!r}", _REASONS.get(name, "not supported for deferred tensors"))
    if extra.get("safe_serialization", True) is not True:
        _refuse("safe_serialization=False", _REASONS["safe_serialization"])
    if extra.get("save_function") is not None:
        _refuse("save_function=...", _REASONS["save_function"])
    if getattr(model, "_hf_peft_config_loaded", False):
        _refuse("a model with PEFT adapters", "adapters are saved by peft, from real tensors")
    if getattr(model, "hf_quantizer", None) is not None:
        _refuse("a quantized model", "quantized weights are packed from real tensors")
    config = getattr(model, "config", None)
    if getattr(model, "_tp_size", None) is not None or getattr(config, "distributed_config", None):
        _refuse("a tensor-parallel model", _REASONS["distributed_checkpoint"])
    state_dict = options["state_dict"]
    if state_dict is not None and not all(isinstance(v, torch.Tensor) for v in state_dict.values()):
        _refuse("state_dict= with values that are not tensors", "only tensors are written")


def _same(value: Any, default: Any) -> bool:
    try:
        return bool(value == default)
    except Exception:  # a value whose == is not a bool (a tensor)
        return value is default


def _refuse(what: str, why: str) -> None:
    raise MetaInitError(
        f"save_pretrained of a model holding deferred tensors: {what} is not supported ({why}); "
        f"nothing was written. {_INSTEAD}."
    )


def _code_files(model: Any) -> Callable[[str], Any] | None:
    """For a custom model (remote code, or a class registered for an auto class), what eager
    writes before the config: the files of its code, and ``auto_map`` in its config."""
    is_remote = getattr(model, "is_remote_code", None)
    if not (callable(is_remote) and is_remote()):
        return None
    from transformers.dynamic_module_utils import custom_object_save

    return lambda directory: custom_object_save(model, directory, config=model.config)


def _saves_on_this_rank(model: Any, is_main_process: bool) -> bool:
    should_save = getattr(model, "should_save_on_this_rank", None)
    return bool(should_save(is_main_process)) if callable(should_save) else bool(is_main_process)


def _state_to_save(
    model: Any, state_dict: dict[str, torch.Tensor] | None
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(name -> tensor to write, name -> the object it comes from, for tied weights): the model's
    (as ``save`` reads it) or the ``state_dict`` given, less ``_keys_to_ignore_on_save``."""
    if state_dict is None:
        return state_dict_of(model)
    state = dict(state_dict)
    for key in getattr(model, "_keys_to_ignore_on_save", None) or []:
        state.pop(key, None)
    return state, dict(state)


def _stale_files(directory: str, weights_name: str, index_name: str) -> Callable[[str], bool]:
    """The files of an earlier save that this one does not rewrite: shards of this weights name
    (``model-0000k-of-0000N.safetensors``), which eager ``save_pretrained`` removes too; and,
    unlike eager, the single weights file or the index (``from_pretrained`` would load that file
    instead of the new shards; an index would name shards that are gone). Another variant's
    files (``model.fp16-...``) stay, where eager removes its shards and leaves its index."""
    stem = _strip(weights_name)

    def stale(name: str) -> bool:
        return os.path.isfile(os.path.join(directory, name)) and (
            name in (weights_name, index_name)
            or re.fullmatch(re.escape(stem) + r"-\d{5}-of-\d{5}", _strip(name)) is not None
        )

    return stale


def _strip(name: str) -> str:
    return name.replace(".bin", "").replace(".safetensors", "")
