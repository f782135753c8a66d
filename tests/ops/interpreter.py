"""Support for the kernel tests that run in Triton's CPU interpreter (TRITON_INTERPRET=1)."""

import functools

from triton.runtime import interpreter


@functools.cache
def patch_interpreter_index() -> None:
    """Triton 3.6's interpreter turns scalars into loop bounds with int() on a 1-element array, which numpy
    >= 2.4 rejects (triton-lang/triton#9171); apply the upstream fix (squeeze first) once for this process."""
    original = interpreter._patch_lang_tensor

    def patched(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.squeeze()))

    interpreter._patch_lang_tensor = patched
