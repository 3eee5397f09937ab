"""Report a different compute capability to vLLM and the series' kernels.

On PYTHONPATH with E2E_REPORT_SM=12.0, every Python process (the engine's
workers too) sees the GPU as that capability where vLLM decides: NVML (what
vLLM's platform reads) and torch.cuda.get_device_capability when vLLM's own
modules call it (the Triton kernels' config tables). torch's compiler and
Triton still see the real GPU and compile for it: this runs the choices
SM120 makes (backend, indexer, tile configs) on another card. Test-only;
never installed.
"""

import os
import sys

_reported = os.environ.get("E2E_REPORT_SM")
if _reported:
    _major, _minor = (int(x) for x in _reported.split("."))

    import torch

    _real = torch.cuda.get_device_capability

    def _capability(device=None):
        caller = sys._getframe(1).f_globals.get("__name__", "")
        if caller.startswith("vllm."):
            return (_major, _minor)
        return _real(device)

    torch.cuda.get_device_capability = _capability

    import vllm.third_party.pynvml as _pynvml

    def _nvml_capability(handle):
        return (_major, _minor)

    _pynvml.nvmlDeviceGetCudaComputeCapability = _nvml_capability
