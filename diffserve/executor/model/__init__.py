"""The model as loaded: the pipeline on its device and dtype (``loading``, ``devices``,
``quantization``, ``compat``), what it serves (``info``: the model info; ``tasks``: each task's
pipeline; ``placements``: where each component sits), the samplers a request may pick
(``samplers``) and the device's clock and memory statistics (``device_stats``). The lowest room:
imports only the house's low modules."""
