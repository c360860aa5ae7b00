"""kdalab as a backend of fla-core's registry (fla-core >= 0.6): FLA's own
``fla.ops.kda.chunk_kda``, and the KDA layers that call it, run on kdalab's
kernel for every call it supports and on FLA's kernels for every other call.
A call with an input that requires grad (training) runs kdalab's forward and
backward only with ``FLA_KDALAB_TRAIN=1``: kdalab's backward (next/13_backward)
is correct but slower than FLA's, so training stays on FLA's kernels unless asked.

    import kdalab.fla   # registers (idempotent: kdalab.fla.register() again replaces it)

Backend "kdalab", priority 2 (before FlashKDA's 3); ``FLA_KDALAB=0`` turns it off.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import types

import torch
from fla.backends import BaseBackend
from fla.backends import register as _fla_register
from fla.ops.kda import chunk_kda as fla_chunk_kda

from .op import chunk_kda, supported


TRAIN_ENV = "FLA_KDALAB_TRAIN"  # 1: calls in training run kdalab's forward and backward too


class KdalabBackend(BaseBackend):
    """FLA's verifier asks ``chunk_kda_verifier`` first, then calls ``chunk_kda``."""

    backend_type = "kdalab"
    package_name = None  # kdalab is imported already
    env_var = "FLA_KDALAB"
    default_enable = True
    priority = 2

    def chunk_kda_verifier(self, *args, **kwargs) -> tuple[bool, str | None]:
        training = torch.is_grad_enabled() and any(
            isinstance(t, torch.Tensor) and t.requires_grad for t in (*args, *kwargs.values()))
        if training and os.environ.get(TRAIN_ENV, "0") != "1":
            return False, (f"an input requires grad and {TRAIN_ENV} is not 1: training runs on FLA's kernels "
                           f"({TRAIN_ENV}=1 trains on kdalab's)")
        return supported(*args, **kwargs)

    def chunk_kda(self, *args, **kwargs):
        return chunk_kda(*args, **kwargs)


def register() -> KdalabBackend:
    """Register the backend for fla.ops.kda.chunk_kda (replacing an earlier one); returns it."""
    _fla_register(fla_chunk_kda)(KdalabBackend)
    return registered()


def registered() -> KdalabBackend | None:
    """The kdalab backend in FLA's registry for chunk_kda, or None."""
    from fla.backends import _function_registries
    from inspect import unwrap

    return _function_registries[unwrap(fla_chunk_kda)]._backends.get(KdalabBackend.backend_type)


def kda_layer_class():
    """FLA's ``KimiDeltaAttention`` (pip package flash-linear-attention). Its
    package's ``__init__`` imports every layer, some of which need transformers;
    when that is missing, fla.layers is set up as a bare package so that only
    fla/layers/kda.py and what it imports are loaded."""
    if "fla.layers" not in sys.modules and importlib.util.find_spec("transformers") is None:
        spec = importlib.util.find_spec("fla.layers")
        if spec is None:
            raise ImportError("fla.layers is not installed: pip install flash-linear-attention (--no-deps "
                              "without transformers)")
        bare = types.ModuleType("fla.layers")
        bare.__path__ = list(spec.submodule_search_locations)
        sys.modules["fla.layers"] = bare
    from fla.layers.kda import KimiDeltaAttention

    return KimiDeltaAttention


register()
