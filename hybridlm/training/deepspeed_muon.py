"""DeepSpeed's Muon modules, imported only for a run whose DeepSpeed JSON names Muon.

``deepspeed.initialize`` imports them for isinstance checks and for a ``muon_update`` it calls on Muon
parameters only; their top-level ``torch.compile`` imports Inductor, about 3 s of every launched rank's
start-up. For any other optimizer a stand-in answers those checks (see ``answer_muon_checks``).
"""
from __future__ import annotations

import sys

import torch

_DEEPSPEED_MUON = "deepspeed.runtime.zero.muon.muon_optimizer"
_DEEPSPEED_MUON_KERNELS = "deepspeed.runtime.zero.muon.original_muon"


class _NotDeepSpeedMuon(torch.optim.Optimizer):
    """Stands in for DeepSpeed's MuonWithAuxAdam where the run's optimizer is not Muon (see ``answer_muon_checks``)."""

    def __init__(self, *args, **kwargs):
        raise RuntimeError("DeepSpeed's Muon optimizer is not available in a run started without it")


class _MuonKernelsOnFirstUse(type(sys)):
    """DeepSpeed's Muon kernels module, imported when one of its names is first used (a ZeRO step imports
    ``muon_update`` whatever the optimizer, and calls it only for Muon parameters)."""

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        if name in ("muon_update", "adam_update"):
            def forward(*args, **kwargs):
                return getattr(self._real(), name)(*args, **kwargs)
            forward.__name__ = name
            return forward
        return getattr(self._real(), name)

    def _real(self):
        import importlib
        if sys.modules.get(self.__name__) is self:
            del sys.modules[self.__name__]
        return importlib.import_module(self.__name__)


def answer_muon_checks(ds_config: dict) -> None:
    """deepspeed.initialize imports DeepSpeed's Muon modules only to ask whether the optimizer is a MuonWithAuxAdam
    (ZeRO's supported-optimizer check, the ZeRO-1/2 gradient reduction, the bf16 optimizer: isinstance checks) and to
    hold ``muon_update`` for Muon parameters; their top-level torch.compile imports Inductor, ~3 s of every rank's
    start-up on a CPU core. Unless the JSON names Muon the answer is no: a stand-in module gives DeepSpeed a class
    that no optimizer is an instance of, and the kernels module is imported on first use. A process that has
    imported the real modules keeps them; a JSON that names Muon gets the real ones."""
    wants_muon = str(ds_config.get("optimizer", {}).get("type", "")).lower() == "muon"
    if wants_muon:
        for name in (_DEEPSPEED_MUON, _DEEPSPEED_MUON_KERNELS):
            module = sys.modules.get(name)
            if isinstance(module, _MuonKernelsOnFirstUse) or getattr(module, "MuonWithAuxAdam", None) is _NotDeepSpeedMuon:
                del sys.modules[name]
    elif _DEEPSPEED_MUON not in sys.modules:
        stand_in = type(sys)(_DEEPSPEED_MUON, "Stand-in for DeepSpeed's Muon module (hybridlm.training.deepspeed_muon).")
        stand_in.MuonWithAuxAdam = _NotDeepSpeedMuon
        sys.modules[_DEEPSPEED_MUON] = stand_in
        sys.modules.setdefault(_DEEPSPEED_MUON_KERNELS, _MuonKernelsOnFirstUse(_DEEPSPEED_MUON_KERNELS))
