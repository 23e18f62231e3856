"""What the kernel modules see of Triton where it is not installed (CPU builds of torch ship without
it): `jit` keeps a kernel's definition and refuses its launch in one line, and `language.constexpr`
passes a value through. So the kernels are written once, at module level, as with Triton, and every
module that holds them imports without it (`fp4_decode` picks this module when the import fails).

Nothing else of Triton is touched at import: kernel bodies and their `tl.constexpr` annotations are
not evaluated until a kernel is compiled.
"""

from __future__ import annotations


class Kernel:
    """A `@triton.jit` function on an install without Triton."""

    def __init__(self, fn):
        self.fn = fn
        self.__name__ = fn.__name__

    def _refuse(self, *args, **kwargs):
        raise RuntimeError(f"{self.__name__} is a Triton kernel and the triton package is not installed; "
                           "install it (it comes with torch's CUDA builds)")

    def __getitem__(self, grid):
        return self._refuse

    __call__ = _refuse


def jit(fn=None, **options):
    """`triton.jit`, bare or with options."""
    return Kernel(fn) if fn is not None else Kernel


class language:  # noqa: N801 - stands in for the module `triton.language`
    """`triton.language`: what module-level code reads of it."""

    @staticmethod
    def constexpr(value):
        return value
