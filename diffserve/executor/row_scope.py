"""Which rows of the forward in progress a denoiser call carries.

Per-row machinery (each row's LoRA stack, each image's step cache) is told a forward's rows when
the forward starts. A family that splits one forward between denoisers (Wan 2.2's two experts)
narrows the scope around each call, so that machinery follows it::

    with family.row_scope.narrow(index):  # the rows of ``index``, in that order
        part = expert(latents[index], ...)
"""

from __future__ import annotations

from contextlib import ExitStack, contextmanager
from typing import Any, Callable, Iterator, Sequence


class RowScope:
    def __init__(self) -> None:
        self._listeners: list[Callable[[list[int]], Any]] = []

    def listen(self, narrow: Callable[[list[int]], Any]) -> None:
        """``narrow(rows)`` gives a context within which the listener sees only ``rows``."""
        self._listeners.append(narrow)

    @contextmanager
    def narrow(self, index: Sequence[int]) -> Iterator[None]:
        rows = [int(i) for i in index]
        with ExitStack() as stack:
            for narrow in self._listeners:
                stack.enter_context(narrow(rows))
            yield
