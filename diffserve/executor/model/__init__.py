"""The model as loaded: the pipeline on its device and dtype (``loading``, ``dtypes``,
``quantization``, ``compat``), what it serves (``info``: the model info; ``tasks``: each task's
pipeline; ``placements``: where each component sits) and the samplers a request may pick
(``samplers``). The lowest room: imports only the house's low modules and the device layer
(:mod:`diffserve.device`)."""
