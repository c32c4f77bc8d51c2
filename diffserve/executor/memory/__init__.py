"""Device memory: what counts as out of memory and what to do before a retry (``oom``), where the
components live (``layout``: offloading, placement on other devices, VAE tiling), admission by a
measured budget (``budget``), and a paused request's tensors off the device and back
(``parking``). May import ``model`` and the house's low modules."""
