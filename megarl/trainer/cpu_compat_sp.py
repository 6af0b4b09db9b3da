"""Megatron-core's sequence parallelism on CPU (part of the CPU compatibility layer,
:mod:`megarl.trainer.cpu_compat`, whose scoped torch shim also covers the modules named here).

With ``sequence_parallel=True`` the tensor-parallel linears all-gather their input's sequence
and reduce-scatter their input gradient (``LinearWithGradAccumulationAndAsyncCommunication``);
the backward allocates the reduce-scattered gradient on ``torch.cuda.current_device()``. gloo
itself has both collectives (``all_gather_into_tensor``, ``reduce_scatter_tensor``); the gather
buffers come from Megatron's global memory buffer, already shimmed with ``megatron.core.utils``.
"""

# Megatron modules whose global ``torch`` the CPU proxy replaces, each with why.
SEQUENCE_PARALLEL_SHIMS = {
    "megatron.core.tensor_parallel.layers": "current_device in the sequence-parallel linears' backward",
}
