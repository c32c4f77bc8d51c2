"""Per-row LoRA adapters in one batched forward.

PEFT applies its *active* adapters to every row of a call; its mixed-batch path (``adapter_names=``)
takes one adapter per row, at that adapter's one global scale. A batch of requests that each asked
for their own adapters at their own strengths needs more: row i gets only its own stack
``[(name, scale), ...]``. :class:`RowAdapters` does this on top of adapters loaded the usual way
(``pipe.load_lora_weights(path, adapter_name=...)``): it switches PEFT's own application off in
every ``LoraLayer`` of the given modules, so each gives its base output, and adds the rows' deltas
in a forward hook from the layer's ``lora_A`` / ``lora_B``, read at call time::

    adapters = RowAdapters(pipe.unet, pipe.text_encoder)
    with adapters.rows([(), [("a", 1.0)], [("a", 0.7), ("b", 0.3)]]):
        noise = pipe.unet(latents, t, encoder_hidden_states=embeds).sample   # 3 rows

What the tests hold it to:

- Each row equals that row run alone through PEFT after ``set_adapters(names, adapter_weights=
  scales)`` (``disable_lora()`` for a base row), within float32 rounding. A row's scale multiplies
  the adapter's unit scale, ``lora_alpha / r`` (``/ sqrt(r)`` with rsLoRA), the one PEFT's
  ``set_scale`` starts from; the mutable ``scaling`` that ``set_adapters`` and the ``scale`` of
  ``cross_attention_kwargs`` change is ignored, so no global state leaks into a row. (A
  ``hotswap=True`` load changes only ``scaling``, so it is not supported.)
- Outside a context every adapted layer gives its base output.
- Adapters loaded or deleted later are picked up before the next forward of a watched module (the
  names in its ``peft_config`` are compared), or at once with :meth:`refresh`.
- Refused: an adapter that is DoRA (or another PEFT LoRA variant) or adapts a layer other than
  Linear / Conv raises ValueError when a stack names it (the other adapters keep working; PEFT's
  own application stays off for it); fused (merged) adapters raise at attach / refresh time;
  ``enable_lora()`` while attached raises RuntimeError at the next forward (PEFT would have added
  its deltas to every row). Unknown names raise KeyError.
- Inference only (LoRA dropout is not applied); one forward at a time per instance. Under autograd
  the deltas are added out of place, otherwise in place.

Ways to add the deltas (``method=``):

- ``"loop"``: for each distinct adapter in the batch, its rows (a view when contiguous, else
  gathered with ``index_select``) go through A, are scaled per row, and B's product is accumulated
  into the output (``addmm_`` / ``index_add_``). Exactly the work needed, but ops grow with k.
- ``"gathered"``: for Linear layers, each distinct stack's A matrices are concatenated along the
  rank axis (its B's, scales folded in, likewise), zero-padded to the largest, gathered per row,
  and all rows' deltas come from two ``torch.bmm`` (the second a ``baddbmm_`` into the output);
  Conv layers, ``uniform()`` and adapters whose B has a bias use the loop.
- ``"auto"`` (default): the loop when the batch has one distinct stack, else gathered.

Measured with ``bench_lora_forward.py`` (a recorded one-off: ``git show
78808fc^:benchmarks/bench_lora_forward.py``) on sd-mid's UNet (attention LoRA), CPU (AMD
EPYC, 2 threads), k adapters spread over the rows, mean of two runs' medians; cost over the same
UNet without LoRA (rows/rank/k: loop, gathered, PEFT's adapter_names path):

    8/8/1   +11% +10% +23%    8/8/8    +22% +20% +56%    8/64/1   +10% +14% +25%
    8/64/8  +20% +20% +46%    16/8/1    +8%  +5% +17%    16/8/16  +16%  +7% +46%
    16/64/1  +8% +11% +20%    16/64/16 +30% +27% +64%

Hooks with every row base cost ~1%. The two methods are within ~5 points of each other (the run
to run noise), gathered ahead from k = 2 on and the loop ahead at k = 1 with rank 64, hence
"auto"; both stay well under PEFT's mixed path, whose cost grows with k. On a GPU the gathered
method's fixed op count (two bmm per layer, whatever k) should matter more; not measured here.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager, nullcontext
from functools import partial
from typing import Iterator, Sequence

import torch
from peft.tuners.lora import LoraLayer
from peft.tuners.lora.layer import Linear as LoraLinear
from peft.tuners.lora.layer import _ConvNd as LoraConv
from torch import nn

from diffserve.executor.lora.gathered import GATHERED_BYTES, GatheredWeights, gather, gatherable
from diffserve.executor.lora.row_plan import RowPlan, unit_scale
from diffserve.executor.rows import Rows, take
from diffserve.wire.request import repeated_adapter

Stack = Sequence[tuple[str, float]]
METHODS = ("auto", "loop", "gathered")
# Row plans kept with their index tensors: a few running sets'.
PLANS_KEPT = 4
SUBSETS_KEPT = 64


def _per_row(scale, like: torch.Tensor):
    """A per-row scale tensor shaped to broadcast over ``like``'s rows; a float as it is."""
    return scale if isinstance(scale, float) else scale.view(-1, *(1,) * (like.dim() - 1))


def _add_rows(out: torch.Tensor, rows: Rows, delta: torch.Tensor) -> torch.Tensor:
    """``out`` with ``delta`` added to ``rows``: in place, unless autograd may need the original."""
    delta = delta.to(out.dtype)
    if torch.is_grad_enabled():
        if isinstance(rows, slice):
            rows = torch.arange(*rows.indices(len(out)), device=out.device)
        return out.index_add(0, rows, delta)
    if isinstance(rows, slice):
        out[rows] += delta
        return out
    return out.index_add_(0, rows, delta)


def _fusable(layer: LoraLayer, out: torch.Tensor) -> bool:
    """Whether B's product may accumulate straight into ``out`` (addmm_ / baddbmm_): a Linear
    whose adapters add no bias, an output in the weights' dtype, and no autograd."""
    return (isinstance(layer, LoraLinear) and not torch.is_grad_enabled() and out.is_contiguous()
            and all(b.bias is None and b.weight.dtype == out.dtype for b in layer.lora_B.values()))


class RowAdapters:
    """Applies LoRA adapters per batch row in the PEFT ``LoraLayer``s of the given modules."""

    def __init__(self, *modules: nn.Module, method: str = "auto",
                 gathered_bytes: int = GATHERED_BYTES):
        if method not in METHODS:
            raise ValueError(f"method must be one of {METHODS}, not {method!r}")
        self._roots = modules
        self.method = method
        self._hooks: dict[LoraLayer, torch.utils.hooks.RemovableHandle] = {}
        # The plan of the context a thread is in: the step loop's forward and an encode stage's
        # text encoders (diffserve.executor.step.stages) run their own contexts at the same time.
        self._local = threading.local()
        # Plans by their stacks: a running set's rows stay the same from step to step, and so
        # do the index tensors and gathered adapter weights each plan keeps.
        self._plans: dict[tuple, RowPlan] = {}
        self._plans_lock = threading.Lock()
        self.gathered = GatheredWeights(gathered_bytes)
        self._seen: tuple = ()
        self.adapters: frozenset[str] = frozenset()
        self._unsupported: dict[str, str] = {}  # adapter -> why it can't be applied per row
        # Loading or deleting an adapter changes a module's peft_config: refresh before it runs.
        self._root_hooks = [m.register_forward_pre_hook(self._refresh_if_changed) for m in modules]
        self.refresh()

    @property
    def _plan(self) -> RowPlan | None:
        return getattr(self._local, "plan", None)

    @_plan.setter
    def _plan(self, plan: RowPlan | None) -> None:
        self._local.plan = plan

    # -- contexts ---------------------------------------------------------------------------------

    def rows(self, stacks: Sequence[Stack]):
        """Row i of every adapted call gets ``stacks[i]``; every such call must have exactly
        ``len(stacks)`` rows (dim 0). An empty stack is the base model."""
        self._refresh_if_changed()
        key = tuple(tuple(s) for s in stacks)
        with self._plans_lock:  # the step loop and an encode stage share them
            plan = self._plans.get(key)
            if plan is None:
                plan = RowPlan([self._check(s) for s in stacks], len(stacks))
                while len(self._plans) >= PLANS_KEPT:
                    self._plans.pop(next(iter(self._plans)))
                self._plans[key] = plan
        return self._active(plan)

    def narrow(self, rows: Sequence[int]):
        """Inside :meth:`rows`: the adapted calls that follow carry only ``rows`` of it, in that
        order (a forward that runs some blocks on part of its rows, or splits between
        denoisers). Outside one, nothing changes."""
        plan = self._plan
        if plan is None or plan.count is None:
            return nullcontext()
        key = tuple(rows)
        if key not in plan.subsets:
            if len(plan.subsets) >= SUBSETS_KEPT:  # which rows miss a step cache varies
                plan.subsets.clear()
            plan.subsets[key] = RowPlan([plan.stacks[i] for i in key], len(key),
                                      root=plan.root or plan)
        return self._active(plan.subsets[key])

    def uniform(self, stack: Stack):
        """Every row of every call gets ``stack``, whatever the batch size."""
        self._refresh_if_changed()
        return self._active(RowPlan([self._check(stack)], None))

    @contextmanager
    def _active(self, plan: RowPlan) -> Iterator[None]:
        outer, self._plan = self._plan, plan
        try:
            yield
        finally:
            self._plan = outer

    def _check(self, stack: Stack) -> tuple[tuple[str, float], ...]:
        """The stack with zero scales dropped; unknown or repeated names refused."""
        repeated = repeated_adapter(stack)
        if repeated is not None:
            raise ValueError(f"LoRA adapter {repeated!r} is named twice in one stack")
        merged: dict[str, float] = {}
        for name, scale in stack:
            if name not in self.adapters:
                raise KeyError(f"no LoRA adapter {name!r} is loaded (loaded: {sorted(self.adapters)})")
            if name in self._unsupported:
                raise ValueError(f"LoRA adapter {name!r} can't be applied per row: "
                                 f"{self._unsupported[name]}")
            merged[name] = float(scale)
        return tuple((name, scale) for name, scale in merged.items() if scale != 0.0)

    # -- attaching ---------------------------------------------------------------------------------

    def refresh(self) -> None:
        """Hooks every LoraLayer now in the modules (and unhooks those gone), switching PEFT's own
        adapter application off in all of them."""
        found: dict[LoraLayer, str] = {}
        self._unsupported = {}
        for root in self._roots:
            for name, module in root.named_modules():
                if isinstance(module, LoraLayer):
                    if module.merged:
                        raise ValueError(f"{name}: adapters {module.merged_adapters} are fused into "
                                         "the weights; unfuse_lora() first")
                    for adapter, why in _unsupported(name, module):
                        self._unsupported.setdefault(adapter, why)
                    found[module] = name
        for layer in self._hooks.keys() - found.keys():
            self._hooks.pop(layer).remove()
        for layer, name in found.items():
            layer.enable_adapters(False)
            if layer not in self._hooks and isinstance(layer, (LoraLinear, LoraConv)):
                self._hooks[layer] = layer.register_forward_hook(partial(self._apply, name),
                                                                 with_kwargs=True)
        self.adapters = frozenset(a for layer in found for a in _adapter_names(layer))
        self._seen = self._loaded_names()
        self._plans = {}
        self.gathered.clear()  # of adapters that may be gone or reloaded

    def unsupported(self, adapter: str) -> str | None:
        """Why ``adapter`` can't be applied per row, or None if it can."""
        return self._unsupported.get(adapter)

    def close(self) -> None:
        """Removes every hook and gives adapter application back to PEFT."""
        for handle in [*self._hooks.values(), *self._root_hooks]:
            handle.remove()
        for layer in self._hooks:
            layer.enable_adapters(True)
        self._hooks, self._root_hooks = {}, []

    def _loaded_names(self) -> tuple:
        return tuple(tuple(getattr(root, "peft_config", None) or ()) for root in self._roots)

    def _refresh_if_changed(self, *_) -> None:
        if self._loaded_names() != self._seen:
            self.refresh()

    # -- the hook ----------------------------------------------------------------------------------

    def _apply(self, name: str, layer: LoraLayer, args, kwargs, out: torch.Tensor):
        if not layer.disable_adapters:
            raise RuntimeError(f"PEFT's own adapter application was switched back on in {name} "
                               "(enable_lora()?) while RowAdapters owns it: its output has PEFT's "
                               "deltas; close() hands the layers to PEFT, refresh() takes them back")
        plan = self._plan
        if plan is None:
            return None
        x = args[0] if args else kwargs["x"]
        if plan.count is not None:
            _check_rows(name, x, plan.count)
        if not plan.groups:
            return None
        gather = self.method == "gathered" or (self.method == "auto" and plan.kinds > 1)
        if gather and plan.count is not None and gatherable(layer):
            return self._gathered(layer, x, out, plan)
        fused = _fusable(layer, out)
        for adapter in plan.groups:
            if adapter not in layer.lora_A:
                continue
            lora_A, lora_B = layer.lora_A[adapter], layer.lora_B[adapter]
            rows, scale = plan.group(adapter, x.device, lora_A.weight.dtype)
            unit = unit_scale(layer, adapter)
            part = take(rows, x).to(lora_A.weight.dtype)
            if fused:
                # Two GEMMs, the second accumulating into the output with the scale as alpha.
                hidden = part.reshape(-1, part.shape[-1]) @ lora_A.weight.T
                if not isinstance(scale, float):
                    hidden = (hidden.view(len(part), -1, hidden.shape[-1]) * scale.view(-1, 1, 1)
                              ).view(hidden.shape)
                alpha = unit * scale if isinstance(scale, float) else unit
                if isinstance(rows, slice):
                    out[rows].view(-1, out.shape[-1]).addmm_(hidden, lora_B.weight.T, alpha=alpha)
                else:
                    delta = (hidden @ lora_B.weight.T).view(len(part), *out.shape[1:])
                    out.index_add_(0, rows, delta, alpha=alpha)
                continue
            hidden = lora_A(part)
            scale = _per_row(scale, hidden) * unit
            # The scale folds into the smaller rank-r activation unless lora_B adds a bias.
            delta = lora_B(hidden * scale) if lora_B.bias is None else lora_B(hidden) * scale
            out = _add_rows(out, rows, delta)
        return out

    def _gathered(self, layer: LoraLayer, x: torch.Tensor, out: torch.Tensor, plan: RowPlan):
        distinct, rows, which = plan.stack_rows(x.device)
        gathered = self.gathered.get((id(layer), tuple(distinct), x.device),
                                     lambda: gather(layer, distinct, x))
        if gathered is None:  # none of the batch's adapters adapts this layer
            return None
        A_all, B_all = gathered
        # Per row from the distinct stacks' (kept per set of stacks; the per-row copies are not:
        # rows x rank x features in every layer would outweigh the adapters themselves).
        A_rows, B_rows = A_all.index_select(0, which), B_all.index_select(0, which)
        part = take(rows, x).to(A_rows.dtype)
        flat = part.reshape(len(part), -1, part.shape[-1])
        hidden = torch.bmm(flat, A_rows.transpose(1, 2))
        B_rows = B_rows.transpose(1, 2)
        if isinstance(rows, slice) and _fusable(layer, out):
            out[rows].view(len(part), -1, out.shape[-1]).baddbmm_(hidden, B_rows)
            return out
        return _add_rows(out, rows, torch.bmm(hidden, B_rows).view(*part.shape[:-1], -1))


def _check_rows(name: str, x: torch.Tensor, count: int) -> None:
    rows = x.shape[0] if x.dim() else None
    if rows != count:
        raise ValueError(f"{name} got {rows} rows (input {tuple(x.shape)}) inside RowAdapters.rows() "
                         f"with {count} stacks: every adapted call needs one row per stack, in dim 0")


def _adapter_names(layer: LoraLayer) -> set[str]:
    return {*layer.lora_A, *layer.lora_embedding_A}  # embeddings keep theirs apart


def _unsupported(name: str, layer: LoraLayer) -> Iterator[tuple[str, str]]:
    """(adapter, why) for each adapter of ``layer`` that can't be applied per row."""
    if not isinstance(layer, (LoraLinear, LoraConv)):
        kind = f"{type(layer).__module__}.{type(layer).__qualname__}"
        for adapter in _adapter_names(layer):
            yield adapter, f"it adapts {name}, a {kind}; only Linear and Conv layers are supported"
        return
    for adapter in layer.lora_A:
        if layer.use_dora.get(adapter):
            yield adapter, f"it is a DoRA adapter (in {name}); only plain LoRA is supported"
        elif adapter in layer.lora_variant:
            variant = type(layer.lora_variant[adapter]).__name__
            yield adapter, f"it is a {variant} (in {name}); only plain LoRA is supported"
