"""The server's configuration, declared once and torch-free: the flags of ``diffserve serve``
(``server``: :class:`~diffserve.config.flags.ServerConfig`; ``speed``: what makes a step faster;
``fields``: how a flag is declared; ``rules``: the flags against each other) and how the
executors are laid out over devices (``topology``)."""
