"""Training and evaluation of the packaged ``shapes`` model (``docs/shapes.md``); the server
needs none of it: the trained weights ship in ``diffserve/builders/shapes/weights``.

- :mod:`tools.shapes.data`: the synthetic dataset (drawn with PIL) and its prompts.
- :mod:`tools.shapes.train`: trains the model (``python -m tools.shapes.train --out DIR``).
- :mod:`tools.shapes.evaluate`: reads generated images back (``classify``) and scores a
  pipeline on the held-out prompts (``python -m tools.shapes.evaluate --model DIR``).
"""
