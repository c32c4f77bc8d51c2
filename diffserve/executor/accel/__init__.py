"""What makes a step cheaper or faster: the first-block step cache (``step_cache``, its state and
decisions in ``cache_state`` and ``cache_decision``), compiled repeated blocks (``compiled``),
the wrapping of a block's ``forward`` both use (``wrapping``), the attention kernel
(``attention``), quantization of the repeated blocks once built (``quantized``), the model's FLOPs
counted for the utilisation metric (``flops``), and what ``--step-cache`` and ``--compile`` set up
on a loaded model (``setup``). May import the families (their block declarations) and the lower
rooms."""
