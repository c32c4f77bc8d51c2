"""Test models built offline, with no download: where a ``--model`` value points
(``registry``), the embedded tiny models' cache (``embedded``), the packaged trained ``shapes``
model, the released architectures with random weights (``random``: ``random:NAME``, and random
LoRA adapters), and what every family's tiny builder shares (``common``, ``components``,
``tokenizers``, the tiny ControlNets in ``controlnets``). Each family's own tiny builder and
architecture are in its folder, ``diffserve/executor/families/<family>/``. Loading a real model
is :mod:`diffserve.executor.model`'s."""
