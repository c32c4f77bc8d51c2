"""The LoRA adapters of one executor: which are served, which are resident, and which version of
each a running request holds.

Adapters are loaded with diffusers' own loader (``load_lora_weights``: diffusers/PEFT files and
the kohya/A1111 layouts it converts) under an internal name per version (``NAME@N``), and applied
per row by :class:`~diffserve.executor.lora.row_adapters.RowAdapters`. A request resolves its adapter
names to the current versions once, when it is admitted (:meth:`AdapterStore.acquire`), and holds
them until it leaves (:meth:`AdapterStore.release`): loading a name again makes a new version for
the requests admitted afterwards, while the running ones finish on theirs, so no request ever
sees two versions across its steps. At most ``max_resident`` versions stay loaded; the least
recently used one that no running request holds is unloaded for another, and loaded again from
its file when asked for.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from dataclasses import dataclass

log = logging.getLogger(__name__)

Stack = tuple[tuple[str, float], ...]


class AdapterError(ValueError):
    """An adapter that cannot be served: ``status`` 400 for a file that is not a LoRA of this
    model, 404 for a name that is not served."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


@dataclass
class _Version:
    name: str
    path: str
    internal: str  # the adapter name in the model's PEFT layers
    holders: int = 0  # running requests that use it
    resident: bool = False


class AdapterStore:
    def __init__(self, pipe, max_resident: int, max_rank: int, on_event=lambda event, **kw: None) -> None:
        """``on_event(event, name=..., seconds=...)`` is told of loads, unloads and evictions."""
        from diffserve.executor.lora.row_adapters import RowAdapters

        self.pipe = pipe
        self.max_resident = max_resident
        self.max_rank = max_rank
        self.on_event = on_event
        self.current: dict[str, _Version] = {}  # name -> the version new requests get
        self._versions: OrderedDict[str, _Version] = OrderedDict()  # internal -> version, LRU first
        self._count = 0
        # The components the pipeline's own LoRA loader puts adapters in.
        components = [getattr(pipe, name) for name in adaptable_components(pipe)]
        self.rows = RowAdapters(*components)

    # -- what is served --------------------------------------------------------------------

    def add(self, name: str, path: str) -> None:
        """Serve ``path`` as ``name`` (a new version if the name is served already): loaded and
        checked now. Raises AdapterError with the reason if it is not a LoRA of this model."""
        self._count += 1
        version = _Version(name, path, f"{name}@{self._count}")
        self._load(version)
        old = self.current.get(name)
        self.current[name] = version
        if old is not None:
            self._drop_if_idle(old)
        self._evict_over_budget(keep=(version,))
        log.info("serving LoRA adapter %r from %s", name, path)

    def remove(self, name: str) -> None:
        version = self.current.pop(name, None)
        if version is None:
            raise AdapterError(f"no adapter {name!r}", 404)
        self._drop_if_idle(version)
        self.on_event("unload", name=name)

    def sync(self, adapters: dict[str, str]) -> list[str]:
        """Serve exactly ``adapters`` (name -> path); the errors of those that could not load."""
        errors = []
        for name in [n for n in self.current if n not in adapters]:
            self.remove(name)
        for name, path in adapters.items():
            if name not in self.current or self.current[name].path != path:
                try:
                    self.add(name, path)
                except AdapterError as error:
                    errors.append(f"{name}: {error}")
        return errors

    # -- per request -----------------------------------------------------------------------

    def fits(self, loras: Stack) -> bool:
        """Whether :meth:`acquire` would take ``loras`` now (True for a name it does not serve:
        acquiring says why it cannot)."""
        versions = [self.current.get(name) for name, _ in loras]
        if None in versions:
            return True
        missing = [v for v in versions if not v.resident]
        return len(missing) <= self._free_slots(exclude={v.internal for v in versions})

    def acquire(self, loras: Stack) -> Stack | None:
        """The request's stack in internal names, held until :meth:`release`; None when its
        adapters cannot all be resident now (every resident one is held by a running request)."""
        versions = []
        for name, _ in loras:
            version = self.current.get(name)
            if version is None:
                raise AdapterError(f"no adapter {name!r}", 404)
            versions.append(version)
        if not self.fits(loras):
            return None
        for version in [v for v in versions if not v.resident]:
            # Never evict another adapter of this same stack to make room for this one.
            self._evict_over_budget(keep=versions, extra=1)
            self._load(version)
        for version in versions:
            version.holders += 1
            self._versions.move_to_end(version.internal)
        return tuple((v.internal, scale) for v, (_, scale) in zip(versions, loras))

    def release(self, stack: Stack) -> None:
        for internal, _ in stack:
            version = self._versions.get(internal)
            if version is not None:
                version.holders -= 1
                if version.holders == 0 and self.current.get(version.name) is not version:
                    self._unload(version)  # replaced or removed meanwhile: nobody needs it
        # A load while every resident adapter was held may have gone over the budget.
        self._evict_over_budget(keep=())

    @property
    def resident(self) -> int:
        return sum(v.resident for v in self._versions.values())

    # -- loading ---------------------------------------------------------------------------

    def _free_slots(self, exclude: set[str]) -> int:
        evictable = sum(1 for v in self._versions.values()
                        if v.resident and v.holders == 0 and v.internal not in exclude)
        return self.max_resident - self.resident + evictable

    def _evict_over_budget(self, keep, extra: int = 0) -> None:
        """Unload the least recently used versions nobody holds, other than those in ``keep``,
        until ``extra`` more fit."""
        for version in list(self._versions.values()):
            if self.resident + extra <= self.max_resident:
                return
            if version.resident and version.holders == 0 and not any(version is k for k in keep):
                self._unload(version)
                self.on_event("evict", name=version.name)

    def _drop_if_idle(self, version: _Version) -> None:
        if version.holders == 0:
            self._unload(version)

    def _unload(self, version: _Version) -> None:
        if version.resident:
            self.pipe.delete_adapters([version.internal])
            version.resident = False
        if self.current.get(version.name) is not version:
            self._versions.pop(version.internal, None)

    def _load(self, version: _Version) -> None:
        start = time.perf_counter()
        with _diffusers_warnings() as warnings:
            try:
                self.pipe.load_lora_weights(version.path, adapter_name=version.internal)
            except Exception as error:  # noqa: BLE001 - any loader complaint is the file's fault
                self._forget_partial(version)
                raise AdapterError(f"{version.path} is not a LoRA adapter this model can load: "
                                   f"{type(error).__name__}: {_first_line(error)}") from None
        try:
            self.rows.refresh()
            self._check(version, warnings)
        except (AdapterError, ValueError) as error:
            self._forget_partial(version)
            raise error if isinstance(error, AdapterError) else AdapterError(
                f"{version.path}: {error}") from None
        version.resident = True
        self._versions[version.internal] = version
        self._versions.move_to_end(version.internal)
        self.on_event("load", name=version.name, seconds=time.perf_counter() - start)

    def _check(self, version: _Version, warnings: list[str]) -> None:
        for message in warnings:
            if "unexpected keys" in message or "missing keys" in message:
                raise AdapterError(f"{version.path} does not fit the base model: {message.strip()}")
        why = self.rows.unsupported(version.internal)
        if why:
            raise AdapterError(f"{version.path} can't be applied per request: {why}")
        ranks = self._ranks(version.internal)
        if not ranks:
            raise AdapterError(f"{version.path} adapts no layer of this model (no key of it names "
                               "a module the model has)")
        if max(ranks) > self.max_rank:
            raise AdapterError(f"{version.path} has rank {max(ranks)}, above --max-lora-rank "
                               f"{self.max_rank}")

    def _ranks(self, internal: str) -> list[int]:
        from peft.tuners.lora import LoraLayer

        return [layer.r[internal] for component in self.rows._roots
                for layer in component.modules()
                if isinstance(layer, LoraLayer) and internal in layer.r]

    def _forget_partial(self, version: _Version) -> None:
        """Remove whatever a failed load left in the model under this version's name."""
        try:
            self.pipe.delete_adapters([version.internal])
        except Exception:  # noqa: BLE001 - nothing of it was injected
            pass
        self.rows.refresh()


def served_adapters(pipe, config, on_event=lambda event, **kw: None) -> "AdapterStore | None":
    """The LoRA adapters, the --lora-modules ones loaded and checked; None where the server
    serves none (nothing of PEFT is then imported or hooked)."""
    if not config.serves_adapters:
        return None
    if not hasattr(pipe, "load_lora_weights"):  # e.g. HunyuanVideo 1.5 in diffusers 0.42
        raise RuntimeError(f"--lora-modules / --enable-lora-runtime-updates: "
                           f"{type(pipe).__name__} has no LoRA loader in diffusers, so this model "
                           "serves no adapters")
    store = AdapterStore(pipe, config.max_loras, config.max_lora_rank, on_event)
    for name, path in config.lora_adapters.items():
        try:
            store.add(name, path)
        except AdapterError as error:
            raise RuntimeError(f"LoRA adapter {name!r} (--lora-modules): {error}") from None
    return store


def adaptable_components(pipe) -> list[str]:
    """The pipeline's components that take LoRA adapters, as its own LoRA loader declares them
    (``_lora_loadable_modules``), among those it has."""
    names = getattr(pipe, "_lora_loadable_modules", None)
    if not names:
        raise AdapterError(f"{type(pipe).__name__} has no LoRA loader in diffusers")
    return [name for name in names if getattr(pipe, name, None) is not None]


class _diffusers_warnings:
    """Collects what diffusers warns about while loading (unexpected or missing LoRA keys are
    warnings there, not errors), whatever verbosity the server set for its log."""

    def __enter__(self) -> list[str]:
        import diffusers.utils.logging as dlog

        self.logger = dlog.get_logger("diffusers")
        self.level = self.logger.level
        self.messages: list[str] = []
        self.handler = _ListHandler(self.messages)
        self.logger.addHandler(self.handler)
        self.logger.setLevel(logging.WARNING)
        self.propagate, self.logger.propagate = self.logger.propagate, False
        return self.messages

    def __exit__(self, *exc) -> None:
        self.logger.removeHandler(self.handler)
        self.logger.setLevel(self.level)
        self.logger.propagate = self.propagate


class _ListHandler(logging.Handler):
    def __init__(self, messages: list[str]) -> None:
        super().__init__(logging.WARNING)
        self.messages = messages

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0][:500] if text else ""
