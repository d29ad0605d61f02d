"""meshtrain's Pallas kernels: flash attention (Triton and Mosaic GPU) and the experts' grouped matmul.

The import below keeps a jitted step from compiling twice. jax >= 0.11 registers a trace-context
setting (`pallas_fuser_disable_nested_fuse`, in jax._src.pallas.fuser) when that module is first
imported, and pallas_call's interpreter (CPU) imports it while it traces the first step. The
step's cache key counts the trace-context settings, so the second call missed the cache, traced
the step again and compiled it again: on jax 0.11.2 and 0.12.1 every CPU run of the pallas core
compiled its step twice (tiny on dp=2,sp=4: 14.0 s of compile instead of 6.2), jax 0.10.2 once.
The Triton lowering for a GPU imports no such module (tiny compiled for an H100, jax 0.12.1).
Imported here, before any kernel is traced, the setting exists from the start.
"""

from jax.experimental.pallas import fuser  # noqa: F401 -- registers its trace-context setting up front
