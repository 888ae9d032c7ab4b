"""The optimizers whose state the profiler knows, by name, and the kernels their
step may run, without importing torch (the command line offers them in --help)."""

OPTIMIZER_NAMES = ("sgd", "sgd_momentum", "adam", "adamw")

#: How the optimizer's step runs, in torch's words: ``"for-loop"`` (one tensor
#: at a time), ``"foreach"`` (multi-tensor kernels over every parameter of one
#: device and dtype at once) or ``"fused"`` (one fused kernel); their
#: temporaries differ (the foreach step of Adam holds one tensor per parameter,
#: the for-loop one the largest parameter's). ``"auto"``: what torch picks for
#: the optimizer a user builds without saying, on the devices the plan runs on
#: (``resolve_optimizer_impl``).
OPTIMIZER_IMPLS = ("auto", "for-loop", "foreach", "fused")

#: Backends whose ranks compute on the CPU, where torch's optimizers default to
#: the for-loop; on every other backend's devices (NCCL's GPUs) to foreach.
CPU_BACKENDS = ("gloo", "mpi")


def resolve_optimizer_impl(impl: str, backend: str | None) -> str:
    """``impl``, with ``"auto"`` resolved for ranks of ``backend`` (None: CPU)."""
    if impl != "auto":
        return impl
    return "for-loop" if backend is None or backend in CPU_BACKENDS else "foreach"
