"""CPU-ONLY STAND-IN for SGLang's compiled `sgl_kernel` package. Never used on GPU.

SGLang's CPU engine imports `sgl_kernel` at import time, but PyPI has no CPU build of it
(the CPU kernels need AMX Xeons and a source build). On CPUs without them SGLang never
*calls* these kernels with the torch-native attention backend, so this module only has to
import. `rlhf.rollout.sglang_server` puts its folder on the server's PYTHONPATH only when the
real package is missing. Any attribute is a function that raises when called, naming the
kernel, so a code path that does need a real kernel fails loudly instead of computing garbage.
"""


class MissingKernelError(RuntimeError):
    """A code path needed a compiled sgl_kernel op that this CPU-only stand-in cannot provide."""


def __getattr__(name: str):
    if name.startswith("__"):
        raise AttributeError(name)

    def missing_kernel(*args, **kwargs):
        raise MissingKernelError(
            f"sgl_kernel.{name} was called, but only the CPU-only stand-in of sgl_kernel is "
            "installed (rlhf/rollout/cpu_shims); install SGLang's real kernels for this path"
        )

    missing_kernel.__name__ = name
    return missing_kernel


# SGLang's Qwen3.5 model module, which every Qwen-VL image processor imports, looks these
# ops up in torch.ops.sgl_kernel when it is imported on the CPU (sglang/srt/models/qwen3_5.py).
# Without them that import fails and the server of any Qwen-VL model stops with "No processor
# registered". They are declared here, each raising when called, like the functions above.
def _declare_missing_ops() -> None:
    import torch

    names = (
        "fused_sigmoid_mul_cpu",
        "fused_qk_gemma_rmsnorm_cpu",
        "fused_qk_gemma_rmsnorm_with_gate_cpu",
        "fused_qkvzba_split_reshape_cat_contiguous_cpu",
        "fused_moe_router_cpu",
    )
    library = torch.library.Library("sgl_kernel", "FRAGMENT")
    for name in names:
        if hasattr(torch.ops.sgl_kernel, name):
            continue

        def missing(*args, _name=name):
            raise MissingKernelError(f"torch.ops.sgl_kernel.{_name} was called (CPU stand-in)")

        library.define(f"{name}(Tensor[] args) -> ()")
        library.impl(name, missing, "CompositeExplicitAutograd")
    _LIBRARIES.append(library)  # a library object unregisters its ops when collected


_LIBRARIES: list = []
_declare_missing_ops()
